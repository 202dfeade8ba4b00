//! `dsv4 bench refit [--config FILE] [--device cuda[:N]]`: weights written from device memory
//! (an RL trainer's sync), every weight of the model in one call. One JSON line.
//!
//! Two sets of source tensors are made in device memory, in the release's encodings (FP8 /
//! FP4 codes with UE8M0 scales, F32 floats, I32 hash tables): the dummy weights of seed 2 and
//! of the default seed. Engine A loads the first with `dsv4_load_tensors` semantics
//! (`Engine::load_tensors`), is finalized, then refits ALL its weights from the second
//! (`Engine::refit_on`): timed, with the process's resident memory sampled every 5 ms during
//! the call (no host bounce: it must stay flat). Engine B is a plain dummy load (default seed,
//! through host staging). A's weights must then hash like B's, and one forward of each must
//! give the same logits bit for bit. The copy floor is a device-to-device copy of the same
//! bytes measured in the same run.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use dsv4::cuda::arena::{Arena, copy_to_device_sync, copy_to_host_sync, memcpy_dtod_async};
use dsv4::cuda::context::Context;
use dsv4::cuda::stream::OwnedStream;
use dsv4::engine::DeviceBatch;
use dsv4::weights::dummy::DummyValues;
use dsv4::weights::qmatrix::QFormat;
use dsv4::weights::rows::Geometry;
use dsv4::weights::table::{StorageKind, WeightTable};
use dsv4::weights::values::WeightValues;
use dsv4::weights::{Bytes, HostDtype, UpdateTensor};
use dsv4::{ConfigSource, Engine, EngineOptions, LoadFormat};

use crate::bench_load::{proc_status_bytes, weights_hash};
use crate::dummy_checkpoint::{e8m0, scale_name};
use crate::{Args, err};

/// One source tensor in device memory: name, dtype, logical shape, byte range in the arena.
struct Src {
    name: String,
    dtype: HostDtype,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// The stored-format tensors of every weight of `table` (dummy values of `seed`): their
/// descriptions and total bytes (256-byte aligned offsets).
fn plan_sources(table: &WeightTable) -> (Vec<(usize, Vec<Src>)>, usize) {
    let mut off = 0usize;
    let mut out = vec![];
    let mut take = |len: usize| {
        let o = off;
        off += len.next_multiple_of(256);
        o
    };
    for i in 0..table.len() {
        let e = table.entry(i);
        let g = Geometry::of(e);
        let name = e.spec.name.clone();
        let shape = e.spec.shape.clone();
        let data = g.data_range(&(0..g.rows)).len();
        let scales = g.scale_range(&(0..g.rows)).len();
        let scale_name = scale_name(&name);
        let srcs = match g.kind {
            StorageKind::F32 => vec![(name, HostDtype::F32, shape, data)],
            StorageKind::Bf16 => vec![(name, HostDtype::Bf16, shape, data)],
            StorageKind::I32 => vec![(name, HostDtype::I32, shape, data)],
            StorageKind::Quant(q) => {
                let (dt, grid) = match q {
                    QFormat::Fp8 { block } => (
                        HostDtype::F8E4M3,
                        vec![g.rows.div_ceil(block[0]), g.cols.div_ceil(block[1])],
                    ),
                    QFormat::Fp4 => (HostDtype::Fp4E2M1, vec![g.rows, g.cols.div_ceil(32)]),
                };
                vec![
                    (name, dt, shape, data),
                    (scale_name, HostDtype::E8M0, grid, scales),
                ]
            }
        };
        let srcs = srcs
            .into_iter()
            .map(|(name, dtype, shape, len)| Src {
                name,
                dtype,
                shape,
                offset: take(len),
                len,
            })
            .collect();
        out.push((i, srcs));
    }
    (out, off)
}

/// Fills the sources of `values` into `arena`: weights made on all cores, each through host
/// memory and copied synchronously.
fn upload_sources(
    table: &WeightTable,
    values: &DummyValues,
    plan: &[(usize, Vec<Src>)],
    arena: &Arena,
    ctx: &Context,
) -> Result<(), String> {
    let next = std::sync::Mutex::new(plan.iter());
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<(), String> {
                    let _g = ctx.enter().map_err(err)?;
                    let null = dsv4::cuda::stream::BorrowedStream::from_raw(std::ptr::null_mut());
                    loop {
                        let Some((i, srcs)) = next.lock().unwrap_or_else(|e| e.into_inner()).next()
                        else {
                            return Ok(());
                        };
                        let g = Geometry::of(table.entry(*i));
                        let rows = 0..g.rows;
                        let mut data = vec![0u8; g.data_range(&rows).len()];
                        let mut scales = vec![0f32; g.scale_range(&rows).len()];
                        values.fill(table, *i, rows, &mut data, &mut scales);
                        let e8m0 = e8m0(&scales);
                        for (k, src) in srcs.iter().enumerate() {
                            let bytes: &[u8] = if k == 0 { &data } else { &e8m0 };
                            let dst = arena.whole().slice(src.offset, src.len).map_err(err)?;
                            copy_to_device_sync(dst, bytes, null).map_err(err)?;
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("a source thread panicked".into()))
            })
            .collect::<Result<Vec<()>, String>>()
    })?;
    Ok(())
}

/// The update entries of a source set in `arena`.
fn updates<'a>(plan: &'a [(usize, Vec<Src>)], arena: &Arena) -> Vec<UpdateTensor<'a>> {
    plan.iter()
        .flat_map(|(_, s)| s)
        .map(|s| UpdateTensor {
            name: &s.name,
            dtype: s.dtype,
            shape: &s.shape,
            data: Bytes::Device {
                addr: arena.whole().addr() + s.offset as u64,
                len: s.len,
            },
        })
        .collect()
}

/// Logits of one 8-token prefill in slot 0 (bit patterns).
fn logits(e: &mut Engine, ctx: &Context, stream: &OwnedStream) -> Result<Vec<u32>, String> {
    let vocab = e.config().vocab_size;
    let t = 8usize;
    let buf = Arena::new(ctx, 4096 + t * vocab * 4).map_err(err)?;
    let w = buf.whole();
    let toks: Vec<i32> = (0..t as i32)
        .map(|i| (i * 131 + 7) % vocab as i32)
        .collect();
    let pos: Vec<i32> = (0..t as i32).collect();
    let st = stream.borrow();
    let arrays: [&[i32]; 4] = [&toks, &pos, &[0], &[0, t as i32]];
    for (k, a) in arrays.iter().enumerate() {
        copy_to_device_sync(w.slice(k * 1024, a.len() * 4).map_err(err)?, a, st).map_err(err)?;
    }
    let out = w.slice(4096, t * vocab * 4).map_err(err)?;
    let db = DeviceBatch {
        num_tokens: t,
        num_seqs: 1,
        token_ids: w.addr(),
        positions: w.addr() + 1024,
        seq_slots: w.addr() + 2048,
        query_start: w.addr() + 3072,
        logits_rows: 0,
        num_logits: t,
        logits: out.addr(),
        logits_bf16: false,
    };
    e.forward_device(&db, st.raw() as *mut _).map_err(err)?;
    let mut host = vec![0u32; t * vocab];
    copy_to_host_sync(&mut host, out, st).map_err(err)?;
    Ok(host)
}

pub fn run(a: &Args, device: i32) -> Result<(), String> {
    if device < 0 {
        return Err("bench refit runs on CUDA (--device cuda[:N])".into());
    }
    let config = a
        .get("config")
        .unwrap_or("configs/flash-shaped-4-layers.json");
    let opts = EngineOptions {
        device,
        max_num_seqs: 1,
        max_num_tokens: 64,
        max_seq_len: 256,
        ..Default::default()
    };
    let source = ConfigSource::Path(config.into());
    let mut ea = Engine::create(source.clone(), opts.clone()).map_err(err)?;
    let ctx = Context::retain(device).map_err(err)?;
    let _g = ctx.enter().map_err(err)?;
    let stream = OwnedStream::new(&ctx).map_err(err)?;
    let raw = stream.borrow().raw() as *mut std::ffi::c_void;
    // The sources, in device memory (made through the host, before anything is measured).
    let table = WeightTable::new(ea.config(), dsv4::WeightFormat::AsStored).map_err(err)?;
    let (plan, bytes) = plan_sources(&table);
    let seed2 = Arena::new(&ctx, bytes).map_err(err)?;
    let seed1 = Arena::new(&ctx, bytes).map_err(err)?;
    let cfg = ea.config().clone();
    upload_sources(
        &table,
        &DummyValues::new(&table, &cfg, 2),
        &plan,
        &seed2,
        &ctx,
    )?;
    let default_seed = DummyValues::new(&table, &cfg, 0x5EED_D5F4);
    upload_sources(&table, &default_seed, &plan, &seed1, &ctx)?;
    // A: load_tensors from device memory (seed 2), finalize, then refit everything (seed 1).
    let t0 = Instant::now();
    ea.load_tensors(&updates(&plan, &seed2), raw).map_err(err)?;
    let load_s = t0.elapsed().as_secs_f64();
    ea.finalize_on(raw).map_err(err)?;
    let weights = ea.weights().total_bytes();
    let ups = updates(&plan, &seed1);
    let source_bytes: usize = ups.iter().map(|u| u.data.len()).sum();
    let stop = AtomicBool::new(false);
    let peak = AtomicU64::new(0);
    let rss_before = proc_status_bytes("VmRSS");
    let (refit_s, result) = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(proc_status_bytes("VmRSS"), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        let t = Instant::now();
        let r = ea.refit_on(&ups, raw);
        let secs = t.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        (secs, r)
    });
    result.map_err(err)?;
    let rss_after = proc_status_bytes("VmRSS");
    // The copy floor: the same bytes copied device to device, in the same run.
    let floor_s = {
        let dst = Arena::new(&ctx, bytes).map_err(err)?;
        let t = Instant::now();
        memcpy_dtod_async(dst.whole(), seed1.whole(), stream.borrow()).map_err(err)?;
        stream.borrow().synchronize().map_err(err)?;
        t.elapsed().as_secs_f64()
    };
    let hash_a = weights_hash(&ea)?;
    let logits_a = logits(&mut ea, &ctx, &stream)?;
    drop(ea);
    drop(seed2);
    // B: a plain dummy load (host staging), default seed.
    let mut eb = Engine::create(source, opts).map_err(err)?;
    eb.load(None, LoadFormat::Dummy).map_err(err)?;
    eb.finalize_on(raw).map_err(err)?;
    let hash_b = weights_hash(&eb)?;
    let logits_b = logits(&mut eb, &ctx, &stream)?;
    let equal = hash_a == hash_b && logits_a == logits_b;
    println!(
        "{{\"bench\": \"refit\", \"device\": {device}, \"layers\": {}, \"entries\": {}, \
         \"weights_bytes\": {weights}, \"source_bytes\": {source_bytes}, \
         \"load_tensors_s\": {load_s:.3}, \"refit_s\": {refit_s:.3}, \
         \"refit_gbps\": {:.1}, \"copy_floor_s\": {floor_s:.4}, \"refit_over_floor\": {:.2}, \
         \"rss_before\": {rss_before}, \"rss_peak_during\": {}, \"rss_after\": {rss_after}, \
         \"weights_equal\": {}, \"logits_equal\": {}}}",
        cfg.num_layers,
        ups.len(),
        source_bytes as f64 / refit_s / 1e9,
        refit_s / floor_s,
        peak.load(Ordering::Relaxed).max(rss_after),
        hash_a == hash_b,
        logits_a == logits_b,
    );
    if !equal {
        return Err("the refit engine differs from a fresh load".into());
    }
    Ok(())
}
