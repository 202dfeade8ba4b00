//! The `wgmma_probe` kernel family (kernels/wgmma_probe.cu): one warpgroup-wide FP8 `wgmma`
//! with A from registers and B from shared memory, to confirm the fragment and descriptor
//! layouts a wgmma GEMM relies on (tests/gpu_wgmma_probe.rs). Tests only: no model code may
//! use it.

use super::stream::BorrowedStream;
use super::{Context, DevicePtr};
use crate::cuda::kernels::need;
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    pub const SOURCE = "wgmma_probe", include_str!("../../kernels/wgmma_probe.cu");

    /// D [64][n] = A [64][32] · B [n][32]ᵀ (e4m3 codes, f32 out); `swap` exchanges the
    /// descriptor's two byte offsets.
    fn wgmma_probe_kernel(a: *const u8, b: *const u8, n: i32, swap: bool, d: *mut f32);
}

crate::launchers! {
    /// The probe's entry point, resolved from a loaded registry.
    pub struct WgmmaProbe {
        probe: wgmma_probe_kernel,
    }
}

impl WgmmaProbe {
    /// One m64n`n`k32 product (`n` in {8, 16, 32}) into `d`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ctx: &Context,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
        swap: bool,
        d: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "wgmma_probe_kernel";
        if ![8, 16, 32].contains(&n) {
            return Err(Error::new(Status::Internal, format!("{K}: n = {n}")));
        }
        need(K, "a", a, 64 * 32)?;
        need(K, "b", b, n * 32)?;
        need(K, "d", d, 64 * n * 4)?;
        let _g = ctx.enter()?;
        let args = wgmma_probe_kernel::Args {
            a,
            b,
            n: n as i32,
            swap,
            d,
        };
        self.probe.launch(1u32, 128u32, 0, stream, args)
    }
}
