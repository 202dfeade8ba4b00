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
    #[pdl(true)]
    fn hc_pre_kernel(
        x: *const f32, t: i32, n: i32, d: i32, proj: *const f32, base: *const f32,
        scale: *const f32, fold: Option<*const f64>, iters: i32, hc_eps: f32, rms_eps: f32,
        round_u: bool, u: *mut f32, post: *mut f32, comb: *mut f32,
    );
    #[pdl(true)]
    fn hc_post_kernel(
        x: *mut f32, a: *const f32, post: *const f32, comb: *const f32, t: i32, n: i32, d: i32,
        round_in: bool, round_out: bool,
    );
    #[pdl(true)]
    fn hc_head_kernel(
        x: *const f32, r: i32, n: i32, d: i32, proj: *const f32, base: *const f32,
        scale: *const f32, hc_eps: f32, rms_eps: f32, round_out: bool, y: *mut f32,
    );
    /// Derived (finalize / refit): layer 0's stream-folded projection from the device `proj`.
    fn hc0_fold_kernel(proj: *const f32, mix: i32, n: i32, d: i32, fold: *mut f64);
    /// Few tokens: each token's logit partial sums over the blocks of grid.x.
    #[pdl(true)]
    fn hc_mix_partial_kernel(
        x: *const f32, n: i32, d: i32, proj: *const f32, fold: Option<*const f64>, mix: i32,
        partials: *mut f64,
    );
    #[pdl(true)]
    fn hc_pre_finish_kernel(
        x: *const f32, n: i32, d: i32, cols: i32, base: *const f32, scale: *const f32, iters: i32,
        hc_eps: f32, rms_eps: f32, s: i32, partials: *const f64, round_u: bool, u: *mut f32,
        post: *mut f32, comb: *mut f32,
    );
    #[pdl(true)]
    fn hc_head_finish_kernel(
        x: *const f32, n: i32, d: i32, base: *const f32, scale: *const f32, hc_eps: f32,
        rms_eps: f32, s: i32, partials: *const f64, round_out: bool, y: *mut f32,
    );
}

/// Most residual streams (hc_mult) the kernels support (`HC_MAX_N` in mhc.cu).
pub const MAX_STREAMS: usize = 8;

/// Threads per block of hc_pre / hc_head (one block per token) and hc_post.
const THREADS: u32 = 256;
/// Most blocks of a launch; the kernels loop (grid-stride) over the rest.
const MAX_BLOCKS: usize = 1 << 20;

/// Most tokens (rows) hc_pre / hc_head split over several blocks each (kernels/mhc.cu "few
/// tokens"); above, one block per token has the GPU busy.
pub const SPLIT_MAX_T: usize = 64;
/// Blocks the logits' partial sums of a split launch aim at (over all its tokens), at most
/// [`MAX_SPLIT`] a token.
const SPLIT_TARGET: usize = 256;
const MAX_SPLIT: usize = 32;
/// Blocks a token's outputs (u / y, D columns) are split over: a quarter as many.
const FINISH_TARGET: usize = 64;

/// Partial-sum slots (f64) the split launches need for any mix up to `(2+MAX_STREAMS)*MAX_STREAMS`:
/// the workspace a caller hands hc_pre / hc_head.
pub const PARTIALS: usize = split_rows_max() * ((2 + MAX_STREAMS) * MAX_STREAMS + 1);

/// Grid of a finish launch: blocks a token's D outputs are split over, by tokens.
fn finish_grid(t: usize, d: usize) -> (u32, u32) {
    (FINISH_TARGET.div_ceil(t).min(d) as u32, t as u32)
}

/// Blocks each of `t` tokens' logits are split over.
fn split(t: usize) -> usize {
    SPLIT_TARGET.div_ceil(t.max(1)).clamp(1, MAX_SPLIT)
}

/// Most (token, block) pairs of a split launch.
const fn split_rows_max() -> usize {
    let mut t = 1;
    let mut most = 0;
    while t <= SPLIT_MAX_T {
        let mut s = SPLIT_TARGET.div_ceil(t);
        if s > MAX_SPLIT {
            s = MAX_SPLIT;
        }
        if t * s > most {
            most = t * s;
        }
        t += 1;
    }
    most
}

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
        partial: hc_mix_partial_kernel,
        pre_finish: hc_pre_finish_kernel,
        head_finish: hc_head_finish_kernel,
    }
}

impl Mhc {
    /// The split path's first launch (kernels/mhc.cu "few tokens"): each of `t` tokens' `mix`
    /// logit partial sums over [`split`] blocks into `partials`; returns the split.
    #[allow(clippy::too_many_arguments)]
    fn partial_sums(
        &self,
        kernel: &str,
        x: DevicePtr,
        t: usize,
        n: usize,
        d: usize,
        site: &HcSiteDev,
        mix: usize,
        partials: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<usize> {
        let sp = split(t);
        need(kernel, "partials", partials, t * sp * (mix + 1) * 8)?;
        self.partial.launch(
            (sp as u32, t as u32),
            THREADS,
            0,
            stream,
            hc_mix_partial_kernel::Args {
                x,
                n: n as i32,
                d: d as i32,
                proj: site.proj,
                fold: site.fold,
                mix: mix as i32,
                partials,
            },
        )?;
        Ok(sp)
    }

    /// hc_pre over streams `x` [t, n, d] (`reference::mhc::hc_pre`): writes `u` [t, d] (bf16 if
    /// `round_u`, i.e. with the official `prec.bf16(&mut pre.u)` folded in), `post` [t, n] and
    /// `comb` [t, n, n] (f32). Sinkhorn runs `iters` rounds. Up to [`SPLIT_MAX_T`] tokens the
    /// work is split over blocks through `partials` ([`PARTIALS`] f64: workspace).
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
        partials: DevicePtr,
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
        if t <= SPLIT_MAX_T {
            let sp = self.partial_sums(K, x, t, n, d, &site, mix, partials, stream)?;
            let cols = if site.fold.is_some() { d } else { n * d };
            return self.pre_finish.launch(
                finish_grid(t, d),
                THREADS,
                0,
                stream,
                hc_pre_finish_kernel::Args {
                    x,
                    n: n as i32,
                    d: d as i32,
                    cols: to_i32(K, "cols", cols)?,
                    base: site.base,
                    scale: site.scale,
                    iters: to_i32(K, "iters", iters)?,
                    hc_eps,
                    rms_eps,
                    s: sp as i32,
                    partials,
                    round_u,
                    u,
                    post,
                    comb,
                },
            );
        }
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
    /// `round_out` (the official `prec.bf16(&mut x)` folded in); `round_in`: `a` rounded to bf16
    /// as read (its writer left its official rounding to this reader).
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
        (round_in, round_out): (bool, bool),
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
            round_in,
            round_out,
        };
        let blocks = (t * d).div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        self.post.launch(blocks, THREADS, 0, stream, args)
    }

    /// hc_head over `x` [r, n, d] (`reference::mhc::hc_head`, no Sinkhorn): `y` [r, d], bf16 if
    /// `round_out`. `site.proj` `[n, n*d]`, `site.base` `[n]`, `site.scale` `[1]`. Up to
    /// [`SPLIT_MAX_T`] rows split over blocks through `partials`, as [`Self::hc_pre`].
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
        partials: DevicePtr,
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
        if r <= SPLIT_MAX_T {
            let sp = self.partial_sums(K, x, r, n, d, &site, n, partials, stream)?;
            return self.head_finish.launch(
                finish_grid(r, d),
                THREADS,
                0,
                stream,
                hc_head_finish_kernel::Args {
                    x,
                    n: n as i32,
                    d: d as i32,
                    base: site.base,
                    scale: site.scale,
                    hc_eps,
                    rms_eps,
                    s: sp as i32,
                    partials,
                    round_out,
                    y,
                },
            );
        }
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
