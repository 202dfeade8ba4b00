//! What the kernel benches (`bench moe`, `bench dense`, `bench attn`) share: their buffers,
//! errors and random numbers.

use dsv4::cuda::arena::{Arena, ArenaPlan, DevicePtr};
use dsv4::cuda::context::Context;
use dsv4::cuda::graph::Graph;
use dsv4::cuda::registry::KernelCache;
use dsv4::cuda::stream::BorrowedStream;
use dsv4::cuda::timer::DeviceTimer;
use std::sync::OnceLock;
use std::time::Instant;

/// The kernel benches' `--defines NAME[=VALUE],...` (set once by main).
static DEFINES: OnceLock<Vec<String>> = OnceLock::new();

/// Sets the kernel benches' preprocessor defines from `--defines` (comma-separated): every
/// family they compile gets them (kernels' `#if` variants timed from one build). When any are
/// given, the bench prints them first as a JSON line (`"bench": "defines"`), so its lines are
/// never mistaken for the default kernels'.
pub fn set_kernel_defines(list: Option<&str>) -> Result<(), String> {
    let v: Vec<String> = list
        .map(|l| {
            l.split(',')
                .filter(|d| !d.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    KernelCache::disabled().with_defines(&v).map_err(e)?;
    if !v.is_empty() {
        let quoted: Vec<String> = v.iter().map(|d| format!("\"{d}\"")).collect();
        println!(
            "{{\"bench\": \"defines\", \"defines\": [{}]}}",
            quoted.join(", ")
        );
    }
    DEFINES
        .set(v)
        .map_err(|_| "kernel defines set twice".to_string())
}

/// Whether `--defines` holds `define` (exactly, e.g. "FMOE_PROBE_FLAT=1").
pub fn has_kernel_define(define: &str) -> bool {
    DEFINES.get().is_some_and(|v| v.iter().any(|d| d == define))
}

/// The kernel cache the benches compile through: the default directory, with `--defines`.
pub fn kernel_cache() -> Result<KernelCache, String> {
    let d = DEFINES.get().map(Vec::as_slice).unwrap_or_default();
    KernelCache::new(None).with_defines(d).map_err(e)
}

/// A library error as the CLI prints it.
pub fn e(x: dsv4::Error) -> String {
    x.to_string()
}

/// One arena with a region of each byte size (at least 4), named `<tag>.<i>`.
pub fn alloc(ctx: &Context, tag: &str, bytes: &[usize]) -> Result<(Arena, Vec<DevicePtr>), String> {
    let mut plan = ArenaPlan::new();
    let ids: Vec<_> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| plan.reserve(format!("{tag}.{i}"), b.max(4), 256))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let a = Arena::from_plan(ctx, &plan).map_err(e)?;
    let p = ids.iter().map(|&i| a.region(i)).collect();
    Ok((a, p))
}

/// xorshift64*: the kernel benches' weights, state and activations (fixed seeds).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1) rounded to BF16 (official activations are BF16 values).
    pub fn bf16(&mut self) -> f32 {
        half::bf16::from_f32(self.unit() * 2.0 - 1.0).to_f32()
    }
}

/// Seconds per call of a graph replay, two ways ([`time_graph`]).
pub struct GraphTiming {
    /// Between CUDA events recorded on the stream just before and after the replay (how the
    /// PyTorch baselines and the ceilings are timed): what the ratios use.
    pub device_s: f64,
    /// The host's clock around launch + synchronize: adds the graph launch call and the sync's
    /// wake-up, spread over the n calls. Reported beside device_s, never used in a ratio.
    pub host_s: f64,
}

/// Seconds per call of `call(0..n)` (n calls, e.g. one per weight or state copy): the calls
/// captured once into a CUDA graph, the graph replayed `replays` times, each between CUDA events
/// and waited for; the median replay / n. `call(0)` runs once before the capture (loads,
/// first-use setup).
pub fn time_graph(
    s: BorrowedStream,
    n: usize,
    replays: usize,
    call: impl Fn(usize) -> dsv4::Result<()>,
) -> Result<GraphTiming, String> {
    call(0).map_err(e)?;
    s.synchronize().map_err(e)?;
    let g = Graph::capture(s, || (0..n).try_for_each(&call)).map_err(e)?;
    g.launch(s).map_err(e)?;
    s.synchronize().map_err(e)?;
    time_replays(s, &g, n, replays)
}

/// Seconds per call of an instantiated graph of `n` calls, replayed `replays` times, each between
/// CUDA events and waited for: the medians ([`GraphTiming`]).
pub fn time_replays(
    s: BorrowedStream,
    g: &Graph,
    n: usize,
    replays: usize,
) -> Result<GraphTiming, String> {
    let timer = DeviceTimer::new().map_err(e)?;
    let (mut device, mut host) = (Vec::with_capacity(replays), Vec::with_capacity(replays));
    for _ in 0..replays {
        let t1 = Instant::now();
        device.push(timer.time(s, || g.launch(s)).map_err(e)? / n as f64);
        host.push(t1.elapsed().as_secs_f64() / n as f64);
    }
    Ok(GraphTiming {
        device_s: median(&mut device),
        host_s: median(&mut host),
    })
}

/// The median of `v` (sorts it).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
