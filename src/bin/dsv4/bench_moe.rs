//! `dsv4 bench moe`: one Flash-shaped MoE layer on the fast kernels (issue 11), alone, on a
//! synthetic layer drawn like real weights (cuda::synthetic_moe). One JSON line per (B, routing):
//! time per layer, touched experts and their bytes (checkpoint format, and what the kernels read),
//! GB/s, TFLOP/s, launches per layer. bench/moe_baseline.py measures the ceilings and PyTorch's
//! `_grouped_mm` on the same routing in the same run and adds the ratios.
//!
//! Timing: each case captures R layer calls on R different input batches (different tokens, so
//! different experts: the 50 MB L2 cannot hold a layer's bytes between calls) into one CUDA
//! graph, replays it G times between CUDA events, and reports the median replay / R (`time_us`;
//! the host clock's around launch + sync beside it, `host_time_us`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use crate::bench_util::{alloc, e, has_kernel_define, kernel_cache, time_replays};
use crate::moe_trace::TraceLogs;
use dsv4::cuda::arena;
use dsv4::cuda::context::Context;
use dsv4::cuda::graph::Graph;
use dsv4::cuda::kernels::fast_moe::{self, FastMoe, FastMoeWorkspace, RouterPath};
use dsv4::cuda::kernels::fast_moe_gemm::{self, GemmPath};
use dsv4::cuda::kernels::norm_rope::NormRope;
use dsv4::cuda::kernels::{FAST_FAMILIES, MODEL_FAMILIES};
use dsv4::cuda::registry::Registry;
use dsv4::cuda::stream::OwnedStream;
use dsv4::cuda::synthetic_moe::{HOT_EXPERT, MoeShape, Rng, Routing, SyntheticMoe};

/// What `dsv4 bench moe` runs.
pub struct MoeBench {
    pub device: i32,
    pub batches: Vec<usize>,
    pub routings: Vec<Routing>,
    /// The expert GEMMs' paths to time: `None` is the layer's own choice by B.
    pub paths: Vec<Option<GemmPath>>,
    /// The router kernel: `None` is the layer's own choice by B.
    pub router: Option<RouterPath>,
    /// Where to write each case's expert ids (`i32[B, k]` of the first input batch) for the
    /// PyTorch baseline.
    pub ids_dir: Option<PathBuf>,
    /// Where to write each case's event log (moe_trace.rs; the kernels' `FMOE_TRACE=1` build):
    /// one eager layer call after the timed ones, traced.
    pub trace_dir: Option<PathBuf>,
}

pub fn parse_routings(v: &str) -> Result<Vec<Routing>, String> {
    v.split(',')
        .map(|r| match r.trim() {
            "uniform" | "hash" => Ok(Routing::Hash),
            "skewed" => Ok(Routing::HashSkewed),
            "topk" => Ok(Routing::TopK),
            o => Err(format!("--routing takes uniform, skewed, topk; got `{o}`")),
        })
        .collect()
}

pub fn parse_paths(v: &str) -> Result<Vec<Option<GemmPath>>, String> {
    v.split(',')
        .map(|p| match p.trim() {
            "auto" => Ok(None),
            "decode" => Ok(Some(GemmPath::Decode)),
            "decode-fused" => Ok(Some(GemmPath::DecodeFused)),
            "decode-routed" => Ok(Some(GemmPath::DecodeRouted)),
            "prefill" => Ok(Some(GemmPath::Prefill)),
            o => Err(format!(
                "--path takes auto, decode, decode-fused, decode-routed, prefill; got `{o}`"
            )),
        })
        .collect()
}

pub fn parse_router(v: &str) -> Result<Option<RouterPath>, String> {
    match v.trim() {
        "auto" => Ok(None),
        "few" => Ok(Some(RouterPath::Few)),
        "tensor" => Ok(Some(RouterPath::Tensor)),
        "tensor-split" => Ok(Some(RouterPath::TensorSplit)),
        "tensor-pair" => Ok(Some(RouterPath::TensorPair)),
        o => Err(format!(
            "--router takes auto, few, tensor, tensor-split, tensor-pair; got `{o}`"
        )),
    }
}

fn router_name(r: RouterPath) -> &'static str {
    match r {
        RouterPath::Few => "few",
        RouterPath::Tensor => "tensor",
        RouterPath::TensorSplit => "tensor-split",
        RouterPath::TensorPair => "tensor-pair",
    }
}

fn path_name(p: GemmPath) -> &'static str {
    match p {
        GemmPath::Decode => "decode",
        GemmPath::DecodeFused => "decode-fused",
        GemmPath::DecodeRouted => "decode-routed",
        GemmPath::Prefill => "prefill",
    }
}

fn routing_name(r: Routing) -> &'static str {
    match r {
        Routing::Hash => "uniform",
        Routing::HashSkewed => "skewed",
        Routing::TopK => "topk",
    }
}

pub fn run(b: &MoeBench) -> Result<(), String> {
    let sh = MoeShape::FLASH;
    let (d, i, k, ne) = (sh.d, sh.i, sh.k, sh.experts);
    let ctx = Context::retain(b.device).map_err(e)?;
    let _g = ctx.enter().map_err(e)?;
    let stream = OwnedStream::new(&ctx).map_err(e)?;
    let s = stream.borrow();
    let families: Vec<_> = MODEL_FAMILIES
        .iter()
        .chain(FAST_FAMILIES.iter())
        .copied()
        .collect();
    let reg = Registry::load_families(&ctx, &families, &kernel_cache()?).map_err(e)?;
    let fast = FastMoe::new(&reg).map_err(e)?;
    let trace = match &b.trace_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|x| format!("{}: {x}", dir.display()))?;
            Some(TraceLogs::find(&reg)?)
        }
        None => None,
    };
    let nr = NormRope::new(&reg).map_err(e)?;
    let t0 = Instant::now();
    let layer = SyntheticMoe::new(&ctx, s, sh, 0x5EED).map_err(e)?;
    layer.derive_fast(&ctx, &fast, s).map_err(e)?;
    if has_kernel_define("FMOE_PROBE_FLAT=1") {
        // The probe reads the expert matrices through maps of 128-byte rows (timings only).
        layer.write_probe_flat_maps(s).map_err(e)?;
    }
    eprintln!(
        "bench moe: synthetic layer in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    let max_b = *b.batches.iter().max().unwrap_or(&1);
    let wsb = fast_moe::workspace_buffers(max_b, d, i, k, ne);
    let (_ws_arena, wp) = alloc(&ctx, "bench_moe", &wsb.map(|(_, el, n)| el.size() * n))?;
    let ws = FastMoeWorkspace::at(&wp, max_b, k, ne);
    ws.write_act_maps(&ctx, d, i, s).map_err(e)?;
    let mut rng = Rng::new(0xB0B);
    for &t in &b.batches {
        // R input batches per graph: together at least ~64 MB of distinct expert bytes.
        let reps = (4096 / t).clamp(2, 32);
        let (_in_arena, ip) = alloc(
            &ctx,
            "bench_moe",
            &[reps * t * d * 4, reps * t * 4, t * d * 4],
        )?;
        let x: Vec<f32> = (0..reps * t * d)
            .map(|_| half::bf16::from_f32(rng.uniform(-2.0, 2.0)).to_f32())
            .collect();
        let toks: Vec<i32> = (0..reps * t).map(|_| rng.below(sh.vocab) as i32).collect();
        arena::copy_to_device_sync(ip[0], &x, s).map_err(e)?;
        arena::copy_to_device_sync(ip[1], &toks, s).map_err(e)?;
        let out = ip[2];
        for (&r, &p) in b
            .routings
            .iter()
            .flat_map(|r| b.paths.iter().map(move |p| (r, p)))
        {
            let path = p.unwrap_or(GemmPath::for_tokens(t));
            if path == GemmPath::DecodeRouted && t > fast_moe_gemm::ROUTED_MAX_TOKENS {
                eprintln!(
                    "bench moe: B = {t}: the routed decode path takes at most {} tokens",
                    fast_moe_gemm::ROUTED_MAX_TOKENS
                );
                continue;
            }
            let router = b.router.unwrap_or(RouterPath::for_tokens(t, d));
            let xr = |j: usize| ip[0].slice(j * t * d * 4, t * d * 4).unwrap();
            let tr = |j: usize| ip[1].slice(j * t * 4, t * 4).unwrap();
            let call = |j: usize| {
                let fl = layer.fast_layer(r, tr(j));
                fast.route_and_experts(&ctx, &fl, xr(j), t, &ws, router, path, false, s)?;
                fast.combine_on(&ctx, &fl, t, &ws, path, out, s)
            };
            // Eager once (touched experts from its ids), then the graph.
            call(0).map_err(e)?;
            s.synchronize().map_err(e)?;
            let mut ids = vec![0i32; t * k];
            arena::copy_to_host_sync(&mut ids, ws.ids, s).map_err(e)?;
            let mut touched = vec![false; ne];
            for &id in &ids {
                if id >= 0 && (id as usize) < ne {
                    touched[id as usize] = true;
                }
            }
            let touched = touched.iter().filter(|&&x| x).count();
            let hot = ids.iter().filter(|&&x| x == HOT_EXPERT as i32).count();
            if let Some(dir) = &b.ids_dir {
                let path = dir.join(format!("moe_ids_B{t}_{}.bin", routing_name(r)));
                let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(&path, bytes).map_err(|x| format!("{}: {x}", path.display()))?;
            }
            let g = Graph::capture(s, || {
                for j in 0..reps {
                    call(j)?;
                }
                Ok(())
            })
            .map_err(e)?;
            g.launch(s).map_err(e)?;
            s.synchronize().map_err(e)?;
            let launches = (20usize.div_ceil(reps)).max(5);
            let timing = time_replays(s, &g, reps, launches)?;
            let (sec, host_sec) = (timing.device_s, timing.host_s);
            let touched_bytes = touched * sh.routed_expert_bytes() + sh.shared_expert_bytes();
            // What the kernels read: FP4 codes with the layer's UE8M0 scale table (a byte per 32,
            // as stored: the synthetic scales are all powers of two), FP8 with f32 block scales.
            let bytes_read =
                touched * sh.routed_expert_bytes() + 3 * (d * i + (d / 128) * (i / 128) * 4);
            let flops = 2.0 * t as f64 * ((k + 1) as f64 * 3.0 * (d * i) as f64 + (d * ne) as f64);
            println!(
                "{{\"bench\": \"moe\", \"B\": {t}, \"routing\": \"{}\", \"path\": \"{}\", \"router\": \"{}\", \"hidden\": {d}, \"moe_inter\": {i}, \"experts\": {ne}, \"top_k\": {k}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"touched_experts\": {touched}, \"hot_expert_assignments\": {hot}, \"touched_bytes\": {touched_bytes}, \"bytes_read\": {bytes_read}, \"gb_per_s\": {:.1}, \"tflop_per_s\": {:.2}, \"flops\": {flops:.4e}, \"launches_per_layer\": {}, \"layer_calls_timed\": {}}}",
                routing_name(r),
                path_name(path),
                router_name(router),
                sec * 1e6,
                host_sec * 1e6,
                touched_bytes as f64 / sec / 1e9,
                flops / sec / 1e12,
                FastMoe::launches_per_layer(path, t),
                launches * reps,
            );
            std::io::stdout().flush().ok();
            // (A case whose kernels were built without their trace is timed, not traced.)
            let traced = trace.as_ref().map(|logs| logs.for_case(path, t));
            if let Some(Err(why)) = &traced {
                eprintln!("bench moe: {why}; not traced");
            }
            if let (Some(Ok(log)), Some(dir)) = (traced, &b.trace_dir) {
                // Input batch 1: its experts are not the last replay's (reps >= 2), as in the timing.
                log.reset(s)?;
                call(1).map_err(e)?;
                s.synchronize().map_err(e)?;
                let name = format!(
                    "{}_B{t}_{}_{}.json",
                    log.prefix,
                    routing_name(r),
                    path_name(path)
                );
                let labels = format!(
                    "\"B\": {t}, \"routing\": \"{}\", \"path\": \"{}\", \"moe_inter\": {i}, \"hidden\": {d}, \"top_k\": {k}",
                    routing_name(r),
                    path_name(path)
                );
                log.write(s, &dir.join(name), &labels)?;
            }
        }
        // The input's norm with the routing, the norm making x's codes or not (once a batch size, on
        // the first routing: what the fast set's boundary leaving ffn_norm to the layer changes).
        if let Some(&r) = b.routings.first()
            && fast_moe::norm_x_covers(t, d)
        {
            let path = b
                .paths
                .first()
                .copied()
                .flatten()
                .unwrap_or(GemmPath::for_tokens(t));
            let router = b.router.unwrap_or(RouterPath::for_tokens(t, d));
            let xr = |j: usize| ip[0].slice(j * t * d * 4, t * d * 4).unwrap();
            let tr = |j: usize| ip[1].slice(j * t * 4, t * 4).unwrap();
            let norm = fast_moe::MoeNorm {
                weight: None,
                eps: 1e-6,
                round_out: true,
            };
            for made in [true, false] {
                let call = |j: usize| {
                    let fl = layer.fast_layer(r, tr(j));
                    if made {
                        fast.norm_x(&ctx, &fl, xr(j), t, &norm, path, &ws, s)?;
                    } else {
                        nr.rmsnorm(&ctx, xr(j), t, d, d, None, 1e-6, true, s)?;
                    }
                    fast.route_on(&ctx, &fl, xr(j), t, &ws, router, path, made, s)
                };
                let g = Graph::capture(s, || (0..reps).try_for_each(call)).map_err(e)?;
                g.launch(s).map_err(e)?;
                s.synchronize().map_err(e)?;
                let launches = (20usize.div_ceil(reps)).max(5);
                let timing = time_replays(s, &g, reps, launches)?;
                println!(
                    "{{\"bench\": \"moe_norm_route\", \"B\": {t}, \"routing\": \"{}\", \"path\": \"{}\", \"router\": \"{}\", \"hidden\": {d}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"calls_timed\": {}}}",
                    routing_name(r),
                    if made {
                        "norm_x_route"
                    } else {
                        "norm_then_route"
                    },
                    router_name(router),
                    timing.device_s * 1e6,
                    timing.host_s * 1e6,
                    launches * reps,
                );
                std::io::stdout().flush().ok();
            }
        }
    }
    Ok(())
}
