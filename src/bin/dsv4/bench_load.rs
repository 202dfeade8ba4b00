//! `dsv4 bench load`: how long create + load + finalize take and how much host memory they
//! hold, for a config with dummy weights or a safetensors checkpoint. One JSON line.
//!
//! Host memory is the process's resident set read from /proc/self/status after each step
//! (`VmRSS`) and its peak over the whole run (`VmHWM`): this process does nothing else, so
//! the peak is the engine's (plus the CUDA driver's own few hundred MB). Load progress lines
//! go to stderr (the library's Info log).

use std::path::Path;
use std::time::Instant;

use dsv4::{ConfigSource, Engine, EngineOptions, LoadFormat};

use crate::{Args, err};

/// A `/proc/self/status` field in bytes (`VmRSS`, `VmHWM`); 0 where unavailable.
pub fn proc_status_bytes(field: &str) -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Bytes of the `*.safetensors` files under `dir` (what a checkpoint load reads).
fn checkpoint_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// A 64-bit hash of `bytes`: 16 slices hashed on their own threads, then combined in order.
fn hash_bytes(bytes: &[u8], mut h: u64) -> u64 {
    let fold = |mut h: u64, part: &[u8]| {
        for c in part.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            h = (h ^ u64::from_le_bytes(w))
                .wrapping_mul(0x0100_0000_01B3)
                .rotate_left(29);
        }
        h
    };
    let parts: Vec<&[u8]> = bytes
        .chunks(bytes.len().div_ceil(16).max(8).next_multiple_of(8))
        .collect();
    let sums: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = parts.iter().map(|p| s.spawn(move || fold(0, p))).collect();
        hs.into_iter().map(|j| j.join().unwrap_or(0)).collect()
    });
    for v in sums {
        h = (h ^ v).wrapping_mul(0x0100_0000_01B3).rotate_left(29);
    }
    h
}

/// A 64-bit hash of the engine's weight buffer (`--checksum 1`, bench refit): the device span
/// copied out in 256 MiB pieces on CUDA, every weight's bytes on the CPU. Two loads of the
/// same values hash alike (a dummy load and a load of its dummy-checkpoint).
pub fn weights_hash(e: &Engine) -> Result<u64, String> {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    if let Some(store) = e.host_store() {
        for t in store.tensors() {
            let l = t.data.layout();
            // SAFETY: the store's buffer holds `data_bytes` bytes at this address.
            h = hash_bytes(
                unsafe { std::slice::from_raw_parts(t.data.as_ptr(), l.data_bytes) },
                h,
            );
        }
        return Ok(h);
    }
    let (addr, bytes) = e.buffer_spans().weights;
    let piece = 256u64 << 20;
    let mut off = 0;
    while off < bytes {
        let n = piece.min(bytes - off) as usize;
        let v = e
            .stage_device_bytes(addr + off, n, std::ptr::null_mut(), "weights checksum")
            .map_err(err)?;
        h = hash_bytes(&v, h);
        off += n as u64;
    }
    Ok(h)
}

pub fn run(a: &Args, device: i32) -> Result<(), String> {
    dsv4::log::set_sink(None, dsv4::log::Level::Info);
    let opts = EngineOptions {
        device,
        max_num_seqs: a.num("max-num-seqs", 1)?,
        max_num_tokens: a.num("max-num-tokens", 256)?,
        max_seq_len: a.num("max-seq-len", 4096)?,
        staging_bytes: a.num("staging-mb", 0)? << 20,
        ..Default::default()
    };
    let model = a.get("model");
    let source = match (a.get("config"), model) {
        (Some(c), _) => ConfigSource::Path(c.into()),
        (None, Some(d)) => ConfigSource::Path(d.into()),
        (None, None) => ConfigSource::TinyDefault,
    };
    let rss = || proc_status_bytes("VmRSS");
    let t0 = Instant::now();
    let mut e = Engine::create(source, opts).map_err(err)?;
    let create_s = t0.elapsed().as_secs_f64();
    let rss_created = rss();
    let t1 = Instant::now();
    match model {
        Some(d) => e.load(Some(Path::new(d)), LoadFormat::Auto),
        None => e.load(None, LoadFormat::Dummy),
    }
    .map_err(err)?;
    let load_s = t1.elapsed().as_secs_f64();
    let rss_loaded = rss();
    let t2 = Instant::now();
    e.finalize().map_err(err)?;
    let finalize_s = t2.elapsed().as_secs_f64();
    let weights = e.weights().total_bytes();
    let read = model.map_or(weights, |d| checkpoint_bytes(Path::new(d)));
    let mem = e.memory();
    let hash = if a.num("checksum", 0)? != 0 {
        format!("\"{:016x}\"", weights_hash(&e)?)
    } else {
        "null".into()
    };
    println!(
        "{{\"bench\": \"load\", \"backend\": \"{}\", \"layers\": {}, \"source\": \"{}\", \
         \"weights_bytes\": {weights}, \"read_bytes\": {read}, \"create_s\": {create_s:.3}, \
         \"load_s\": {load_s:.3}, \"load_gbps\": {:.3}, \"read_gbps\": {:.3}, \
         \"finalize_s\": {finalize_s:.3}, \"rss_after_create\": {rss_created}, \
         \"rss_after_load\": {rss_loaded}, \"rss_after_finalize\": {}, \"peak_rss\": {}, \
         \"host_transient_after_finalize\": {}, \"device_bytes\": {}, \"host_bytes\": {}, \"weights_hash\": {hash}}}",
        if device >= 0 {
            format!("cuda:{device}")
        } else {
            "cpu".into()
        },
        e.config().num_layers,
        if model.is_some() {
            "safetensors"
        } else {
            "dummy"
        },
        weights as f64 / load_s / 1e9,
        read as f64 / load_s / 1e9,
        rss(),
        proc_status_bytes("VmHWM"),
        e.transient_host_bytes(),
        mem.device,
        mem.host,
    );
    Ok(())
}
