//! Rust side of the `norm_rope` kernel family (kernels/norm_rope.cu): RMSNorm, RoPE, the KV
//! and indexer fake-quantisation, and small elementwise / copy kernels. Contract in
//! kernels/SPEC.md; every kernel is bit-identical to its CPU reference (tests/gpu_norm_rope.rs).
//!
//! Every launch function checks that each buffer holds what the kernel will touch, then
//! enqueues on the borrowed stream (no host sync). Zero-sized work launches nothing.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::registry::{Kernel, KernelFn, KernelSource, Registry};
use crate::cuda::stream::{BorrowedStream, KernelArgs, launch};
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource {
    family: "norm_rope",
    source: include_str!("../../../kernels/norm_rope.cu"),
    functions: &[
        KernelFn::new("rmsnorm_kernel"),
        KernelFn::new("rope_kernel"),
        KernelFn::new("kv_sim_kernel"),
        KernelFn::new("index_sim_kernel"),
        KernelFn::new("round_bf16_kernel"),
        KernelFn::new("scale2_kernel"),
        KernelFn::new("embed_kernel"),
        KernelFn::new("gather_rows_kernel"),
        KernelFn::new("to_bf16_kernel"),
    ],
};

/// Longest row of [`NormRope::index_sim`] (`NR_HADAMARD_MAX` in norm_rope.cu).
pub const HADAMARD_MAX: usize = 1024;

/// Threads per block of the per-row kernels (a multiple of 32).
const ROW_THREADS: u32 = 256;
/// Threads per block of the flat elementwise kernels.
const FLAT_THREADS: u32 = 256;
/// Most blocks of a launch; the kernels loop (grid-stride) over the rest.
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

/// The norm_rope family's entry points, resolved from a loaded registry.
pub struct NormRope {
    rmsnorm: Kernel,
    rope: Kernel,
    kv_sim: Kernel,
    index_sim: Kernel,
    round_bf16: Kernel,
    scale2: Kernel,
    embed: Kernel,
    gather_rows: Kernel,
    to_bf16: Kernel,
}

impl NormRope {
    pub fn new(reg: &Registry) -> Result<NormRope> {
        let f = SOURCE.family;
        Ok(NormRope {
            rmsnorm: reg.get(f, "rmsnorm_kernel")?,
            rope: reg.get(f, "rope_kernel")?,
            kv_sim: reg.get(f, "kv_sim_kernel")?,
            index_sim: reg.get(f, "index_sim_kernel")?,
            round_bf16: reg.get(f, "round_bf16_kernel")?,
            scale2: reg.get(f, "scale2_kernel")?,
            embed: reg.get(f, "embed_kernel")?,
            gather_rows: reg.get(f, "gather_rows_kernel")?,
            to_bf16: reg.get(f, "to_bf16_kernel")?,
        })
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
        let threads = if dim <= 128 { 128 } else { ROW_THREADS };
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(x).i32(r32).i32(d32).i32(l32);
        a.ptr(weight.map_or(0, |w| w.addr()))
            .f32(eps)
            .i32(round_out as i32);
        // SAFETY: matches `rmsnorm_kernel(float*, int, int, int, const float*, float, int)`;
        // sizes checked above.
        unsafe { launch(&self.rmsnorm, row_blocks(rows), threads, 0, stream, &a) }
    }

    /// In-place RoPE of `rows` rows at stride `ld`, each holding `heads` heads of `head_dim`
    /// values: the last `2 * half_rope` channels of every head rotate by `pos[row] *
    /// inv_freq[k]` (`pos`: i32 per row, `inv_freq`: `half_rope` f32), `sign` -1 rotates back.
    /// With `round_out` the whole head is then rounded to bf16. `rope::apply` (+ `Prec::bf16`).
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
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "rope_kernel";
        if 2 * half_rope > head_dim || heads * head_dim > ld || half_rope == 0 {
            return Err(err(format!(
                "{K}: heads = {heads}, head_dim = {head_dim}, half_rope = {half_rope}, ld = {ld}"
            )));
        }
        need(K, "x", x, strided_bytes(rows, heads * head_dim, ld))?;
        need(K, "pos", pos, rows * 4)?;
        need(K, "inv_freq", inv_freq, half_rope * 4)?;
        if rows == 0 || heads == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(x)
            .i32(to_i32(K, "rows", rows)?)
            .i32(to_i32(K, "ld", ld)?)
            .i32(to_i32(K, "heads", heads)?)
            .i32(to_i32(K, "head_dim", head_dim)?);
        a.ptr(pos)
            .ptr(inv_freq)
            .i32(to_i32(K, "half_rope", half_rope)?)
            .f32(sign)
            .i32(round_out as i32);
        let threads = if heads * head_dim <= 128 {
            64
        } else {
            ROW_THREADS
        };
        // SAFETY: matches `rope_kernel(float*, int, int, int, int, const int*, const float*,
        // int, float, int)`; sizes checked above.
        unsafe { launch(&self.rope, row_blocks(rows), threads, 0, stream, &a) }
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
        let mut a = KernelArgs::new();
        a.ptr(x)
            .i32(to_i32(K, "rows", rows)?)
            .i32(to_i32(K, "ld", ld)?)
            .i32(to_i32(K, "nope", nope)?);
        // SAFETY: matches `kv_sim_kernel(float*, int, int, int)`; sizes checked above.
        unsafe { launch(&self.kv_sim, row_blocks(rows), 128, 0, stream, &a) }
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
        let mut a = KernelArgs::new();
        a.ptr(x)
            .i32(to_i32(K, "rows", rows)?)
            .i32(to_i32(K, "dim", dim)?);
        let threads = (dim as u32 / 2).clamp(32, ROW_THREADS);
        // SAFETY: matches `index_sim_kernel(float*, int, int)`; sizes checked above.
        unsafe { launch(&self.index_sim, row_blocks(rows), threads, 0, stream, &a) }
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
        let mut a = KernelArgs::new();
        a.ptr(x).i64(n as i64);
        // SAFETY: matches `round_bf16_kernel(float*, long long)`; size checked above.
        unsafe {
            launch(
                &self.round_bf16,
                flat_blocks(n),
                FLAT_THREADS,
                0,
                stream,
                &a,
            )
        }
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
        let mut a = KernelArgs::new();
        a.ptr(x).i64(n as i64).f32(s1).f32(s2);
        // SAFETY: matches `scale2_kernel(float*, long long, float, float)`; size checked.
        unsafe { launch(&self.scale2, flat_blocks(n), FLAT_THREADS, 0, stream, &a) }
    }

    /// Embedding into the residual streams: `x[t, s, :] = table[tokens[t], :]` for `t < t_count`
    /// and every stream `s < n` (`table`: f32 rows of `d`; `x`: [t_count, n, d]). Token ids are
    /// not checked on the device: the caller validates them against the table's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        ctx: &Context,
        tokens: DevicePtr,
        t_count: usize,
        table: DevicePtr,
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
        need(K, "table", table, d * 4)?;
        need(K, "x", x, t_count * n * d * 4)?;
        if t_count == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(tokens)
            .i32(to_i32(K, "T", t_count)?)
            .ptr(table)
            .i32(to_i32(K, "D", d)?)
            .i32(to_i32(K, "N", n)?)
            .ptr(x);
        // SAFETY: matches `embed_kernel(const int*, int, const float*, int, int, float*)`;
        // sizes checked above (token ids by the caller).
        unsafe {
            launch(
                &self.embed,
                flat_blocks(t_count * d),
                FLAT_THREADS,
                0,
                stream,
                &a,
            )
        }
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
        let mut a = KernelArgs::new();
        a.ptr(src)
            .i32(to_i32(K, "row_len", row_len)?)
            .ptr(rows.map_or(0, |r| r.addr()))
            .i32(to_i32(K, "nrows", nrows)?)
            .ptr(dst);
        // SAFETY: matches `gather_rows_kernel(const float*, int, const int*, int, float*)`;
        // sizes checked above (row ids by the caller).
        unsafe {
            launch(
                &self.gather_rows,
                flat_blocks(nrows * row_len),
                FLAT_THREADS,
                0,
                stream,
                &a,
            )
        }
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
        let mut a = KernelArgs::new();
        a.ptr(src).ptr(dst).i64(n as i64);
        // SAFETY: matches `to_bf16_kernel(const float*, unsigned short*, long long)`; sizes
        // checked above.
        unsafe { launch(&self.to_bf16, flat_blocks(n), FLAT_THREADS, 0, stream, &a) }
    }
}
