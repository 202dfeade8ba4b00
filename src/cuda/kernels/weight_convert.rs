//! Rust side of the `weight_convert` kernel family (kernels/weight_convert.cu): weights written
//! from device memory without a host bounce (issue 14). A check pass finds non-finite floats
//! headed for quantized storage and out-of-range expert ids before anything is written; the
//! conversion writes a source's rows into a weight's storage layout, bit for bit as the host
//! path (load.rs write_rows); stored-format codes are copied as they are and only their scales
//! converted. The CUDA backend loads this family on its first device write (before finalize
//! too: dsv4_load_tensors takes device entries).

use std::ffi::c_void;

use crate::cuda::DevicePtr;
use crate::cuda::kernels::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;
use crate::weights::format::StorageFormat;
pub use crate::weights::load::DeviceEnc as SourceEnc;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "weight_convert", include_str!("../../../kernels/weight_convert.cu");

    /// `first` must hold `u64::MAX` before the launch.
    fn wc_scan_kernel(src: *const c_void, enc: i32, n: i64, bound: i64, first: *mut u64);
    fn wc_convert_kernel(
        src: *const c_void, enc: i32, scale: Option<*const c_void>, scale_f32: bool, sbr: i32,
        sbc: i32, mat_rows: i64, row0: i64, rows: i32, cols: i32, dst: *mut c_void,
        dst_scale: Option<*mut f32>, dst_fmt: i32, dbr: i32, dbc: i32,
    );
    fn wc_scales_kernel(scale: *const c_void, scale_f32: bool, offset: i64, n: i64, dst: *mut f32);
}

const THREADS: u32 = 256;
const MAX_BLOCKS: usize = 1 << 16;

/// A source's block scale on the device: UE8M0 bytes or f32, FP8 blocks `[rows, cols]`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceScale {
    pub ptr: DevicePtr,
    pub f32: bool,
    pub block: [usize; 2],
}

/// Rows `[row0, row0 + rows)` of a device source whose matrix view has `cols` columns, seen as
/// a stack of `mat_rows`-row matrices (FP8 scales are per matrix).
#[derive(Clone, Copy, Debug)]
pub struct SourceRows {
    pub ptr: DevicePtr,
    pub enc: SourceEnc,
    pub scale: Option<DeviceScale>,
    pub mat_rows: usize,
    pub cols: usize,
    pub row0: usize,
    pub rows: usize,
}

/// A weight's device storage: values / codes and (quantized) f32 scales.
#[derive(Clone, Copy, Debug)]
pub struct DestWeight {
    pub data: DevicePtr,
    pub scales: Option<DevicePtr>,
    /// None: an int32 index table.
    pub format: Option<StorageFormat>,
    /// FP8 scale blocks.
    pub block: [usize; 2],
}

crate::launchers! {
    /// The family's entry points, resolved from a loaded registry.
    pub struct WeightConvert {
        scan: wc_scan_kernel,
        convert: wc_convert_kernel,
        scales: wc_scales_kernel,
    }
}

fn blocks(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32
}

impl WeightConvert {
    /// Enqueues the check of `n` elements of `src` into `first` (8 bytes, set to u64::MAX
    /// here): the index of the first non-finite float, or integer outside [0, bound).
    pub fn scan(
        &self,
        src: DevicePtr,
        enc: SourceEnc,
        n: usize,
        bound: usize,
        first: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "wc_scan_kernel";
        need(K, "src", src, n * enc.size())?;
        need(K, "first", first, 8)?;
        crate::cuda::arena::memset_async(first.slice(0, 8)?, 0xff, stream)?;
        if n == 0 {
            return Ok(());
        }
        self.scan.launch(
            blocks(n),
            THREADS,
            0,
            stream,
            wc_scan_kernel::Args {
                src,
                enc: enc as i32,
                n: n as i64,
                bound: bound as i64,
                first,
            },
        )
    }

    /// Writes `src`'s rows as the whole weight `dst` (decoded, then encoded in its storage).
    pub fn convert(
        &self,
        src: &SourceRows,
        dst: &DestWeight,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "wc_convert_kernel";
        let (rows, cols) = (src.rows, src.cols);
        let elems = rows * cols;
        if elems == 0 {
            return Ok(());
        }
        let src_bytes = match src.enc {
            SourceEnc::Fp4 => (src.row0 + rows) * cols / 2,
            e => (src.row0 + rows) * cols * e.size(),
        };
        need(K, "src", src.ptr, src_bytes)?;
        let (fmt, grid) = match dst.format {
            None => (4, blocks(elems)),
            Some(f) => {
                need(K, "dst", dst.data, f.data_bytes(rows, cols))?;
                let grid = match f {
                    StorageFormat::F32 | StorageFormat::Bf16 => blocks(elems),
                    StorageFormat::Fp8 => (rows.div_ceil(dst.block[0])
                        * cols.div_ceil(dst.block[1]))
                    .clamp(1, MAX_BLOCKS) as u32,
                    StorageFormat::Fp4 => {
                        (rows * cols.div_ceil(32)).div_ceil(8).clamp(1, MAX_BLOCKS) as u32
                    }
                };
                if let Some(s) = dst.scales {
                    need(K, "dst scales", s, 4 * f.scale_count(rows, cols, dst.block))?;
                }
                (f.code(), grid)
            }
        };
        if dst.format.is_none() {
            need(K, "dst", dst.data, elems * 4)?;
        }
        let (scale, scale_f32, [sbr, sbc]) = match src.scale {
            Some(s) => (Some(s.ptr), s.f32, s.block),
            None => (None, false, [1, 1]),
        };
        self.convert.launch(
            grid,
            THREADS,
            0,
            stream,
            wc_convert_kernel::Args {
                src: src.ptr,
                enc: src.enc as i32,
                scale,
                scale_f32,
                sbr: to_i32(K, "scale block rows", sbr.max(1))?,
                sbc: to_i32(K, "scale block cols", sbc.max(1))?,
                mat_rows: src.mat_rows.max(1) as i64,
                row0: src.row0 as i64,
                rows: to_i32(K, "rows", rows)?,
                cols: to_i32(K, "cols", cols)?,
                dst: dst.data,
                dst_scale: dst.scales,
                dst_fmt: fmt,
                dbr: to_i32(K, "block rows", dst.block[0].max(1))?,
                dbc: to_i32(K, "block cols", dst.block[1].max(1))?,
            },
        )
    }

    /// `dst[i]` = scale element `offset + i` of `scale` as f32, for `i < n`.
    pub fn scales(
        &self,
        scale: DeviceScale,
        offset: usize,
        n: usize,
        dst: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "wc_scales_kernel";
        let size = if scale.f32 { 4 } else { 1 };
        need(K, "scale", scale.ptr, (offset + n) * size)?;
        need(K, "dst", dst, n * 4)?;
        if n == 0 {
            return Ok(());
        }
        self.scales.launch(
            blocks(n),
            THREADS,
            0,
            stream,
            wc_scales_kernel::Args {
                scale: scale.ptr,
                scale_f32: scale.f32,
                offset: offset as i64,
                n: n as i64,
                dst,
            },
        )
    }
}
