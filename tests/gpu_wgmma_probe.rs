//! The layouts a wgmma GEMM relies on (kernels/wgmma_probe.cu): one m64nNk32 e4m3 product, A
//! from registers in mma.m16n8k32's fragment layout, B from shared memory (K-major, no swizzle,
//! 8 x 16-byte core matrices, LBO = the k-half step, SBO = the row-group step), D in the
//! documented register layout, for N = 8, 16, 32, against a host matmul of the e4m3 values on
//! fresh random codes. The descriptor with its two offsets exchanged is run too and reported,
//! so a wrong guess shows which reading the hardware makes. Bound: products of e4m3 values are
//! exact; the FP8 accumulator keeps fewer bits than f32 over the 32-term sum, so
//! |Δ| <= 2^-10 · Σ|a·b| per output (a wrong layout is off by O(Σ|a·b|)).
//!
//! Without a CUDA device it prints `skipped: no CUDA device`.

mod common;

use common::gpu::family_gpu;
use common::rng::Rng;
use dsv4::cuda::OwnedStream;
use dsv4::cuda::wgmma_probe::{self, WgmmaProbe};
use dsv4::weights::dtype::E4M3_LUT;

/// A random finite e4m3 code (NaN codes 0x7f / 0xff excluded).
fn code(rng: &mut Rng) -> u8 {
    loop {
        let c = (rng.u64() & 0xff) as u8;
        if c & 0x7f != 0x7f {
            return c;
        }
    }
}

#[test]
fn wgmma_e4m3_rs_layouts_match_the_host() {
    let Some(g) = family_gpu(&[&wgmma_probe::SOURCE]) else {
        return;
    };
    let probe = WgmmaProbe::new(&g.reg).unwrap();
    let stream = OwnedStream::new(&g.ctx).unwrap();
    let s = stream.borrow();
    let mut rng = Rng::from_env("gpu_wgmma_probe");
    let (_arena, p) = common::gpu::alloc(&g.ctx, &[64 * 32, 32 * 32, 64 * 32 * 4]);
    let a: Vec<u8> = (0..64 * 32).map(|_| code(&mut rng)).collect();
    let b: Vec<u8> = (0..32 * 32).map(|_| code(&mut rng)).collect();
    {
        let _g = g.ctx.enter().unwrap();
        dsv4::cuda::arena::copy_to_device_sync(p[0], &a, s).unwrap();
        dsv4::cuda::arena::copy_to_device_sync(p[1], &b, s).unwrap();
    }
    for n in [8usize, 16, 32] {
        let mut worst = [0f64; 2];
        for swap in [false, true] {
            let _g = g.ctx.enter().unwrap();
            dsv4::cuda::arena::memset_async(p[2], 0xff, s).unwrap();
            probe.run(&g.ctx, p[0], p[1], n, swap, p[2], s).unwrap();
            s.synchronize().unwrap();
            let mut d = vec![0f32; 64 * n];
            dsv4::cuda::arena::copy_to_host_sync(&mut d, p[2], s).unwrap();
            for r in 0..64 {
                for c in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for k in 0..32 {
                        let x = E4M3_LUT[a[r * 32 + k] as usize] as f64
                            * E4M3_LUT[b[c * 32 + k] as usize] as f64;
                        want += x;
                        mag += x.abs();
                    }
                    let err = (d[r * n + c] as f64 - want).abs() / (mag + 1e-30);
                    let err = if err.is_nan() { f64::INFINITY } else { err };
                    worst[swap as usize] = worst[swap as usize].max(err);
                }
            }
        }
        println!(
            "n = {n}: worst |Δ| / Σ|a·b| = {:.3e} (LBO = k-half step), {:.3e} (offsets exchanged)",
            worst[0], worst[1]
        );
        assert!(
            worst[0] <= 2f64.powi(-10),
            "n = {n}: the assumed A / B / D layouts do not match the hardware (worst relative error {:.3e}; with the offsets exchanged {:.3e})",
            worst[0],
            worst[1]
        );
    }
}
