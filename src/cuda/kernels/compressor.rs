//! Rust side of the `compressor` kernel family (kernels/compressor.cu): typed launch wrappers.
//! See kernels/SPEC.md. The token-streaming compressor of one layer (main KV entries or
//! indexer keys); the CPU reference is `reference::attention::compress_chunk` +
//! `reference::compressor::push`. Two ways to run it, the same bits (`CompressPath`): one block a
//! sequence walking its tokens in order (`compress_kernel`, decode), or every window the batch
//! completes at once, a block each, then the state (`compress_windows_kernel` +
//! `compress_state_kernel`, prefill).

use super::attention::BatchMeta;
use crate::cuda::kernels::{need, to_i32};
use crate::cuda::kv_pages::{KvPagesDev, RowKind};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "compressor", include_str!("../../../kernels/compressor.cu");

    /// `prev_a`, `prev_z`, `has_prev` may be NULL without overlap; `kind` a [`CompressKind`].
    #[pdl(true)]
    fn compress_kernel(
        a: *const f32, z: *const f32, positions: *const i32, query_start: *const i32,
        seq_slots: *const i32, s: i32, pend_a: *mut f32, pend_z: *mut f32,
        prev_a: Option<*mut f32>, prev_z: Option<*mut f32>, has_prev: Option<*mut i32>,
        ape: *const f32, norm_w: *const f32, inv_freq: *const f32, half_rope: i32, ratio: i32,
        overlap: bool, dc: i32, eps: f32, kind: i32, nope: i32, official: bool,
        entries: *mut u8, etable: Option<*const i32>, epps: i32, maxe: i32,
    );
    /// Grid (at least the most windows a sequence completes, S): `compress_kernel`'s entries,
    /// a window a block; leaves the state to `compress_state_kernel`.
    #[pdl(true)]
    fn compress_windows_kernel(
        a: *const f32, z: *const f32, positions: *const i32, query_start: *const i32,
        seq_slots: *const i32, s: i32, pend_a: *mut f32, pend_z: *mut f32,
        prev_a: Option<*mut f32>, prev_z: Option<*mut f32>, has_prev: Option<*mut i32>,
        ape: *const f32, norm_w: *const f32, inv_freq: *const f32, half_rope: i32, ratio: i32,
        overlap: bool, dc: i32, eps: f32, kind: i32, nope: i32, official: bool,
        entries: *mut u8, etable: Option<*const i32>, epps: i32, maxe: i32,
    );
    /// One block a sequence, after `compress_windows_kernel`: the state `compress_kernel` leaves.
    #[pdl(true)]
    fn compress_state_kernel(
        a: *const f32, z: *const f32, positions: *const i32, query_start: *const i32,
        seq_slots: *const i32, s: i32, pend_a: *mut f32, pend_z: *mut f32,
        prev_a: Option<*mut f32>, prev_z: Option<*mut f32>, has_prev: Option<*mut i32>,
        ape: *const f32, norm_w: *const f32, inv_freq: *const f32, half_rope: i32, ratio: i32,
        overlap: bool, dc: i32, eps: f32, kind: i32, nope: i32, official: bool,
        entries: *mut u8, etable: Option<*const i32>, epps: i32, maxe: i32,
    );
}

const FAMILY: &str = "compressor";
/// Threads per block: one channel each for d_c = 512 (latency of the f64 exps is what
/// limits the pooling, so more warps help).
pub(crate) const THREADS: u32 = 512;
/// Largest d_c: shared memory holds d_c doubles + d_c floats within the default 48 KB.
pub const MAX_DC: usize = 2048;

/// What the compressor produces (they differ only in the official fake-quantisation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressKind {
    /// Main KV entry: nope channels fp8sim (official).
    Kv = 0,
    /// Indexer key: Hadamard + fp4sim (official).
    IndexKey = 1,
}

/// One compressor's launch (kernels/SPEC.md `compress_kernel`).
#[derive(Clone, Copy, Debug)]
pub struct CompressArgs {
    /// Inputs `a` and raw gate logits `z` (without ape): [T, width] f32,
    /// width = 2 * dc with overlap, else dc.
    pub a: DevicePtr,
    pub z: DevicePtr,
    /// State: pending rows [num_slots, ratio, width] x2; previous window's A halves
    /// `[num_slots, ratio, dc]` x2 and has_prev int `[num_slots]` (overlap only).
    pub pend_a: DevicePtr,
    pub pend_z: DevicePtr,
    pub prev_a: Option<DevicePtr>,
    pub prev_z: Option<DevicePtr>,
    pub has_prev: Option<DevicePtr>,
    /// Weights: ape `[ratio, width]`, RMSNorm weight `[dc]`, inverse RoPE frequencies `[rope_dim/2]`.
    pub ape: DevicePtr,
    pub norm_w: DevicePtr,
    pub inv_freq: DevicePtr,
    pub rope_dim: usize,
    pub ratio: usize,
    pub overlap: bool,
    pub dc: usize,
    pub eps: f32,
    pub kind: CompressKind,
    /// Leading channels fp8-simulated (Kv, official): head_dim - rope_dim.
    pub nope: usize,
    pub official: bool,
    /// Output: `maxe` rows per slot (KV rows for [`CompressKind::Kv`], indexer keys otherwise).
    pub entries: KvPagesDev,
    pub maxe: usize,
    pub num_slots: usize,
}

impl CompressArgs {
    pub fn width(&self) -> usize {
        if self.overlap { 2 * self.dc } else { self.dc }
    }

    /// Dynamic shared memory of the launch: d_c doubles (Hadamard) + d_c floats (the entry).
    pub fn smem_bytes(&self) -> usize {
        self.dc * 12
    }
}

crate::launchers! {
    /// The compressor family's entry points, resolved from a loaded registry.
    pub struct Compressor {
        compress: compress_kernel,
        windows: compress_windows_kernel,
        state: compress_state_kernel,
    }
}

/// How [`Compressor::compress_on`] runs a batch; every path leaves the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressPath {
    /// One block a sequence, its tokens in order: one launch, serial in the sequence's windows.
    Serial,
    /// Every window the batch completes at once, a block each, then the state: two launches.
    Windows,
    /// `Windows` when some sequence brings more than one token, else `Serial`.
    Auto,
}

fn bad(msg: String) -> Error {
    Error::new(Status::Internal, format!("{FAMILY}: {msg}"))
}

impl Compressor {
    /// Pushes every token of the batch through the compressor of its sequence's slot, in
    /// order; completed windows become entries `p / ratio`. Resets `has_prev` of sequences
    /// that start at position 0. [`CompressPath::Auto`].
    pub fn compress(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &CompressArgs,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.compress_on(ctx, b, x, CompressPath::Auto, stream)
    }

    /// [`Compressor::compress`] on a chosen path. Measured (H200, ncu, a 4096-token prefill at
    /// Flash shapes): the serial kernel took ~15 ms a call; see BENCHMARKS.md for the windows'.
    pub fn compress_on(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &CompressArgs,
        path: CompressPath,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        let (t, r, dc, w, slots) = (b.num_tokens, x.ratio, x.dc, x.width(), x.num_slots);
        // maxe may be 0: max_seq_len below the ratio, no window ever completes (the kernel
        // writes entry w only when w < maxe).
        if r == 0 || dc == 0 || slots == 0 || dc > MAX_DC {
            return Err(bad(format!(
                "ratio {r}, dc {dc}, {slots} slots, maxe {} (dc <= {MAX_DC})",
                x.maxe
            )));
        }
        if !x.rope_dim.is_multiple_of(2) || x.rope_dim > dc {
            return Err(bad(format!("rope_dim {} with dc {dc}", x.rope_dim)));
        }
        match x.kind {
            CompressKind::Kv if x.nope > dc => {
                return Err(bad(format!("nope {} above dc {dc}", x.nope)));
            }
            CompressKind::IndexKey if !dc.is_power_of_two() => {
                return Err(bad(format!(
                    "indexer keys need a power-of-two dc, got {dc}"
                )));
            }
            _ => {}
        }
        need(FAMILY, "a", x.a, t * w * 4)?;
        need(FAMILY, "z", x.z, t * w * 4)?;
        need(FAMILY, "pend_a", x.pend_a, slots * r * w * 4)?;
        need(FAMILY, "pend_z", x.pend_z, slots * r * w * 4)?;
        need(FAMILY, "ape", x.ape, r * w * 4)?;
        need(FAMILY, "norm_w", x.norm_w, dc * 4)?;
        need(FAMILY, "inv_freq", x.inv_freq, x.rope_dim / 2 * 4)?;
        let rows_match = match (x.kind, x.entries.rows.kind) {
            (CompressKind::Kv, RowKind::Kv { nope }) => nope == x.nope,
            (CompressKind::IndexKey, RowKind::IndexKey) => true,
            _ => false,
        };
        if !rows_match || x.entries.rows.dim != dc {
            return Err(bad(format!(
                "{:?} entries stored as {:?}",
                x.kind, x.entries.rows
            )));
        }
        x.entries
            .check(FAMILY, "entries", slots, x.maxe, x.official)?;
        let (pa, pz, hp) = if x.overlap {
            let (Some(pa), Some(pz), Some(hp)) = (x.prev_a, x.prev_z, x.has_prev) else {
                return Err(bad(
                    "an overlapping compressor needs prev_a, prev_z and has_prev".into(),
                ));
            };
            need(FAMILY, "prev_a", pa, slots * r * dc * 4)?;
            need(FAMILY, "prev_z", pz, slots * r * dc * 4)?;
            need(FAMILY, "has_prev", hp, slots * 4)?;
            (Some(pa), Some(pz), Some(hp))
        } else {
            (x.prev_a, x.prev_z, x.has_prev)
        };
        let smem = x.smem_bytes();
        let limit = self.compress.kernel().max_dynamic_smem;
        if smem > limit as usize {
            return Err(bad(format!(
                "dc {dc} needs {smem} bytes of shared memory, above {limit}"
            )));
        }
        let _g = ctx.enter()?;
        // The three kernels take the same arguments.
        macro_rules! args {
            ($k:ident) => {
                $k::Args {
                    a: x.a,
                    z: x.z,
                    positions: b.positions,
                    query_start: b.query_start,
                    seq_slots: b.seq_slots,
                    s: to_i32(FAMILY, "num_seqs", b.num_seqs)?,
                    pend_a: x.pend_a,
                    pend_z: x.pend_z,
                    prev_a: pa,
                    prev_z: pz,
                    has_prev: hp,
                    ape: x.ape,
                    norm_w: x.norm_w,
                    inv_freq: x.inv_freq,
                    half_rope: (x.rope_dim / 2) as i32,
                    ratio: to_i32(FAMILY, "ratio", r)?,
                    overlap: x.overlap,
                    dc: dc as i32,
                    eps: x.eps,
                    kind: x.kind as i32,
                    nope: x.nope as i32,
                    official: x.official,
                    entries: x.entries.pool,
                    etable: x.entries.table,
                    epps: to_i32(FAMILY, "pages per slot", x.entries.pages_per_slot)?,
                    maxe: to_i32(FAMILY, "maxe", x.maxe)?,
                }
            };
        }
        let windows = match path {
            CompressPath::Serial => false,
            CompressPath::Windows => true,
            CompressPath::Auto => b.num_tokens > b.num_seqs,
        };
        if !windows {
            return self.compress.launch(
                b.num_seqs as u32,
                THREADS,
                smem as u32,
                stream,
                args!(compress_kernel),
            );
        }
        // A sequence of n tokens completes at most ceil(n / ratio) windows, and n <= T.
        let most_windows = to_i32(FAMILY, "windows", t.div_ceil(r).max(1))? as u32;
        self.windows.launch(
            (most_windows, b.num_seqs as u32, 1),
            THREADS,
            smem as u32,
            stream,
            args!(compress_windows_kernel),
        )?;
        self.state.launch(
            b.num_seqs as u32,
            THREADS,
            0,
            stream,
            args!(compress_state_kernel),
        )
    }
}
