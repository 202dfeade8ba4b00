//! GPU runtime tests (src/cuda): primary context, arena, NVRTC registry with its disk cache,
//! launches on a host-style stream, and common.cuh's number formats bit for bit against the
//! CPU reference (its silu_newton against silu_div_rn, on every f32 pattern, on the device). Without a CUDA device every test prints `skipped: no CUDA device` and
//! returns; on the GPU machine scripts/gpu-check.sh runs this binary (also under
//! compute-sanitizer) and treats that line as a failure.
//!
//! Tests run one at a time (a lock): the free-memory check must not see another test allocate.

mod common;

use common::TempDir;
use dsv4::cuda::arena::{self, ArenaPlan};
use dsv4::cuda::registry::{KernelCache, families};
use dsv4::cuda::smoke::{self, ROUNDTRIP_COLS, ROUNDTRIP_COLUMNS, Smoke};
use dsv4::cuda::{Arena, BorrowedStream, Context, DevicePtr, OwnedStream, PinnedStaging, Registry};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

/// The device context, or None after printing the skip line.
fn device_or_skip() -> Option<Context> {
    let ctx = common::gpu::device_or_skip()?;
    let i = ctx.info();
    println!(
        "device 0: {} (sm {}.{} -> {}), {:.1} GiB, {} SMs, driver {}",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.arch,
        i.total_mem_bytes as f64 / (1u64 << 30) as f64,
        i.multiprocessors,
        i.driver_version
    );
    Some(ctx)
}

/// One test's smoke-family setup; fields drop in the order a test's locals did.
struct SmokeRig {
    stream: OwnedStream,
    sm: Smoke,
    reg: Registry,
    /// The registry's kernel cache directory.
    _dir: TempDir,
    ctx: Context,
    /// Held for the whole test (see `lock`).
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// Under the test lock: the device context, the smoke family loaded through a registry whose
/// kernel cache is a fresh directory tagged `tag`, and a stream; or None after printing the
/// skip line.
fn smoke_or_skip(tag: &str) -> Option<SmokeRig> {
    let serial = lock();
    let ctx = device_or_skip()?;
    let dir = TempDir::new(tag);
    let reg = Registry::load(&ctx, Some(&dir.0)).unwrap_or_else(|e| panic!("{e}"));
    let sm = Smoke::new(&reg).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    Some(SmokeRig {
        stream,
        sm,
        reg,
        _dir: dir,
        ctx,
        _serial: serial,
    })
}

fn under_sanitizer() -> bool {
    std::env::var_os("DSV4_UNDER_SANITIZER").is_some()
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn primary_context_is_retained_and_entered() {
    let _l = lock();
    let Some(ctx) = device_or_skip() else { return };
    let info = ctx.info();
    assert!(!info.name.is_empty());
    assert!(info.compute_capability.0 >= 7, "{info:?}");
    assert_eq!(
        info.arch,
        dsv4::cuda::arch_for(info.compute_capability.0, info.compute_capability.1)
    );
    assert!(info.total_mem_bytes > 0 && info.max_shared_mem_per_block_optin >= 48 * 1024);
    {
        let _g = ctx.enter().unwrap();
        let cur = cudarc::driver::result::ctx::get_current().unwrap();
        assert_eq!(cur, Some(ctx.raw()), "enter() makes the context current");
    }
    // It is THE primary context: retaining it again yields the same handle.
    // SAFETY: device handle from the context; balanced release.
    unsafe {
        let again = cudarc::driver::result::primary_ctx::retain(ctx.device()).unwrap();
        assert_eq!(again, ctx.raw(), "not the device's primary context");
        cudarc::driver::result::primary_ctx::release(ctx.device()).unwrap();
    }
    // A clone shares the retain; dropping both releases it without error.
    let c2 = ctx.clone();
    drop(ctx);
    assert!(c2.mem_info().unwrap().0 > 0);
}

#[test]
fn registry_compiles_once_then_loads_from_cache() {
    let _l = lock();
    let Some(ctx) = device_or_skip() else { return };
    let dir = TempDir::new("gpu-kcache");
    let n = families().len();

    let t = std::time::Instant::now();
    let r1 = Registry::load(&ctx, Some(&dir.0)).unwrap_or_else(|e| panic!("{e}"));
    let s1 = r1.stats();
    println!(
        "first load: {s1:?} in {:.2} s (NVRTC {:?})",
        t.elapsed().as_secs_f64(),
        r1.nvrtc_version()
    );
    assert_eq!((s1.compiled, s1.cache_hits, s1.cache_rejected), (n, 0, 0));
    for k in r1.kernels() {
        println!(
            "  {}::{}: {} regs, {} B static smem, {} B local, max {} threads, max dyn smem {}",
            k.family,
            k.name,
            k.num_regs,
            k.static_smem,
            k.local_bytes,
            k.max_threads_per_block,
            k.max_dynamic_smem
        );
        assert!(k.max_threads_per_block >= 32, "{}::{}", k.family, k.name);
        if k.name == "smoke_reduce" {
            assert!(
                k.max_threads_per_block >= 1024,
                "{}: smoke_reduce runs 1024-thread blocks",
                k.name
            );
        }
    }
    let expected: usize = families().iter().map(|f| f.functions.len()).sum();
    assert_eq!(r1.kernels().len(), expected);
    drop(r1);

    let t = std::time::Instant::now();
    let r2 = Registry::load(&ctx, Some(&dir.0)).unwrap();
    let s2 = r2.stats();
    println!("second load: {s2:?} in {:.3} s", t.elapsed().as_secs_f64());
    assert_eq!(
        (s2.compiled, s2.cache_hits, s2.cache_rejected),
        (0, n, 0),
        "second load must hit the cache"
    );
    assert!(r2.get("smoke", "smoke_fill").is_ok());
    assert!(r2.get("smoke", "no_such_kernel").is_err());
    drop(r2);

    // A corrupt cache file is detected and recompiled.
    let cache = KernelCache::new(Some(&dir.0));
    let path = cache.path_for(&smoke::SOURCE, ctx.arch()).unwrap().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let k = bytes.len() - 100;
    bytes[k] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let r3 = Registry::load(&ctx, Some(&dir.0)).unwrap();
    assert_eq!(r3.stats().cache_rejected, 1, "{:?}", r3.stats());
    assert_eq!(r3.stats().cache_hits, n - 1);
}

/// Buffers of the smoke tests, carved from one arena.
struct Bufs {
    xf: DevicePtr,
    xu: DevicePtr,
    out: DevicePtr,
    fill_u: DevicePtr,
    fill_f: DevicePtr,
}

fn arena_for(ctx: &Context, n: usize, fill_n: usize) -> (Arena, Bufs) {
    let mut plan = ArenaPlan::new();
    let xf = plan.reserve("smoke.xf", n * 4, 256).unwrap();
    let xu = plan.reserve("smoke.xu", n * 4, 256).unwrap();
    let out = plan
        .reserve("smoke.out", n * ROUNDTRIP_COLS * 4, 4096)
        .unwrap();
    let fu = plan.reserve("smoke.fill_u32", fill_n * 4, 16).unwrap();
    let ff = plan
        .reserve("smoke.fill_f32", fill_n * 4, 64 * 1024)
        .unwrap();
    let a = Arena::from_plan(ctx, &plan).unwrap();
    let b = Bufs {
        xf: a.region(xf),
        xu: a.region(xu),
        out: a.region(out),
        fill_u: a.region(fu),
        fill_f: a.region(ff),
    };
    (a, b)
}

#[test]
fn common_cuh_matches_the_cpu_reference_bit_for_bit() {
    let Some(rig) = smoke_or_skip("gpu-rt") else {
        return;
    };
    let (s, sm, ctx) = (rig.stream.borrow(), &rig.sm, &rig.ctx);

    let inputs = smoke::probe_inputs();
    let n = inputs.len();
    let xf: Vec<f32> = inputs.iter().map(|p| p.0).collect();
    let xu: Vec<u32> = inputs.iter().map(|p| p.1).collect();
    let (_arena, b) = arena_for(ctx, n, 16);
    let _g = ctx.enter().unwrap();
    let mut staging = PinnedStaging::new(ctx, 1 << 20).unwrap(); // smaller than the inputs: chunked
    staging.upload(b.xf, &xf, s).unwrap();
    staging.upload(b.xu, &xu, s).unwrap();
    arena::memset_async(b.out, 0xff, s).unwrap(); // poison: every output starts as NaN bits
    sm.roundtrip(ctx, b.xf, b.xu, b.out, n, s).unwrap();
    let mut out = vec![0u32; n * ROUNDTRIP_COLS];
    staging.download(&mut out, b.out, s).unwrap();

    let mut bad = [0usize; ROUNDTRIP_COLS];
    for (i, (&x, &u)) in xf.iter().zip(&xu).enumerate() {
        let want = smoke::roundtrip_ref(x, u);
        for c in 0..ROUNDTRIP_COLS {
            let got = out[i * ROUNDTRIP_COLS + c];
            if !smoke::roundtrip_col_matches(c, got, want[c]) {
                bad[c] += 1;
                if bad[c] <= 5 {
                    println!(
                        "MISMATCH {}: x = {x:e} ({:#010x}), u = {u:#x}: device {got:#010x}, reference {:#010x}",
                        ROUNDTRIP_COLUMNS[c],
                        x.to_bits(),
                        want[c]
                    );
                }
            }
        }
    }
    for c in 0..ROUNDTRIP_COLS {
        println!(
            "{:<40} {:>8} inputs, {} mismatches",
            ROUNDTRIP_COLUMNS[c], n, bad[c]
        );
    }
    assert_eq!(
        bad.iter().sum::<usize>(),
        0,
        "common.cuh disagrees with the CPU reference"
    );
}

#[test]
fn warp_and_block_reductions_match_their_reference_order() {
    let Some(rig) = smoke_or_skip("gpu-red") else {
        return;
    };
    let (s, sm, ctx) = (rig.stream.borrow(), &rig.sm, &rig.ctx);
    let mut seed = 0x1234_5678_9abc_def1u64;
    for threads in [32u32, 96, 256, 1024] {
        let rows = 300u32;
        let len = (rows * threads) as usize;
        // Nonzero, finite, wildly different magnitudes: the summation order shows in the bits.
        let x: Vec<f32> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let m = 1.0 + (seed >> 41) as f32 / (1u64 << 23) as f32;
                let e = ((seed >> 8) % 40) as i32 - 20;
                m * 2f32.powi(e) * if seed & 1 == 0 { 1.0 } else { -1.0 }
            })
            .collect();
        let mut plan = ArenaPlan::new();
        let ids = [
            plan.reserve("x", len * 4, 256).unwrap(),
            plan.reserve("sums", rows as usize * 4, 256).unwrap(),
            plan.reserve("maxs", rows as usize * 4, 256).unwrap(),
            plan.reserve("warp_sums", len / 32 * 4, 256).unwrap(),
            plan.reserve("agree", rows as usize * 4, 256).unwrap(),
        ];
        let a = Arena::from_plan(ctx, &plan).unwrap();
        let [px, ps, pm, pw, pa] = ids.map(|i| a.region(i));
        let _g = ctx.enter().unwrap();
        arena::copy_to_device_sync(px, &x, s).unwrap();
        for p in [ps, pm, pw] {
            arena::memset_async(p, 0xff, s).unwrap();
        }
        sm.reduce(ctx, px, ps, pm, pw, pa, rows, threads, s)
            .unwrap();
        let (mut sums, mut maxs, mut ws, mut agree) = (
            vec![0f32; rows as usize],
            vec![0f32; rows as usize],
            vec![0f32; len / 32],
            vec![0u32; rows as usize],
        );
        arena::copy_to_host_sync(&mut sums, ps, s).unwrap();
        arena::copy_to_host_sync(&mut maxs, pm, s).unwrap();
        arena::copy_to_host_sync(&mut ws, pw, s).unwrap();
        arena::copy_to_host_sync(&mut agree, pa, s).unwrap();
        for r in 0..rows as usize {
            let row = &x[r * threads as usize..(r + 1) * threads as usize];
            assert_eq!(
                sums[r].to_bits(),
                smoke::block_sum_ref(row).to_bits(),
                "block_sum, {threads} threads, row {r}"
            );
            assert_eq!(
                maxs[r].to_bits(),
                smoke::block_max_ref(row).to_bits(),
                "block_max, {threads} threads, row {r}"
            );
            assert_eq!(
                agree[r], 0,
                "threads of row {r} saw different block results"
            );
            for (w, chunk) in row.chunks_exact(32).enumerate() {
                let got = ws[r * threads as usize / 32 + w];
                assert_eq!(
                    got.to_bits(),
                    smoke::warp_sum_ref(chunk).to_bits(),
                    "warp_sum row {r} warp {w}"
                );
            }
        }
        println!("reductions with {threads} threads per block: {rows} rows bit-exact");
    }
}

/// The f32 patterns where silu_newton claims its result (kernels/common.cuh): 2^-100 <= |x| <= 64.
fn silu_newton_claims(x: f32) -> bool {
    (2f32.powi(-100)..=64.0).contains(&x.abs())
}

#[test]
fn silu_newton_equals_the_ieee_division_on_every_pattern_it_claims() {
    let Some(rig) = smoke_or_skip("gpu-silu") else {
        return;
    };
    let (s, sm, ctx) = (rig.stream.borrow(), &rig.sm, &rig.ctx);
    // Every f32 bit pattern; under compute-sanitizer every 4099th (each exponent, both signs).
    let (step, n) = if under_sanitizer() {
        (4099u32, (1u64 << 32).div_ceil(4099))
    } else {
        (1u32, 1u64 << 32)
    };
    let claimed: u64 = if step == 1 {
        // Per sign: exponents -100 ..= 5 with every mantissa, and 64 itself.
        2 * (106 * (1 << 23) + 1)
    } else {
        (0..n)
            .filter(|&i| silu_newton_claims(f32::from_bits((i * step as u64) as u32)))
            .count() as u64
    };
    let mut plan = ArenaPlan::new();
    let id = plan.reserve("counts", 3 * 8, 256).unwrap();
    let a = Arena::from_plan(ctx, &plan).unwrap();
    let counts = a.region(id);
    let _g = ctx.enter().unwrap();
    arena::copy_to_device_sync(counts, &[0u64, 0, u64::MAX], s).unwrap();
    sm.silu_exhaustive(ctx, 0, step, n, counts, s).unwrap();
    let mut got = [0u64; 3];
    arena::copy_to_host_sync(&mut got, counts, s).unwrap();
    println!(
        "silu_newton: {n} patterns (step {step}), {} claimed, {} differ from silu_div_rn (first {:#x})",
        got[0], got[1], got[2]
    );
    assert_eq!(
        got[0], claimed,
        "silu_newton's range is not 2^-100 <= |x| <= 64"
    );
    assert_eq!(
        got[1], 0,
        "silu_newton differs from silu_div_rn (first pattern {:#x})",
        got[2]
    );
}

#[test]
fn arena_is_stable_and_launches_allocate_nothing() {
    let Some(rig) = smoke_or_skip("gpu-arena") else {
        return;
    };
    let (s, sm, reg, ctx) = (rig.stream.borrow(), &rig.sm, &rig.reg, &rig.ctx);
    let fill_n = 1_000_003usize;
    let n = 4096usize;
    let (mut a, b) = arena_for(ctx, n, fill_n);
    let before: Vec<_> = a.regions().to_vec();

    // Regions: inside the allocation, aligned, disjoint, in plan order.
    let whole = a.whole();
    let mut prev_end = whole.addr();
    for r in a.regions() {
        assert_eq!(r.ptr.addr() % r.align as u64, 0, "{} misaligned", r.name);
        assert!(
            r.ptr.addr() >= prev_end,
            "{} overlaps the previous region",
            r.name
        );
        prev_end = r.ptr.addr() + r.ptr.bytes() as u64;
        assert!(
            prev_end <= whole.addr() + whole.bytes() as u64,
            "{} runs past the arena",
            r.name
        );
    }
    // Sealed after create: no more device memory.
    let e = a.reserve("late", 16, 16).unwrap_err();
    assert_eq!(e.status, dsv4::Status::State, "{e}");

    let _g = ctx.enter().unwrap();
    let mut staging = PinnedStaging::new(ctx, 64 * 1024).unwrap();
    // Warm-up: one launch of each kernel, on the host-style stream and the legacy default stream.
    sm.fill(ctx, b.fill_u, b.fill_f, fill_n as u64, -7, 0.25, s)
        .unwrap();
    s.synchronize().unwrap(); // `s` is non-blocking: it does not order against the legacy stream
    sm.fill(
        ctx,
        b.fill_u,
        b.fill_f,
        fill_n as u64,
        -7,
        0.25,
        BorrowedStream::LEGACY_DEFAULT,
    )
    .unwrap();
    sm.roundtrip(ctx, b.xf, b.xu, b.out, n, s).unwrap();
    ctx.synchronize().unwrap();
    let (free0, total) = ctx.mem_info().unwrap();

    for i in 0..100 {
        sm.fill(ctx, b.fill_u, b.fill_f, fill_n as u64, i, 0.25, s)
            .unwrap();
        sm.roundtrip(ctx, b.xf, b.xu, b.out, n, s).unwrap();
    }
    sm.fill(ctx, b.fill_u, b.fill_f, fill_n as u64, -7, 0.25, s)
        .unwrap();
    s.synchronize().unwrap();
    let (free1, _) = ctx.mem_info().unwrap();
    println!("device memory free before/after 100 launch rounds: {free0} / {free1} of {total}");
    if under_sanitizer() {
        println!(
            "note: free-memory equality not asserted under compute-sanitizer (it allocates itself)"
        );
    } else {
        assert_eq!(free0, free1, "device memory changed across launches");
    }
    assert_eq!(a.regions(), &before[..], "arena regions moved");

    // The last fill's results, read back through the staging buffer (several chunks).
    let mut u = vec![0u32; fill_n];
    let mut f = vec![0f32; fill_n];
    staging.download(&mut u, b.fill_u, s).unwrap();
    staging.download(&mut f, b.fill_f, s).unwrap();
    for i in 0..fill_n {
        assert_eq!(u[i], smoke::fill_u32_ref(i as u64, -7), "fill_u32[{i}]");
        assert_eq!(f[i], i as f32 * 0.25, "fill_f32[{i}]");
    }

    // Staged upload then download round-trips a buffer larger than the staging buffer.
    let data: Vec<u32> = (0..fill_n as u32)
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    staging.upload(b.fill_u, &data, s).unwrap();
    let mut back = vec![0u32; fill_n];
    staging.download(&mut back, b.fill_u, s).unwrap();
    assert!(back == data, "staged upload/download round trip");

    // Launch-time checks: too much dynamic shared memory is refused before the driver sees it.
    let k = reg.get("smoke", "smoke_fill").unwrap();
    let mut args = dsv4::cuda::KernelArgs::new();
    args.ptr(b.fill_u).ptr(b.fill_f).u64(1).i32(0).f32(1.0);
    // SAFETY: arguments match smoke_fill; the launch is refused anyway.
    let e = unsafe { dsv4::cuda::launch(&k, 1u32, 32u32, k.max_dynamic_smem + 1, s, &args) }
        .unwrap_err();
    assert!(e.message.contains("smoke::smoke_fill"), "{e}");
}
