//! Rust side of the `attention` kernel family (kernels/attention.cu): typed launch wrappers.
//! See kernels/SPEC.md. Batch metadata (`seq_of`), the core attention over window +
//! compressed keys with the per-head sink (o before the inverse RoPE), the window ring update
//! and the slot lengths. The CPU reference is `reference::attention::attention_core`.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::registry::{Kernel, KernelFn, KernelSource, Registry};
use crate::cuda::stream::{BorrowedStream, KernelArgs, launch};
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// Largest dynamic shared memory of `attention_kernel`: q (head_dim doubles) plus one float
/// per key (window + top-k, or window + every entry of an HCA slot) and the CSA selection.
pub const ATTENTION_MAX_SMEM: u32 = 96 * 1024;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource {
    family: "attention",
    source: include_str!("../../../kernels/attention.cu"),
    functions: &[
        KernelFn::new("batch_meta_kernel"),
        KernelFn::with_smem("attention_kernel", ATTENTION_MAX_SMEM),
        KernelFn::new("ring_update_kernel"),
        KernelFn::new("slot_len_kernel"),
    ],
};

/// Threads per attention block; each thread accumulates at most 4 output channels.
const ATTN_THREADS: u32 = 256;
const ATTN_MAX_CHANNELS_PER_THREAD: usize = 4;

/// The batch's int32 metadata on the device (kernels/SPEC.md): `positions` [T],
/// `query_start` [S+1], `seq_slots` [S], `seq_of` [T] (written by [`Attention::batch_meta`]).
#[derive(Clone, Copy, Debug)]
pub struct BatchMeta {
    pub positions: DevicePtr,
    pub query_start: DevicePtr,
    pub seq_slots: DevicePtr,
    pub seq_of: DevicePtr,
    pub num_tokens: usize,
    pub num_seqs: usize,
}

impl BatchMeta {
    /// Checks every array against T and S.
    pub fn check(&self, family: &str) -> Result<()> {
        let (t, s) = (self.num_tokens, self.num_seqs);
        if t == 0 || s == 0 || s > t {
            return Err(bad(family, format!("batch of {t} tokens in {s} sequences")));
        }
        to_i32(family, "num_tokens", t)?;
        need(family, "positions", self.positions, t * 4)?;
        need(family, "query_start", self.query_start, (s + 1) * 4)?;
        need(family, "seq_slots", self.seq_slots, s * 4)?;
        need(family, "seq_of", self.seq_of, t * 4)
    }
}

/// One layer's attention launch (kernels/SPEC.md `attention_kernel`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs {
    /// Queries after norm + RoPE: [T, H, head_dim] f32.
    pub q: DevicePtr,
    /// This batch's window vectors: [T, head_dim].
    pub kv: DevicePtr,
    /// Window ring: [num_slots, window, head_dim].
    pub ring: DevicePtr,
    /// Compressed entries [num_slots, maxe, head_dim] (ratio > 0).
    pub entries: Option<DevicePtr>,
    /// CSA: the indexer's `selected` [T, topk] and `nsel` [T]. None on HCA / sliding layers.
    pub selected: Option<(DevicePtr, DevicePtr)>,
    /// Per-head sink logits [H].
    pub sinks: DevicePtr,
    pub heads: usize,
    pub head_dim: usize,
    pub window: usize,
    /// Compression ratio (0: sliding layer).
    pub ratio: usize,
    /// Entries per slot (max_seq_len / ratio; 0 on sliding layers).
    pub maxe: usize,
    /// index_topk (CSA; ignored otherwise).
    pub topk: usize,
    /// Slots the state arrays hold (for size checks).
    pub num_slots: usize,
    pub official: bool,
    /// Output [T, H, head_dim]: o before the inverse RoPE, bf16 values if official.
    pub o: DevicePtr,
}

impl AttentionArgs {
    /// Keys one query may attend at most (window + compressed).
    pub fn max_keys(&self) -> usize {
        let comp = match (self.ratio, self.selected) {
            (0, _) => 0,
            (_, Some(_)) => self.topk,
            (_, None) => self.maxe,
        };
        self.window + comp
    }

    /// Dynamic shared memory of the launch: q as f64, one f32 per key, the CSA selection.
    pub fn smem_bytes(&self) -> usize {
        let sel = if self.ratio > 0 && self.selected.is_some() {
            self.topk
        } else {
            0
        };
        self.head_dim.div_ceil(2) * 2 * 8 + (self.max_keys() + sel) * 4
    }
}

/// Ring update launch (after attention): the last min(len, W) rows of each sequence.
#[derive(Clone, Copy, Debug)]
pub struct RingArgs {
    pub kv: DevicePtr,
    pub ring: DevicePtr,
    pub window: usize,
    pub head_dim: usize,
    pub num_slots: usize,
}

/// The attention family's entry points, resolved from a loaded registry.
pub struct Attention {
    batch_meta: Kernel,
    attention: Kernel,
    ring_update: Kernel,
    slot_len: Kernel,
}

const FAMILY: &str = "attention";

fn bad(family: &str, msg: String) -> Error {
    Error::new(Status::Internal, format!("{family}: {msg}"))
}

impl Attention {
    pub fn new(reg: &Registry) -> Result<Attention> {
        Ok(Attention {
            batch_meta: reg.get(FAMILY, "batch_meta_kernel")?,
            attention: reg.get(FAMILY, "attention_kernel")?,
            ring_update: reg.get(FAMILY, "ring_update_kernel")?,
            slot_len: reg.get(FAMILY, "slot_len_kernel")?,
        })
    }

    /// `seq_of[t]` = the sequence of token t, from `query_start`.
    pub fn batch_meta(&self, ctx: &Context, b: &BatchMeta, stream: BorrowedStream) -> Result<()> {
        b.check(FAMILY)?;
        let s = to_i32(FAMILY, "num_seqs", b.num_seqs)?;
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(b.query_start).i32(s).ptr(b.seq_of);
        // SAFETY: matches `batch_meta_kernel(const int*, int, int*)`; sizes checked.
        unsafe { launch(&self.batch_meta, b.num_seqs as u32, 128, 0, stream, &a) }
    }

    /// One block per (token, head): o = softmax-with-sink over window + compressed keys.
    pub fn attention(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &AttentionArgs,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        let (t, h, hd, w) = (b.num_tokens, x.heads, x.head_dim, x.window);
        if h == 0 || hd == 0 || w == 0 || x.num_slots == 0 {
            return Err(bad(
                FAMILY,
                format!(
                    "attention with {h} heads, head_dim {hd}, window {w}, {} slots",
                    x.num_slots
                ),
            ));
        }
        if hd > ATTN_THREADS as usize * ATTN_MAX_CHANNELS_PER_THREAD {
            return Err(bad(
                FAMILY,
                format!(
                    "head_dim {hd} above {}",
                    ATTN_THREADS as usize * ATTN_MAX_CHANNELS_PER_THREAD
                ),
            ));
        }
        need(FAMILY, "q", x.q, t * h * hd * 4)?;
        need(FAMILY, "kv", x.kv, t * hd * 4)?;
        need(FAMILY, "ring", x.ring, x.num_slots * w * hd * 4)?;
        need(FAMILY, "sinks", x.sinks, h * 4)?;
        need(FAMILY, "o", x.o, t * h * hd * 4)?;
        let entries = if x.ratio > 0 {
            let e = x
                .entries
                .ok_or_else(|| bad(FAMILY, "compressed layer without entries".into()))?;
            if x.maxe == 0 {
                return Err(bad(FAMILY, "compressed layer with maxe = 0".into()));
            }
            need(FAMILY, "entries", e, x.num_slots * x.maxe * hd * 4)?;
            e.addr()
        } else {
            0
        };
        let (sel, nsel) = match (x.ratio, x.selected) {
            (r, Some((s, n))) if r > 0 => {
                if x.topk == 0 {
                    return Err(bad(FAMILY, "CSA layer with topk = 0".into()));
                }
                need(FAMILY, "selected", s, t * x.topk * 4)?;
                need(FAMILY, "nsel", n, t * 4)?;
                (s.addr(), n.addr())
            }
            _ => (0, 0),
        };
        let smem = x.smem_bytes();
        if smem > self.attention.max_dynamic_smem as usize {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "attention: {} keys per query need {smem} bytes of shared memory, above {}",
                    x.max_keys(),
                    self.attention.max_dynamic_smem
                ),
            ));
        }
        let blocks = u32::try_from(t * h)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| bad(FAMILY, format!("{t} tokens x {h} heads: too many blocks")))?;
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(x.q)
            .ptr(x.kv)
            .ptr(x.ring)
            .u64(entries)
            .u64(sel)
            .u64(nsel)
            .ptr(b.positions)
            .ptr(b.seq_of)
            .ptr(b.query_start)
            .ptr(b.seq_slots)
            .ptr(x.sinks)
            .i32(i("num_tokens", t)?)
            .i32(i("heads", h)?)
            .i32(i("head_dim", hd)?)
            .i32(i("window", w)?)
            .i32(i("ratio", x.ratio)?)
            .i32(i("maxe", x.maxe)?)
            .i32(i("topk", x.topk)?)
            .i32(x.official as i32)
            .ptr(x.o);
        // SAFETY: matches `attention_kernel` of kernels/attention.cu in order and size; every
        // buffer's size was checked above; block size is a multiple of 32 (block_max).
        unsafe {
            launch(
                &self.attention,
                blocks,
                ATTN_THREADS,
                smem as u32,
                stream,
                &a,
            )
        }
    }

    /// `ring[slot][pos % W] = kv[i]` for the last min(len, W) tokens of every sequence.
    pub fn ring_update(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &RingArgs,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        let (t, w, hd) = (b.num_tokens, x.window, x.head_dim);
        if w == 0 || hd == 0 || w > 65535 {
            return Err(bad(
                FAMILY,
                format!("ring update with window {w}, head_dim {hd}"),
            ));
        }
        need(FAMILY, "kv", x.kv, t * hd * 4)?;
        need(FAMILY, "ring", x.ring, x.num_slots * w * hd * 4)?;
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(x.kv)
            .ptr(b.positions)
            .ptr(b.query_start)
            .ptr(b.seq_slots)
            .i32(to_i32(FAMILY, "num_seqs", b.num_seqs)?)
            .i32(w as i32)
            .i32(to_i32(FAMILY, "head_dim", hd)?)
            .ptr(x.ring);
        // SAFETY: matches `ring_update_kernel(const float*, const int*, const int*, const int*,
        // int, int, int, float*)`; sizes checked.
        unsafe {
            launch(
                &self.ring_update,
                (b.num_seqs as u32, w as u32),
                128,
                0,
                stream,
                &a,
            )
        }
    }

    /// `slot_len[seq_slots[s]] = last position of sequence s + 1` (`slot_len`: int [num_slots]).
    pub fn slot_len(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        slot_len: DevicePtr,
        num_slots: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        need(FAMILY, "slot_len", slot_len, num_slots * 4)?;
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(b.positions)
            .ptr(b.query_start)
            .ptr(b.seq_slots)
            .i32(to_i32(FAMILY, "num_seqs", b.num_seqs)?)
            .ptr(slot_len);
        let blocks = b.num_seqs.div_ceil(128).max(1) as u32;
        // SAFETY: matches `slot_len_kernel(const int*, const int*, const int*, int, int*)`.
        unsafe { launch(&self.slot_len, blocks, 128, 0, stream, &a) }
    }
}
