//! Rust side of the `l2_prefetch` kernel family (kernels/l2_prefetch.cu): one launch asks L2 for
//! up to three weights' bytes, ahead of the kernels that read them, while the kernels before those
//! leave HBM idle (the fast set's decode step: [`L2Prefetch::weights`]).

use super::linear::WeightDev;
use crate::cuda::Context;
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;

/// Blocks of a launch: each asks for 1 / BLOCKS of every range, so the requests leave from as
/// many SMs' copy engines at once (one SM's alone would take longer than the window).
pub const BLOCKS: u32 = 128;
/// Most ranges one launch takes (a warp each).
pub const RANGES: usize = 3;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "l2_prefetch", include_str!("../../../kernels/l2_prefetch.cu");

    /// Asks L2 for the ranges' bytes; reads and writes nothing.
    #[pdl(true)]
    fn l2_prefetch_kernel(
        p0: Option<*const u8>, bytes0: u64, p1: Option<*const u8>, bytes1: u64,
        p2: Option<*const u8>, bytes2: u64,
    );
}

crate::launchers! {
    /// The family's entry point, resolved from a loaded registry.
    pub struct L2Prefetch {
        kernel: l2_prefetch_kernel,
    }
}

/// A weight's codes as a range the kernel takes: None where the bulk prefetch cannot (not 16-byte
/// aligned or sized) or there is nothing.
fn range(w: &WeightDev) -> Option<(crate::cuda::DevicePtr, u64)> {
    let bytes = w.format.data_bytes(w.rows, w.cols) as u64;
    (bytes > 0 && bytes.is_multiple_of(16) && w.data.addr().is_multiple_of(16))
        .then_some((w.data, bytes))
}

impl L2Prefetch {
    /// One launch asking L2 for the codes of up to [`RANGES`] weights (more are left out; so
    /// is one the bulk prefetch cannot take). Launches only, no host sync; nothing if none.
    pub fn weights(&self, ctx: &Context, ws: &[WeightDev], stream: BorrowedStream) -> Result<()> {
        let mut r = ws.iter().take(RANGES).filter_map(range);
        let (a, b, c) = (r.next(), r.next(), r.next());
        if a.is_none() {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = l2_prefetch_kernel::Args {
            p0: a.map(|x| x.0),
            bytes0: a.map_or(0, |x| x.1),
            p1: b.map(|x| x.0),
            bytes1: b.map_or(0, |x| x.1),
            p2: c.map(|x| x.0),
            bytes2: c.map_or(0, |x| x.1),
        };
        self.kernel.launch(BLOCKS, 96, 0, stream, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::DevicePtr;
    use crate::weights::format::StorageFormat;

    fn weight(format: StorageFormat, addr: u64, rows: usize, cols: usize) -> WeightDev {
        WeightDev {
            format,
            // SAFETY: never dereferenced: only the ranges are computed here.
            data: unsafe { DevicePtr::from_raw(addr, format.data_bytes(rows, cols)) },
            scales: None,
            block: [128, 128],
            rows,
            cols,
        }
    }

    #[test]
    fn a_range_is_the_weights_codes_where_the_bulk_prefetch_takes_them() {
        let wq_b = weight(StorageFormat::Fp8, 1 << 30, 32768, 1024);
        assert_eq!(range(&wq_b).map(|r| r.1), Some(32 << 20));
        let fp4 = weight(StorageFormat::Fp4, 1 << 30, 2048, 4096);
        assert_eq!(range(&fp4).map(|r| r.1), Some(4 << 20), "two codes a byte");
        assert!(range(&weight(StorageFormat::Fp8, (1 << 30) + 8, 128, 128)).is_none());
        assert!(range(&weight(StorageFormat::Fp8, 1 << 30, 3, 5)).is_none());
        assert!(range(&weight(StorageFormat::Fp8, 1 << 30, 0, 128)).is_none());
    }
}
