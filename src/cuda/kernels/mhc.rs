//! Rust side of the `mhc` kernel family (kernels/mhc.cu): manifold-constrained
//! hyper-connections, hc_pre / hc_post / hc_head (MODEL.md §5). Contract in kernels/SPEC.md;
//! bit-identical to src/reference/mhc.rs (tests/gpu_mhc.rs).
//!
//! Every launch function checks that each buffer holds what the kernel will touch, then
//! enqueues on the borrowed stream (no host sync). Zero tokens launch nothing.

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "mhc", include_str!("../../../kernels/mhc.cu");

    /// `fold`: layer 0's stream-folded projection (f64), NULL at other sites.
    fn hc_pre_kernel(
        x: *const f32, t: i32, n: i32, d: i32, proj: *const f32, base: *const f32,
        scale: *const f32, fold: Option<*const f64>, iters: i32, hc_eps: f32, rms_eps: f32,
        round_u: bool, u: *mut f32, post: *mut f32, comb: *mut f32,
    );
    fn hc_post_kernel(
        x: *mut f32, a: *const f32, post: *const f32, comb: *const f32, t: i32, n: i32, d: i32,
        round_out: bool,
    );
    fn hc_head_kernel(
        x: *const f32, r: i32, n: i32, d: i32, proj: *const f32, base: *const f32,
        scale: *const f32, hc_eps: f32, rms_eps: f32, round_out: bool, y: *mut f32,
    );
    /// Derived (finalize / refit): layer 0's stream-folded projection from the device `proj`.
    fn hc0_fold_kernel(proj: *const f32, mix: i32, n: i32, d: i32, fold: *mut f64);
}

/// Most residual streams (hc_mult) the kernels support (`HC_MAX_N` in mhc.cu).
pub const MAX_STREAMS: usize = 8;

/// Threads per block of hc_pre / hc_head (one block per token) and hc_post.
const THREADS: u32 = 256;
/// Most blocks of a launch; the kernels loop (grid-stride) over the rest.
const MAX_BLOCKS: usize = 1 << 20;

fn err(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

fn check_shape(kernel: &str, n: usize, d: usize) -> Result<()> {
    if n == 0 || n > MAX_STREAMS || d == 0 {
        return Err(err(format!(
            "{kernel}: N = {n} (1..={MAX_STREAMS}), D = {d}"
        )));
    }
    to_i32(kernel, "N*D", n * d).map(|_| ())
}

/// The f32 parameters of one mHC site on the device (`reference::mhc::HcParams`):
/// `proj` [(2+N)*N, N*D] for a layer site or [N, N*D] for the head, `base` of the same
/// leading size, `scale` `[3]` (layer) or `[1]` (head).
#[derive(Clone, Copy, Debug)]
pub struct HcSiteDev {
    pub proj: DevicePtr,
    pub base: DevicePtr,
    pub scale: DevicePtr,
    /// Layer 0's attention site only: the derived f64 stream-folded projection
    /// [(2+N)*N, D] (`reference::mhc::fold_projection`), read instead of `proj`.
    pub fold: Option<DevicePtr>,
}

crate::launchers! {
    /// The derived-tensor builder of the family (the backend's, not a kernel set's).
    pub struct Hc0Fold {
        fold: hc0_fold_kernel,
    }
}

impl Hc0Fold {
    /// Writes `fold` [(2+N)*N, D] f64 from `proj` [(2+N)*N, N*D] f32 (hc_fold.rs
    /// fold_projection, bit for bit).
    pub fn launch(
        &self,
        proj: DevicePtr,
        n: usize,
        d: usize,
        fold: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "hc0_fold_kernel";
        check_shape(K, n, d)?;
        let mix = (2 + n) * n;
        need(K, "proj", proj, mix * n * d * 4)?;
        need(K, "fold", fold, mix * d * 8)?;
        let blocks = (mix * d).div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        self.fold.launch(
            blocks,
            THREADS,
            0,
            stream,
            hc0_fold_kernel::Args {
                proj,
                mix: to_i32(K, "mix", mix)?,
                n: to_i32(K, "N", n)?,
                d: to_i32(K, "D", d)?,
                fold,
            },
        )
    }
}

crate::launchers! {
    /// The mhc family's entry points, resolved from a loaded registry.
    pub struct Mhc {
        pre: hc_pre_kernel,
        post: hc_post_kernel,
        head: hc_head_kernel,
    }
}

impl Mhc {
    /// hc_pre over streams `x` [t, n, d] (`reference::mhc::hc_pre`): writes `u` [t, d] (bf16 if
    /// `round_u`, i.e. with the official `prec.bf16(&mut pre.u)` folded in), `post` [t, n] and
    /// `comb` [t, n, n] (f32). Sinkhorn runs `iters` rounds.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_pre(
        &self,
        ctx: &Context,
        x: DevicePtr,
        t: usize,
        n: usize,
        d: usize,
        site: HcSiteDev,
        iters: usize,
        hc_eps: f32,
        rms_eps: f32,
        round_u: bool,
        u: DevicePtr,
        post: DevicePtr,
        comb: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "hc_pre_kernel";
        check_shape(K, n, d)?;
        let mix = (2 + n) * n;
        need(K, "x", x, t * n * d * 4)?;
        need(K, "proj", site.proj, mix * n * d * 4)?;
        need(K, "base", site.base, mix * 4)?;
        need(K, "scale", site.scale, 3 * 4)?;
        if let Some(f) = site.fold {
            need(K, "fold", f, mix * d * 8)?;
        }
        need(K, "u", u, t * d * 4)?;
        need(K, "post", post, t * n * 4)?;
        need(K, "comb", comb, t * n * n * 4)?;
        if t == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = hc_pre_kernel::Args {
            x,
            t: to_i32(K, "T", t)?,
            n: n as i32,
            d: d as i32,
            proj: site.proj,
            base: site.base,
            scale: site.scale,
            fold: site.fold,
            iters: to_i32(K, "iters", iters)?,
            hc_eps,
            rms_eps,
            round_u,
            u,
            post,
            comb,
        };
        self.pre
            .launch(t.min(MAX_BLOCKS) as u32, THREADS, 0, stream, args)
    }

    /// hc_post in place over `x` [t, n, d] (`reference::mhc::hc_post`): `x'[k] = post_k * a +
    /// Σ_j C[j, k] x[j]` with `a` [t, d], `post` [t, n], `comb` [t, n, n] from hc_pre; bf16 if
    /// `round_out` (the official `prec.bf16(&mut x)` folded in).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post(
        &self,
        ctx: &Context,
        x: DevicePtr,
        a_in: DevicePtr,
        post: DevicePtr,
        comb: DevicePtr,
        t: usize,
        n: usize,
        d: usize,
        round_out: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "hc_post_kernel";
        check_shape(K, n, d)?;
        need(K, "x", x, t * n * d * 4)?;
        need(K, "a", a_in, t * d * 4)?;
        need(K, "post", post, t * n * 4)?;
        need(K, "comb", comb, t * n * n * 4)?;
        if t == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = hc_post_kernel::Args {
            x,
            a: a_in,
            post,
            comb,
            t: to_i32(K, "T", t)?,
            n: n as i32,
            d: d as i32,
            round_out,
        };
        let blocks = (t * d).div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        self.post.launch(blocks, THREADS, 0, stream, args)
    }

    /// hc_head over `x` [r, n, d] (`reference::mhc::hc_head`, no Sinkhorn): `y` [r, d], bf16 if
    /// `round_out`. `site.proj` `[n, n*d]`, `site.base` `[n]`, `site.scale` `[1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_head(
        &self,
        ctx: &Context,
        x: DevicePtr,
        r: usize,
        n: usize,
        d: usize,
        site: HcSiteDev,
        hc_eps: f32,
        rms_eps: f32,
        round_out: bool,
        y: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "hc_head_kernel";
        check_shape(K, n, d)?;
        need(K, "x", x, r * n * d * 4)?;
        need(K, "proj", site.proj, n * n * d * 4)?;
        need(K, "base", site.base, n * 4)?;
        need(K, "scale", site.scale, 4)?;
        need(K, "y", y, r * d * 4)?;
        if r == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let args = hc_head_kernel::Args {
            x,
            r: to_i32(K, "R", r)?,
            n: n as i32,
            d: d as i32,
            proj: site.proj,
            base: site.base,
            scale: site.scale,
            hc_eps,
            rms_eps,
            round_out,
            y,
        };
        self.head
            .launch(r.min(MAX_BLOCKS) as u32, THREADS, 0, stream, args)
    }
}
