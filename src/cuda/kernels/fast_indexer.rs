//! Rust side of the `fast_indexer` kernel family (kernels/fast_indexer.cu): the fast set's
//! lightning indexer. `fi_score_kernel` scores every visible key of each token with all heads
//! on FP8 tensor cores (wgmma; official FP4 queries and keys are exact in e4m3, each 32-block's
//! sum promoted into f32), `fi_topk_kernel` selects the top min(topk, visible) exactly on those
//! scores (radix select on their BF16 bits over a cluster of blocks, ties to the lower index,
//! listed in index order). Takes the reference's [`IndexerArgs`]; the keys must be stored in the
//! official format. `fi_score_tc_kernel` is the scoring with the sum over the heads on the BF16
//! tensor core ([`HeadSum::TensorCore`]): measured next to the other by `dsv4 bench attn`
//! (`indexer_fast_tc`). `fi_score_fold_kernel` and
//! `fi_score_fold_tc_kernel` fold the 32-block scales into the codes ([`SelectPlan::fold`]):
//! where a tile's keys and the token's queries allow it, a key's dot with a head is one chain of
//! wgmmas over the whole head dim ([`ScaleFold::Chain128`]; or two of 64, added in f32:
//! [`ScaleFold::Chain64`]), and the two power-of-two factors left move into the head's weight and
//! the key's finished score (no promotion); compiled for head dim [`FOLD_DIM`] only (Flash's and
//! Pro's), other dims run the plain kernels. The fast set runs the fold with the tensor-core head
//! sum ([`fast_plan`]; `dsv4 bench attn`: `indexer_fast`, beside `indexer_plain`, the others).
//! `fi_score_stream_kernel` is the same operation as a stream ([`SelectPlan::streamed`],
//! [`stream_plan`]; `indexer_stream` in the bench): each 64-key tile's page is copied whole, by one
//! bulk copy, into a ring of the warpgroup that scores it, which decodes the keys straight into the
//! wgmmas' registers. `fi_select_stream_kernel` runs that scoring and the top-k in one launch, a
//! cluster of blocks a token whose scores stay in shared memory ([`SelectPlan::fused_topk`],
//! [`fused_plan`]; `indexer_fused` in the bench).
//! tests/gpu_fast_indexer.rs bounds the scores against the reference kernel and checks the
//! selection against an exact top-k of the fast scores.

use super::attention::BatchMeta;
use super::indexer::IndexerArgs;
use super::to_i32;
use crate::cuda::Context;
use crate::cuda::kv_pages::{KV_PAGE, KvFormat, RowKind};
use crate::cuda::stream::BorrowedStream;
use crate::error::{Error, Result, Status};

/// Threads of a scoring block (FI_THREADS): one warpgroup, 4 warps of 16 keys (the m64 rows of
/// its wgmmas; the heads are their n64 columns).
pub const THREADS: usize = 128;
/// Keys decoded and scored together (FI_TILE_KEYS).
pub const TILE_KEYS: usize = 64;
/// Keys one scoring block takes (FI_CHUNK_KEYS): the grid's second dimension covers maxe.
pub const CHUNK_KEYS: usize = 256;
/// Most heads (FI_MAX_HEADS) and the largest head dim (FI_MAX_DIM).
pub const MAX_HEADS: usize = 64;
pub const MAX_DIM: usize = 256;
/// Threads of a top-k block (FI_TOPK_THREADS).
pub const TOPK_THREADS: usize = 256;
/// Most blocks of a token's top-k (FI_TOPK_CLUSTER): one thread-block cluster (8: the portable
/// cluster size), each a contiguous run of the token's entries; [`topk_cluster_for`] picks how many.
pub const TOPK_CLUSTER: usize = 8;
/// Most order keys (u16) a top-k block stages in shared memory (64 KB): a block whose run of
/// entries fits (up to 256K entries a token: 1M positions at ratio 4) reads its scores once, not
/// four times.
pub const TOPK_STAGE_KEYS: usize = 32768;

/// Bytes of the head weights as the tensor-core head sum's B operand (FI_WB_BYTES): 64 heads x 8
/// columns of bf16 ([`HeadSum::TensorCore`]).
pub const HEAD_SUM_B_BYTES: usize = MAX_HEADS * 8 * 2;

/// The head dim the scale-fold kernels are compiled for (FI_FOLD_DIM): a [`SelectPlan::fold`]
/// at another dim runs the plain kernels (and one chunk a block).
pub const FOLD_DIM: usize = 128;

/// Bytes the scale fold adds to a scoring block ([`SelectPlan::fold`]): each chunk key's
/// largest scale exponent, a flag a 32 keys (padded to 16 bytes) and each head's exponent.
pub const FOLD_BYTES: usize = CHUNK_KEYS + 16 + MAX_HEADS;

/// Dynamic shared memory of a scoring block for head dim `di`: one key tile and the token's queries
/// as e4m3 codes (`di` bytes a key or head), the chunk's keys as stored (`di / 2` code bytes and
/// `di / 32` scale bytes a key) and the factors (one f32 a tile key or head and 32-block); with
/// the head sum on the tensor core, its weights ([`HEAD_SUM_B_BYTES`]); with the scale fold,
/// [`FOLD_BYTES`].
pub const fn score_smem_bytes(di: usize, head_sum: HeadSum, folded: bool) -> usize {
    di * (TILE_KEYS + MAX_HEADS)
        + CHUNK_KEYS * (di / 2 + di / 32)
        + 4 * (di / 32) * (TILE_KEYS + MAX_HEADS)
        + match head_sum {
            HeadSum::Ordered => 0,
            HeadSum::TensorCore => HEAD_SUM_B_BYTES,
        }
        + if folded { FOLD_BYTES } else { 0 }
}

/// How a score's sum over the heads, `Σ_h relu(bf16(d_h)) · w_h`, is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSum {
    /// In f32 in a fixed order on the CUDA cores (`fi_score_kernel`, `fi_score_fold_kernel`).
    Ordered,
    /// On the BF16 tensor core (`fi_score_tc_kernel`, `fi_score_fold_tc_kernel`): the relu'd d_h
    /// as registers against the weights split into two bf16 columns; fewer instructions, other
    /// rounding (the tests' bound covers both). The fast set's ([`fast_plan`]).
    TensorCore,
}

// One warpgroup whose m64 wgmma rows are a tile's keys and whose n64 columns are all the heads.
const _: () = assert!(
    THREADS == 128 && MAX_HEADS == 64 && TILE_KEYS == 64 && CHUNK_KEYS.is_multiple_of(THREADS)
);

/// Warpgroups of a `fi_score_stream_kernel` block (FI_STREAM_WGS), which take its tiles in turn,
/// and its threads (FI_STREAM_THREADS).
pub const STREAM_WGS: usize = 2;
pub const STREAM_THREADS: usize = 128 * STREAM_WGS;
/// Pages of a streamed block's ring (FI_STREAM_SLOTS): [`STREAM_SLOTS`] / [`STREAM_WGS`] a
/// warpgroup, which keeps one fewer tiles in flight ahead of the one it scores.
pub const STREAM_SLOTS: usize = 12;
/// Dynamic shared memory of a streamed block (FI_STREAM_SMEM): the ring's pages as stored
/// ([`KV_PAGE`] keys of `FOLD_DIM / 2` code bytes and `FOLD_DIM / 32` scale bytes), the queries'
/// codes in two k orders ([`FOLD_DIM`] bytes a head each), their block factors (an f32 a head and
/// 32-block), the head sum's weights and an mbarrier a slot.
pub const STREAM_SMEM: usize = STREAM_SLOTS * KV_PAGE * (FOLD_DIM / 2 + FOLD_DIM / 32)
    + 2 * FOLD_DIM * MAX_HEADS
    + 4 * (FOLD_DIM / 32) * MAX_HEADS
    + HEAD_SUM_B_BYTES
    + 8 * STREAM_SLOTS;
// A streamed tile is one page; four consumer threads a head build the queries.
const _: () = assert!(TILE_KEYS == KV_PAGE && 128 * STREAM_WGS == 4 * MAX_HEADS);

/// The largest scoring block (the registry raises the kernel's limit to it).
pub const MAX_SMEM: usize = score_smem_bytes(MAX_DIM, HeadSum::TensorCore, true);

/// Most blocks of a `fi_select_stream_kernel` cluster (FI_FUSED_MAX_CLUSTER): 16, a non-portable
/// size (above [`TOPK_CLUSTER`]) that H100 / H200 schedule, for few tokens of long contexts.
pub const FUSED_MAX_CLUSTER: usize = 16;
/// Most order keys (u16) a `fi_select_stream_kernel` block stages after [`STREAM_SMEM`]: its run
/// of the token's entries (256K entries a token at the largest cluster: 1M positions at ratio 4).
/// With the selection's own ~3 KB, two blocks still fit an SM (2 x 107 KB).
pub const FUSED_STAGE_KEYS: usize = 16384;
/// Dynamic shared memory of the largest `fi_select_stream_kernel` block.
pub const FUSED_MAX_SMEM: usize = STREAM_SMEM + 2 * FUSED_STAGE_KEYS;
// The fused launch's blocks are the stream's and the selection's at once.
const _: () = assert!(
    STREAM_THREADS == TOPK_THREADS
        && STREAM_SMEM.is_multiple_of(16)
        && FUSED_MAX_CLUSTER >= TOPK_CLUSTER
);

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_indexer", include_str!("../../../kernels/fast_indexer.cu");

    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fi_score_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, chunk_keys: i32, scores: *mut f32,
    );
    /// fi_score_kernel with the head sum on the tensor core ([`HeadSum::TensorCore`]).
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fi_score_tc_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, chunk_keys: i32, scores: *mut f32,
    );
    /// fi_score_kernel with the scale fold ([`SelectPlan::fold`]; `fold_chains`: 1 or 2, its
    /// [`ScaleFold::chains`]).
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fi_score_fold_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, chunk_keys: i32, fold_chains: i32, scores: *mut f32,
    );
    /// The scale fold with the head sum on the tensor core.
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fi_score_fold_tc_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, chunk_keys: i32, fold_chains: i32, scores: *mut f32,
    );
    /// The scale fold with the tensor-core head sum as a stream of pages ([`SelectPlan::streamed`]).
    #[smem(STREAM_SMEM as u32)]
    #[pdl(true)]
    fn fi_score_stream_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, scores: *mut f32,
    );
    /// The streamed scoring and the top-k in one clustered launch ([`SelectPlan::fused_topk`]);
    /// `scores` None: the row is not written.
    #[smem(FUSED_MAX_SMEM as u32)]
    #[pdl(true)]
    #[cluster(FUSED_MAX_CLUSTER as u32)]
    fn fi_select_stream_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32, seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32,
        di: i32, ratio: i32, maxe: i32, topk: i32, stage_keys: i32, scores: Option<*mut f32>,
        selected: *mut i32, nsel: *mut i32,
    );
    #[smem((2 * TOPK_STAGE_KEYS) as u32)]
    #[pdl(true)]
    fn fi_topk_kernel(
        scores: *const f32, positions: *const i32, seq_of: *const i32, seq_slots: *const i32,
        t: i32, ratio: i32, maxe: i32, topk: i32, stage_keys: i32, nc: i32,
        selected: *mut i32, nsel: *mut i32,
    );
}

crate::launchers! {
    /// The fast_indexer family's entry points, resolved from a loaded registry.
    pub struct FastIndexer {
        score: fi_score_kernel,
        score_tc: fi_score_tc_kernel,
        score_fold: fi_score_fold_kernel,
        score_fold_tc: fi_score_fold_tc_kernel,
        score_stream: fi_score_stream_kernel,
        select_stream: fi_select_stream_kernel,
        topk: fi_topk_kernel,
    }
}

const FAMILY: &str = "fast_indexer";

/// How [`FastIndexer::select_with`] splits the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectPlan {
    /// Keys a scoring block takes (1 ..= CHUNK_KEYS).
    pub chunk_keys: usize,
    /// Order keys the top-k block stages in shared memory (0 ..= TOPK_STAGE_KEYS): a token with
    /// more visible entries reads its scores row in every pass.
    pub stage_keys: usize,
    /// How the scores sum over the heads (the selection follows the scores).
    pub head_sum: HeadSum,
    /// Whether and how the 32-block scales are folded into the e4m3 codes ([`ScaleFold`]).
    /// Folding needs `chunk_keys` a multiple of [`TILE_KEYS`], so that the tiles, and with them
    /// the fold's decisions, do not depend on the split. At head dims other than [`FOLD_DIM`]
    /// the plain kernels run (the same scores as [`ScaleFold::Off`]).
    pub fold: ScaleFold,
    /// Chunks a scoring block takes (its token's chunks `blockIdx.y`, `+ gridDim.y`, ...), its
    /// queries' codes made once: 1, or more with a fold (whose kernels loop; at other head dims
    /// than [`FOLD_DIM`] it is taken as 1).
    pub chunks_per_block: usize,
    /// Whether the folded scoring runs as a stream of pages (`fi_score_stream_kernel`): needs
    /// [`ScaleFold::Chain128`] and [`HeadSum::TensorCore`]. A block then takes `chunk_keys x
    /// chunks_per_block` keys' worth of 64-key tiles, interleaved over its token's blocks (tile y,
    /// y + blocks, ...). Its scores are within the fold's bound, not the tiled kernel's bits (the
    /// wgmmas group the products into other k32 steps). At head dims other than [`FOLD_DIM`] the
    /// plain kernels run.
    pub streamed: bool,
    /// With `streamed`: the top-k in the scoring launch ([`FusedTopk`]); None, a launch of its own
    /// (`fi_topk_kernel`, reading the scores row). The same scores and selection either way. At
    /// head dims other than [`FOLD_DIM`] the plain kernels and the separate top-k run.
    pub fused_topk: Option<FusedTopk>,
    /// Blocks of a token's separate top-k launch (`fi_topk_kernel`: one thread-block cluster,
    /// 1 ..= [`TOPK_CLUSTER`]; [`topk_cluster_for`]). Not used with `fused_topk`. The selection
    /// does not depend on it.
    pub topk_cluster: usize,
}

/// Which of a select's launches [`FastIndexer::select_part`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectPart {
    /// The scoring, then the top-k: the select.
    Both,
    /// The scoring alone (it writes the scores row).
    Scoring,
    /// The top-k alone, on the scores row as the last scoring left it.
    TopK,
}

/// The top-k inside the streamed scoring launch (`fi_select_stream_kernel`): a cluster of
/// `cluster` blocks a token, block r scoring the token's tiles r m .. r m + m - 1 (m = its tiles /
/// `cluster`, rounded up: contiguous runs, as the selection wants them) into its shared memory,
/// then the cluster selecting on them as `fi_topk_kernel` does on the scores row
/// ([`SelectPlan::chunks_per_block`] is not used). Needs every run to fit [`FUSED_STAGE_KEYS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedTopk {
    /// Blocks a token (1 ..= [`FUSED_MAX_CLUSTER`]; above [`TOPK_CLUSTER`] a non-portable
    /// cluster size).
    pub cluster: usize,
    /// Whether the launch also writes the scores row (the tests compare it with the unfused
    /// kernels'); the fast set's plans do not, so that the scores never leave the SMs.
    pub write_scores: bool,
}

/// Order keys a `fi_select_stream_kernel` block stages for `maxe` entries a token over `cluster`
/// blocks: its run of whole tiles; None past [`FUSED_STAGE_KEYS`] (or for no cluster).
pub fn fused_stage_keys(maxe: usize, cluster: usize) -> Option<usize> {
    if cluster == 0 {
        return None;
    }
    let keys = maxe.div_ceil(TILE_KEYS).div_ceil(cluster) * TILE_KEYS;
    (keys <= FUSED_STAGE_KEYS).then_some(keys)
}

/// The scale fold of the scoring (kernels/fast_indexer.cu, "the scale fold"): where a 64-key
/// tile's keys and the token's queries allow it, the keys' and heads' 32-block scales are folded
/// into their e4m3 codes and a key's dots need no promotion; elsewhere the per-32-block promotion
/// runs as without the fold. Another rounding than [`ScaleFold::Off`] (the tests' bound).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleFold {
    /// No fold: the per-32-block promotion everywhere (`fi_score_kernel`, `fi_score_tc_kernel`).
    Off,
    /// A key's dot with a head as one chain of four wgmmas over its 128 dims (DESIGN.md §4's
    /// longest: promotion at least every 128 of K).
    Chain128,
    /// Two chains of 64 dims added in f32: half the chain's accumulator error, 32 more adds a
    /// thread and tile.
    Chain64,
}

impl ScaleFold {
    /// Chains a key tile's dots take (the fold kernels' `fold_chains`); 0 without the fold.
    pub fn chains(self) -> usize {
        match self {
            ScaleFold::Off => 0,
            ScaleFold::Chain128 => 1,
            ScaleFold::Chain64 => 2,
        }
    }
}

/// Order keys a top-k block of a `cluster`-block top-k stages for `maxe` entries a token: its whole
/// run (a multiple of 32), up to [`TOPK_STAGE_KEYS`].
pub fn stage_keys_for(maxe: usize, cluster: usize) -> usize {
    maxe.div_ceil(cluster.max(1))
        .next_multiple_of(32)
        .min(TOPK_STAGE_KEYS)
}

/// Blocks of a token's separate top-k ([`SelectPlan::topk_cluster`]) for `tokens` tokens of up
/// to `maxe` entries: a cluster of [`TOPK_CLUSTER`] splits one token's passes eight ways (one
/// block took ~35 µs for 16K entries, its own instruction issue), but few entries a block cost
/// more in the cluster's exchanges than they save. `dsv4 bench attn` times 1, 2, 4 and 8 blocks
/// (`indexer_topk` lines: the whole select). Measured (H100, best of 2 rounds, µs for 1 / 2 / 4
/// / 8 blocks; BENCHMARKS.md 2026-12-05, thirty-third part): 8K (2048 entries) 8 tokens 13.55 /
/// **12.49** / 12.91 / 13.18, 32 tokens 20.40 / 18.25 / **17.38** / 17.92, 64 tokens 24.01 /
/// 21.90 / **21.10** / 22.00; 64K (16384 entries) 8 tokens 57.58 / 31.42 / 29.45 / **23.97**,
/// 32 tokens **42.25** with 8, 64 tokens **67.78** with 8. Between (16K, 32K contexts) not
/// measured: 8 from there.
pub fn topk_cluster_for(tokens: usize, maxe: usize) -> usize {
    if maxe > SMALL_TOPK_ENTRIES {
        TOPK_CLUSTER
    } else if tokens <= 8 {
        2
    } else {
        4
    }
}

/// Most entries a token has where [`topk_cluster_for`] takes clusters of 2 or 4 (an 8K context's).
const SMALL_TOPK_ENTRIES: usize = 2048;

/// Blocks a scoring launch aims at when [`chunks_per_block_for`] gives a block several chunks:
/// about one wave of four blocks on an H200's 132 SMs.
const SCORE_BLOCKS: usize = 512;
/// The same for launches of 3 to [`FEW_TOKENS`] tokens: half as many, larger blocks.
const FEW_TOKENS_SCORE_BLOCKS: usize = 256;
/// Tokens up to which [`FEW_TOKENS_SCORE_BLOCKS`] applies and [`chunk_keys_for`] keeps chunks
/// smaller than [`CHUNK_KEYS`] where a token has few entries.
const FEW_TOKENS: usize = 8;
/// Entries a token has from which launches of 3 to [`FEW_TOKENS`] tokens take whole
/// [`CHUNK_KEYS`] chunks (a 64K context's CSA entries).
const FEW_TOKENS_WIDE_MAXE: usize = 16384;

/// Chunks a fold kernel's scoring block takes ([`SelectPlan::chunks_per_block`]) for `tokens`
/// tokens of up to `maxe` entries in chunks of `chunk_keys`: as many as keep about
/// [`SCORE_BLOCKS`] blocks ([`FEW_TOKENS_SCORE_BLOCKS`] from 3 to [`FEW_TOKENS`] tokens), at most 8
/// (each block makes its token's query codes once instead of once a chunk). Measured (`dsv4
/// bench attn`, H200, `fi_score_fold_tc_kernel`, µs, chunk keys / chunks a block; two calls of
/// 2026-12-05 alike): 64K, 64 tokens 138.2 (128/1), 104.7 (256/1), 82.4 (256/4), **78.8
/// (256/8)**; 8K, 64 tokens **26.0 (256/1)**, 31.7 (256/2), 25.6 (128/2); 64K, 8 tokens 28.0
/// (128/1), 27.7 (128/2), 26.6 (128/4), **25.9 (256/2)**, 28.0 (256/1); 8K, 8 tokens **13.8
/// (128/1)**, 14.1 (256/1); 1 token: 64/1 best at 8K and 64K.
pub fn chunks_per_block_for(tokens: usize, maxe: usize, chunk_keys: usize) -> usize {
    let chunks = tokens * maxe.div_ceil(chunk_keys.max(1));
    // (One or two tokens' 64-key chunks keep the wider target: at one token 64 keys a block was
    // best, 64/2 and 64/4 slower.)
    let target = if (3..=FEW_TOKENS).contains(&tokens) {
        FEW_TOKENS_SCORE_BLOCKS
    } else {
        SCORE_BLOCKS
    };
    (chunks / target).clamp(1, 8)
}

/// The fast set's plan for `tokens` tokens of up to `maxe` entries: the scale fold (one chain of
/// 128 dims) with the head sum on the tensor core, in chunks of [`chunk_keys_for`], several a
/// block by [`chunks_per_block_for`]. Measured against the plain kernel with the ordered head sum
/// (`dsv4 bench attn`, H200, the whole select, µs): 64K, 64 tokens 143.5 → 78.8; 64K, 8 tokens
/// 32.4 → 27.7 (25.9 with 256-key chunks, two a block: the rule since); 8K, 64 tokens 30.9 →
/// 26.0; one token 15.4 → 14.7 (64K) and 12.4 → 11.4 (8K).
pub fn fast_plan(tokens: usize, maxe: usize) -> SelectPlan {
    let chunk_keys = chunk_keys_for(tokens, maxe);
    SelectPlan {
        chunk_keys,
        stage_keys: stage_keys_for(maxe, topk_cluster_for(tokens, maxe)),
        head_sum: HeadSum::TensorCore,
        fold: ScaleFold::Chain128,
        chunks_per_block: chunks_per_block_for(tokens, maxe, chunk_keys),
        streamed: false,
        fused_topk: None,
        topk_cluster: topk_cluster_for(tokens, maxe),
    }
}

/// The plan [`FastIndexer::select`] (the fast set's call) runs for `tokens` tokens of up to `maxe`
/// entries: the streamed kernel's ([`stream_plan`]). Measured against the tiled fold kernel
/// ([`fast_plan`]) on an H100 (`dsv4 bench attn`, the whole select, µs, best of two rounds): 64K,
/// 1 / 8 / 64 tokens 15.04 / 26.62 / 77.50 → 14.00 / 23.99 / 66.71; 8K 12.08 / 14.85 / 26.76 →
/// 11.62 / 12.79 / 21.79. The top-k fused into the scoring launch ([`fused_plan`]), at its best
/// cluster, is faster still at 8K (10.99 / 11.21 / 17.98, clusters 16 / 8 / 2) and slower at 64K
/// (17.17 / 23.94 / 81.53); at 16K it wins from 8 tokens, at 32K only at 8 (BENCHMARKS.md
/// 2026-12-05, twenty-eighth part). The plan follows the slot's capacity (`maxe`), not the live
/// context, so a fused rule would pay only in engines built with a short max_seq_len: not taken.
pub fn select_plan(tokens: usize, maxe: usize) -> SelectPlan {
    stream_plan(tokens, maxe)
}

/// Blocks a streamed scoring launch aims at: two an SM (256 threads of at most 128 registers)
/// on an H200's 132 SMs, so that every block's stream starts at once.
const STREAM_BLOCKS: usize = 264;

/// The streamed kernel's plan ([`SelectPlan::streamed`]) for `tokens` tokens of up to `maxe`
/// entries: 64-key chunks, as many a block as spread a token's tiles over its share of
/// [`STREAM_BLOCKS`], and at least one a consumer warpgroup. `dsv4 bench attn` sweeps the tiles
/// a block (`indexer_stream` lines with `chunk_keys`); on an H100 this rule's pick was the best
/// or within 1% of it at 64 tokens (8K: 8 tiles, 64K: 64), and 3-5% behind 4 tiles a block at
/// 8 tokens (8K 12.58 against 12.27 µs, 64K 23.73 against 22.62).
pub fn stream_plan(tokens: usize, maxe: usize) -> SelectPlan {
    let tiles = maxe.div_ceil(TILE_KEYS);
    let blocks_per_token = (STREAM_BLOCKS / tokens.max(1)).max(1);
    SelectPlan {
        chunk_keys: TILE_KEYS,
        stage_keys: stage_keys_for(maxe, topk_cluster_for(tokens, maxe)),
        head_sum: HeadSum::TensorCore,
        fold: ScaleFold::Chain128,
        chunks_per_block: tiles.div_ceil(blocks_per_token).max(STREAM_WGS),
        streamed: true,
        fused_topk: None,
        topk_cluster: topk_cluster_for(tokens, maxe),
    }
}

/// The streamed plan with the top-k in its launch ([`SelectPlan::fused_topk`]) over clusters of
/// `cluster` blocks, the scores row not written; None where a block's run would not fit
/// [`FUSED_STAGE_KEYS`] or `cluster` is out of 1 ..= [`FUSED_MAX_CLUSTER`]. `dsv4 bench attn` times
/// it at each cluster size (`indexer_fused`). A token's scoring then runs on `cluster` blocks, not
/// [`STREAM_BLOCKS`] / tokens: on an H100 it beat the stream at 8K (see [`select_plan`]), where a
/// token's 32 tiles fit a few blocks, and lost at 64K, where they do not.
pub fn fused_plan(tokens: usize, maxe: usize, cluster: usize) -> Option<SelectPlan> {
    if !(1..=FUSED_MAX_CLUSTER).contains(&cluster) {
        return None;
    }
    fused_stage_keys(maxe, cluster)?;
    Some(SelectPlan {
        fused_topk: Some(FusedTopk {
            cluster,
            write_scores: false,
        }),
        ..stream_plan(tokens, maxe)
    })
}

/// Keys a scoring block takes at `tokens` tokens of up to `maxe` entries: whole tiles, fewer
/// where few tokens would leave SMs idle (a block's fixed cost, its queries' codes, is paid once
/// a chunk), unless a token has [`FEW_TOKENS_WIDE_MAXE`] entries or more (then several whole
/// chunks a block, [`chunks_per_block_for`]). Measured (`dsv4 bench attn --indexer-chunks
/// 64,128,256`, H200, µs at 8K / 64K contexts, one chunk a block): 1 token 12.6 / 15.4 at 64
/// keys (14.5 / 16.9 at 128); 8 tokens 14.8 / 40.8 at 64, 15.9 / 33.4 at 128, 18.6 / 33.2 at
/// 256; 16 tokens 19.9 / 71.4, 20.0 / 55.3, 20.9 / 48.2; 64 tokens 43.7 / 252.0, 35.3 / 184.0,
/// 31.7 / 150.5. (The scores do not depend on the chunks.)
pub fn chunk_keys_for(tokens: usize, maxe: usize) -> usize {
    match tokens {
        0..=2 => TILE_KEYS,
        3..=FEW_TOKENS if maxe < FEW_TOKENS_WIDE_MAXE => 2 * TILE_KEYS,
        _ => CHUNK_KEYS,
    }
}

/// A scoring kernel's `Args`: the indexer's inputs and the batch's layout as every scoring kernel
/// takes them (`$b`: [`BatchMeta`], `$x`: [`IndexerArgs`], `$i`: the i32 conversion that names
/// a value in its error), then the kernel's own fields (`scores` among them: optional in one).
macro_rules! score_args {
    ($kernel:ident, $b:expr, $x:expr, $i:expr $(, $extra:ident: $value:expr)*) => {
        $kernel::Args {
            $($extra: $value,)*
            qi: $x.qi,
            iw: $x.iw,
            ikeys: $x.ikeys.pool,
            itable: $x.ikeys.table,
            ipps: $i("pages per slot", $x.ikeys.pages_per_slot)?,
            positions: $b.positions,
            seq_of: $b.seq_of,
            seq_slots: $b.seq_slots,
            t: $i("num_tokens", $b.num_tokens)?,
            hi: $i("heads", $x.heads)?,
            di: $i("dim", $x.dim)?,
            ratio: $i("ratio", $x.ratio)?,
            maxe: $i("maxe", $x.maxe)?,
        }
    };
}

fn bad(msg: String) -> Error {
    Error::new(Status::Internal, format!("{FAMILY}: {msg}"))
}

impl FastIndexer {
    /// Whether the kernels take this layer: official keys, heads and dims they tile.
    pub fn covers(x: &IndexerArgs) -> bool {
        x.official
            && x.ikeys.rows.format == KvFormat::Official
            && x.ikeys.rows.kind == RowKind::IndexKey
            && x.heads <= MAX_HEADS
            && x.dim <= MAX_DIM
            && x.dim.is_multiple_of(32)
    }

    /// Scores every visible key of each token's slot and selects the top min(topk, visible)
    /// (the reference's [`IndexerArgs`], which [`FastIndexer::covers`]); two launches (one with a
    /// fused top-k, [`SelectPlan::fused_topk`]), with [`select_plan`]'s kernels and split.
    pub fn select(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &IndexerArgs,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.select_with(ctx, b, x, select_plan(b.num_tokens, x.maxe), stream)
    }

    /// [`FastIndexer::select`] with the work split chosen by the caller (the tests take every
    /// path with it: unstaged top-k, each chunk size). The results do not depend on the split;
    /// they do on [`SelectPlan::head_sum`] (its rounding).
    pub fn select_with(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &IndexerArgs,
        plan: SelectPlan,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.select_part(ctx, b, x, plan, SelectPart::Both, stream)
    }

    /// [`FastIndexer::select_with`], or one of its two launches alone ([`SelectPart`]: `dsv4
    /// bench attn` times the scoring and the top-k apart; the top-k alone reads the scores row
    /// the last scoring left). A fused plan runs only as [`SelectPart::Both`].
    pub fn select_part(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &IndexerArgs,
        plan: SelectPlan,
        part: SelectPart,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        if plan.chunk_keys == 0
            || plan.chunk_keys > CHUNK_KEYS
            || plan.stage_keys > TOPK_STAGE_KEYS
            || (plan.fold != ScaleFold::Off && !plan.chunk_keys.is_multiple_of(TILE_KEYS))
            || plan.chunks_per_block == 0
            || !(1..=TOPK_CLUSTER).contains(&plan.topk_cluster)
            || (plan.chunks_per_block > 1 && plan.fold == ScaleFold::Off)
            || (plan.streamed
                && (plan.fold != ScaleFold::Chain128 || plan.head_sum != HeadSum::TensorCore))
            || plan.fused_topk.is_some_and(|f| {
                // (The runs must fit the stage only where the fused kernel runs.)
                part != SelectPart::Both
                    || !plan.streamed
                    || !(1..=FUSED_MAX_CLUSTER).contains(&f.cluster)
                    || (x.dim == FOLD_DIM && fused_stage_keys(x.maxe, f.cluster).is_none())
            })
        {
            return Err(bad(format!("{plan:?} out of range")));
        }
        if !Self::covers(x) {
            return Err(bad(format!(
                "{} heads of {} stored as {:?}, top-{}, official {}",
                x.heads, x.dim, x.ikeys.rows, x.topk, x.official
            )));
        }
        let (t, di) = (b.num_tokens, x.dim);
        x.check(FAMILY, t)?;
        let blocks = u32::try_from(t)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| bad(format!("{t} tokens: too many blocks")))?;
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        // The fold kernels at their head dim only, and only they take several chunks a block.
        let fold = plan.fold != ScaleFold::Off && di == FOLD_DIM;
        if let Some(f) = plan.fused_topk.filter(|_| fold) {
            return self.select_fused(b, x, f, stream);
        }
        let chunks_per_block = if fold { plan.chunks_per_block } else { 1 };
        let chunks = x.maxe.div_ceil(plan.chunk_keys).div_ceil(chunks_per_block);
        if chunks > 0 && part != SelectPart::TopK {
            let chunks = u32::try_from(chunks)
                .ok()
                .filter(|&c| c <= 65535)
                .ok_or_else(|| bad(format!("{} entries: too many chunks", x.maxe)))?;
            let chunk_keys = i("chunk keys", plan.chunk_keys)?;
            let smem = score_smem_bytes(di, plan.head_sum, fold) as u32;
            let chains = i("fold chains", plan.fold.chains())?;
            let grid = (blocks, chunks);
            match (plan.head_sum, fold) {
                (_, true) if plan.streamed => {
                    let args = score_args!(fi_score_stream_kernel, b, x, i, scores: x.scores);
                    self.score_stream.launch(
                        grid,
                        STREAM_THREADS as u32,
                        STREAM_SMEM as u32,
                        stream,
                        args,
                    )?
                }
                (HeadSum::Ordered, false) => {
                    let args = score_args!(fi_score_kernel, b, x, i, chunk_keys: chunk_keys, scores: x.scores);
                    self.score
                        .launch(grid, THREADS as u32, smem, stream, args)?
                }
                (HeadSum::TensorCore, false) => {
                    let args = score_args!(fi_score_tc_kernel, b, x, i, chunk_keys: chunk_keys, scores: x.scores);
                    self.score_tc
                        .launch(grid, THREADS as u32, smem, stream, args)?
                }
                (HeadSum::Ordered, true) => {
                    let args = score_args!(fi_score_fold_kernel, b, x, i, chunk_keys: chunk_keys, fold_chains: chains, scores: x.scores);
                    self.score_fold
                        .launch(grid, THREADS as u32, smem, stream, args)?
                }
                (HeadSum::TensorCore, true) => {
                    let args = score_args!(fi_score_fold_tc_kernel, b, x, i, chunk_keys: chunk_keys, fold_chains: chains, scores: x.scores);
                    self.score_fold_tc
                        .launch(grid, THREADS as u32, smem, stream, args)?
                }
            }
        }
        if part == SelectPart::Scoring {
            return Ok(());
        }
        let args = fi_topk_kernel::Args {
            scores: x.scores,
            positions: b.positions,
            seq_of: b.seq_of,
            seq_slots: b.seq_slots,
            t: i("num_tokens", t)?,
            ratio: i("ratio", x.ratio)?,
            maxe: i("maxe", x.maxe)?,
            topk: i("topk", x.topk)?,
            stage_keys: i("stage keys", plan.stage_keys)?,
            nc: i("top-k cluster", plan.topk_cluster)?,
            selected: x.selected,
            nsel: x.nsel,
        };
        let smem = (2 * plan.stage_keys).next_multiple_of(16) as u32;
        let grid = blocks
            .checked_mul(plan.topk_cluster as u32)
            .ok_or_else(|| bad(format!("{t} tokens: too many blocks")))?;
        let cluster = (plan.topk_cluster as u32, 1, 1);
        self.topk
            .launch_clustered(grid, TOPK_THREADS as u32, smem, stream, args, cluster)
    }

    /// The scoring and the top-k in one launch (`fi_select_stream_kernel`), a cluster of
    /// `f.cluster` blocks a token; the caller checked the plan and the arguments.
    fn select_fused(
        &self,
        b: &BatchMeta,
        x: &IndexerArgs,
        f: FusedTopk,
        stream: BorrowedStream,
    ) -> Result<()> {
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let t = b.num_tokens;
        let stage_keys = fused_stage_keys(x.maxe, f.cluster)
            .ok_or_else(|| bad(format!("{} entries over {} blocks", x.maxe, f.cluster)))?;
        let args = score_args!(fi_select_stream_kernel, b, x, i,
            topk: i("topk", x.topk)?,
            stage_keys: i("stage keys", stage_keys)?,
            scores: f.write_scores.then_some(x.scores),
            selected: x.selected,
            nsel: x.nsel
        );
        let tokens = u32::try_from(t).map_err(|_| bad(format!("{t} tokens: too many blocks")))?;
        let cluster = f.cluster as u32;
        let smem = (STREAM_SMEM + 2 * stage_keys) as u32;
        self.select_stream.launch_clustered(
            (tokens, cluster),
            STREAM_THREADS as u32,
            smem,
            stream,
            args,
            (1, cluster, 1),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_work_split_is_the_measured_best_at_the_benched_sizes() {
        // (tokens, entries a token: 8K / 64K contexts' CSA entries) -> (chunk keys, chunks a
        // block), the sweep's best of `chunks_per_block_for`'s table (8K, 64 tokens: 256/1, within
        // 2% of the best 128/2).
        let cases = [
            ((1, 2048), (64, 1)),
            ((1, 16384), (64, 1)),
            ((8, 2048), (128, 1)),
            ((8, 16384), (256, 2)),
            ((64, 2048), (256, 1)),
            ((64, 16384), (256, 8)),
            // 256K contexts, one token: two chunks a block, as before the few-token target.
            ((1, 65536), (64, 2)),
        ];
        for ((t, maxe), want) in cases {
            let p = fast_plan(t, maxe);
            assert_eq!(
                (p.chunk_keys, p.chunks_per_block),
                want,
                "{t} tokens, {maxe}"
            );
        }
        // The streamed plan: tiles a block at the benched sizes, and at most about two blocks an SM
        // (or a block a token) at any size.
        let cases = [
            ((1, 2048), 2),
            ((1, 16384), 2),
            ((8, 2048), 2),
            ((8, 16384), 8),
            ((64, 2048), 8),
            ((64, 16384), 64),
        ];
        for ((t, maxe), want) in cases {
            let p = stream_plan(t, maxe);
            assert!(
                p.streamed && p.fold == ScaleFold::Chain128 && p.head_sum == HeadSum::TensorCore
            );
            assert_eq!(
                (p.chunk_keys, p.chunks_per_block),
                (TILE_KEYS, want),
                "{t} tokens, {maxe}"
            );
        }
        for t in [1, 3, 9, 64, 500, 100_000] {
            for maxe in [1, 300, 16384, 1 << 20] {
                let p = stream_plan(t, maxe);
                let blocks = t * maxe.div_ceil(TILE_KEYS).div_ceil(p.chunks_per_block);
                assert!(
                    p.chunks_per_block >= STREAM_WGS && blocks <= STREAM_BLOCKS.max(t) + t,
                    "{t} tokens, {maxe}: {} tiles a block, {blocks} blocks",
                    p.chunks_per_block
                );
            }
        }
        // The fused plans: a block's run of whole tiles in its stage, refused past it or out of
        // 1 ..= FUSED_MAX_CLUSTER.
        assert_eq!(fused_stage_keys(16384, 4), Some(4096));
        assert_eq!(fused_stage_keys(16384, 1), Some(FUSED_STAGE_KEYS));
        assert_eq!(fused_stage_keys(16385, 1), None);
        assert_eq!(fused_stage_keys(16385, 2), Some(8256));
        assert_eq!(fused_stage_keys(0, 3), Some(0));
        assert_eq!(fused_stage_keys(100, 0), None);
        let p = fused_plan(64, 16384, 4).unwrap();
        assert!(p.streamed && p.fold == ScaleFold::Chain128 && p.head_sum == HeadSum::TensorCore);
        assert_eq!(
            p.fused_topk,
            Some(FusedTopk {
                cluster: 4,
                write_scores: false
            })
        );
        assert_eq!(fused_plan(1, 1 << 19, FUSED_MAX_CLUSTER), None);
        assert!(fused_plan(1, 1 << 18, FUSED_MAX_CLUSTER).is_some());
        assert!(fused_plan(1, 65536, 4).is_some());
        assert_eq!(fused_plan(8, 2048, 0), None);
        assert_eq!(fused_plan(8, 2048, FUSED_MAX_CLUSTER + 1), None);
        // A block's chunks stay within 1..=8 at any size.
        for t in [0, 1, 3, 9, 500, 100_000] {
            for maxe in [0, 1, 300, 1 << 20] {
                let c = fast_plan(t, maxe).chunks_per_block;
                assert!((1..=8).contains(&c), "{t} tokens, {maxe}: {c}");
            }
        }
    }
}
