//! Rust side of five small kernel families, one job each: `norm` (kernels/norm.cu: RMSNorm),
//! `rope` (kernels/rope.cu), `quant_sim` (kernels/quant_sim.cu: the KV and indexer
//! fake-quantisation, bf16 rounding), `elementwise` (kernels/elementwise.cu: scaling,
//! embedding, row gathers, bf16 conversion) and `head_prep` (kernels/head_prep.cu: a query or
//! KV head's norm, RoPE and KV sim in one launch). [`NormRope`] is the one facade the forward
//! uses for all of them. Contract in kernels/SPEC.md; every kernel is bit-identical to its CPU
//! reference (tests/gpu_norm_rope.rs).
//!
//! Every launch function checks that each buffer holds what the kernel will touch, then
//! enqueues on the borrowed stream (no host sync). Zero-sized work launches nothing.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::registry::KernelSource;
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use std::ffi::c_void;

crate::kernel_family! {
    /// RMSNorm.
    pub const NORM_SOURCE = "norm", include_str!("../../../kernels/norm.cu");

    #[pdl(true)]

    fn rmsnorm_kernel(
        x: *mut f32, rows: i32, dim: i32, ld: i32, weight: Option<*const f32>, eps: f32,
        round_out: bool,
    );
    #[pdl(true)]
    fn rmsnorm_rows_kernel(
        x: *mut f32, rows: i32, dim: i32, ld: i32, weight: Option<*const f32>, eps: f32,
        round_out: bool,
    );
}

crate::kernel_family! {
    /// RoPE.
    pub const ROPE_SOURCE = "rope", include_str!("../../../kernels/rope.cu");

    #[pdl(true)]

    fn rope_kernel(
        x: *mut f32, rows: i32, ld: i32, heads: i32, head_dim: i32, pos: *const i32,
        inv_freq: *const f32, half_rope: i32, sign: f32, round_out: bool, round_in: bool,
        out_bf16: Option<*mut u16>, ld_out: i32,
    );
    #[pdl(true)]
    fn rope_rows_kernel(
        x: *mut f32, rows: i32, ld: i32, heads: i32, head_dim: i32, pos: *const i32,
        inv_freq: *const f32, half_rope: i32, sign: f32, round_out: bool, round_in: bool,
        out_bf16: Option<*mut u16>, ld_out: i32, vec4: bool,
    );
}

crate::kernel_family! {
    /// The official precision simulations, in place.
    pub const QUANT_SIM_SOURCE = "quant_sim", include_str!("../../../kernels/quant_sim.cu");

    #[pdl(true)]

    fn kv_sim_kernel(x: *mut f32, rows: i32, ld: i32, nope: i32);
    #[pdl(true)]
    fn index_sim_kernel(x: *mut f32, rows: i32, dim: i32);
    #[pdl(true)]
    fn round_bf16_kernel(x: *mut f32, n: i64);
}

crate::kernel_family! {
    /// Small elementwise and copy kernels.
    pub const ELEMENTWISE_SOURCE = "elementwise", include_str!("../../../kernels/elementwise.cu");

    #[pdl(true)]

    fn scale2_kernel(x: *mut f32, n: i64, s1: f32, s2: f32);
    #[pdl(true)]
    fn embed_kernel(
        tokens: *const i32, t: i32, table: *const c_void, bf16: bool, d: i32, n: i32, x: *mut f32,
    );
    #[pdl(true)]
    fn gather_rows_kernel(
        src: *const f32, row_len: i32, rows: Option<*const i32>, nrows: i32, dst: *mut f32,
    );
    #[pdl(true)]
    fn to_bf16_kernel(src: *const f32, dst: *mut u16, n: i64);
}

crate::kernel_family! {
    /// A query or KV head row's RMSNorm, RoPE and (KV, official) FP8 simulation in one launch.
    pub const HEAD_PREP_SOURCE = "head_prep", include_str!("../../../kernels/head_prep.cu");

    #[pdl(true)]
    fn head_prep_kernel(
        x: *mut f32, rows: i32, ld: i32, heads: i32, head_dim: i32, weight: Option<*const f32>,
        eps: f32, pos: *const i32, inv_freq: *const f32, half_rope: i32, sim_nope: i32,
        round_out: bool, round_in: bool, out_bf16: Option<*mut u16>,
    );
    #[pdl(true)]
    fn head_prep_rows_kernel(
        x: *mut f32, rows: i32, ld: i32, heads: i32, head_dim: i32, weight: Option<*const f32>,
        eps: f32, pos: *const i32, inv_freq: *const f32, half_rope: i32, sim_nope: i32,
        round_out: bool, round_in: bool, out_bf16: Option<*mut u16>,
    );
}

/// The families behind [`NormRope`], as the registry compiles and loads them.
pub const FAMILIES: [&KernelSource; 5] = [
    &NORM_SOURCE,
    &ROPE_SOURCE,
    &QUANT_SIM_SOURCE,
    &ELEMENTWISE_SOURCE,
    &HEAD_PREP_SOURCE,
];

/// Most channel pairs of a `head_prep_kernel` head (HP_MAX_PAIRS): a block per head row, a thread
/// per pair, so head_dim <= 2 x this.
pub const HEAD_PREP_MAX_PAIRS: usize = 1024;

/// Longest row of [`NormRope::index_sim`] (HADAMARD_MAX in dsv4_consts.cuh).
pub const HADAMARD_MAX: usize = 1024;

/// Threads per block of the per-row kernels (a multiple of 32).
const ROW_THREADS: u32 = 256;
/// Values an `rmsnorm_kernel` thread holds in registers (RN_VALS): a row of at most this many
/// values a thread is read once, every load in flight at once.
pub const RMSNORM_VALUES: usize = 4;

/// Fewest rows [`NormRope::rmsnorm`] gives `rmsnorm_rows_kernel` (a prefill's).
pub const RMSNORM_ROWS_MIN: usize = 256;
/// Values an `rmsnorm_rows_kernel` thread holds in registers (RN_ROWS_VALS).
pub const RMSNORM_ROWS_VALUES: usize = 16;
/// Threads of an `rmsnorm_rows_kernel` block (RN_ROWS_THREADS): rows of up to 4096 values.
pub const RMSNORM_ROWS_THREADS: usize = 256;

/// Threads of an `rmsnorm_kernel` block for rows of `dim` values: 128 up to 128 values,
/// [`ROW_THREADS`] up to 1024, then enough (at most 1024) for [`RMSNORM_VALUES`] a thread, so
/// the hidden size's rows (4096 on Flash) take the registers path.
fn rmsnorm_threads(dim: usize) -> u32 {
    let base = if dim <= 128 { 128 } else { ROW_THREADS };
    base.max(dim.div_ceil(RMSNORM_VALUES).next_multiple_of(32).min(1024) as u32)
}

/// An RMSNorm in place ([`NormRope::rmsnorm`]'s operation): `rows` rows of `dim` values of `x` at
/// row stride `ld`, times `weight` (None: none), with `eps`, rounded to BF16 when `round_out`
/// (official numerics).
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub x: DevicePtr,
    pub rows: usize,
    pub dim: usize,
    pub ld: usize,
    pub weight: Option<DevicePtr>,
    pub eps: f32,
    pub round_out: bool,
}

/// The kernel and block [`NormRope::rmsnorm`] gives `rows` rows of `dim` values; another
/// kernel that must write the same bits (it runs the same row code, kernels/norm_row.cuh)
/// takes the same block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsnormBlock {
    /// `rmsnorm_rows_kernel`: [`RMSNORM_ROWS_THREADS`] threads, [`RMSNORM_ROWS_VALUES`] values a
    /// thread in registers.
    Rows,
    /// `rmsnorm_kernel` with `threads` threads: its registers path ([`RMSNORM_VALUES`] a thread)
    /// where `in_registers`, else its strided loop.
    Row { threads: u32, in_registers: bool },
}

/// The block of `rows` rows of `dim` values where a kernel that quantizes the normed row per 128
/// of k can run on it (kernels/norm_row.cuh's callers in the fast families): the row held in
/// registers, each 128-block of k four whole warps of one register slot (threads a multiple of
/// 128), and `dim` a multiple of 128; else None.
pub fn register_block(rows: usize, dim: usize) -> Option<RmsnormBlock> {
    let block = rmsnorm_block(rows, dim);
    let held = match block {
        RmsnormBlock::Rows => true,
        RmsnormBlock::Row {
            threads,
            in_registers,
        } => in_registers && threads.is_multiple_of(128),
    };
    (rows > 0 && dim > 0 && dim.is_multiple_of(128) && held).then_some(block)
}

/// The block of `rows` rows of `dim` values (see [`RmsnormBlock`]).
pub fn rmsnorm_block(rows: usize, dim: usize) -> RmsnormBlock {
    if rows >= RMSNORM_ROWS_MIN && dim <= RMSNORM_ROWS_VALUES * RMSNORM_ROWS_THREADS {
        return RmsnormBlock::Rows;
    }
    let threads = rmsnorm_threads(dim);
    RmsnormBlock::Row {
        threads,
        in_registers: dim <= RMSNORM_VALUES * threads as usize,
    }
}
/// Threads per block of the flat elementwise kernels.
const FLAT_THREADS: u32 = 256;
/// Most blocks of a launch; the kernels loop (grid-stride) over the rest.
/// Heads a rope_kernel thread rotates with one f64 cos / sin (kernels/rope.cu).
pub(crate) const ROPE_HEADS: usize = 8;
/// Rows from which [`NormRope::rope`] takes `rope_rows_kernel` (a block a row, one cos / sin per
/// pair of the row): a prefill's. Below, a decode step's few rows are spread over blocks by
/// `rope_kernel`.
pub const ROPE_ROWS_MIN: usize = 256;
/// Warps (heads at a time) of a `head_prep_rows_kernel` block.
pub const HEAD_PREP_ROWS_WARPS: usize = 8;
/// Pairs a lane of `head_prep_rows_kernel` holds: heads of at most 64 x this many values.
pub const HEAD_PREP_ROWS_LANE_PAIRS: usize = 8;
/// Most RoPE pairs `rope_rows_kernel` takes (its shared cos / sin).
pub(crate) const ROPE_ROWS_MAX_PAIRS: usize = 256;
const MAX_BLOCKS: usize = 1 << 20;

fn err(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

/// Bytes of `rows` f32 rows of `width` values at stride `ld` (values).
fn strided_bytes(rows: usize, width: usize, ld: usize) -> usize {
    if rows == 0 {
        0
    } else {
        ((rows - 1) * ld + width) * 4
    }
}

fn row_blocks(rows: usize) -> u32 {
    rows.clamp(1, MAX_BLOCKS) as u32
}

fn flat_blocks(n: usize) -> u32 {
    n.div_ceil(FLAT_THREADS as usize).clamp(1, MAX_BLOCKS) as u32
}

/// The rows a RoPE call rotates: `rows` rows of `heads` heads of `head_dim` f32 values at stride
/// `ld`, the last `2 * half_rope` of each head rotating by `pos[row] * inv_freq[k]`.
struct RopeShape {
    x: DevicePtr,
    rows: usize,
    ld: usize,
    heads: usize,
    head_dim: usize,
    pos: DevicePtr,
    inv_freq: DevicePtr,
    half_rope: usize,
}

crate::launchers! {
    /// The entry points of the five families, resolved from a loaded registry.
    pub struct NormRope {
        rmsnorm: rmsnorm_kernel,
        rmsnorm_rows: rmsnorm_rows_kernel,
        rope: rope_kernel,
        rope_rows: rope_rows_kernel,
        head_prep_rows: head_prep_rows_kernel,
        kv_sim: kv_sim_kernel,
        index_sim: index_sim_kernel,
        round_bf16: round_bf16_kernel,
        scale2: scale2_kernel,
        embed: embed_kernel,
        gather_rows: gather_rows_kernel,
        to_bf16: to_bf16_kernel,
        head_prep: head_prep_kernel,
    }
}

impl NormRope {
    /// Runs `n` ([`Self::rmsnorm`]).
    pub fn run(&self, ctx: &Context, n: &RmsNorm, stream: BorrowedStream) -> Result<()> {
        let (x, w) = (n.x, n.weight);
        self.rmsnorm(ctx, x, n.rows, n.dim, n.ld, w, n.eps, n.round_out, stream)
    }

    /// In-place RMSNorm of `rows` f32 rows of `dim` values at stride `ld` (values), with an
    /// optional f32 `weight[dim]`; bf16 output if `round_out`. `ops::rms_norm` (+ `Prec::bf16`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        dim: usize,
        ld: usize,
        weight: Option<DevicePtr>,
        eps: f32,
        round_out: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "rmsnorm_kernel";
        if dim == 0 || ld < dim {
            return Err(err(format!("{K}: dim = {dim}, ld = {ld}")));
        }
        need(K, "x", x, strided_bytes(rows, dim, ld))?;
        if let Some(w) = weight {
            need(K, "weight", w, dim * 4)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let (r32, d32, l32) = (
            to_i32(K, "rows", rows)?,
            to_i32(K, "dim", dim)?,
            to_i32(K, "ld", ld)?,
        );
        let _g = ctx.enter()?;
        if rmsnorm_block(rows, dim) == RmsnormBlock::Rows {
            // More rows an SM than rmsnorm_kernel's 1024-thread blocks for the hidden size's rows
            // (see kernels/norm.cu: two against one, by registers).
            let args = rmsnorm_rows_kernel::Args {
                x,
                rows: r32,
                dim: d32,
                ld: l32,
                weight,
                eps,
                round_out,
            };
            return self.rmsnorm_rows.launch(
                row_blocks(rows),
                RMSNORM_ROWS_THREADS as u32,
                0,
                stream,
                args,
            );
        }
        let threads = rmsnorm_threads(dim);
        let args = rmsnorm_kernel::Args {
            x,
            rows: r32,
            dim: d32,
            ld: l32,
            weight,
            eps,
            round_out,
        };
        self.rmsnorm
            .launch(row_blocks(rows), threads, 0, stream, args)
    }

    /// In-place RoPE of `rows` rows at stride `ld`, each holding `heads` heads of `head_dim`
    /// values: the last `2 * half_rope` channels of every head rotate by `pos[row] *
    /// inv_freq[k]` (`pos`: i32 per row, `inv_freq`: `half_rope` f32), `sign` -1 rotates back.
    /// With `round_out` the whole head is then rounded to bf16. `rope::apply` (+ `Prec::bf16`).
    /// With `round_in` the head is first rounded to bf16 as loaded: the projection that wrote x
    /// may leave its bf16 rounding to this, its first reader.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        ld: usize,
        heads: usize,
        head_dim: usize,
        pos: DevicePtr,
        inv_freq: DevicePtr,
        half_rope: usize,
        sign: f32,
        round_out: bool,
        round_in: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        let shape = RopeShape {
            x,
            rows,
            ld,
            heads,
            head_dim,
            pos,
            inv_freq,
            half_rope,
        };
        self.launch_rope(ctx, &shape, sign, round_out, round_in, None, stream)
    }

    /// [`Self::rope`] with `round_out` that also writes every value's bf16 bits to `out`
    /// (`[rows, ld_out]` 16-bit, the heads at the columns they have in x): a BF16 copy for a
    /// reader that takes BF16 (the fast set's grouped wo_a GEMM reads o's), made while the values
    /// are in registers instead of by a conversion pass of its own. x is written as by
    /// [`Self::rope`]. `ld_out` even, `out` 4-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_with_bf16_copy(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        ld: usize,
        heads: usize,
        head_dim: usize,
        pos: DevicePtr,
        inv_freq: DevicePtr,
        half_rope: usize,
        sign: f32,
        (out, ld_out): (DevicePtr, usize),
        stream: BorrowedStream,
    ) -> Result<()> {
        let shape = RopeShape {
            x,
            rows,
            ld,
            heads,
            head_dim,
            pos,
            inv_freq,
            half_rope,
        };
        self.launch_rope(ctx, &shape, sign, true, false, Some((out, ld_out)), stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_rope(
        &self,
        ctx: &Context,
        shape: &RopeShape,
        sign: f32,
        round_out: bool,
        round_in: bool,
        out: Option<(DevicePtr, usize)>,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "rope_kernel";
        let &RopeShape {
            x,
            rows,
            ld,
            heads,
            head_dim,
            pos,
            inv_freq,
            half_rope,
        } = shape;
        if 2 * half_rope > head_dim || heads * head_dim > ld || half_rope == 0 {
            return Err(err(format!(
                "{K}: heads = {heads}, head_dim = {head_dim}, half_rope = {half_rope}, ld = {ld}"
            )));
        }
        need(K, "x", x, strided_bytes(rows, heads * head_dim, ld))?;
        if let Some((o, ld_out)) = out {
            if !round_out
                || heads * head_dim > ld_out
                || !ld_out.is_multiple_of(2)
                || !head_dim.is_multiple_of(2)
                || !o.addr().is_multiple_of(4)
            {
                return Err(err(format!(
                    "{K}: a BF16 copy needs round_out, an even ld_out >= heads x head_dim and 4-byte alignment (ld_out = {ld_out})"
                )));
            }
            need(
                K,
                "out_bf16",
                o,
                strided_bytes(rows, heads * head_dim, ld_out) / 2,
            )?;
        }
        let (out_bf16, ld_out) = match out {
            Some((o, l)) => (Some(o), to_i32(K, "ld_out", l)?),
            None => (None, 0),
        };
        need(K, "pos", pos, rows * 4)?;
        need(K, "inv_freq", inv_freq, half_rope * 4)?;
        if rows == 0 || heads == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        const THREADS: usize = 256;
        let nope = head_dim - 2 * half_rope;
        // Both kernels take these parameters (the rows one also `vec4`).
        macro_rules! args {
            ($k:ident $(, $extra:ident)?) => {
                $k::Args {
                    x,
                    rows: to_i32(K, "rows", rows)?,
                    ld: to_i32(K, "ld", ld)?,
                    heads: to_i32(K, "heads", heads)?,
                    head_dim: to_i32(K, "head_dim", head_dim)?,
                    pos,
                    inv_freq,
                    half_rope: to_i32(K, "half_rope", half_rope)?,
                    sign,
                    round_out,
                    round_in,
                    out_bf16,
                    ld_out,
                    $($extra,)?
                }
            };
        }
        if rows >= ROPE_ROWS_MIN && half_rope <= ROPE_ROWS_MAX_PAIRS {
            // A block a row, the row's cos / sin once. Measured (ncu, a 4096-token prefill of
            // the 4-layer Flash-shaped model, five calls): rope_kernel 4.45 ms, this 1.25 ms.
            let vec4 = x.addr().is_multiple_of(16)
                && ld.is_multiple_of(4)
                && head_dim.is_multiple_of(4)
                && nope.is_multiple_of(4)
                && out.is_none_or(|(o, l)| o.addr().is_multiple_of(8) && l.is_multiple_of(4));
            return self.rope_rows.launch(
                row_blocks(rows),
                THREADS as u32,
                0,
                stream,
                args!(rope_rows_kernel, vec4),
            );
        }
        // A thread per pair of ROPE_HEADS heads (and per nope channel to round): a row's work
        // over ceil(work / THREADS) blocks, rows over the grid's y, grid-stride, about
        // ROPE_BLOCKS blocks in all. A block a row (x 448 for the nope rounding of 64 heads of
        // 512) was 1.8M blocks of 64 threads at 4096 tokens: 1.9 ms a call, bound by starting
        // blocks (ncu), against ~0.3 GB of reads and writes.
        const ROPE_BLOCKS: usize = 4096;
        let work =
            (heads.div_ceil(ROPE_HEADS) * half_rope).max(if round_out { heads * nope } else { 0 });
        let gx = work.div_ceil(THREADS).clamp(1, MAX_BLOCKS);
        let grid = (
            gx as u32,
            rows.min(ROPE_BLOCKS.div_ceil(gx)).clamp(1, 65535) as u32,
            1,
        );
        self.rope
            .launch(grid, THREADS as u32, 0, stream, args!(rope_kernel))
    }

    /// Whether [`Self::head_prep`] takes heads of `head_dim` values with `half_rope` RoPE pairs.
    pub fn head_prep_covers(head_dim: usize, half_rope: usize) -> bool {
        head_dim.is_multiple_of(2)
            && head_dim <= 2 * HEAD_PREP_MAX_PAIRS
            && half_rope > 0
            && 2 * half_rope <= head_dim
    }

    /// In place over `rows` rows at stride `ld` of `heads` heads of `head_dim` values: each
    /// head's [`Self::rmsnorm`] (optional `weight[head_dim]`), then [`Self::rope`] (sign +1),
    /// then with `sim_nope > 0` [`Self::kv_sim`] of its first `sim_nope` channels, in one launch
    /// and bit for bit as the three ([`Self::head_prep_covers`] must hold; `sim_nope` at most
    /// the nope channels). With `round_in`, x is first rounded to bf16 as it is loaded: the
    /// projection that wrote it may leave its bf16 rounding to this, its only reader. With
    /// `out_bf16` the results go there as BF16 (`[rows][heads][head_dim]`, dense; exact with
    /// `round_out`, which makes them bf16 values) instead of back into x: the fast attention's
    /// queries.
    #[allow(clippy::too_many_arguments)]
    pub fn head_prep(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        ld: usize,
        heads: usize,
        head_dim: usize,
        weight: Option<DevicePtr>,
        eps: f32,
        pos: DevicePtr,
        inv_freq: DevicePtr,
        half_rope: usize,
        sim_nope: usize,
        round_out: bool,
        round_in: bool,
        out_bf16: Option<DevicePtr>,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "head_prep_kernel";
        if !Self::head_prep_covers(head_dim, half_rope)
            || heads * head_dim > ld
            || sim_nope > head_dim - 2 * half_rope
        {
            return Err(err(format!(
                "{K}: heads = {heads}, head_dim = {head_dim}, half_rope = {half_rope}, sim_nope = \
                 {sim_nope}, ld = {ld}"
            )));
        }
        need(K, "x", x, strided_bytes(rows, heads * head_dim, ld))?;
        need(K, "pos", pos, rows * 4)?;
        need(K, "inv_freq", inv_freq, half_rope * 4)?;
        if let Some(w) = weight {
            need(K, "weight", w, head_dim * 4)?;
        }
        if let Some(out) = out_bf16 {
            need(K, "out_bf16", out, rows * heads * head_dim * 2)?;
        }
        if rows == 0 || heads == 0 {
            return Ok(());
        }
        let items = rows * heads;
        let _g = ctx.enter()?;
        // Both kernels take the same parameters.
        macro_rules! args {
            ($k:ident) => {
                $k::Args {
                    x,
                    rows: to_i32(K, "rows", rows)?,
                    ld: to_i32(K, "ld", ld)?,
                    heads: to_i32(K, "heads", heads)?,
                    head_dim: to_i32(K, "head_dim", head_dim)?,
                    weight,
                    eps,
                    pos,
                    inv_freq,
                    half_rope: to_i32(K, "half_rope", half_rope)?,
                    sim_nope: to_i32(K, "sim_nope", sim_nope)?,
                    round_out,
                    round_in,
                    out_bf16,
                }
            };
        }
        if items > i32::MAX as usize {
            return Err(err(format!("{K}: {items} head rows")));
        }
        if rows >= ROPE_ROWS_MIN
            && heads >= HEAD_PREP_ROWS_WARPS
            && head_dim <= 64 * HEAD_PREP_ROWS_LANE_PAIRS
            && ld.is_multiple_of(2)
            && x.addr().is_multiple_of(8)
        {
            // A block a row, a warp a head, the row's cos / sin once. head_prep_kernel's block a
            // head row is 262K blocks for a 4096-token prefill's queries. Measured (ncu, that
            // prefill's four query calls): 2.9 ms with head_prep_kernel, 1.19 ms with this.
            let threads = 32 * HEAD_PREP_ROWS_WARPS;
            return self.head_prep_rows.launch(
                row_blocks(rows),
                threads as u32,
                0,
                stream,
                args!(head_prep_rows_kernel),
            );
        }
        let threads = 32 * head_dim.div_ceil(64);
        self.head_prep.launch(
            items as u32,
            threads as u32,
            0,
            stream,
            args!(head_prep_kernel),
        )
    }

    /// KV nope FP8 simulation in place: `fp8sim(x[r][0:nope], 64)` for `rows` rows at stride
    /// `ld`. `Prec::kv_nope_sim` (official mode only; the caller decides).
    pub fn kv_sim(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        ld: usize,
        nope: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "kv_sim_kernel";
        if nope > ld {
            return Err(err(format!("{K}: nope = {nope} > ld = {ld}")));
        }
        need(K, "x", x, strided_bytes(rows, nope, ld))?;
        if rows == 0 || nope == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = kv_sim_kernel::Args {
            x,
            rows: to_i32(K, "rows", rows)?,
            ld: to_i32(K, "ld", ld)?,
            nope: to_i32(K, "nope", nope)?,
        };
        self.kv_sim.launch(row_blocks(rows), 128, 0, stream, args)
    }

    /// Indexer query/key simulation in place over `rows` contiguous rows of `dim` values (a
    /// power of two <= 1024): Hadamard, `fp4sim(·, 32)`, bf16. `Prec::index_sim` (official).
    pub fn index_sim(
        &self,
        ctx: &Context,
        x: DevicePtr,
        rows: usize,
        dim: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "index_sim_kernel";
        if !dim.is_power_of_two() || dim > HADAMARD_MAX {
            return Err(err(format!(
                "{K}: dim = {dim} is not a power of two <= {HADAMARD_MAX}"
            )));
        }
        need(K, "x", x, rows * dim * 4)?;
        if rows == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = index_sim_kernel::Args {
            x,
            rows: to_i32(K, "rows", rows)?,
            dim: to_i32(K, "dim", dim)?,
        };
        let threads = (dim as u32 / 2).clamp(32, ROW_THREADS);
        self.index_sim
            .launch(row_blocks(rows), threads, 0, stream, args)
    }

    /// `x = bf16(x)` for `n` f32 values.
    pub fn round_bf16(
        &self,
        ctx: &Context,
        x: DevicePtr,
        n: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("round_bf16_kernel", "x", x, n * 4)?;
        if n == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = round_bf16_kernel::Args { x, n: n as i64 };
        self.round_bf16
            .launch(flat_blocks(n), FLAT_THREADS, 0, stream, args)
    }

    /// `x = x * s1 * s2` (f32, that order) for `n` values.
    pub fn scale2(
        &self,
        ctx: &Context,
        x: DevicePtr,
        n: usize,
        s1: f32,
        s2: f32,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("scale2_kernel", "x", x, n * 4)?;
        if n == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = scale2_kernel::Args {
            x,
            n: n as i64,
            s1,
            s2,
        };
        self.scale2
            .launch(flat_blocks(n), FLAT_THREADS, 0, stream, args)
    }

    /// Embedding into the residual streams: `x[t, s, :] = table[tokens[t], :]` for `t < t_count`
    /// and every stream `s < n` (`table`: rows of `d` values, BF16 when `bf16`, else f32; `x`:
    /// [t_count, n, d] f32). Token ids are not checked on the device: the caller validates them
    /// against the table's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        ctx: &Context,
        tokens: DevicePtr,
        t_count: usize,
        table: DevicePtr,
        bf16: bool,
        d: usize,
        n: usize,
        x: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "embed_kernel";
        if d == 0 || n == 0 {
            return Err(err(format!("{K}: d = {d}, n = {n}")));
        }
        need(K, "tokens", tokens, t_count * 4)?;
        need(K, "table", table, d * if bf16 { 2 } else { 4 })?;
        need(K, "x", x, t_count * n * d * 4)?;
        if t_count == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        // (Token ids are checked by the caller.)
        let args = embed_kernel::Args {
            tokens,
            t: to_i32(K, "T", t_count)?,
            table,
            bf16,
            d: to_i32(K, "D", d)?,
            n: to_i32(K, "N", n)?,
            x,
        };
        self.embed
            .launch(flat_blocks(t_count * d), FLAT_THREADS, 0, stream, args)
    }

    /// `dst[r, :] = src[rows[r], :]` for `r < nrows` (f32 rows of `row_len`; `rows` i32 per
    /// output row, `None` = identity). Row ids are not checked on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        ctx: &Context,
        src: DevicePtr,
        row_len: usize,
        rows: Option<DevicePtr>,
        nrows: usize,
        dst: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "gather_rows_kernel";
        if row_len == 0 {
            return Err(err(format!("{K}: row_len = 0")));
        }
        match rows {
            Some(r) => {
                need(K, "rows", r, nrows * 4)?;
                need(K, "src", src, row_len * 4)?;
            }
            None => need(K, "src", src, nrows * row_len * 4)?,
        }
        need(K, "dst", dst, nrows * row_len * 4)?;
        if nrows == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        // (Row ids are checked by the caller.)
        let args = gather_rows_kernel::Args {
            src,
            row_len: to_i32(K, "row_len", row_len)?,
            rows,
            nrows: to_i32(K, "nrows", nrows)?,
            dst,
        };
        self.gather_rows
            .launch(flat_blocks(nrows * row_len), FLAT_THREADS, 0, stream, args)
    }

    /// `dst[i] = bf16 bits of src[i]` (round to nearest even) for `n` values; `dst` u16.
    pub fn to_bf16(
        &self,
        ctx: &Context,
        src: DevicePtr,
        dst: DevicePtr,
        n: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("to_bf16_kernel", "src", src, n * 4)?;
        need("to_bf16_kernel", "dst", dst, n * 2)?;
        if n == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = to_bf16_kernel::Args {
            src,
            dst,
            n: n as i64,
        };
        self.to_bf16
            .launch(flat_blocks(n), FLAT_THREADS, 0, stream, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_blocks_hold_the_model_rows_in_registers() {
        assert_eq!(rmsnorm_threads(64), 128);
        assert_eq!(rmsnorm_threads(512), ROW_THREADS);
        assert_eq!(rmsnorm_threads(1536), 384);
        assert_eq!(rmsnorm_threads(4096), 1024);
        // V4 Pro's 7168: 1024 threads, the kernel's strided loop.
        assert_eq!(rmsnorm_threads(7168), 1024);
        for dim in [64, 128, 512, 1024, 1536, 4096] {
            assert!(
                dim <= RMSNORM_VALUES * rmsnorm_threads(dim) as usize,
                "dim {dim}"
            );
        }
    }

    /// `register_block`: the blocks on which the fast families' fused norms (norm_row.cuh) write
    /// `rmsnorm`'s bits and quantize per 128 of k: the rows kernel's from RMSNORM_ROWS_MIN rows,
    /// rmsnorm_kernel's registers path below, where its threads are whole 128s; never the strided
    /// loop (V4 Pro's 7168), a block of 288 threads (1152: its 128-blocks would straddle two
    /// register slots) or a width that is not whole 128-blocks.
    #[test]
    fn the_fused_norms_take_the_blocks_that_hold_whole_128_blocks() {
        let row = |threads| {
            Some(RmsnormBlock::Row {
                threads,
                in_registers: true,
            })
        };
        assert_eq!(register_block(1, 4096), row(1024));
        assert_eq!(register_block(1, 1024), row(256));
        assert_eq!(register_block(255, 384), row(256));
        assert_eq!(register_block(1, 128), row(128));
        assert_eq!(
            register_block(RMSNORM_ROWS_MIN, 4096),
            Some(RmsnormBlock::Rows)
        );
        assert_eq!(
            register_block(RMSNORM_ROWS_MIN, 1024),
            Some(RmsnormBlock::Rows)
        );
        assert_eq!(register_block(1, 7168), None);
        assert_eq!(register_block(RMSNORM_ROWS_MIN, 7168), None);
        assert_eq!(register_block(1, 1536), row(384));
        assert_eq!(register_block(1, 1152), None);
        assert_eq!(register_block(1, 4096 + 64), None);
        assert_eq!(register_block(0, 4096), None);
        for (rows, dim) in [(1, 4096), (8, 1024), (RMSNORM_ROWS_MIN, 4096)] {
            // The block is rmsnorm's own (so the normed rows are its bits).
            let block = register_block(rows, dim).unwrap();
            assert_eq!(block, rmsnorm_block(rows, dim), "{rows} x {dim}");
        }
    }
}
