//! dsv4_plan_memory (ABI 1.3): the memory an engine would use, by kind, from the create
//! params alone; after dsv4_create with the same params dsv4_get_info reports the same
//! figures, to the byte. On the CPU for several models, weight formats and capacities (the
//! state grows by exactly one slot's bytes per slot); on CUDA (device 0 when there is one)
//! also for the Flash-shaped config and against the device memory the create takes.

mod common;

use std::ffi::CString;

use common::abi::{fails, ok};
use common::fixture_dir;
use common::gpu::devices;
use dsv4::ffi::*;

struct Params {
    p: dsv4_create_params,
    _dir: Option<CString>,
}

fn params(model: Option<&str>, dev: i32, format: i32, seqs: i32, seq_len: i32) -> Params {
    let mut p = dsv4_create_params_default();
    // A fixture name, or a config file of the repository (`configs/...`).
    let path = |m: &str| match m.strip_prefix("configs/") {
        Some(_) => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(m),
        None => fixture_dir(m),
    };
    let dir = model.map(|m| CString::new(path(m).to_str().unwrap()).unwrap());
    match &dir {
        Some(d) => p.config_path = d.as_ptr(),
        None => p.use_tiny_default = 1,
    }
    p.device = dev;
    p.weight_format = format;
    p.max_num_seqs = seqs;
    p.max_num_tokens = 32;
    p.max_seq_len = seq_len;
    Params { p, _dir: dir }
}

fn plan(p: &dsv4_create_params) -> dsv4_memory_plan {
    // SAFETY: a zeroed plan is valid; struct_size says how much may be written.
    let mut m: dsv4_memory_plan = unsafe { std::mem::zeroed() };
    m.struct_size = std::mem::size_of::<dsv4_memory_plan>();
    unsafe { ok(dsv4_plan_memory(p, &mut m)) };
    m
}

fn figures(m: &dsv4_memory_plan) -> [u64; 7] {
    [
        m.weights_nbytes,
        m.derived_nbytes,
        m.state_nbytes,
        m.state_slot_nbytes,
        m.workspace_nbytes,
        m.device_nbytes,
        m.host_nbytes,
    ]
}

fn info_figures(i: &dsv4_info) -> [u64; 7] {
    [
        i.weights_nbytes,
        i.derived_nbytes,
        i.state_nbytes,
        i.state_slot_nbytes,
        i.workspace_nbytes,
        i.device_nbytes,
        i.host_nbytes,
    ]
}

#[test]
fn the_plan_equals_what_create_allocates_on_every_backend() {
    let cases: &[(Option<&str>, i32)] = &[
        (None, DSV4_WEIGHT_FORMAT_AS_STORED),
        (Some("tiny"), DSV4_WEIGHT_FORMAT_AS_STORED),
        (Some("tiny"), DSV4_WEIGHT_FORMAT_QUANTIZE),
        (Some("tiny"), DSV4_WEIGHT_FORMAT_BF16),
        (Some("tiny_fp8"), DSV4_WEIGHT_FORMAT_AS_STORED),
        (Some("tiny_native"), DSV4_WEIGHT_FORMAT_AS_STORED),
    ];
    for dev in devices() {
        // Flash shapes on CUDA (on the CPU its host store would not fit a CI machine).
        let flash = [(
            Some("configs/flash-shaped-4-layers.json"),
            DSV4_WEIGHT_FORMAT_AS_STORED,
        )];
        let extra: &[(Option<&str>, i32)] = if dev >= 0 { &flash } else { &[] };
        for &(model, format) in cases.iter().chain(extra) {
            let capacities: &[(i32, i32)] = if model.is_some_and(|m| m.starts_with("configs/")) {
                &[(4, 256)]
            } else {
                &[(1, 16), (3, 64), (4, 256)]
            };
            for &(seqs, seq_len) in capacities {
                let what = format!("{model:?} format {format} dev {dev} seqs {seqs} len {seq_len}");
                let p = params(model, dev, format, seqs, seq_len);
                let m = plan(&p.p);
                let free_before = (dev >= 0).then(|| common::gpu::free_memory(dev));
                let mut e = std::ptr::null_mut();
                unsafe { ok(dsv4_create(&p.p, &mut e)) };
                let mut i: dsv4_info = unsafe { std::mem::zeroed() };
                i.struct_size = std::mem::size_of::<dsv4_info>();
                unsafe { ok(dsv4_get_info(e, &mut i)) };
                assert_eq!(figures(&m), info_figures(&i), "{what}: plan vs info");
                assert!(m.weights_nbytes > 0 && m.state_slot_nbytes > 0, "{what}");
                if dev < 0 {
                    // Host memory, exactly one slot's bytes per slot, no device memory.
                    assert_eq!(m.state_nbytes, seqs as u64 * m.state_slot_nbytes, "{what}");
                    assert_eq!(m.device_nbytes, 0, "{what}");
                    assert_eq!(
                        m.host_nbytes,
                        m.weights_nbytes + m.derived_nbytes + m.state_nbytes,
                        "{what}"
                    );
                } else {
                    // The engine's one device allocation: the kinds fit inside it, and the
                    // device's free memory dropped by it (up to the driver's granularity).
                    let sum =
                        m.weights_nbytes + m.derived_nbytes + m.state_nbytes + m.workspace_nbytes;
                    assert!(
                        sum <= m.device_nbytes,
                        "{what}: kinds {sum} > device {}",
                        m.device_nbytes
                    );
                    let taken = free_before.unwrap() - common::gpu::free_memory(dev);
                    assert!(
                        taken >= m.device_nbytes && taken <= m.device_nbytes + (64 << 20),
                        "{what}: create took {taken} bytes of device memory, planned {}",
                        m.device_nbytes
                    );
                }
                unsafe { dsv4_destroy(e) };
            }
        }
    }
}

/// Planning allocates nothing: a plan for 65,536 slots of 2^20 positions (far beyond this
/// machine's memory) returns at once with exactly that many slots' bytes; bad params are the errors dsv4_create
/// gives.
#[test]
fn planning_allocates_nothing_and_checks_params_like_create() {
    let one = plan(&params(Some("tiny"), -1, DSV4_WEIGHT_FORMAT_AS_STORED, 1, 1 << 20).p);
    let mut p = params(
        Some("tiny"),
        -1,
        DSV4_WEIGHT_FORMAT_AS_STORED,
        1 << 16,
        1 << 20,
    );
    let t0 = std::time::Instant::now();
    let m = plan(&p.p);
    assert!(
        t0.elapsed().as_secs_f64() < 1.0,
        "planning took {:?}",
        t0.elapsed()
    );
    assert_eq!(m.state_nbytes, (1u64 << 16) * one.state_slot_nbytes);
    assert!(
        m.state_nbytes > 1 << 40,
        "{} bytes of state",
        m.state_nbytes
    );
    p.p.max_num_seqs = 0;
    let mut m2: dsv4_memory_plan = unsafe { std::mem::zeroed() };
    m2.struct_size = std::mem::size_of::<dsv4_memory_plan>();
    unsafe {
        fails(
            dsv4_plan_memory(&p.p, &mut m2),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["max_num_seqs"],
        );
        fails(
            dsv4_plan_memory(&p.p, std::ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["out"],
        );
    }
}

/// The CUDA state in official numerics keeps the KV rows as their codes (src/cuda/kv_pages.rs):
/// a Flash-shaped engine's slot at 65,536 positions is exactly the closed form smaller than in
/// exact numerics (f32 rows): per KV row 2048 -> 584 bytes (448 e4m3 + 64 BF16 + 8 scale
/// bytes), per indexer key 512 -> 68 (64 nibble bytes + 4 scales), in pages of 64 rows: the
/// rings (4 layers x 2 pages), the CSA layer's 16,384 entries and keys (256 pages each) and the
/// HCA layer's 512 entries (8 pages). Planning needs no GPU.
#[test]
fn official_numerics_store_the_kv_state_as_codes() {
    let flash = |numerics: i32| {
        let mut p = params(
            Some("configs/flash-shaped-4-layers.json"),
            0,
            DSV4_WEIGHT_FORMAT_AS_STORED,
            1,
            65536,
        );
        p.p.numerics = numerics;
        plan(&p.p)
    };
    let exact = flash(DSV4_NUMERICS_EXACT);
    let official = flash(DSV4_NUMERICS_OFFICIAL);
    let kv_pages = 4 * 2 + 256 + 8;
    let key_pages = 256;
    let saved = 64 * (kv_pages * (2048 - 584) + key_pages * (512 - 68));
    assert_eq!(
        exact.state_slot_nbytes - official.state_slot_nbytes,
        saved,
        "exact {} official {}",
        exact.state_slot_nbytes,
        official.state_slot_nbytes
    );
    println!(
        "Flash-shaped 4 layers, one slot of 65536 positions: state {} bytes exact, {} official ({:.2}x)",
        exact.state_slot_nbytes,
        official.state_slot_nbytes,
        exact.state_slot_nbytes as f64 / official.state_slot_nbytes as f64
    );
}
