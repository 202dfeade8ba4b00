//! Rust side of the `attention` kernel family (kernels/attention.cu): typed launch wrappers.
//! See kernels/SPEC.md. Batch metadata (`seq_of`), the core attention over window +
//! compressed keys with the per-head sink (o before the inverse RoPE), the window ring update
//! and the slot lengths. The CPU reference is `reference::attention::attention_core`.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::kv_pages::{KvPagesDev, KvRows, RowKind};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// Largest dynamic shared memory of `attention_kernel`: q (head_dim doubles) plus one float
/// per key (window + top-k, or window + every entry of an HCA slot) and the CSA selection.
pub const ATTENTION_MAX_SMEM: u32 = 96 * 1024;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "attention", include_str!("../../../kernels/attention.cu");

    #[pdl(true)]

    fn batch_meta_kernel(query_start: *const i32, s: i32, seq_of: *mut i32);
    /// `entries` NULL on window-only layers; `selected` / `nsel` NULL except on CSA layers.
    #[smem(ATTENTION_MAX_SMEM)]
    #[pdl(true)]
    fn attention_kernel(
        q: *const f32, kv: *const f32, ring: *const u8, entries: Option<*const u8>,
        etable: Option<*const i32>, epps: i32, selected: Option<*const i32>,
        nsel: Option<*const i32>, positions: *const i32, seq_of: *const i32,
        query_start: *const i32, seq_slots: *const i32, sinks: *const f32, t: i32, h: i32,
        hd: i32, nope: i32, w: i32, ratio: i32, maxe: i32, topk: i32, official: bool,
        o: *mut f32,
    );
    #[pdl(true)]
    fn ring_update_kernel(
        kv: *const f32, positions: *const i32, query_start: *const i32, seq_slots: *const i32,
        s: i32, w: i32, hd: i32, nope: i32, official: bool, ring: *mut u8,
    );
    #[pdl(true)]
    fn slot_len_kernel(
        positions: *const i32, query_start: *const i32, seq_slots: *const i32, s: i32,
        slot_len: *mut i32,
    );
}

/// Threads per attention block; each thread accumulates at most 4 output channels.
const ATTN_THREADS: u32 = 256;
pub(crate) const ATTN_MAX_CHANNELS_PER_THREAD: usize = 4;

/// The batch's int32 metadata on the device (kernels/SPEC.md): `positions` `[T]`,
/// `query_start` `[S+1]`, `seq_slots` `[S]`, `seq_of` `[T]` (written by [`Attention::batch_meta`]).
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
    /// The same queries as BF16 (the same values in official numerics), where head_prep wrote
    /// only those for the fast attention, which reads them ([`crate::cuda::kernel_sets::FastOps::
    /// attention_q_bf16`]); `q` is then not written. None: `q` holds them (the reference kernel
    /// reads only `q`).
    pub q_bf16: Option<DevicePtr>,
    /// This batch's window vectors: [T, head_dim].
    pub kv: DevicePtr,
    /// Window ring: `window` KV rows per slot, without a block table.
    pub ring: KvPagesDev,
    /// Compressed entries: `maxe` KV rows per slot (ratio > 0).
    pub entries: Option<KvPagesDev>,
    /// CSA: the indexer's `selected` `[T, topk]` and `nsel` `[T]`. None on HCA / sliding layers.
    pub selected: Option<(DevicePtr, DevicePtr)>,
    /// Per-head sink logits `[H]`.
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

    /// The checks every attention launch of `t` tokens makes: shapes, buffer sizes, the state's
    /// format for the numerics; what the launch then passes.
    pub fn check(&self, family: &str, t: usize) -> Result<CheckedAttention> {
        let (h, hd, w) = (self.heads, self.head_dim, self.window);
        if h == 0 || hd == 0 || w == 0 || self.num_slots == 0 {
            return Err(bad(
                family,
                format!(
                    "attention with {h} heads, head_dim {hd}, window {w}, {} slots",
                    self.num_slots
                ),
            ));
        }
        // (Threads own channel pairs.)
        if hd > ATTN_THREADS as usize * ATTN_MAX_CHANNELS_PER_THREAD || hd % 2 != 0 {
            return Err(bad(
                family,
                format!(
                    "head_dim {hd}: must be even and at most {}",
                    ATTN_THREADS as usize * ATTN_MAX_CHANNELS_PER_THREAD
                ),
            ));
        }
        need(family, "q", self.q, t * h * hd * 4)?;
        need(family, "kv", self.kv, t * hd * 4)?;
        let nope = check_ring(family, &self.ring, self.num_slots, w, hd, self.official)?;
        need(family, "sinks", self.sinks, h * 4)?;
        need(family, "o", self.o, t * h * hd * 4)?;
        let entries = if self.ratio > 0 {
            let e = self
                .entries
                .ok_or_else(|| bad(family, "compressed layer without entries".into()))?;
            // maxe may be 0 (max_seq_len below the ratio): the kernel attends to no entry.
            if kv_nope(family, "entries", &e, hd)? != nope {
                return Err(bad(family, "ring and entries differ in nope".into()));
            }
            e.check(family, "entries", self.num_slots, self.maxe, self.official)?;
            Some(e)
        } else {
            None
        };
        let selected = match (self.ratio, self.selected) {
            (r, Some((s, n))) if r > 0 => {
                if self.topk == 0 {
                    return Err(bad(family, "CSA layer with topk = 0".into()));
                }
                need(family, "selected", s, t * self.topk * 4)?;
                need(family, "nsel", n, t * 4)?;
                Some((s, n))
            }
            _ => None,
        };
        Ok(CheckedAttention {
            nope,
            entries,
            selected,
        })
    }
}

/// What [`AttentionArgs::check`] found: the KV rows' nope width, the entries (compressed layers)
/// and the CSA selection buffers.
#[derive(Clone, Copy, Debug)]
pub struct CheckedAttention {
    pub nope: usize,
    pub entries: Option<KvPagesDev>,
    pub selected: Option<(DevicePtr, DevicePtr)>,
}

/// Ring update launch (after attention): the last min(len, W) rows of each sequence.
#[derive(Clone, Copy, Debug)]
pub struct RingArgs {
    pub kv: DevicePtr,
    pub ring: KvPagesDev,
    pub window: usize,
    pub head_dim: usize,
    pub num_slots: usize,
    pub official: bool,
}

/// The window ring's checks (the kernels find a slot's ring pages without a table, at
/// `slot * ceil(W / KV_PAGE)`); returns its nope width.
fn check_ring(
    family: &str,
    ring: &KvPagesDev,
    num_slots: usize,
    w: usize,
    hd: usize,
    official: bool,
) -> Result<usize> {
    if ring.table.is_some() || ring.pages_per_slot != KvRows::pages_for(w) {
        return Err(bad(
            family,
            format!(
                "the window ring of {w} rows needs {} pages per slot and no block table",
                KvRows::pages_for(w)
            ),
        ));
    }
    ring.check(family, "ring", num_slots, w, official)?;
    kv_nope(family, "ring", ring, hd)
}

/// The ring and the entries hold KV rows of `head_dim` values: their nope width.
fn kv_nope(family: &str, what: &str, pages: &KvPagesDev, head_dim: usize) -> Result<usize> {
    match pages.rows.kind {
        RowKind::Kv { nope } if pages.rows.dim == head_dim && nope <= head_dim => Ok(nope),
        _ => Err(bad(
            family,
            format!("{what} of head_dim {head_dim} stored as {:?}", pages.rows),
        )),
    }
}

crate::launchers! {
    /// The attention family's entry points, resolved from a loaded registry.
    pub struct Attention {
        batch_meta: batch_meta_kernel,
        attention: attention_kernel,
        ring_update: ring_update_kernel,
        slot_len: slot_len_kernel,
    }
}

const FAMILY: &str = "attention";

fn bad(family: &str, msg: String) -> Error {
    Error::new(Status::Internal, format!("{family}: {msg}"))
}

impl Attention {
    /// `seq_of[t]` = the sequence of token t, from `query_start`.
    pub fn batch_meta(&self, ctx: &Context, b: &BatchMeta, stream: BorrowedStream) -> Result<()> {
        b.check(FAMILY)?;
        let s = to_i32(FAMILY, "num_seqs", b.num_seqs)?;
        let _g = ctx.enter()?;
        let args = batch_meta_kernel::Args {
            query_start: b.query_start,
            s,
            seq_of: b.seq_of,
        };
        self.batch_meta
            .launch(b.num_seqs as u32, 128, 0, stream, args)
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
        let checked = x.check(FAMILY, b.num_tokens)?;
        let (t, h, hd, w) = (b.num_tokens, x.heads, x.head_dim, x.window);
        let (entries, nope) = (checked.entries, checked.nope);
        let (sel, nsel) = checked.selected.unzip();
        let smem = x.smem_bytes();
        let limit = self.attention.kernel().max_dynamic_smem;
        if smem > limit as usize {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "attention: {} keys per query need {smem} bytes of shared memory, above {}",
                    x.max_keys(),
                    limit
                ),
            ));
        }
        let blocks = u32::try_from(t * h)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| bad(FAMILY, format!("{t} tokens x {h} heads: too many blocks")))?;
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        let args = attention_kernel::Args {
            q: x.q,
            kv: x.kv,
            ring: x.ring.pool,
            entries: entries.map(|e| e.pool),
            etable: entries.and_then(|e| e.table),
            epps: i("pages per slot", entries.map_or(0, |e| e.pages_per_slot))?,
            selected: sel,
            nsel,
            positions: b.positions,
            seq_of: b.seq_of,
            query_start: b.query_start,
            seq_slots: b.seq_slots,
            sinks: x.sinks,
            t: i("num_tokens", t)?,
            h: i("heads", h)?,
            hd: i("head_dim", hd)?,
            nope: i("nope", nope)?,
            w: i("window", w)?,
            ratio: i("ratio", x.ratio)?,
            maxe: i("maxe", x.maxe)?,
            topk: i("topk", x.topk)?,
            official: x.official,
            o: x.o,
        };
        // (ATTN_THREADS is a multiple of 32, as block_max needs.)
        self.attention
            .launch(blocks, ATTN_THREADS, smem as u32, stream, args)
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
        let nope = check_ring(FAMILY, &x.ring, x.num_slots, w, hd, x.official)?;
        let _g = ctx.enter()?;
        let args = ring_update_kernel::Args {
            kv: x.kv,
            positions: b.positions,
            query_start: b.query_start,
            seq_slots: b.seq_slots,
            s: to_i32(FAMILY, "num_seqs", b.num_seqs)?,
            w: w as i32,
            hd: to_i32(FAMILY, "head_dim", hd)?,
            nope: to_i32(FAMILY, "nope", nope)?,
            official: x.official,
            ring: x.ring.pool,
        };
        let grid = (b.num_seqs as u32, w as u32);
        self.ring_update.launch(grid, 128, 0, stream, args)
    }

    /// `slot_len[seq_slots[s]] = last position of sequence s + 1` (`slot_len`: int `[num_slots]`).
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
        let args = slot_len_kernel::Args {
            positions: b.positions,
            query_start: b.query_start,
            seq_slots: b.seq_slots,
            s: to_i32(FAMILY, "num_seqs", b.num_seqs)?,
            slot_len,
        };
        let blocks = b.num_seqs.div_ceil(128).max(1) as u32;
        self.slot_len.launch(blocks, 128, 0, stream, args)
    }
}
