//! The fast MoE (kernels/fast_moe*.cu) against the reference kernels on the device, at Flash
//! shapes (hidden 4096, moe_inter 2048, 256 experts top-6, an FP8 shared expert, FP4 routed
//! experts with per-32 scales), on fresh random weights and inputs (seed printed;
//! `DSV4_TEST_SEED=<n>` repeats one), for B = 1 .. 16384 tokens, top-k and hash layers, uniform
//! and skewed routing (one expert taking 30% of the tokens) and experts with no tokens.
//!
//! What is compared, and the bound each is held to:
//! - x's FP8 quantisation: bit for bit (the same exact operation).
//! - Routing: the fast routers accumulate their logits in f32: the few-token kernel per lane over
//!   D/128 terms, then a 5-level butterfly and 4 parts (D/128 + 9 roundings); the tensor-core
//!   kernel exact BF16 products (x's BF16 values times the gate's three BF16 planes) summed by the
//!   tensor core per 64 of k, then the D/64 sums in order (280 + D/64: kernels/fast_moe.cu
//!   derives it without assuming the tensor core's guard bits). So |Δlogit| ≤ (that count)·2⁻²⁴·
//!   Σ_d |x_d·g_ed| (the reference's logit is the correctly rounded f32;
//!   RouterPath::logit_error_terms); sqrtsoftplus has slope ≤ 1/2 for these logits... so a
//!   selection may differ from the reference only where the two keys it swaps are closer than
//!   the sum of their bounds (checked on the host in f64). Weights of agreeing tokens: the same
//!   selected scores up to that error, so |Δw| ≤ 2⁻¹⁰·w (renormalised by a sum of six).
//! - The expert path, on the reference's routing (so only the arithmetic differs): FP8 wgmma
//!   products promoted to f32 every k32 (decode path, kernels/fast_moe_gemm.cu) or every k128
//!   (prefill path, kernels/fast_moe_wide.cu, FP4 scales folded into the codes exactly). The
//!   tensor core keeps fewer accumulator bits than f32: its error is ≤ 2⁻¹⁰ of the 32-term
//!   Σ|w·x| (asserted by gpu_wgmma_probe, measured ≈ 2⁻¹¹·⁵), four such sums chained in the
//!   tensor core on the prefill path (measured: 2-4x more h codes differ there, BENCHMARKS.md),
//!   so g and u carry ≤ 2⁻¹⁰·Σ_k |w_k·x_k| (2⁻⁸ on the prefill path), small against
//!   |g| except where the sum cancels. A bf16 rounding of g, v or h may then flip, and a flipped
//!   h moves its FP8 code by one e4m3 step (≤ 2⁻³ of the value); where silu(g)·u nearly cancels,
//!   the carried error can exceed a step of that small code. So: every h code agrees, or differs
//!   by at most one step plus 2⁻⁹ of its 128-block's largest |h| (2⁻⁷ on the prefill path, whose
//!   carried error is 4x: a sign flip of an h near 2⁻¹⁰ of its block's largest, where u nearly
//!   cancelled, exceeded 2⁻⁹ there once in a full gpu-check); at most 1/16 of the codes
//!   differ; per token the output's relative L2 error is ≤ 2⁻⁵, and on average over tokens
//!   ≤ 2⁻⁸. These last two are ceilings, not derived: the worst case 2⁻¹⁰·Σ|w·x| allows far
//!   more than random rows show (measured at every B: max ≈ 9e-3, mean ≈ 2e-3, most of it the
//!   accumulator's error), so they hold with a 2-4x margin and catch any layout or scale error.
//!   The mean is asserted over at least MEAN_MIN_TOKENS tokens only: the mean of a few tokens is
//!   a sample of the per-token error, whose tail reaches the per-token ceiling (a 384-wide layer
//!   at B = 1 measured 1.1e-2 once, one flipped h code of 1152 weighing more than in a 2048-wide
//!   one).
//! - The whole fast layer (its own routing): outputs of tokens whose selection agrees, same
//!   bound; and two runs are bit-identical (no order-dependent atomics). On the decode path the
//!   GEMMs also run in their other forms (two launches, one, and up to 16 tokens the router with
//!   them in one), which must give the same bits (routing, x's codes, h, output), and the routed
//!   launch's synchronisation words and the fused launch's start ticket must be zero again after
//!   the layer.
//! - Both GEMM paths and both routers: the Flash cases take the ones the layer picks by B; the
//!   small shape runs every case on both (the decode path with the few-token router, the prefill
//!   path with the tensor-core one), on a BF16 gate and, in one test, on f32 gate values, with the
//!   FP4 scales as UE8M0 bytes folded into the codes (whole rows; one row whose groups take the
//!   fold's smallest shifts; one row folded per 128-block), as bytes that cannot be folded (one
//!   128-block spanning 2^16), and as f32.
//!
//! Without a CUDA device every test prints `skipped: no CUDA device`.

mod common;

use common::gpu::{family_gpu, print_kernel_resources};
use common::rig::{Rig, RigOptions, Step};
use common::rng::{Rng, tokens};
use dsv4::cuda::arena::{self, Arena, ArenaPlan};
use dsv4::cuda::kernels::fast_moe::{self, FastMoe, FastMoeLayer, FastMoeWorkspace, RouterPath};
use dsv4::cuda::kernels::fast_moe_gemm::{self, GemmPath};
use dsv4::cuda::kernels::fast_moe_wide;
use dsv4::cuda::kernels::linear::{self, Linear, StorageFormat};
use dsv4::cuda::kernels::moe::{self, Moe, MoePlan};
use dsv4::cuda::kernels::norm_rope::{self, NormRope};
use dsv4::cuda::registry::{KernelCache, KernelSource, Registry};
use dsv4::cuda::synthetic_moe::{HOT_EXPERT, MoeShape, Routing, SyntheticMoe};
use dsv4::cuda::{BorrowedStream, Context, DevicePtr, OwnedStream};
use dsv4::weights::dtype::E4M3_LUT;
use std::sync::OnceLock;

/// A small layer whose widths are odd multiples of 128: FP4 stages of half the usual K (128 of
/// 256), down items with rows past D, many tokens per expert (16-token tiles, several items per
/// block) — the paths the tiny model fixtures take, checked here op by op.
const SMALL: MoeShape = MoeShape {
    d: 384,
    i: 384,
    experts: 16,
    k: 2,
    vocab: 1024,
    limit: 1.5,
};

/// MODEL.md's names for the layer's widths (hidden, moe_inter, experts, experts per token).
#[allow(non_snake_case)]
struct Dims {
    D: usize,
    I: usize,
    E: usize,
    K: usize,
}

fn dims(sh: &MoeShape) -> Dims {
    Dims {
        D: sh.d,
        I: sh.i,
        E: sh.experts,
        K: sh.k,
    }
}

struct Env {
    ctx: &'static Context,
    lin: Linear,
    moe: Moe,
    fast: FastMoe,
    /// The reference RMSNorm, which `fmoe_norm_x_kernel` must match bit for bit.
    nr: NormRope,
}

fn families() -> Vec<&'static KernelSource> {
    [
        &linear::SOURCE,
        &moe::SOURCE,
        &fast_moe::SOURCE,
        &fast_moe_gemm::SOURCE,
        &fast_moe_wide::SOURCE,
        &fast_moe_wide::NARROW_SOURCE,
    ]
    .into_iter()
    .chain(norm_rope::FAMILIES)
    .collect()
}

fn env_of(ctx: &'static Context, reg: &Registry) -> Env {
    print_kernel_resources(reg);
    Env {
        ctx,
        lin: Linear::new(reg).unwrap(),
        moe: Moe::new(reg).unwrap(),
        fast: FastMoe::new(reg).unwrap(),
        nr: NormRope::new(reg).unwrap(),
    }
}

fn env() -> Option<&'static Env> {
    static ENV: OnceLock<Env> = OnceLock::new();
    let g = family_gpu(&families())?;
    Some(ENV.get_or_init(|| env_of(&g.ctx, &g.reg)))
}

/// The same kernels compiled with the diagnostic variant FMOE_SHARED_EARLY=0 (kernels/fast_moe_gemm.cu:
/// the fused launch takes every item from its queue after the programmatic wait, as it did before
/// the default took the shared expert's up items before the plan is known).
fn queue_only_env() -> Option<&'static Env> {
    static ENV: OnceLock<(Registry, Env)> = OnceLock::new();
    variant_env(&ENV, "FMOE_SHARED_EARLY=0")
}

/// The same kernels compiled with the diagnostic variant FMOE_SPREAD_SHARED=0 (kernels/fast_moe_gemm.cu:
/// the fused launch hands out all the shared expert's items first, as it did before the default
/// spread them among the routed ones past the first round).
fn shared_first_env() -> Option<&'static Env> {
    static ENV: OnceLock<(Registry, Env)> = OnceLock::new();
    variant_env(&ENV, "FMOE_SPREAD_SHARED=0")
}

/// The same kernels compiled with the diagnostic variant FMOE_TC_ONE_BANK=1 (kernels/fast_moe.cu: the
/// tensor-core router's consumers wait on each stage's wgmmas, as before the banked loop).
fn one_bank_env() -> Option<&'static Env> {
    static ENV: OnceLock<(Registry, Env)> = OnceLock::new();
    variant_env(&ENV, "FMOE_TC_ONE_BANK=1")
}

/// The kernels compiled with `define`, once per `lock`. The registry owns the compiled modules, so
/// it lives as long as the kernels taken from it.
fn variant_env(lock: &'static OnceLock<(Registry, Env)>, define: &str) -> Option<&'static Env> {
    let g = family_gpu(&families())?;
    let (_, e) = lock.get_or_init(|| {
        let cache = KernelCache::disabled()
            .with_defines(&[define.to_string()])
            .unwrap();
        let reg = Registry::load_families(&g.ctx, &families(), &cache)
            .unwrap_or_else(|e| panic!("{define}: {e}"));
        let env = env_of(&g.ctx, &reg);
        (reg, env)
    });
    Some(e)
}

fn put<T: arena::Pod>(ctx: &Context, p: DevicePtr, v: &[T], s: BorrowedStream) {
    let _g = ctx.enter().unwrap();
    arena::copy_to_device_sync(p, v, s).unwrap();
}

fn get<T: arena::Pod + Default>(
    ctx: &Context,
    p: DevicePtr,
    n: usize,
    s: BorrowedStream,
) -> Vec<T> {
    let _g = ctx.enter().unwrap();
    s.synchronize().unwrap();
    let mut v = vec![T::default(); n];
    arena::copy_to_host_sync(&mut v, p, s).unwrap();
    v
}

/// One arena with a region per byte size.
fn alloc(ctx: &Context, bytes: &[usize]) -> (Arena, Vec<DevicePtr>) {
    let mut plan = ArenaPlan::new();
    let ids: Vec<_> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| plan.reserve(format!("b{i}"), b.max(4), 256).unwrap())
        .collect();
    let a = Arena::from_plan(ctx, &plan).unwrap();
    let p = ids.iter().map(|&i| a.region(i)).collect();
    (a, p)
}

fn bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

// ------------------------------------------------------------------------------ one case

/// The reference kernels' results for one batch.
struct RefOut {
    ids: Vec<i32>,
    weights: Vec<f32>,
    /// act_quant(x) `[T, D]`, act_quant(h) of the routed rows `[T*k, I]` and of the shared
    /// expert's h `[T, I]`.
    xq: Vec<f32>,
    hq: Vec<f32>,
    hq_shared: Vec<f32>,
    out: Vec<f32>,
}

/// The fast kernels' results for one batch.
struct FastOut {
    ids: Vec<i32>,
    weights: Vec<f32>,
    /// Dequantized x `[T, D]` and h `[T*k + T, I]`.
    xq: Vec<f32>,
    hq: Vec<f32>,
    out: Vec<f32>,
}

/// One batch's device buffers: inputs, the fast workspace, the reference's buffers.
struct Batch {
    _arena: Arena,
    t: usize,
    x: DevicePtr,
    tokens: DevicePtr,
    ws: FastMoeWorkspace,
    out: DevicePtr,
    /// Reference buffers: ids, weights, plan (4), xq, h, hq, ya, g, v, hs, hsq, ys.
    r: Vec<DevicePtr>,
}

fn batch(e: &Env, sh: &MoeShape, t: usize, x: &[f32], tokens: &[i32], s: BorrowedStream) -> Batch {
    let Dims { D, I, E, K } = dims(sh);
    let fb = fast_moe::workspace_buffers(t, D, I, K, E);
    let rp = MoePlan::buffer_bytes(t, K, E, moe::TILE_ROWS);
    let n = t * K;
    let mut sizes = vec![t * D * 4, t * 4, t * D * 4];
    sizes.extend(fb.iter().map(|(_, el, c)| el.size() * c));
    sizes.extend([n * 4, n * 4, rp[0], rp[1], rp[2], rp[3]]);
    sizes.extend([n.max(t) * D * 4, n * I * 4, n * I * 4, n * D * 4]);
    sizes.extend([t * I * 4, t * I * 4, t * I * 4, t * I * 4, t * D * 4]);
    let (arena, p) = alloc(e.ctx, &sizes);
    put(e.ctx, p[0], x, s);
    put(e.ctx, p[1], tokens, s);
    let ws = FastMoeWorkspace::at(&p[3..3 + fb.len()], t, K, E);
    let _g = e.ctx.enter().unwrap();
    for q in &p[2..] {
        arena::memset_async(*q, 0xff, s).unwrap(); // NaN poison
    }
    // But the routed decode launch's synchronisation words start zero, as the engine's arena
    // gives them (each launch's combine zeroes them for the next).
    arena::memset_async(ws.route_sync, 0, s).unwrap();
    // So does the fused launch's start ticket, its first synchronisation word (each launch leaves
    // it zero; the fused path's plan zeroes the others before each launch). Then the prefill
    // path's tensor maps over x and h.
    arena::memset_async(ws.sync.slice(0, 4).unwrap(), 0, s).unwrap();
    ws.write_act_maps(e.ctx, D, I, s).unwrap();
    Batch {
        t,
        x: p[0],
        tokens: p[1],
        out: p[2],
        ws,
        r: p[3 + fb.len()..].to_vec(),
        _arena: arena,
    }
}

fn reference(e: &Env, l: &SyntheticMoe, b: &Batch, r: Routing, s: BorrowedStream) -> RefOut {
    let Dims { D, I, E, K } = dims(&l.shape);
    let (t, n) = (b.t, b.t * K);
    let q = &b.r;
    let (ids, weights) = (q[0], q[1]);
    let plan = MoePlan {
        offsets: q[2],
        rows: q[3],
        tiles: q[4],
        ntiles: q[5],
        tokens: t,
        k: K,
        experts: E,
        tile_rows: moe::TILE_ROWS,
    };
    let (xq, h, hq, ya) = (q[6], q[7], q[8], q[9]);
    let (g, v, hs, hsq, ys) = (q[10], q[11], q[12], q[13], q[14]);
    let (ctx, lin, m) = (e.ctx, &e.lin, &e.moe);
    let x = b.x;
    m.router(
        ctx,
        x,
        t,
        D,
        l.gate,
        l.selection(r, b.tokens),
        &l.router(),
        ids,
        weights,
        s,
    )
    .unwrap();
    m.plan(ctx, ids, &plan, s).unwrap();
    let [w1, w2, w3] = &l.routed;
    lin.act_quant(ctx, x, D, t, D, xq, s).unwrap();
    m.up(ctx, &plan, xq, w1, w3, weights, l.shape.limit, true, h, s)
        .unwrap();
    lin.act_quant(ctx, h, I, n, I, hq, s).unwrap();
    m.down(ctx, &plan, hq, w2, true, ya, s).unwrap();
    let [s1, s2, s3] = &l.shared;
    lin.linear(ctx, xq, D, t, s1, I, true, g, I, s).unwrap();
    lin.linear(ctx, xq, D, t, s3, I, true, v, I, s).unwrap();
    m.swiglu(ctx, g, v, t * I, l.shape.limit, true, hs, s)
        .unwrap();
    lin.act_quant(ctx, hs, I, t, I, hsq, s).unwrap();
    lin.linear(ctx, hsq, I, t, s2, D, true, ys, D, s).unwrap();
    m.combine(ctx, ya, Some(ys), t, K, D, true, b.out, s)
        .unwrap();
    RefOut {
        ids: get(ctx, ids, n, s),
        weights: get(ctx, weights, n, s),
        xq: get(ctx, xq, t * D, s),
        hq: get(ctx, hq, n * I, s),
        hq_shared: get(ctx, hsq, t * I, s),
        out: get(ctx, b.out, t * D, s),
    }
}

/// The reference down GEMMs and combine run on given h values (routed rows `[T*k, I]` on the
/// reference's plan, which `reference` built, then the shared rows `[T, I]`): separates the fast
/// down GEMM's own error (fast out vs this) from what differing h codes cause (this vs the
/// reference's out).
fn reference_down_on(
    e: &Env,
    l: &SyntheticMoe,
    b: &Batch,
    h_routed: &[f32],
    h_shared: &[f32],
    s: BorrowedStream,
) -> Vec<f32> {
    let Dims { D, I, E, K } = dims(&l.shape);
    let t = b.t;
    let q = &b.r;
    let plan = MoePlan {
        offsets: q[2],
        rows: q[3],
        tiles: q[4],
        ntiles: q[5],
        tokens: t,
        k: K,
        experts: E,
        tile_rows: moe::TILE_ROWS,
    };
    let (hq, ya, hsq, ys) = (q[8], q[9], q[13], q[14]);
    let (ctx, lin, m) = (e.ctx, &e.lin, &e.moe);
    put(ctx, hq, h_routed, s);
    put(ctx, hsq, h_shared, s);
    let [_, w2, _] = &l.routed;
    m.down(ctx, &plan, hq, w2, true, ya, s).unwrap();
    let [_, s2, _] = &l.shared;
    lin.linear(ctx, hsq, I, t, s2, D, true, ys, D, s).unwrap();
    m.combine(ctx, ya, Some(ys), t, K, D, true, b.out, s)
        .unwrap();
    get(ctx, b.out, t * D, s)
}

/// Fewest tokens whose mean output error is held to the 2^-8 ceiling (see the file comment).
const MEAN_MIN_TOKENS: usize = 32;

/// Per-token relative L2 distance of `a` from `b` (rows of `d`): (max, mean).
fn rel_l2(a: &[f32], b: &[f32], d: usize) -> (f64, f64) {
    let (mut worst, mut sum, mut n) = (0f64, 0f64, 0usize);
    for (ra, rb) in a.chunks(d).zip(b.chunks(d)) {
        let d2: f64 = ra
            .iter()
            .zip(rb)
            .map(|(p, q)| ((p - q) as f64).powi(2))
            .sum();
        let r2: f64 = rb.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = d2.sqrt() / (r2.sqrt() + 1e-30);
        worst = worst.max(rel);
        sum += rel;
        n += 1;
    }
    (worst, sum / n.max(1) as f64)
}

/// The fast kernels' activations (e4m3 codes, kernels/fp8_mma.cuh) times their per-128 scales, in
/// natural order: position 4t + i + 16h of each 32-block holds k 8t + 4h + i in the halves order
/// (`halves`, the prefill path's), k 8t + 2i + h in the fragment order (the decode path's).
/// The prefill path's h (codes at plan rows, scales tile by tile: fast_moe_wide::act_scale_index)
/// in the decode path's layout, rows per (token, slot) then the shared expert's, through the plan
/// the run left in `b.ws`. Rows no tile wrote stay NaN-coded (0xff codes, NaN scales).
fn wide_h_by_token(
    ctx: &Context,
    b: &Batch,
    hq: &[u8],
    hs: &[f32],
    i: usize,
    k: usize,
    s: BorrowedStream,
) -> (Vec<u8>, Vec<f32>) {
    let t = b.t;
    let (rows, blocks, tile_n) = (t * k + t, i / 128, fast_moe_wide::tile_tokens(t));
    let nt = get::<i32>(ctx, b.ws.plan.ntiles, 1, s)[0] as usize;
    let tiles: Vec<i32> = get(ctx, b.ws.plan.tiles, 3 * nt, s);
    let plan_rows: Vec<i32> = get(ctx, b.ws.plan.rows, t * k, s);
    let (mut q, mut sc) = (vec![0xffu8; rows * i], vec![f32::NAN; rows * blocks]);
    let mut put_row = |tile: usize, c: usize, from: usize, to: usize| {
        q[to * i..(to + 1) * i].copy_from_slice(&hq[from * i..(from + 1) * i]);
        for blk in 0..blocks {
            sc[to * blocks + blk] =
                hs[fast_moe_wide::act_scale_index(tile, blk, blocks, c, tile_n)];
        }
    };
    for tile in 0..nt {
        let (start, n) = (tiles[3 * tile + 1] as usize, tiles[3 * tile + 2] as usize);
        for c in 0..n {
            put_row(tile, c, start + c, plan_rows[start + c] as usize);
        }
    }
    for st in 0..t.div_ceil(tile_n) {
        for c in 0..tile_n.min(t - st * tile_n) {
            let row = t * k + st * tile_n + c;
            put_row(nt + st, c, row, row);
        }
    }
    (q, sc)
}

fn dequant(codes: &[u8], scales: &[f32], rows: usize, cols: usize, halves: bool) -> Vec<f32> {
    let mut v = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let (block, pos) = (c / 32 * 32, c % 32);
            let (t, i, h) = (pos % 16 / 4, pos % 4, pos / 16);
            let k = block + 8 * t + if halves { 4 * h + i } else { 2 * i + h };
            v[r * cols + k] =
                E4M3_LUT[codes[r * cols + c] as usize] * scales[r * (cols / 128) + k / 128];
        }
    }
    v
}

/// The fast layer; with `routing`, the selection step's ids and weights are replaced by these
/// before the experts run.
#[allow(clippy::too_many_arguments)]
fn fast(
    e: &Env,
    l: &SyntheticMoe,
    b: &Batch,
    r: Routing,
    routing: Option<(&[i32], &[f32])>,
    path: GemmPath,
    router: RouterPath,
    s: BorrowedStream,
) -> FastOut {
    let Dims { D, I, K, .. } = dims(&l.shape);
    let (ctx, t) = (e.ctx, b.t);
    let fl = l.fast_layer(r, b.tokens);
    {
        // Every run writes every output: NaN poison first, so a work item that skipped its
        // epilogue shows (the second of two runs would otherwise find the first's values), and
        // so do x's codes or scales that the router or the selection left unwritten.
        let _g = ctx.enter().unwrap();
        for p in [b.ws.xq, b.ws.xs, b.ws.hq, b.ws.hs, b.ws.y, b.out] {
            arena::memset_async(p, 0xff, s).unwrap();
        }
    }
    if path == GemmPath::DecodeRouted {
        // The router runs inside the one launch: no routing can be put in between.
        assert!(
            routing.is_none(),
            "the routed decode path makes its own routing"
        );
        e.fast
            .route_and_experts(ctx, &fl, b.x, t, &b.ws, router, path, false, s)
            .unwrap();
    } else {
        e.fast
            .route_on(ctx, &fl, b.x, t, &b.ws, router, path, false, s)
            .unwrap();
        if let Some((ids, w)) = routing {
            put(ctx, b.ws.ids, ids, s);
            put(ctx, b.ws.weights, w, s);
        }
        e.fast.experts_on(ctx, &fl, t, &b.ws, path, s).unwrap();
    }
    e.fast
        .combine_on(ctx, &fl, t, &b.ws, path, b.out, s)
        .unwrap();
    let rows = t * K + t;
    let xq: Vec<u8> = get(ctx, b.ws.xq, t * D, s);
    let xs: Vec<f32> = get(ctx, b.ws.xs, t * D / 128, s);
    let (hq, hs) = if path == GemmPath::Prefill {
        let scales = fast_moe_wide::act_scale_floats(t, K, dims(&l.shape).E, I);
        let (hq, hs) = (get(ctx, b.ws.hq, rows * I, s), get(ctx, b.ws.hs, scales, s));
        wide_h_by_token(ctx, b, &hq, &hs, I, K, s)
    } else {
        (
            get(ctx, b.ws.hq, rows * I, s),
            get(ctx, b.ws.hs, rows * I / 128, s),
        )
    };
    FastOut {
        ids: get(ctx, b.ws.ids, t * K, s),
        weights: get(ctx, b.ws.weights, t * K, s),
        xq: dequant(&xq, &xs, t, D, path.halves_order()),
        hq: dequant(&hq, &hs, rows, I, path.halves_order()),
        out: get(ctx, b.out, t * D, s),
    }
}

// ------------------------------------------------------------------------------ checks

/// Two runs' f32 outputs (as bits) are the same bit for bit, and the first left none unwritten
/// (the buffers are NaN-poisoned before each run): `what` names an output, `a` and `b` each run.
fn assert_same_f32_bits(case: &str, what: &str, a: (&str, &[u32]), b: (&str, &[u32])) {
    assert!(
        a.1.iter().all(|&v| f32::from_bits(v).is_finite()),
        "{case}: a {what} left unwritten"
    );
    let diff = a.1.iter().zip(b.1).position(|(x, y)| x != y);
    assert!(
        diff.is_none(),
        "{case}: {what} {diff:?} differs, {} {:?} / {} {:?}",
        a.0,
        diff.map(|i| f32::from_bits(a.1[i])),
        b.0,
        diff.map(|i| f32::from_bits(b.1[i])),
    );
}

fn sorted(v: &[i32]) -> Vec<i32> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Host f64 key (score + bias) of expert `ex` for token row `xr`, and the bound of `router`'s
/// f32 error on it (module doc).
fn key_and_bound(l: &SyntheticMoe, xr: &[f32], ex: usize, router: RouterPath) -> (f64, f64) {
    let Dims { D, .. } = dims(&l.shape);
    let g = &l.gate_host[ex * D..(ex + 1) * D];
    let (mut dot, mut abs) = (0f64, 0f64);
    for (a, b) in xr.iter().zip(g) {
        dot += *a as f64 * *b as f64;
        abs += (*a as f64 * *b as f64).abs();
    }
    let sp = if dot > 20.0 { dot } else { dot.exp().ln_1p() };
    let key = sp.sqrt() + l.bias_host[ex] as f64;
    // The logit's f32 error, through a slope below 1/2, plus a few f32 ulps of the score
    // functions and the bias add on either side.
    let terms = router.logit_error_terms(D) as f64;
    let bound = terms * 2f64.powi(-24) * abs + 2f64.powi(-20) * (key.abs() + 1.0);
    (key, bound)
}

/// Routing: selections agree except within the rounding margin (top-k) or exactly (hash);
/// weights of agreeing tokens within 2^-10 relative. Returns the agreeing tokens.
fn check_routing(
    what: &str,
    l: &SyntheticMoe,
    x: &[f32],
    r: Routing,
    router: RouterPath,
    f: &FastOut,
    rf: &RefOut,
) -> Vec<bool> {
    let Dims { D, K, .. } = dims(&l.shape);
    let t = x.len() / D;
    let mut agree = vec![false; t];
    let mut within_margin = 0;
    for tok in 0..t {
        let (a, b) = (
            &f.ids[tok * K..(tok + 1) * K],
            &rf.ids[tok * K..(tok + 1) * K],
        );
        if sorted(a) == sorted(b) {
            // The same experts: each one's weight agrees wherever it sits.
            for (j, &ex) in a.iter().enumerate() {
                let rj = b.iter().position(|&e| e == ex).unwrap();
                let (fw, rw) = (f.weights[tok * K + j], rf.weights[tok * K + rj]);
                assert!(
                    (fw - rw).abs() <= rw.abs() * 2f32.powi(-10),
                    "{what}: token {tok}: expert {ex} weight {fw} (slot {j}) vs reference {rw} (slot {rj})"
                );
            }
            if a == b {
                agree[tok] = true;
                continue;
            }
        }
        assert_eq!(
            r,
            Routing::TopK,
            "{what}: token {tok}: hash rows differ: {a:?} vs {b:?}"
        );
        let xr = &x[tok * D..(tok + 1) * D];
        // The experts in different slots (a near tie in the order, or a different choice) must
        // be within the rounding margin of the one the reference put there. Such a token's h rows
        // are slot by slot another expert's, so check_experts skips it.
        let (only_fast, only_ref): (Vec<i32>, Vec<i32>) = if sorted(a) == sorted(b) {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x != y)
                .map(|(x, y)| (*x, *y))
                .unzip()
        } else {
            (
                a.iter().filter(|e| !b.contains(e)).copied().collect(),
                b.iter().filter(|e| !a.contains(e)).copied().collect(),
            )
        };
        for (&fe, &re) in only_fast.iter().zip(&only_ref) {
            let (kf, bf) = key_and_bound(l, xr, fe as usize, router);
            let (kr, br) = key_and_bound(l, xr, re as usize, router);
            assert!(
                (kr - kf).abs() <= bf + br,
                "{what}: token {tok}: fast picked {fe} (key {kf:.9}), reference {re} (key {kr:.9}): \
                 margin {:.3e} above the rounding bound {:.3e}",
                (kr - kf).abs(),
                bf + br
            );
        }
        within_margin += 1;
    }
    println!("{what}: {within_margin} of {t} tokens select differently within the rounding margin");
    agree
}

/// The expert path: h codes and outputs of the tokens in `rows` (module doc's bounds).
fn check_experts(
    what: &str,
    sh: &MoeShape,
    path: GemmPath,
    f: &FastOut,
    rf: &RefOut,
    agree: &[bool],
) {
    let Dims { D, I, K, .. } = dims(sh);
    // The absolute part of an h code's allowance: the accumulator's error carried by g and u
    // (module doc), 4x on the prefill path.
    let carried = if path == GemmPath::Prefill {
        2f32.powi(-7)
    } else {
        2f32.powi(-9)
    };
    let t = agree.len();
    // h: routed rows a = t*k + j, then the shared expert's rows (counted apart: [routed, shared]).
    let (mut differ, mut total) = ([0usize; 2], [0usize; 2]);
    let mut check_h = |fast: &[f32], refv: &[f32], row: &str, x: usize| {
        for (blk, (fb, rb)) in fast.chunks(128).zip(refv.chunks(128)).enumerate() {
            // One e4m3 step: 2^-3 of the value in the normal range; below it the subnormal
            // step s·2^-9 of the block scale s = ue8m0(amax / 448) < amax·2^-7.8. Plus the
            // wgmma accumulator's error carried by g and u (module doc): where silu(g)·u is
            // small against its block, that can exceed a step of its own code, so an absolute
            // `carried` of the block's largest |h| is allowed too.
            let amax = rb.iter().chain(fb).fold(0f32, |m, v| m.max(v.abs()));
            for (c, (&a, &b)) in fb.iter().zip(rb).enumerate() {
                total[x] += 1;
                if a.to_bits() == b.to_bits() {
                    continue;
                }
                differ[x] += 1;
                let m = a.abs().max(b.abs());
                assert!(
                    (a - b).abs() <= m * 0.125 + amax * carried,
                    "{what}: h {row} column {}: {a} vs reference {b}: more than one e4m3 step",
                    blk * 128 + c
                );
            }
        }
    };
    for (tok, _) in agree.iter().enumerate().filter(|(_, a)| **a) {
        for j in 0..K {
            let a = tok * K + j;
            check_h(
                &f.hq[a * I..(a + 1) * I],
                &rf.hq[a * I..(a + 1) * I],
                &format!("row {a}"),
                0,
            );
        }
        let sr = t * K + tok;
        check_h(
            &f.hq[sr * I..(sr + 1) * I],
            &rf.hq_shared[tok * I..(tok + 1) * I],
            &format!("shared row {tok}"),
            1,
        );
    }
    let pct = |x: usize| 100.0 * differ[x] as f64 / total[x].max(1) as f64;
    let (differ_all, total_all) = (differ[0] + differ[1], total[0] + total[1]);
    let frac = differ_all as f64 / total_all.max(1) as f64;
    println!(
        "{what}: {differ_all} of {total_all} h codes differ ({:.4}%; routed experts {:.4}%, shared expert {:.4}%)",
        frac * 100.0,
        pct(0),
        pct(1)
    );
    assert!(
        frac <= 1.0 / 16.0,
        "{what}: {frac} of the h codes differ (bound 1/16)"
    );

    let (mut worst, mut sum, mut n) = (0f64, 0f64, 0usize);
    for (tok, _) in agree.iter().enumerate().filter(|(_, a)| **a) {
        let (a, b) = (
            &f.out[tok * D..(tok + 1) * D],
            &rf.out[tok * D..(tok + 1) * D],
        );
        assert!(
            a.iter().all(|v| v.is_finite()),
            "{what}: token {tok} has non-finite outputs"
        );
        let d2: f64 = a.iter().zip(b).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let r2: f64 = b.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = d2.sqrt() / (r2.sqrt() + 1e-30);
        assert!(
            rel <= 2f64.powi(-5),
            "{what}: token {tok}: relative L2 error {rel:.3e} above 2^-5"
        );
        worst = worst.max(rel);
        sum += rel;
        n += 1;
    }
    let mean = sum / n.max(1) as f64;
    println!("{what}: output relative L2 error over {n} tokens: max {worst:.3e}, mean {mean:.3e}");
    assert!(
        n < MEAN_MIN_TOKENS || mean <= 2f64.powi(-8),
        "{what}: mean relative error {mean:.3e} above 2^-8"
    );
}

fn inputs(rng: &mut Rng, sh: &MoeShape, t: usize) -> (Vec<f32>, Vec<i32>) {
    let x: Vec<f32> = (0..t * sh.d)
        .map(|_| bf16(rng.uniform(-2.0, 2.0)))
        .collect();
    let tokens: Vec<i32> = (0..t)
        .map(|_| (rng.u64() % sh.vocab as u64) as i32)
        .collect();
    (x, tokens)
}

/// How the layer's FP4 scales reach the GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scales {
    /// Every scale is a power of two (as UE8M0 checkpoints give) and the four of each 128-block
    /// are within 2^11 of each other: the UE8M0 byte table, folded into the codes on the prefill
    /// path.
    Bytes,
    /// The four scales of expert 0's w1, row 0, k 0..127 are 2^-7 times what they were: the row
    /// still spans at most 2^11 (the synthetic scales span 2^4), so it folds whole, and those
    /// groups take the fold's smallest shifts (1..5; the synthetic layer alone gives 8..12).
    DeepFold,
    /// The four scales of expert 0's w1, row 0, k 0..127 are 2^-17 times what they were: each
    /// 128-block still folds, but that row's exponents span more than 2^11, so its row block
    /// folds per 128-block (the others fold whole rows).
    RowUnfoldable,
    /// One scale of expert 0's w1 is 2^-16 times what it was: still bytes, but its 128-block
    /// cannot be folded, so the prefill path promotes every k32.
    Unfoldable,
    /// One scale of expert 0's w1 is not a power of two: the derive step must notice, and the
    /// GEMMs read every scale as f32 through the tensor maps.
    F32,
}

impl Scales {
    /// The scale table's header flags the derive step must set: (exact, foldable).
    fn flags(self) -> [i32; 2] {
        match self {
            Scales::Bytes | Scales::DeepFold | Scales::RowUnfoldable => [1, 1],
            Scales::Unfoldable => [1, 0],
            Scales::F32 => [0, 1],
        }
    }
}

/// Which GEMM paths a case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Paths {
    /// The one the layer picks for B ([`GemmPath::for_tokens`]).
    Auto,
    /// The decode GEMMs with the few-token router, then the prefill GEMMs with the tensor-core
    /// router.
    Both,
    /// The path the layer picks, with this router.
    Router(RouterPath),
}

/// The router's gate values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// BF16 values, as a released checkpoint stores them: the tensor-core router's lo planes are
    /// zero and their wgmmas skipped.
    Bf16,
    /// f32 values that BF16 cannot hold (a refit from f32, a float fixture): the tensor-core router
    /// multiplies all three of its BF16 planes.
    F32,
}

/// Runs `cases` (B, routing) on one layer of shape `sh`: both routings' checks (module doc), on
/// each path of `paths`.
fn run_cases(sh: MoeShape, scales: Scales, gate: Gate, paths: Paths, cases: &[(usize, Routing)]) {
    if let Some(e) = env() {
        run_cases_on(e, sh, scales, gate, paths, cases);
    }
}

/// Makes `l`'s gate hold f32 values BF16 cannot (a refit from f32, a float fixture). The derived
/// tensors of the BF16 gate are built first, as a finalize builds them, so the caller's
/// `derive_fast` must then replace every gate plane and stage flag, as after a refit of the gate.
fn gate_to_f32_values(e: &Env, l: &mut SyntheticMoe, rng: &mut Rng, s: BorrowedStream) {
    l.derive_fast(e.ctx, &e.fast, s).unwrap();
    // Each value times (1 + u·2^-9), u in [-1, 1): the low bits BF16 drops, at every magnitude.
    for g in &mut l.gate_host {
        *g *= 1.0 + rng.uniform(-1.0, 1.0) * 2f32.powi(-9);
    }
    let inexact = l.gate_host.iter().filter(|g| bf16(**g) != **g).count();
    assert!(
        inexact * 2 > l.gate_host.len(),
        "the f32 gate holds {inexact} values BF16 cannot"
    );
    put(e.ctx, l.gate, &l.gate_host, s);
}

/// [`run_cases`] on the kernels of `e`.
fn run_cases_on(
    e: &'static Env,
    sh: MoeShape,
    scales: Scales,
    gate: Gate,
    paths: Paths,
    cases: &[(usize, Routing)],
) {
    let mut rng = Rng::from_env("gpu_fast_moe");
    let stream = OwnedStream::new(e.ctx).unwrap();
    let s = stream.borrow();
    let mut l = SyntheticMoe::new(e.ctx, s, sh, rng.u64()).unwrap();
    if gate == Gate::F32 {
        gate_to_f32_values(e, &mut l, &mut rng, s);
    }
    if scales != Scales::Bytes {
        // Expert 0's w1 scales of row 0: k 0..31 times 0.75 (not a UE8M0 value) or 2^-16 (a
        // 128-block spanning 2^16), or k 0..127 times 2^-7 (a row spanning 2^7 to 2^11, as the
        // synthetic scales span 2^4) or 2^-17 (a row spanning at least 2^13):
        // still valid f32 scales for the reference kernels.
        let table = l.routed[0].scales.unwrap();
        let addr = get::<u64>(e.ctx, table, 1, s)[0];
        let (factor, n) = match scales {
            Scales::F32 => (0.75, 1),
            Scales::Unfoldable => (2f32.powi(-16), 1),
            Scales::DeepFold => (2f32.powi(-7), 4),
            _ => (2f32.powi(-17), 4),
        };
        // SAFETY: the address is expert 0's scale array inside the layer's arena, alive with `l`.
        let first = unsafe { DevicePtr::from_raw(addr, 4 * n) };
        let v: Vec<f32> = get::<f32>(e.ctx, first, n, s)
            .iter()
            .map(|v| v * factor)
            .collect();
        put(e.ctx, first, &v, s);
    }
    l.derive_fast(e.ctx, &e.fast, s).unwrap();
    let flags = get::<i32>(e.ctx, l.scales8.slice(0, 8).unwrap(), 2, s);
    assert_eq!(
        flags,
        scales.flags(),
        "UE8M0 scale table's flags (exact, foldable) for {scales:?}"
    );
    if flags[0] == 1 {
        // The whole-row fold flags of expert 0's w1: row block 0 folds unless its row 0 was
        // scaled apart; row block 1 always does (the synthetic scales span 2^4).
        let flag = |rb| {
            let at = fast_moe_gemm::scales8_row_flag_offset(sh.d, sh.i, 0, 0, rb);
            get::<u8>(e.ctx, l.scales8.slice(at, 1).unwrap(), 1, s)[0]
        };
        let first_folds = u8::from(matches!(scales, Scales::Bytes | Scales::DeepFold));
        assert_eq!(
            [flag(0), flag(1)],
            [first_folds, 1],
            "whole-row fold flags for {scales:?}"
        );
    }
    for &(t, r) in cases {
        let (x, tokens) = inputs(&mut rng, &sh, t);
        let b = batch(e, &sh, t, &x, &tokens, s);
        let rf = reference(e, &l, &b, r, s);
        let on: &[(GemmPath, RouterPath)] = match paths {
            Paths::Auto => &[(GemmPath::for_tokens(t), RouterPath::for_tokens(t, sh.d))],
            Paths::Router(router) => &[(GemmPath::for_tokens(t), router)],
            Paths::Both => &[
                (GemmPath::Decode, RouterPath::Few),
                (GemmPath::Prefill, RouterPath::Tensor),
            ],
        };
        for &(path, router) in on {
            let what = format!(
                "{}x{} B = {t}, {r:?}, {path:?} path, {router:?} router",
                sh.d, sh.i
            );
            check_case(e, &l, &b, &x, r, (path, router), &rf, &what, s);
        }
    }
}

/// One case on one path (module doc).
#[allow(clippy::too_many_arguments)]
fn check_case(
    e: &Env,
    l: &SyntheticMoe,
    b: &Batch,
    x: &[f32],
    r: Routing,
    (path, router): (GemmPath, RouterPath),
    rf: &RefOut,
    what: &str,
    s: BorrowedStream,
) {
    let (sh, t) = (l.shape, b.t);
    // 1. The fast layer on its own routing, twice: bit-identical. The prefill GEMMs take their
    // items from queues in `sync` that the gather kernel zeroes before them: poisoned between the
    // runs (past every item, as a launch leaves them), they must change nothing.
    let f1 = fast(e, l, b, r, None, path, router, s);
    if path == GemmPath::Prefill {
        let word = fast_moe_gemm::PREFILL_QUEUE_WORD;
        put(
            e.ctx,
            b.ws.sync.slice(word * 4, 8).unwrap(),
            &[0x5a5a_5a5au32; 2],
            s,
        );
    }
    let f2 = fast(e, l, b, r, None, path, router, s);
    let decode = [
        GemmPath::Decode,
        GemmPath::DecodeFused,
        GemmPath::DecodeRouted,
    ];
    if decode.contains(&path) {
        // Every decode form makes the same bits: the GEMMs in two launches or one, and the router
        // with them in one (up to ROUTED_MAX_TOKENS). The fused launch needs its synchronisation
        // words zero, which the plan before it makes them: poisoned first (as a launch leaves
        // them, and more), they must change nothing. The routed launch's words must be zero
        // again after the layer (its combine zeroes them for the next launch).
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let ints = |a: &[i32], b: &[i32]| a == b;
        for other_path in decode {
            // (The fused form runs again after its words are poisoned, even where it made f1.)
            if (other_path == path && path != GemmPath::DecodeFused)
                || (other_path == GemmPath::DecodeRouted
                    && (t > fast_moe_gemm::ROUTED_MAX_TOKENS || router != RouterPath::Few))
            {
                continue;
            }
            if other_path == GemmPath::DecodeFused {
                // The words the plan zeroes (all but the start ticket, which must stay zero).
                let words = fast_moe_gemm::plan_cleared_sync_words(t, sh.k, sh.experts);
                let cleared = b.ws.sync.slice(4, words * 4).unwrap();
                put(e.ctx, cleared, &vec![0x5a5a_5a5au32; words], s);
            }
            let other = fast(e, l, b, r, None, other_path, router, s);
            let first_diff = |a: &[f32], b: &[f32]| {
                let n = a
                    .iter()
                    .zip(b)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
                let at = a
                    .iter()
                    .zip(b)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                (n, at.map(|i| (i, a[i], b[i])))
            };
            assert!(
                ints(&f1.ids, &other.ids)
                    && same(&f1.weights, &other.weights)
                    && same(&f1.xq, &other.xq),
                "{what}: the {other_path:?} path's routing or x codes differ: ids {:?} / {:?}, weights {:?}, x codes {:?}",
                f1.ids,
                other.ids,
                first_diff(&f1.weights, &other.weights),
                first_diff(&f1.xq, &other.xq),
            );
            assert!(
                same(&f1.out, &other.out) && same(&f1.hq, &other.hq),
                "{what}: the {other_path:?} path's h or output differs: h {:?} (of {}), output {:?} (of {})",
                first_diff(&f1.hq, &other.hq),
                f1.hq.len(),
                first_diff(&f1.out, &other.out),
                f1.out.len(),
            );
        }
        // The fused launch's start ticket is zero after every launch: its last block to start
        // resets it for the next.
        let ticket: Vec<u32> = get(e.ctx, b.ws.sync, 1, s);
        assert_eq!(
            ticket,
            [0],
            "{what}: the fused launch's start ticket after the layer"
        );
        if path == GemmPath::DecodeRouted
            || (t <= fast_moe_gemm::ROUTED_MAX_TOKENS && router == RouterPath::Few)
        {
            // x's codes made before the launch (as the input's norm makes them, in the same
            // order: the decode paths' runs above left them): it leaves them and gives the same
            // bits.
            let fl = l.fast_layer(r, b.tokens);
            let routed = GemmPath::DecodeRouted;
            {
                let _g = e.ctx.enter().unwrap();
                arena::memset_async(b.out, 0xff, s).unwrap();
            }
            e.fast
                .route_and_experts(e.ctx, &fl, b.x, t, &b.ws, router, routed, true, s)
                .unwrap();
            e.fast
                .combine_on(e.ctx, &fl, t, &b.ws, routed, b.out, s)
                .unwrap();
            let out: Vec<f32> = get(e.ctx, b.out, t * sh.d, s);
            assert!(
                same(&f1.out, &out),
                "{what}: the routed launch on x's codes made before differs"
            );
            let words = fast_moe_gemm::route_sync_words(t, sh.k, sh.experts);
            let left: Vec<u32> = get(e.ctx, b.ws.route_sync, words, s);
            assert!(
                left.iter().all(|&w| w == 0),
                "{what}: the routed launch's synchronisation words are not zero after the layer: {left:?}"
            );
        }
    }
    assert!(
        f1.out
            .iter()
            .zip(&f2.out)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && f1
                .hq
                .iter()
                .zip(&f2.hq)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: two runs differ"
    );
    assert!(
        f1.xq
            .iter()
            .zip(&rf.xq)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: x's FP8 quantisation differs from act_quant"
    );
    let agree = check_routing(what, l, x, r, router, &f1, rf);
    if r == Routing::HashSkewed {
        let hot = f1.ids.iter().filter(|&&i| i == HOT_EXPERT as i32).count();
        println!("{what}: expert {HOT_EXPERT} takes {hot} of {t} tokens");
    }
    // 2. On the reference's routing: every token compares (the routed decode path makes its own
    // routing: its GEMMs' bits are the decode path's, compared above).
    let f3_path = if path == GemmPath::DecodeRouted {
        GemmPath::Decode
    } else {
        path
    };
    let f3 = fast(e, l, b, r, Some((&rf.ids, &rf.weights)), f3_path, router, s);
    // Where the output error comes from: the down GEMM's arithmetic, or differing h codes.
    let n = t * sh.k;
    let via_h = reference_down_on(e, l, b, &f3.hq[..n * sh.i], &f3.hq[n * sh.i..], s);
    let (dm, da) = rel_l2(&f3.out, &via_h, sh.d);
    let (hm, ha) = rel_l2(&via_h, &rf.out, sh.d);
    println!(
        "{what}: output error from the fast down GEMM max {dm:.3e} mean {da:.3e}; from differing h codes max {hm:.3e} mean {ha:.3e}"
    );
    check_experts(&format!("{what}, own routing"), &sh, path, &f1, rf, &agree);
    check_experts(
        &format!("{what}, reference routing"),
        &sh,
        path,
        &f3,
        rf,
        &vec![true; t],
    );
}

/// Every batch size and routing of the issue, one layer of weights (4 GB) for all of them.
#[test]
fn fast_moe_matches_the_reference_kernels_at_flash_shapes() {
    run_cases(
        MoeShape::FLASH,
        Scales::Bytes,
        Gate::Bf16,
        Paths::Auto,
        &[
            (1, Routing::TopK),
            (1, Routing::Hash),
            (8, Routing::TopK),
            (32, Routing::HashSkewed),
            (64, Routing::TopK),
            (256, Routing::TopK),
            (256, Routing::HashSkewed),
            // The last batch on the few-token router (below fast_moe::TC_MIN_TOKENS), its logits
            // four experts a warp (fast_moe::LOGIT_GROUP_MIN_TOKENS), on the fused decode launch.
            (fast_moe::TC_MIN_TOKENS - 1, Routing::TopK),
            // The last batch on the fused decode launch (fast_moe_gemm::FUSED_TOKENS), routed by
            // the split tensor-core router (x quantised by the selection), partial tiles.
            (fast_moe_wide::MIN_TOKENS - 1, Routing::HashSkewed),
            // The first batch on the prefill GEMMs and the wide plan
            // (fast_moe::WIDE_PLAN_MIN_TOKENS): x quantised in the halves order by the selection,
            // the split tensor-core router; from fast_moe::TC_SPLIT_MAX_TOKENS + 1 the paired one.
            (fast_moe_wide::MIN_TOKENS, Routing::TopK),
            (fast_moe::TC_SPLIT_MAX_TOKENS + 1, Routing::Hash),
            // The narrow tiles' last batch (fast_moe_wide::tile_tokens: full tiles of 64 for the
            // hot expert) and the paired router's last (fast_moe::TC_PAIR_MAX_TOKENS), then the
            // wide tiles' first, partial tiles of 128, on the unsplit router.
            (fast_moe_wide::NARROW_MAX_TOKENS, Routing::HashSkewed),
            (fast_moe_wide::NARROW_MAX_TOKENS + 1, Routing::TopK),
            (4096, Routing::TopK),
            (16384, Routing::HashSkewed),
        ],
    );
}

/// The fused launch takes the shared expert's up items before the plan is known by default
/// (FMOE_SHARED_EARLY: shared tiles numbered first, their first weights asked for before the
/// programmatic wait), which every decode case above runs; its diagnostic variant that takes
/// every item from the queue after the wait gives the other decode forms' bits and the
/// reference's bounds too, with one and two shared token tiles (B = 16, 17) and at the small
/// shape's odd widths.
#[test]
fn fast_moe_fused_launch_from_its_queue_alone_matches_the_reference_kernels() {
    let Some(e) = queue_only_env() else { return };
    run_variant_cases(
        e,
        &[
            (1, Routing::TopK),
            (2, Routing::Hash),
            (16, Routing::TopK),
            (17, Routing::HashSkewed),
        ],
    );
}

/// The fused launch with the shared expert's items first (FMOE_SPREAD_SHARED=0; the default
/// spreads them among the routed ones once the shared up items outnumber the blocks: from 129
/// tokens at Flash shapes on a 132-SM H100, nine tiles of 16 row blocks; 144 fills the ninth) gives
/// the other decode forms' bits and the reference's bounds too, up to the last batch the fused
/// launch takes. The default's order at these counts is checked by the automatic paths' tests.
#[test]
fn fast_moe_fused_launch_with_the_shared_items_first_matches_the_reference_kernels() {
    let Some(e) = shared_first_env() else { return };
    run_variant_cases(
        e,
        &[
            (144, Routing::TopK),
            (256, Routing::HashSkewed),
            (512, Routing::TopK),
            (fast_moe_wide::MIN_TOKENS - 1, Routing::Hash),
        ],
    );
}

/// A variant's `cases` at Flash shapes and the small shape's odd widths, on the automatic
/// paths (the fused launch at all of them).
fn run_variant_cases(e: &'static Env, cases: &[(usize, Routing)]) {
    let flash = MoeShape::FLASH;
    run_cases_on(e, flash, Scales::Bytes, Gate::Bf16, Paths::Auto, cases);
    run_cases_on(e, SMALL, Scales::Bytes, Gate::Bf16, Paths::Auto, cases);
}

/// The tensor-core router's logits, banked (the default: two stages' wgmmas in flight, a BF16
/// gate) and one-bank (FMOE_TC_ONE_BANK=1, each stage waited on): the same bits, on every
/// tensor-core router at Flash shapes (64 stages a block unsplit, 16 split, 32 paired), with a
/// partial last token tile, and with a gate of f32 values (whose lo planes send every block to the
/// one-bank loop in both builds).
#[test]
fn banked_tensor_router_gives_the_one_bank_bits() {
    let Some(e) = env() else {
        return;
    };
    let Some(one_bank) = one_bank_env() else {
        return;
    };
    let mut rng = Rng::from_env("banked_tensor_router_gives_the_one_bank_bits");
    let stream = OwnedStream::new(e.ctx).unwrap();
    let s = stream.borrow();
    let sh = MoeShape::FLASH;
    let mut l = SyntheticMoe::new(e.ctx, s, sh, rng.u64()).unwrap();
    l.derive_fast(e.ctx, &e.fast, s).unwrap();
    let (d, ne) = (sh.d, sh.experts);
    for gate in [Gate::Bf16, Gate::F32] {
        if gate == Gate::F32 {
            gate_to_f32_values(e, &mut l, &mut rng, s);
            l.derive_fast(e.ctx, &e.fast, s).unwrap();
        }
        for (t, router) in [
            (fast_moe::TC_MIN_TOKENS + 5, RouterPath::Tensor),
            (300, RouterPath::TensorSplit),
            (1500, RouterPath::TensorPair),
            (fast_moe::TC_PAIR_MAX_TOKENS + 70, RouterPath::Tensor),
        ] {
            let (x, tokens) = inputs(&mut rng, &sh, t);
            let b = batch(e, &sh, t, &x, &tokens, s);
            let fl = l.fast_layer(Routing::TopK, b.tokens);
            let run = |env: &Env| {
                {
                    let _g = e.ctx.enter().unwrap();
                    arena::memset_async(b.ws.logits, 0xff, s).unwrap(); // NaN poison
                }
                env.fast
                    .route_on(
                        e.ctx,
                        &fl,
                        b.x,
                        t,
                        &b.ws,
                        router,
                        GemmPath::Prefill,
                        false,
                        s,
                    )
                    .unwrap();
                get::<u32>(e.ctx, b.ws.logits, t * ne, s)
            };
            let case = format!("{gate:?} gate, {router:?}, T = {t}");
            let (banked, one) = (run(e), run(one_bank));
            assert_same_f32_bits(&case, "score", ("banked", &banked), ("one bank", &one));
            println!("{case}: the banked router gives the one-bank bits ({d} wide)");
        }
    }
}

/// The small shape's paths (see [`SMALL`]), from one token to many tiles per expert.
#[test]
fn fast_moe_matches_the_reference_kernels_at_odd_widths() {
    run_cases(
        SMALL,
        Scales::Bytes,
        Gate::Bf16,
        Paths::Both,
        &[
            (1, Routing::TopK),
            (5, Routing::Hash),
            (64, Routing::TopK),
            (300, Routing::HashSkewed),
            (1000, Routing::TopK),
            // The prefill path's wide tiles (from fast_moe_wide::NARROW_MAX_TOKENS + 1).
            (fast_moe_wide::NARROW_MAX_TOKENS + 52, Routing::HashSkewed),
        ],
    );
}

/// A gate whose values BF16 cannot hold: the tensor-core router multiplies all three of its BF16
/// planes, and every router still selects within its bound.
#[test]
fn fast_moe_routes_on_a_gate_of_f32_values() {
    run_cases(
        SMALL,
        Scales::Bytes,
        Gate::F32,
        Paths::Both,
        &[(64, Routing::TopK), (1000, Routing::TopK)],
    );
}

/// The tensor-core routers where the layer does not take them: the unsplit one on the fused decode
/// launch and on the prefill path below `fast_moe::TC_PAIR_MAX_TOKENS` (where the split and the
/// paired ones route, `RouterPath::for_tokens`), the split one above `fast_moe::TC_SPLIT_MAX_TOKENS`
/// and the paired one below and above its range, each within its bound and giving every decode
/// form's bits, with partial token tiles; and the split and paired ones with a gate of f32 values,
/// whose lo planes every split multiplies.
#[test]
fn fast_moe_tensor_routers_on_the_other_paths_match_the_reference_kernels() {
    let flash = MoeShape::FLASH;
    let unsplit = Paths::Router(RouterPath::Tensor);
    let below = [
        (fast_moe::TC_MIN_TOKENS, Routing::TopK),
        (1000, Routing::HashSkewed),
        (fast_moe::TC_SPLIT_MAX_TOKENS + 1, Routing::TopK),
    ];
    run_cases(flash, Scales::Bytes, Gate::Bf16, unsplit, &below);
    let split = Paths::Router(RouterPath::TensorSplit);
    let above = [(fast_moe::TC_SPLIT_MAX_TOKENS + 1, Routing::TopK)];
    run_cases(flash, Scales::Bytes, Gate::Bf16, split, &above);
    run_cases(flash, Scales::Bytes, Gate::F32, split, &above);
    let pair = Paths::Router(RouterPath::TensorPair);
    let outside = [
        (fast_moe::TC_MIN_TOKENS + 3, Routing::HashSkewed),
        (fast_moe::TC_PAIR_MAX_TOKENS + 1, Routing::TopK),
    ];
    run_cases(flash, Scales::Bytes, Gate::Bf16, pair, &outside);
    run_cases(flash, Scales::Bytes, Gate::F32, pair, &outside[1..]);
}

/// FP4 scales that are not powers of two (a checkpoint with f32 scales): the GEMMs read them as
/// f32, and still match.
#[test]
fn fast_moe_reads_f32_scales_when_one_is_not_a_power_of_two() {
    run_cases(
        SMALL,
        Scales::F32,
        Gate::Bf16,
        Paths::Both,
        &[
            (1, Routing::TopK),
            (64, Routing::TopK),
            (300, Routing::HashSkewed),
        ],
    );
}

/// UE8M0 scales of one row 2^7 to 2^11 apart: the row still folds whole, its low groups with the
/// shifted bit move's smallest shifts, and still matches.
#[test]
fn fast_moe_folds_rows_that_span_up_to_2_to_the_11() {
    run_cases(
        SMALL,
        Scales::DeepFold,
        Gate::Bf16,
        Paths::Both,
        &[(9, Routing::TopK), (300, Routing::HashSkewed)],
    );
}

/// UE8M0 scales of one row too far apart to fold the whole row: that row block folds per
/// 128-block, and still matches.
#[test]
fn fast_moe_folds_per_block_where_a_row_spans_more_than_2_to_the_11() {
    run_cases(
        SMALL,
        Scales::RowUnfoldable,
        Gate::Bf16,
        Paths::Both,
        &[(9, Routing::TopK), (300, Routing::HashSkewed)],
    );
}

/// UE8M0 scales too far apart to fold into the e4m3 codes: the prefill path promotes every k32,
/// and still matches.
#[test]
fn fast_moe_promotes_every_k32_when_scales_cannot_be_folded() {
    run_cases(
        SMALL,
        Scales::Unfoldable,
        Gate::Bf16,
        Paths::Both,
        &[(7, Routing::TopK), (300, Routing::HashSkewed)],
    );
}

/// Layers the fast kernels cannot run are named (the fast set then runs the reference MoE).
#[test]
fn unsupported_layers_are_reported() {
    use StorageFormat::*;
    let ok = FastMoeLayer::unsupported(4096, 2048, 6, 256, (Fp4, [0, 0]), Some((Fp8, [128, 128])));
    assert_eq!(ok, None);
    let cases = [
        (
            FastMoeLayer::unsupported(4000, 2048, 6, 256, (Fp4, [0, 0]), None),
            "4000",
        ),
        (
            FastMoeLayer::unsupported(4096, 2048, 6, 256, (Bf16, [0, 0]), None),
            "Bf16",
        ),
        (
            FastMoeLayer::unsupported(4096, 2048, 6, 256, (Fp4, [0, 0]), Some((Fp8, [1, 128]))),
            "shared",
        ),
        (
            FastMoeLayer::unsupported(4096, 2048, 6, 4096, (Fp4, [0, 0]), None),
            "4096 experts",
        ),
    ];
    for (why, needle) in cases {
        let why = why.expect("must be unsupported").to_string();
        assert!(why.contains(needle), "{why}");
    }
}

/// In the engine, the fast set runs these kernels for quantized experts (`tiny_fp8`: FP4 routed,
/// FP8 shared experts) and the reference kernels for BF16 ones (`tiny`), and its log says which.
#[test]
fn the_fast_set_reports_which_moe_layers_run_the_fast_kernels() {
    use dsv4::log::{Level, set_sink};
    use std::sync::{Arc, Mutex};
    if !common::gpu::has_cuda() {
        return;
    }
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = seen.clone();
    set_sink(
        Some(Box::new(move |_, m| {
            sink.lock().unwrap().push(m.to_string())
        })),
        Level::Info,
    );
    for (model, runs) in [
        ("tiny_fp8", "the fast kernels"),
        ("tiny", "the reference kernels"),
    ] {
        seen.lock().unwrap().clear();
        let mut o = RigOptions::new(model, 0);
        o.kernel_set = Some("fast");
        let r = Rig::build(&o, &[]);
        r.forward_finite(&Step::of(&[(0, 0, tokens(5, 9)), (1, 0, tokens(6, 4))]));
        let log = seen.lock().unwrap().join("\n");
        let layers = r.info().num_layers;
        assert!(layers > 0, "{model}: no layers");
        for l in 0..layers {
            let needle = format!("fast set: layer {l} MoE runs {runs}");
            assert!(
                log.contains(&needle),
                "{model}: no `{needle}` in the log:\n{log}"
            );
        }
        println!("{model}:\n{log}");
    }
    set_sink(None, Level::Warn);
}

/// `fmoe_norm_x_kernel` (the fast set's MoE input norm with x's quantisation, `FastMoe::norm_x`)
/// writes the normed rows `NormRope::rmsnorm` writes and the codes and scales the router kernels
/// make of them (`route_on` without `x_made`: `fmoe_logits_kernel` at few tokens,
/// `fmoe_select_kernel` behind the tensor-core router), byte for byte, in both code orders, on
/// both of the norm's blocks (a row a 256- or 1024-thread block; the rows kernel's from 256 rows,
/// two blocks an SM each taking every grid-th row, the next one copied ahead: up to 6 rows a block),
/// at a width of 384 and at Flash's 4096 (few small experts: only the router runs), with a zero
/// row; and the routers, told the codes are made, leave them and route as before.
#[test]
fn norm_x_gives_the_norms_rows_and_the_routers_codes() {
    let Some(e) = env() else {
        return;
    };
    let mut rng = Rng::from_env("norm_x_gives_the_norms_rows_and_the_routers_codes");
    let stream = OwnedStream::new(e.ctx).unwrap();
    let s = stream.borrow();
    let wide = MoeShape {
        d: 4096,
        i: 128,
        experts: 16,
        k: 2,
        vocab: 1024,
        limit: 1.5,
    };
    for sh in [SMALL, wide] {
        let l = SyntheticMoe::new(e.ctx, s, sh, rng.u64()).unwrap();
        // The tensor-core router's gate planes, as a finalize derives them.
        l.derive_fast(e.ctx, &e.fast, s).unwrap();
        let d = sh.d;
        let w: Vec<f32> = (0..d).map(|_| 1.0 + 0.25 * rng.normal()).collect();
        let (_wa, wp) = alloc(e.ctx, &[d * 4]);
        put(e.ctx, wp[0], &w, s);
        let norm = fast_moe::MoeNorm {
            weight: Some(wp[0]),
            eps: 1e-6,
            round_out: true,
        };
        // The few-token router on the fused decode path, the tensor-core router on it and on the
        // prefill path (whose GEMMs read x's codes in the halves order).
        for t in [
            1,
            8,
            300,
            fast_moe::TC_MIN_TOKENS + 76,
            fast_moe_wide::MIN_TOKENS + 76,
            1500,
        ] {
            assert!(fast_moe::norm_x_covers(t, d), "d {d}, T={t}");
            let (mut x, tokens) = inputs(&mut rng, &sh, t);
            if t > 1 {
                x[..d].fill(0.0);
            }
            let (router, path) = (RouterPath::for_tokens(t, d), GemmPath::for_tokens(t));
            let case = format!("d {d}, T={t}, {router:?} router, {path:?} order");
            // The norm, then the router making x's codes; the norm making them, then the router.
            let (a, b) = (
                batch(e, &sh, t, &x, &tokens, s),
                batch(e, &sh, t, &x, &tokens, s),
            );
            let fl = l.fast_layer(Routing::TopK, a.tokens);
            e.nr.rmsnorm(e.ctx, a.x, t, d, d, norm.weight, norm.eps, true, s)
                .unwrap();
            e.fast
                .route_on(e.ctx, &fl, a.x, t, &a.ws, router, path, false, s)
                .unwrap();
            let fl_b = l.fast_layer(Routing::TopK, b.tokens);
            e.fast
                .norm_x(e.ctx, &fl_b, b.x, t, &norm, path, &b.ws, s)
                .unwrap();
            let made: Vec<u8> = get(e.ctx, b.ws.xq, t * d, s);
            e.fast
                .route_on(e.ctx, &fl_b, b.x, t, &b.ws, router, path, true, s)
                .unwrap();
            let u = |p| get::<u32>(e.ctx, p, t * d, s);
            assert!(
                u(a.x) == u(b.x),
                "{case}: the normed rows differ from rmsnorm's"
            );
            let (qa, qb): (Vec<u8>, Vec<u8>) =
                (get(e.ctx, a.ws.xq, t * d, s), get(e.ctx, b.ws.xq, t * d, s));
            assert!(qa == made, "{case}: x's codes differ from the router's");
            assert!(
                qb == made,
                "{case}: the router rewrote the codes it was told were made"
            );
            let sc = |p| get::<u32>(e.ctx, p, t * d / 128, s);
            assert!(sc(a.ws.xs) == sc(b.ws.xs), "{case}: x's scales differ");
            let ids = |p| get::<i32>(e.ctx, p, t * sh.k, s);
            let wts = |p| get::<u32>(e.ctx, p, t * sh.k, s);
            assert!(
                ids(a.ws.ids) == ids(b.ws.ids),
                "{case}: the selection differs"
            );
            assert!(
                wts(a.ws.weights) == wts(b.ws.weights),
                "{case}: the weights differ"
            );
            let zero_codes = made[..128].iter().all(|&c| c & 0x7f == 0);
            assert!(t == 1 || zero_codes, "{case}: the zero row's codes");
            println!(
                "{case}: rows, codes, scales and routing as the norm and the router make them"
            );
        }
    }
}

/// `fmoe_logits_grouped_kernel`, each warp on [`fast_moe::LOGIT_GROUP`] experts (the router from
/// [`fast_moe::LOGIT_GROUP_MIN_TOKENS`] tokens) gives the logits and x's codes of
/// `fmoe_logits_kernel`'s one-expert warps bit for bit: every logit takes the same sums in the same order. At Flash shapes, the
/// small shape's odd widths, and 20 experts (the last block's group runs past E); token counts
/// that fill no token tile, one, and many, with a partial last one.
#[test]
fn grouped_logit_warps_give_the_single_expert_warps_bits() {
    let Some(e) = env() else {
        return;
    };
    let mut rng = Rng::from_env("grouped_logit_warps_give_the_single_expert_warps_bits");
    let stream = OwnedStream::new(e.ctx).unwrap();
    let s = stream.borrow();
    let twenty = MoeShape {
        d: 1024,
        i: 128,
        experts: 20,
        k: 2,
        vocab: 1024,
        limit: 1.5,
    };
    for sh in [MoeShape::FLASH, SMALL, twenty] {
        let l = SyntheticMoe::new(e.ctx, s, sh, rng.u64()).unwrap();
        let (d, ne) = (sh.d, sh.experts);
        for t in [1, 5, 8, 33, 256] {
            let (x, tokens) = inputs(&mut rng, &sh, t);
            let b = batch(e, &sh, t, &x, &tokens, s);
            let fl = l.fast_layer(Routing::TopK, b.tokens);
            let path = GemmPath::for_tokens(t);
            let run = |group: usize| {
                {
                    let _g = e.ctx.enter().unwrap();
                    arena::memset_async(b.ws.logits, 0xff, s).unwrap(); // NaN poison
                    arena::memset_async(b.ws.xq, 0xff, s).unwrap();
                }
                e.fast
                    .logits_few(e.ctx, &fl, b.x, t, &b.ws, group, path, false, s)
                    .unwrap();
                (
                    get::<u32>(e.ctx, b.ws.logits, t * ne, s),
                    get::<u8>(e.ctx, b.ws.xq, t * d, s),
                )
            };
            let case = format!("D {d}, E {ne}, T = {t}");
            let (one, one_x) = run(1);
            let (grouped, grouped_x) = run(fast_moe::LOGIT_GROUP);
            assert_same_f32_bits(
                &case,
                "logit",
                ("one expert a warp", &one),
                ("grouped", &grouped),
            );
            assert!(one_x == grouped_x, "{case}: x's codes differ");
            println!("{case}: grouped logit warps give the same bits");
        }
    }
}
