//! Rust side of the `fast_attention` kernel family (kernels/fast_attention.cu): the fast set's
//! sparse attention over window + compressed keys with the per-head sink, MLA style (one block
//! per token and run of keys takes every head, so each key row is read and decoded once per
//! token), on BF16 tensor cores with an online softmax, split over blocks for few tokens and
//! combined in split order. Takes the reference's [`AttentionArgs`]; the state must be stored in
//! the official format. tests/gpu_fast_attention.rs derives and asserts its error bound against
//! the reference kernel.

use super::attention::AttentionArgs;
use super::attention::BatchMeta;
use super::{need, to_i32};
use crate::cuda::kv_pages::{KvFormat, RowKind};
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
// A Hopper block may use 227 KB of shared memory.
const _: () = assert!(MAX_SMEM <= 227 * 1024);

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_attention", include_str!("../../../kernels/fast_attention.cu");

    /// `entries`, `etable` NULL on window-only layers; `selected` / `nsel` NULL except on CSA.
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fa_attention_kernel(
        q: *const f32, kv: *const f32, ring: *const u8, entries: Option<*const u8>,
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
        combine: fa_combine_kernel,
    }
}

const FAMILY: &str = "fast_attention";

/// Splits of each token's keys for a batch of `t` tokens attending to at most `max_keys` keys:
/// enough blocks for the GPU at few tokens, one per token from [`SPLIT_TARGET`] / 2 tokens on.
pub fn splits(t: usize, max_keys: usize) -> usize {
    (SPLIT_TARGET / t.max(1))
        .min(MAX_SPLITS)
        .min(max_keys.div_ceil(TILE_KEYS))
        .max(1)
}

/// Floats of the split workspace: partial outputs and (max, sum) pairs for every (token, split,
/// head), at most [`SPLIT_TARGET`] token-splits (more tokens run unsplit).
pub fn workspace_floats(heads: usize, head_dim: usize) -> [usize; 2] {
    [SPLIT_TARGET * heads * head_dim, SPLIT_TARGET * heads * 2]
}

/// The split workspace at its arena addresses.
#[derive(Clone, Copy, Debug)]
pub struct FastAttentionWorkspace {
    pub part_o: DevicePtr,
    pub part_ml: DevicePtr,
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

    /// o = softmax-with-sink over each token's keys (the reference's [`AttentionArgs`], which
    /// [`FastAttention::covers`]); one launch, or two with the split combine.
    pub fn attention(
        &self,
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
        // The reference wrapper's checks: state sizes, formats, selection buffers.
        let checked = x.check(FAMILY, b.num_tokens)?;
        let (t, h, hd) = (b.num_tokens, x.heads, x.head_dim);
        let blocks = u32::try_from(t)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| bad(format!("{t} tokens: too many blocks")))?;
        let splits = splits(t, x.max_keys());
        let [po, pml] = workspace_floats(h, hd);
        let part = (splits > 1).then_some((ws.part_o, ws.part_ml));
        if splits > 1 {
            need(FAMILY, "part_o", ws.part_o, po * 4)?;
            need(FAMILY, "part_ml", ws.part_ml, pml * 4)?;
        }
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        let args = fa_attention_kernel::Args {
            q: x.q,
            kv: x.kv,
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
        };
        let grid = (blocks, splits as u32);
        let smem = smem_bytes(hd, x.ring.rows.bytes_per_row());
        self.attention
            .launch(grid, THREADS as u32, smem as u32, stream, args)?;
        if splits == 1 {
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
