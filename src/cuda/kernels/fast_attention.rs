//! Rust side of the `fast_attention` kernel family (kernels/fast_attention.cu): the fast set's
//! sparse attention over window + compressed keys with the per-head sink, MLA style (one block
//! per token and run of keys takes every head, so each key row is read and decoded once per
//! token), on BF16 tensor cores with an online softmax, split over blocks for few tokens and
//! combined in split order (in a thread-block cluster for 2 splits, [`SplitCombine`]; else through
//! a workspace and a second launch). Kernels with the same bits: mma.sync (any head dim it covers;
//! few tokens) and wgmma (head dim 512, from [`WGMMA_MIN_TOKENS`]), picked by [`AttentionPath`],
//! and the warp-specialized wgmma kernel in two schedules (a producer warpgroup; measured slower,
//! not picked); from
//! [`STAGE_MIN_TOKENS`] the batch's own rows are first staged in the stored format. Takes the
//! reference's [`AttentionArgs`]; the state must be stored in the official format.
//! tests/gpu_fast_attention.rs derives and asserts the error bound of both against the reference
//! kernel.

use super::attention::AttentionArgs;
use super::attention::BatchMeta;
use super::{need, to_i32};
use crate::cuda::kv_pages::{KvFormat, KvRows, RowKind};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// Threads of a block (FA_THREADS): 8 warps, 4 head groups of 16 x 2 halves of the head dims.
pub const THREADS: usize = 256;
/// Keys per tile (FA_TILE_KEYS): decoded into shared memory together, one mma n-dimension of 32.
pub const TILE_KEYS: usize = 32;
/// Most heads (FA_MAX_HEADS): 4 warps' 16 rows.
pub const MAX_HEADS: usize = 64;
/// Largest head dim (FA_MAX_HD): each warp keeps 16 heads x hd/2 f32 accumulators.
pub const MAX_HD: usize = 512;
/// Blocks a launch aims for: few tokens split their keys over up to [`MAX_SPLITS`] blocks each
/// until tokens x splits reaches this: one wave of a block per SM (an H100 / H200 has 132; the
/// kernel takes one block an SM). Measured (bench attn, H200, CSA 4K): 64 tokens in one wave of
/// 2 splits took 104 us against 125 in two waves of 4 (at 256). A function of T only, so a
/// token's rounding does not depend on the device.
pub const SPLIT_TARGET: usize = 128;
/// Most splits of one token's keys: one 32-key tile a block for a decode token's 640 keys (at 16,
/// CSA's blocks took two tiles: 26.5 us against HCA's 19.1 with one).
pub const MAX_SPLITS: usize = 32;

/// Most splits of a token that combine inside one thread-block cluster (FA_CLUSTER_MAX_SPLITS;
/// [`SplitCombine::Cluster`]): 2, as measured (bench attn, H100, BENCHMARKS.md 2026-12-05,
/// twenty-ninth part). 64 tokens of 2 splits: CSA 64K 63.74 -> 55.78 us, HCA 8K 38.28 -> 28.74. But
/// 16 tokens of 8 splits took 46.4 us in clusters against 26.8 through the workspace (CSA 8K):
/// the blocks take a whole SM each, a GPC (16-18 SMs) holds two clusters of 8, so 16 such
/// clusters do not all fit at once. Clusters of 4 (17-32 tokens) lose the same way: 32 tokens
/// 39.70 -> 61.76 us (CSA 8K, H100, BENCHMARKS.md 2026-12-05, thirtieth part). Raising this
/// constant admits larger clusters (the kernels size their combine's arrays by it, up to the
/// portable 8).
pub const CLUSTER_MAX_SPLITS: usize = 2;

/// How a token's split partials are combined.
///
/// `Cluster` (the default): where 2 to [`CLUSTER_MAX_SPLITS`] splits run on the mma.sync or wgmma
/// kernel, the token's blocks are launched as one thread-block cluster and combine through
/// distributed shared memory in the attention's launch, writing `o` directly (kernels/
/// fast_attention.cu `fa_cluster_combine`, fa_combine_kernel's operations: the same bits). That
/// saves the workspace's write and read of T x splits x heads x head_dim f32 (16.8 MB at 64 tokens
/// of 2 splits) and the combine's launch. Elsewhere (more splits, the warp-specialized kernels) the
/// workspace's path runs. `Workspace`: always the workspace and `fa_combine_kernel` (benches and
/// tests compare the two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitCombine {
    Cluster,
    Workspace,
}

impl SplitCombine {
    /// Whether `splits` splits on kernel `path` (resolved: not `Auto`) combine in a cluster.
    pub fn in_cluster(self, path: AttentionPath, splits: usize) -> bool {
        self == SplitCombine::Cluster
            && (2..=CLUSTER_MAX_SPLITS).contains(&splits)
            && matches!(path, AttentionPath::Mma | AttentionPath::Wgmma)
    }
}

/// Dynamic shared memory a block needs for the cluster combine at head dim `hd` (the kernels'
/// fa_cl_* offsets): the partial O of every head (rows of `hd + 8` f32), its (max, sum) pairs, the
/// combine's weights and each head's denominator and max.
pub const fn cluster_smem_bytes(hd: usize) -> usize {
    4 * MAX_HEADS * (hd + 8) + 8 * MAX_HEADS + 4 * (CLUSTER_MAX_SPLITS * MAX_HEADS + 2 * MAX_HEADS)
}

/// Dynamic shared memory of a block for head dim `hd` whose stored rows take `raw_row` bytes
/// (values and scale record, [`crate::cuda::kv_pages::KvRows::bytes_per_row`]): Q (all heads) and one key tile as bf16
/// rows padded by 8 values, the S exchange (16 f32 per thread), two raw tiles of rows
/// padded to 16 bytes and their keys' addresses and kinds (8 + 8 + 4 bytes a key).
pub const fn smem_bytes(hd: usize, raw_row: usize) -> usize {
    2 * (MAX_HEADS + TILE_KEYS) * (hd + 8)
        + 4 * (THREADS / 32) * 32 * 16
        + 2 * TILE_KEYS * raw_row.next_multiple_of(16)
        + 2 * TILE_KEYS * 20
}

/// The largest block (the registry raises the kernel's limit to it): a stored row is at most
/// 2 bytes a value plus its scale record.
pub const MAX_SMEM: usize = smem_bytes(MAX_HD, 2 * MAX_HD + 16);
/// Shared memory a Hopper block may use.
pub const SM90_MAX_SMEM: usize = 227 * 1024;
const _: () = assert!(MAX_SMEM <= SM90_MAX_SMEM);
const _: () = assert!(cluster_smem_bytes(MAX_HD) <= MAX_SMEM);

/// The head dim of the wgmma path (FA_WG_HD): 8 chunks of 64 dims, each warpgroup's P V one
/// m64n256 wgmma.
pub const WGMMA_HD: usize = 512;
/// Raw tiles the wgmma path keeps (FA_WG_RAW): the one being decoded and two in flight.
pub const WGMMA_RAW_TILES: usize = 3;

/// Dynamic shared memory of a wgmma-path block whose stored rows take `raw_row` bytes: Q (all
/// heads) and two key tiles as swizzled bf16, the S exchange, [`WGMMA_RAW_TILES`] raw tiles and
/// their address slots. The kernel needs its start 1024-byte aligned (a dynamic allocation
/// without static shared memory is).
pub const fn wgmma_smem_bytes(raw_row: usize) -> usize {
    2 * MAX_HEADS * WGMMA_HD
        + 2 * 2 * TILE_KEYS * WGMMA_HD
        + 4 * THREADS * 16
        + WGMMA_RAW_TILES * TILE_KEYS * raw_row.next_multiple_of(16)
        + WGMMA_RAW_TILES * TILE_KEYS * 20
}

/// Threads of a warp-specialized wgmma block (FA_WS_THREADS, [`AttentionPath::WgmmaWs`] and
/// [`AttentionPath::WgmmaWsEarlyPv`]): the two
/// consumer warpgroups of [`THREADS`] and the producer warpgroup that fetches and decodes the key
/// tiles.
pub const WS_THREADS: usize = THREADS + 128;
/// Decoded key tiles of the warp-specialized kernel (FA_WS_KBUF): the one the consumers' S and
/// P V read, the one the previous tile's P V may still read, and the one the producer decodes.
pub const WS_K_TILES: usize = 3;
/// Its raw tiles (FA_WS_RAW): the one being decoded and one in flight.
pub const WS_RAW_TILES: usize = 2;
/// Its address slots (FA_WS_ADDR): the raw tiles', the one being looked up, and one more, so that
/// a tile is looked up (and its rows asked into L2: `fa_locate`'s prefetch) two tiles before its
/// rows are fetched, which then wait for L2 rather than HBM.
pub const WS_ADDR_SLOTS: usize = 4;
/// Registers a consumer thread (FA_WS_CONSUMER_REGS) and a producer thread (FA_WS_PRODUCER_REGS)
/// of the warp-specialized block take by `setmaxnreg`, from the block's pool.
/// At 56 the producer spills (ptxas: 36 B stored, 60 B loaded, in its tile lookup and L2
/// prefetch). 72 / 216 removes those spills (ws_early: none; ws: 12 B stored in the consumers'
/// setup) but was measured no better (bench attn, H100, 64 tokens: CSA 64K ws_early 63.55
/// against 65.28 µs, HCA 64K 61.21 against 59.40; BENCHMARKS.md 2026-12-05, twenty-eighth part).
pub const WS_CONSUMER_REGS: usize = 224;
pub const WS_PRODUCER_REGS: usize = 56;
/// Registers a thread ptxas must give the warp-specialized kernel for that pool: the consumers'
/// `setmaxnreg.inc` waits until the pool holds what they ask, so with fewer it would wait forever.
/// [`FastAttention::attention_split`] refuses the launch then.
pub const WS_MIN_REGS: usize =
    (THREADS * WS_CONSUMER_REGS + 128 * WS_PRODUCER_REGS).div_ceil(WS_THREADS);
// The pool fits an SM's 64K registers, in setmaxnreg's steps of 8.
const _: () = assert!(
    THREADS * WS_CONSUMER_REGS + 128 * WS_PRODUCER_REGS <= 65536
        && WS_CONSUMER_REGS.is_multiple_of(8)
        && WS_PRODUCER_REGS.is_multiple_of(8)
);

/// Dynamic shared memory of a warp-specialized wgmma block whose stored rows take `raw_row` bytes:
/// Q (all heads) and [`WS_K_TILES`] key tiles as swizzled bf16, the S exchange,
/// [`WS_RAW_TILES`] raw tiles, [`WS_ADDR_SLOTS`] address slots and the key ring's two mbarriers a
/// tile (the start 1024-byte aligned, as [`wgmma_smem_bytes`]'s).
pub const fn wgmma_ws_smem_bytes(raw_row: usize) -> usize {
    2 * MAX_HEADS * WGMMA_HD
        + WS_K_TILES * 2 * TILE_KEYS * WGMMA_HD
        + 4 * THREADS * 16
        + WS_RAW_TILES * TILE_KEYS * raw_row.next_multiple_of(16)
        + WS_ADDR_SLOTS * TILE_KEYS * 20
        + 2 * WS_K_TILES * 8
}

/// Which kernel runs the attention: [`AttentionPath::Mma`] (mma.sync, any head dim it covers),
/// [`AttentionPath::Wgmma`] (wgmma, head dim [`WGMMA_HD`] only), [`AttentionPath::WgmmaWs`]
/// (the same, warp-specialized: a producer warpgroup decodes the key tiles, the consumers' S runs
/// during the softmax; the same bits) or [`AttentionPath::WgmmaWsEarlyPv`] (the same kernel
/// retiring each P V a softmax earlier, so that the producer decodes a tile ahead; the same bits);
/// [`AttentionPath::Auto`] picks by [`AttentionPath::for_layer`], which does not take the
/// warp-specialized kernels: on an H100 they were 1-10% slower than the wgmma kernel in every case
/// of `dsv4 bench attn` (CSA / HCA, 8K / 64K, 1 / 8 / 64 tokens; BENCHMARKS.md 2026-12-05,
/// twenty-eighth part), and 1-4% slower in the whole step's prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    Auto,
    Mma,
    Wgmma,
    WgmmaWs,
    WgmmaWsEarlyPv,
}

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_attention", include_str!("../../../kernels/fast_attention.cu");

    /// The batch's KV rows in the stored format, for the attention's fetch path.
    #[pdl(true)]
    fn fa_stage_rows_kernel(kv: *const f32, t: i32, hd: i32, nope: i32, staged: *mut u8);
    /// f32 queries as the BF16 copy the attention kernels read, where the caller has none.
    #[pdl(true)]
    fn fa_q_bf16_kernel(q: *const f32, n4: i64, out: *mut u16);
    /// `entries`, `etable` NULL on window-only layers; `selected` / `nsel` NULL except on CSA;
    /// `staged` NULL or the batch's rows from `fa_stage_rows_kernel`.
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fa_attention_kernel(
        q: *const u16, kv: *const f32, staged: Option<*const u8>, ring: *const u8, entries: Option<*const u8>,
        etable: Option<*const i32>, epps: i32, selected: Option<*const i32>,
        nsel: Option<*const i32>, positions: *const i32, seq_of: *const i32,
        query_start: *const i32, seq_slots: *const i32, sinks: *const f32, t: i32, h: i32,
        hd: i32, nope: i32, w: i32, ratio: i32, maxe: i32, topk: i32, splits: i32,
        part_o: Option<*mut f32>, part_ml: Option<*mut f32>, o: *mut f32,
    );
    /// The same on wgmma (head dim [`WGMMA_HD`]; the block at most [`SM90_MAX_SMEM`]).
    #[smem(SM90_MAX_SMEM as u32)]
    #[pdl(true)]
    fn fa_attention_wgmma_kernel(
        q: *const u16, kv: *const f32, staged: Option<*const u8>, ring: *const u8, entries: Option<*const u8>,
        etable: Option<*const i32>, epps: i32, selected: Option<*const i32>,
        nsel: Option<*const i32>, positions: *const i32, seq_of: *const i32,
        query_start: *const i32, seq_slots: *const i32, sinks: *const f32, t: i32, h: i32,
        hd: i32, nope: i32, w: i32, ratio: i32, maxe: i32, topk: i32, splits: i32,
        part_o: Option<*mut f32>, part_ml: Option<*mut f32>, o: *mut f32,
    );
    /// The same, warp-specialized ([`WS_THREADS`] threads).
    #[smem(SM90_MAX_SMEM as u32)]
    #[pdl(true)]
    fn fa_attention_wgmma_ws_kernel(
        q: *const u16, kv: *const f32, staged: Option<*const u8>, ring: *const u8, entries: Option<*const u8>,
        etable: Option<*const i32>, epps: i32, selected: Option<*const i32>,
        nsel: Option<*const i32>, positions: *const i32, seq_of: *const i32,
        query_start: *const i32, seq_slots: *const i32, sinks: *const f32, t: i32, h: i32,
        hd: i32, nope: i32, w: i32, ratio: i32, maxe: i32, topk: i32, splits: i32,
        part_o: Option<*mut f32>, part_ml: Option<*mut f32>, o: *mut f32,
    );
    /// The warp-specialized kernel retiring each P V at the next softmax's exchange
    /// ([`AttentionPath::WgmmaWsEarlyPv`]).
    #[smem(SM90_MAX_SMEM as u32)]
    #[pdl(true)]
    fn fa_attention_wgmma_ws_early_kernel(
        q: *const u16, kv: *const f32, staged: Option<*const u8>, ring: *const u8, entries: Option<*const u8>,
        etable: Option<*const i32>, epps: i32, selected: Option<*const i32>,
        nsel: Option<*const i32>, positions: *const i32, seq_of: *const i32,
        query_start: *const i32, seq_slots: *const i32, sinks: *const f32, t: i32, h: i32,
        hd: i32, nope: i32, w: i32, ratio: i32, maxe: i32, topk: i32, splits: i32,
        part_o: Option<*mut f32>, part_ml: Option<*mut f32>, o: *mut f32,
    );
    #[pdl(true)]
    fn fa_combine_kernel(
        part_o: *const f32, part_ml: *const f32, sinks: *const f32, t: i32, h: i32, hd: i32,
        splits: i32, o: *mut f32,
    );
}

crate::launchers! {
    /// The fast_attention family's entry points, resolved from a loaded registry.
    pub struct FastAttention {
        attention: fa_attention_kernel,
        attention_wgmma: fa_attention_wgmma_kernel,
        attention_wgmma_ws: fa_attention_wgmma_ws_kernel,
        attention_wgmma_ws_early: fa_attention_wgmma_ws_early_kernel,
        stage: fa_stage_rows_kernel,
        q_bf16: fa_q_bf16_kernel,
        combine: fa_combine_kernel,
    }
}

const FAMILY: &str = "fast_attention";

impl AttentionPath {
    /// The kernel [`AttentionPath::Auto`] runs for `t` tokens: wgmma where it covers the layer and
    /// from [`WGMMA_MIN_TOKENS`] tokens.
    pub fn for_layer(x: &AttentionArgs, t: usize) -> AttentionPath {
        if t >= WGMMA_MIN_TOKENS && FastAttention::covers_wgmma(x) {
            AttentionPath::Wgmma
        } else {
            AttentionPath::Mma
        }
    }
}

/// Refuses a warp-specialized kernel that ptxas gave fewer registers a thread than its
/// `setmaxnreg` pool needs ([`WS_MIN_REGS`]): the consumers' `setmaxnreg.inc` would wait forever.
fn ws_pool_holds(k: &crate::cuda::registry::Kernel) -> Result<()> {
    if usize::try_from(k.num_regs).is_ok_and(|r| r < WS_MIN_REGS) {
        return Err(bad(format!(
            "{} has {} registers a thread; its setmaxnreg pool needs {WS_MIN_REGS} (launching it would hang)",
            k.name, k.num_regs
        )));
    }
    Ok(())
}

/// Tokens from which [`AttentionPath::Auto`] takes the wgmma kernel. Measured (bench attn, H100,
/// CSA / HCA at 8K and 64K, both kernels reading the BF16 queries; BENCHMARKS.md 2026-12-05,
/// thirty-first part): at 16 tokens the wgmma kernel is 3-9% faster (CSA 64K 25.18 against 27.60
/// us), at 8 tokens the mma.sync one in three of the four cases (HCA 8K 13.42 against 14.82), at 1
/// token in all four; from 64 tokens the wgmma one wins more (CSA 8K: 58 against 69 us at 64
/// tokens, 2523 against 3236 at 4096, H200).
pub const WGMMA_MIN_TOKENS: usize = 16;

/// Splits of each token's keys for a batch of `t` tokens attending to at most `max_keys` keys:
/// enough blocks for the GPU at few tokens, one per token from [`SPLIT_TARGET`] / 2 tokens on.
pub fn splits(t: usize, max_keys: usize) -> usize {
    (SPLIT_TARGET / t.max(1))
        .min(MAX_SPLITS)
        .min(max_keys.div_ceil(TILE_KEYS))
        .max(1)
}

/// The split count of a launch of `t` tokens of up to `max_keys` keys: [`splits`]'s, or the
/// `requested` one if the workspace holds it (at most [`MAX_SPLITS`], and tokens x splits at most
/// [`SPLIT_TARGET`] unless unsplit); `InvalidArgument` otherwise.
pub fn split_count(t: usize, max_keys: usize, requested: Option<usize>) -> Result<usize> {
    match requested {
        None => Ok(splits(t, max_keys)),
        Some(n) if (1..=MAX_SPLITS).contains(&n) && (n == 1 || t * n <= SPLIT_TARGET) => Ok(n),
        Some(n) => Err(Error::new(
            Status::InvalidArgument,
            format!(
                "{FAMILY}: {n} splits of {t} tokens' keys: at most {MAX_SPLITS}, and tokens x \
                 splits at most {SPLIT_TARGET} (the split workspace)"
            ),
        )),
    }
}

/// Floats of the split workspace: partial outputs and (max, sum) pairs for every (token, split,
/// head), at most [`SPLIT_TARGET`] token-splits (more tokens run unsplit).
pub fn workspace_floats(heads: usize, head_dim: usize) -> [usize; 2] {
    [SPLIT_TARGET * heads * head_dim, SPLIT_TARGET * heads * 2]
}

/// Tokens from which the batch's KV rows are staged in the stored format before the attention
/// (`fa_stage_rows_kernel`, one launch), so both kernels fetch them with their async copies
/// instead of loading f32 rows in the decode. Below, a token's only batch row is usually its own
/// (the wgmma kernel's 16-token measurement behind [`WGMMA_MIN_TOKENS`] ran without the staging).
pub const STAGE_MIN_TOKENS: usize = 64;

/// Bytes of one staged row (the kernel's `fa_staged_stride`): value bytes and scale record,
/// 16-byte aligned.
pub fn staged_row_bytes(head_dim: usize, nope: usize) -> usize {
    KvRows::kv(KvFormat::Official, head_dim, nope)
        .bytes_per_row()
        .next_multiple_of(16)
}

/// Bytes of the queries' BF16 copy a token ([`FastAttentionWorkspace::q_bf16`]).
pub fn q_bf16_bytes(heads: usize, head_dim: usize) -> usize {
    2 * heads * head_dim
}

/// The split workspace, the staged batch rows and the queries' BF16 copy at their arena
/// addresses.
#[derive(Clone, Copy, Debug)]
pub struct FastAttentionWorkspace {
    pub part_o: DevicePtr,
    pub part_ml: DevicePtr,
    /// Room for [`staged_row_bytes`] a token of the largest batch; null (or too small for a
    /// batch) to read the batch's f32 rows directly.
    pub staged: DevicePtr,
    /// Room for [`q_bf16_bytes`] a token of the largest batch: the kernels read the queries as
    /// BF16 ([T, H, head_dim]). The forward's head_prep writes them there
    /// ([`AttentionArgs::q_bf16`]); where a caller passes f32 queries only, the wrapper converts
    /// them into this first (one more launch).
    pub q_bf16: DevicePtr,
}

fn bad(msg: String) -> Error {
    Error::new(Status::Internal, format!("{FAMILY}: {msg}"))
}

impl FastAttention {
    /// Whether the kernels take this layer: official state, heads and dims they tile, a ring
    /// (and entries) they can decode 8 values at a time.
    pub fn covers(x: &AttentionArgs) -> bool {
        let nope = match x.ring.rows.kind {
            RowKind::Kv { nope } => nope,
            RowKind::IndexKey => return false,
        };
        x.official
            && x.ring.rows.format == KvFormat::Official
            && x.heads <= MAX_HEADS
            && x.head_dim <= MAX_HD
            && x.head_dim.is_multiple_of(32)
            && nope.is_multiple_of(16)
            && nope <= x.head_dim
    }

    /// Whether the wgmma kernel takes this layer too: [`FastAttention::covers`], head dim
    /// [`WGMMA_HD`], and its block within [`SM90_MAX_SMEM`].
    pub fn covers_wgmma(x: &AttentionArgs) -> bool {
        Self::covers(x)
            && x.head_dim == WGMMA_HD
            && wgmma_smem_bytes(x.ring.rows.bytes_per_row()) <= SM90_MAX_SMEM
    }

    /// The same for the warp-specialized kernels (both schedules): their block within
    /// [`SM90_MAX_SMEM`] too. (Asked of `AttentionPath::Auto`'s wgmma kernel, it would have let the
    /// untaken kernels' larger ring decide the default path.)
    pub fn covers_wgmma_ws(x: &AttentionArgs) -> bool {
        Self::covers_wgmma(x) && wgmma_ws_smem_bytes(x.ring.rows.bytes_per_row()) <= SM90_MAX_SMEM
    }

    /// o = softmax-with-sink over each token's keys (the reference's [`AttentionArgs`], which
    /// [`FastAttention::covers`]), on the kernel [`AttentionPath::Auto`] picks.
    pub fn attention(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &AttentionArgs,
        ws: &FastAttentionWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.attention_on(AttentionPath::Auto, ctx, b, x, ws, stream)
    }

    /// The same on a chosen kernel (benches and tests time and check both): one launch, or two
    /// with the split combine.
    pub fn attention_on(
        &self,
        path: AttentionPath,
        ctx: &Context,
        b: &BatchMeta,
        x: &AttentionArgs,
        ws: &FastAttentionWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.attention_split(path, None, SplitCombine::Cluster, ctx, b, x, ws, stream)
    }

    /// The same with `splits` splits of each token's keys instead of [`splits`]'s count (`None`:
    /// that count), so a bench can time the split rule's alternatives: at most [`MAX_SPLITS`],
    /// and tokens x splits within the workspace's [`SPLIT_TARGET`] unless unsplit; and the
    /// partials combined as `combine` says where it applies ([`SplitCombine`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_split(
        &self,
        path: AttentionPath,
        splits: Option<usize>,
        combine: SplitCombine,
        ctx: &Context,
        b: &BatchMeta,
        x: &AttentionArgs,
        ws: &FastAttentionWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        if !Self::covers(x) {
            return Err(bad(format!(
                "{} heads of {} stored as {:?}, official {}",
                x.heads, x.head_dim, x.ring.rows, x.official
            )));
        }
        let path = match path {
            AttentionPath::Auto => AttentionPath::for_layer(x, b.num_tokens),
            AttentionPath::Wgmma if !Self::covers_wgmma(x) => {
                return Err(bad(format!(
                    "the wgmma kernel takes head dim {WGMMA_HD} only (and rows whose block fits), not {} ({} bytes a row)",
                    x.head_dim,
                    x.ring.rows.bytes_per_row()
                )));
            }
            AttentionPath::WgmmaWs | AttentionPath::WgmmaWsEarlyPv if !Self::covers_wgmma_ws(x) => {
                return Err(bad(format!(
                    "the warp-specialized wgmma kernels take head dim {WGMMA_HD} only (and rows whose block fits), not {} ({} bytes a row)",
                    x.head_dim,
                    x.ring.rows.bytes_per_row()
                )));
            }
            p => p,
        };
        // The reference wrapper's checks: state sizes, formats, selection buffers.
        let checked = x.check(FAMILY, b.num_tokens)?;
        let (t, h, hd) = (b.num_tokens, x.heads, x.head_dim);
        let blocks = u32::try_from(t)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| bad(format!("{t} tokens: too many blocks")))?;
        let splits = split_count(t, x.max_keys(), splits)?;
        let clustered = combine.in_cluster(path, splits);
        let [po, pml] = workspace_floats(h, hd);
        let part = (splits > 1).then_some((ws.part_o, ws.part_ml));
        if splits > 1 && !clustered {
            need(FAMILY, "part_o", ws.part_o, po * 4)?;
            need(FAMILY, "part_ml", ws.part_ml, pml * 4)?;
        }
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        let q_bytes = t * q_bf16_bytes(h, hd);
        let q = match x.q_bf16 {
            Some(q) => {
                need(FAMILY, "q_bf16", q, q_bytes)?;
                q
            }
            None => {
                need(FAMILY, "workspace q_bf16", ws.q_bf16, q_bytes)?; // (x.q: checked above)
                let n4 = t * h * hd / 4; // (hd % 32 == 0: covers)
                let args = fa_q_bf16_kernel::Args {
                    q: x.q,
                    n4: n4 as i64,
                    out: ws.q_bf16,
                };
                let blocks = n4.div_ceil(256).clamp(1, 1024) as u32;
                self.q_bf16.launch(blocks, 256, 0, stream, args)?;
                ws.q_bf16
            }
        };
        let staged = (t >= STAGE_MIN_TOKENS
            && ws.staged.bytes() >= t * staged_row_bytes(hd, checked.nope))
        .then_some(ws.staged);
        if let Some(dst) = staged {
            let args = fa_stage_rows_kernel::Args {
                kv: x.kv,
                t: i("num_tokens", t)?,
                hd: i("head_dim", hd)?,
                nope: i("nope", checked.nope)?,
                staged: dst,
            };
            self.stage.launch(blocks, THREADS as u32, 0, stream, args)?;
        }
        // Both attention kernels take the same parameters.
        macro_rules! args {
            ($k:ident) => {
                $k::Args {
                    q,
                    kv: x.kv,
                    staged,
                    ring: x.ring.pool,
                    entries: checked.entries.map(|e| e.pool),
                    etable: checked.entries.and_then(|e| e.table),
                    epps: i(
                        "pages per slot",
                        checked.entries.map_or(0, |e| e.pages_per_slot),
                    )?,
                    selected: checked.selected.map(|s| s.0),
                    nsel: checked.selected.map(|s| s.1),
                    positions: b.positions,
                    seq_of: b.seq_of,
                    query_start: b.query_start,
                    seq_slots: b.seq_slots,
                    sinks: x.sinks,
                    t: i("num_tokens", t)?,
                    h: i("heads", h)?,
                    hd: i("head_dim", hd)?,
                    nope: i("nope", checked.nope)?,
                    w: i("window", x.window)?,
                    ratio: i("ratio", x.ratio)?,
                    maxe: i("maxe", x.maxe)?,
                    topk: i("topk", x.topk)?,
                    splits: i("splits", splits)?,
                    part_o: part.map(|p| p.0),
                    part_ml: part.map(|p| p.1),
                    o: x.o,
                }
            };
        }
        let grid = (blocks, splits as u32);
        let raw_row = x.ring.rows.bytes_per_row();
        // A clustered launch's blocks also hold their partials for the combine.
        let cluster_smem = if clustered { cluster_smem_bytes(hd) } else { 0 };
        let cluster = (1, splits as u32, 1);
        match path {
            AttentionPath::Wgmma if clustered => self.attention_wgmma.launch_clustered(
                grid,
                THREADS as u32,
                wgmma_smem_bytes(raw_row).max(cluster_smem) as u32,
                stream,
                args!(fa_attention_wgmma_kernel),
                cluster,
            )?,
            AttentionPath::Wgmma => self.attention_wgmma.launch(
                grid,
                THREADS as u32,
                wgmma_smem_bytes(raw_row) as u32,
                stream,
                args!(fa_attention_wgmma_kernel),
            )?,
            AttentionPath::WgmmaWs => {
                ws_pool_holds(self.attention_wgmma_ws.kernel())?;
                self.attention_wgmma_ws.launch(
                    grid,
                    WS_THREADS as u32,
                    wgmma_ws_smem_bytes(raw_row) as u32,
                    stream,
                    args!(fa_attention_wgmma_ws_kernel),
                )?
            }
            AttentionPath::WgmmaWsEarlyPv => {
                ws_pool_holds(self.attention_wgmma_ws_early.kernel())?;
                self.attention_wgmma_ws_early.launch(
                    grid,
                    WS_THREADS as u32,
                    wgmma_ws_smem_bytes(raw_row) as u32,
                    stream,
                    args!(fa_attention_wgmma_ws_early_kernel),
                )?
            }
            _ if clustered => self.attention.launch_clustered(
                grid,
                THREADS as u32,
                smem_bytes(hd, raw_row).max(cluster_smem) as u32,
                stream,
                args!(fa_attention_kernel),
                cluster,
            )?,
            _ => self.attention.launch(
                grid,
                THREADS as u32,
                smem_bytes(hd, raw_row) as u32,
                stream,
                args!(fa_attention_kernel),
            )?,
        }
        if splits == 1 || clustered {
            return Ok(());
        }
        let args = fa_combine_kernel::Args {
            part_o: ws.part_o,
            part_ml: ws.part_ml,
            sinks: x.sinks,
            t: i("num_tokens", t)?,
            h: i("heads", h)?,
            hd: i("head_dim", hd)?,
            splits: i("splits", splits)?,
            o: x.o,
        };
        self.combine
            .launch((blocks, h as u32), 128, 0, stream, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wgmma_block_fits_flash_rows_and_refuses_rows_it_cannot_hold() {
        use crate::cuda::kv_pages::{KvFormat, KvRows};
        // Flash: 448 FP8 nope channels + 64 BF16 RoPE, 592 bytes a staged row.
        let flash = KvRows::kv(KvFormat::Official, WGMMA_HD, 448).bytes_per_row();
        for bytes in [wgmma_smem_bytes(flash), wgmma_ws_smem_bytes(flash)] {
            assert!(bytes <= SM90_MAX_SMEM, "{bytes} bytes");
            assert!(bytes > MAX_SMEM.min(smem_bytes(WGMMA_HD, flash)));
        }
        // An all-BF16 row (no FP8 part) would need more than a block has: covers_wgmma and
        // covers_wgmma_ws refuse it.
        let bf16 = KvRows::kv(KvFormat::Official, WGMMA_HD, 0).bytes_per_row();
        assert!(wgmma_smem_bytes(bf16) > SM90_MAX_SMEM);
        assert!(wgmma_ws_smem_bytes(bf16) > SM90_MAX_SMEM);
    }

    #[test]
    fn a_requested_split_count_is_checked_against_the_workspace() {
        assert_eq!(split_count(64, 640, None).unwrap(), splits(64, 640));
        assert_eq!(split_count(64, 640, Some(1)).unwrap(), 1);
        assert_eq!(split_count(64, 640, Some(2)).unwrap(), 2);
        assert_eq!(split_count(100_000, 640, Some(1)).unwrap(), 1); // unsplit: no workspace
        for (t, n) in [(64, 3), (1, 0), (1, MAX_SPLITS + 1), (SPLIT_TARGET, 2)] {
            let e = split_count(t, 640, Some(n)).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{t} tokens, {n} splits");
            assert!(e.to_string().contains(&format!("{n} splits")), "{e}");
        }
    }

    #[test]
    fn splits_fill_the_gpu_at_few_tokens_and_stop_at_the_workspace() {
        assert_eq!(splits(1, 640), 20); // one tile a block
        assert_eq!(splits(1, 100_000), MAX_SPLITS);
        assert_eq!(splits(1, 40), 2); // two tiles of keys
        assert_eq!(splits(8, 640), 16);
        assert_eq!(splits(64, 640), 2);
        assert_eq!(splits(65, 640), 1);
        for t in 1..600 {
            let s = splits(t, 100_000);
            assert!(s == 1 || t * s <= SPLIT_TARGET, "{t} tokens x {s} splits");
        }
    }
}
