//! Rust side of the `linear` kernel family (kernels/linear.cu): typed launch wrappers. See
//! kernels/SPEC.md.
//!
//! - [`Linear::linear`]: `y = x · Wᵀ` with W in any stored format ([`WeightDev`]), f64 sums in the
//!   CPU reference's order (bit-identical to `ops::matmul_mat`), optional BF16 rounding, strided
//!   x and y.
//! - [`Linear::act_quant`]: the official per-token FP8 activation quantisation (`fp8_sim(·, 128)`).
//!
//! `Prec::linear` of the reference is `act_quant` (official mode, quantized weight) followed by
//! `linear` with `round_out = official`.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::qmatrix::FP4_BLOCK;
use std::ffi::c_void;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "linear", include_str!("../../../kernels/linear.cu");

    /// `fmt` is a [`StorageFormat`] code; `scales` is NULL for unquantized formats.
    #[pdl(true)]
    fn linear_kernel(
        x: *const f32, ldx: i32, t: i32, k: i32, n: i32, fmt: i32, w: *const c_void,
        scales: Option<*const f32>, br: i32, bc: i32, round_out: bool, y: *mut f32, ldy: i32,
    );
    #[pdl(true)]
    fn act_quant_kernel(x: *const f32, ldx: i32, rows: i32, k: i32, xq: *mut f32);
}

/// Token rows per `linear_kernel` block on the tiled path (GT_BM).
pub const TILE_T: usize = 32;
/// Token rows per `linear_kernel` block on the skinny path (GS_MAXR).
pub const SKINNY_T: usize = 8;
/// Largest T that takes the skinny path (LIN_SKINNY_MAX_T).
pub const SKINNY_MAX_T: usize = 16;
/// Output columns per `linear_kernel` block on the tiled path (LIN_BN).
pub const TILE_N: usize = 64;
/// Threads of a `linear_kernel` block (GEMM_THREADS).
pub const LINEAR_THREADS: u32 = 256;

/// Output columns per `linear_kernel` block on the skinny path (GS_BN).
pub const SKINNY_N: usize = 16;

/// (token rows, output columns) per `linear_kernel` block for `t` rows: the kernel takes the
/// skinny path when `t <= SKINNY_MAX_T`, the tiled one otherwise.
pub fn block_tile(t: usize) -> (usize, usize) {
    if t <= SKINNY_MAX_T {
        (SKINNY_T, SKINNY_N)
    } else {
        (TILE_T, TILE_N)
    }
}
/// Block of the activation quantisation along K (ACT_BLOCK).
pub const ACT_BLOCK: usize = 128;

pub use crate::weights::format::StorageFormat;

/// A `rows x cols` weight matrix in device memory, laid out exactly as the CPU store holds it
/// (`TensorData::F32` / `Bf16` / `Quant`): `data` the values or codes, `scales` the f32 scales
/// of quantized formats, `block` the FP8 scale block [br, bc] (ignored otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightDev {
    pub format: StorageFormat,
    pub data: DevicePtr,
    pub scales: Option<DevicePtr>,
    pub block: [usize; 2],
    pub rows: usize,
    pub cols: usize,
}

impl WeightDev {
    /// Checks that the buffers hold the whole matrix and the scales are present when needed.
    pub fn validate(&self) -> Result<()> {
        // Runs in every forward's linears: the message is formatted only on failure.
        let what = || format!("{:?} weight {}x{}", self.format, self.rows, self.cols);
        let data_bytes = self.format.data_bytes(self.rows, self.cols);
        if self.data.bytes() < data_bytes {
            return need(&what(), "data", self.data, data_bytes);
        }
        if self.format.is_quantized() {
            let Some(s) = self.scales else {
                return Err(internal(format!(
                    "{}: quantized weight without scales",
                    what()
                )));
            };
            if self.format == StorageFormat::Fp8 && (self.block[0] == 0 || self.block[1] == 0) {
                return Err(internal(format!(
                    "{}: FP8 scale block {:?}",
                    what(),
                    self.block
                )));
            }
            let scale_bytes = 4 * self.format.scale_count(self.rows, self.cols, self.block);
            if s.bytes() < scale_bytes {
                return need(&what(), "scales", s, scale_bytes);
            }
        }
        Ok(())
    }

    /// The sub-matrix of rows `[row0, row0 + n)` (pointers offset; for FP8, `row0` must be a
    /// multiple of the scale block's rows, as SPEC.md requires).
    pub fn rows(&self, row0: usize, n: usize) -> Result<WeightDev> {
        if row0.checked_add(n).is_none_or(|e| e > self.rows) {
            return Err(internal(format!(
                "rows {row0}..{row0}+{n} of a {}-row weight",
                self.rows
            )));
        }
        let c = self.cols;
        let (data, scales) = match self.format {
            StorageFormat::F32 | StorageFormat::Bf16 => {
                let es = if self.format == StorageFormat::F32 {
                    4
                } else {
                    2
                };
                (self.data.slice(row0 * c * es, n * c * es)?, self.scales)
            }
            StorageFormat::Fp8 => {
                let br = self.block[0].max(1);
                if !row0.is_multiple_of(br) {
                    return Err(internal(format!(
                        "FP8 weight row offset {row0} is not a multiple of the scale block {br}"
                    )));
                }
                let sc = c.div_ceil(self.block[1].max(1));
                let s = self
                    .scales
                    .ok_or_else(|| internal("FP8 weight without scales".into()))?;
                (
                    self.data.slice(row0 * c, n * c)?,
                    Some(s.slice(row0 / br * sc * 4, n.div_ceil(br) * sc * 4)?),
                )
            }
            StorageFormat::Fp4 => {
                let (half, sc) = (c.div_ceil(2), c.div_ceil(FP4_BLOCK));
                let s = self
                    .scales
                    .ok_or_else(|| internal("FP4 weight without scales".into()))?;
                (
                    self.data.slice(row0 * half, n * half)?,
                    Some(s.slice(row0 * sc * 4, n * sc * 4)?),
                )
            }
        };
        Ok(WeightDev {
            data,
            scales,
            rows: n,
            ..*self
        })
    }
}

fn internal(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

/// Bytes of a `rows x cols` f32 matrix with row stride `ld` (0 when empty).
pub fn strided_bytes(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        ((rows - 1) * ld + cols) * 4
    }
}

crate::launchers! {
    /// The linear family's entry points, resolved from a loaded registry.
    pub struct Linear {
        linear: linear_kernel,
        act_quant: act_quant_kernel,
    }
}

impl Linear {
    /// `y[t*ldy + c] = f32(Σ_k f64(x[t*ldx + k]) * f64(W[c, k]))` for `t < rows`, `c < n`,
    /// `k < w.cols`, then BF16-rounded if `round_out`. W is rows `[0, n)` of `w` (use
    /// [`WeightDev::rows`] for an offset). `x` and `y` must not overlap.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        ctx: &Context,
        x: DevicePtr,
        ldx: usize,
        rows: usize,
        w: &WeightDev,
        n: usize,
        round_out: bool,
        y: DevicePtr,
        ldy: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "linear_kernel";
        let k = w.cols;
        if ldx < k || ldy < n {
            return Err(internal(format!(
                "{K}: strides ldx {ldx} / ldy {ldy} below K {k} / N {n}"
            )));
        }
        if n > w.rows {
            return Err(internal(format!(
                "{K}: {n} outputs from a {}-row weight",
                w.rows
            )));
        }
        w.validate()?;
        need(K, "x", x, strided_bytes(rows, k, ldx))?;
        need(K, "y", y, strided_bytes(rows, n, ldy))?;
        let (t32, k32, n32) = (
            to_i32(K, "rows", rows)?,
            to_i32(K, "K", k)?,
            to_i32(K, "N", n)?,
        );
        let (ldx32, ldy32) = (to_i32(K, "ldx", ldx)?, to_i32(K, "ldy", ldy)?);
        let br = to_i32(K, "block rows", w.block[0])?;
        let bc = to_i32(K, "block cols", w.block[1])?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let (bt, bn) = block_tile(rows);
        let gy = rows.div_ceil(bt);
        if gy > 65_535 {
            return Err(internal(format!("{K}: {rows} rows exceed the grid")));
        }
        let gx = n.div_ceil(bn) as u32;
        let _g = ctx.enter()?;
        let args = linear_kernel::Args {
            x,
            ldx: ldx32,
            t: t32,
            k: k32,
            n: n32,
            fmt: w.format.code(),
            w: w.data,
            scales: w.scales,
            br,
            bc,
            round_out,
            y,
            ldy: ldy32,
        };
        self.linear
            .launch((gx, gy as u32), LINEAR_THREADS, 0, stream, args)
    }

    /// `xq[r*k + c] = fp8_sim(x[r*ldx + ..k], 128)[c]` for `r < rows`: the official per-token
    /// activation quantisation (`xq` contiguous `[rows, k]`; may equal `x` only when `ldx == k`).
    #[allow(clippy::too_many_arguments)]
    pub fn act_quant(
        &self,
        ctx: &Context,
        x: DevicePtr,
        ldx: usize,
        rows: usize,
        k: usize,
        xq: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "act_quant_kernel";
        if ldx < k {
            return Err(internal(format!("{K}: ldx {ldx} below K {k}")));
        }
        if x.addr() == xq.addr() && ldx != k {
            return Err(internal(format!(
                "{K}: in place needs ldx == K ({ldx} != {k})"
            )));
        }
        need(K, "x", x, strided_bytes(rows, k, ldx))?;
        need(K, "xq", xq, rows * k * 4)?;
        let (r32, k32, ld32) = (
            to_i32(K, "rows", rows)?,
            to_i32(K, "K", k)?,
            to_i32(K, "ldx", ldx)?,
        );
        if rows == 0 || k == 0 {
            return Ok(());
        }
        let gy = k.div_ceil(ACT_BLOCK);
        if gy > 65_535 {
            return Err(internal(format!("{K}: K = {k} exceeds the grid")));
        }
        let _g = ctx.enter()?;
        let args = act_quant_kernel::Args {
            x,
            ldx: ld32,
            rows: r32,
            k: k32,
            xq,
        };
        self.act_quant
            .launch((r32 as u32, gy as u32), ACT_BLOCK as u32, 0, stream, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp(bytes: usize) -> DevicePtr {
        // SAFETY: never dereferenced; only sizes are checked here.
        unsafe { DevicePtr::from_raw(0x1000_0000, bytes) }
    }

    #[test]
    fn sizes_of_each_format() {
        assert_eq!(StorageFormat::F32.data_bytes(3, 5), 60);
        assert_eq!(StorageFormat::Bf16.data_bytes(3, 5), 30);
        assert_eq!(StorageFormat::Fp8.data_bytes(3, 5), 15);
        assert_eq!(StorageFormat::Fp4.data_bytes(3, 5), 9);
        assert_eq!(StorageFormat::Fp8.scale_count(130, 200, [128, 128]), 4);
        assert_eq!(StorageFormat::Fp4.scale_count(3, 65, [0, 0]), 9);
        assert_eq!(strided_bytes(3, 4, 10), (2 * 10 + 4) * 4);
        assert_eq!(strided_bytes(0, 4, 10), 0);
    }

    #[test]
    fn row_views_offset_codes_and_scales() {
        let w = WeightDev {
            format: StorageFormat::Fp8,
            data: dp(256 * 100),
            scales: Some(dp(4 * 4)),
            block: [128, 64],
            rows: 256,
            cols: 100,
        };
        w.validate().unwrap();
        let v = w.rows(128, 100).unwrap();
        assert_eq!(v.data.addr(), 0x1000_0000 + 128 * 100);
        assert_eq!(v.scales.unwrap().addr(), 0x1000_0000 + 2 * 4);
        assert_eq!(v.rows, 100);
        assert!(w.rows(64, 10).is_err(), "FP8 offset inside a scale block");
        assert!(w.rows(200, 100).is_err(), "past the end");
        let f4 = WeightDev {
            format: StorageFormat::Fp4,
            data: dp(10 * 33),
            scales: Some(dp(10 * 3 * 4)),
            block: [0, 0],
            rows: 10,
            cols: 65,
        };
        f4.validate().unwrap();
        let v = f4.rows(3, 2).unwrap();
        assert_eq!(v.data.addr(), 0x1000_0000 + 3 * 33);
        assert_eq!(v.scales.unwrap().addr(), 0x1000_0000 + 3 * 3 * 4);
        let short = WeightDev {
            scales: Some(dp(10)),
            ..f4
        };
        assert!(short.validate().is_err());
    }
}
