//! The `kernel_set` create option (ABI 1.2) and the create-params layouts of older hosts,
//! through the C ABI. CPU always; the CUDA half needs a device (compiles the chosen set).

mod common;

use std::ffi::CString;

use common::abi::last_error;
use common::gpu::devices;
use dsv4::ffi::*;

fn params(dev: i32) -> dsv4_create_params {
    let mut p = dsv4_create_params_default();
    p.use_tiny_default = 1;
    p.device = dev;
    p.max_num_seqs = 2;
    p.max_num_tokens = 16;
    p.max_seq_len = 32;
    p
}

/// create -> dummy load -> finalize; the status of the first failing step.
fn build(p: &dsv4_create_params) -> (dsv4_status, String) {
    let mut e = std::ptr::null_mut();
    let mut st = unsafe { dsv4_create(p, &mut e) };
    if st == DSV4_STATUS_OK {
        st = unsafe { dsv4_load(e, std::ptr::null(), DSV4_LOAD_DUMMY) };
    }
    if st == DSV4_STATUS_OK {
        st = unsafe { dsv4_finalize(e, std::ptr::null_mut()) };
    }
    let msg = last_error();
    unsafe { dsv4_destroy(e) };
    (st, msg)
}

#[test]
fn both_sets_are_accepted_and_an_unknown_set_is_a_config_error_naming_it() {
    for dev in devices() {
        for name in ["reference", "fast"] {
            let set = CString::new(name).unwrap();
            let mut p = params(dev);
            p.kernel_set = set.as_ptr();
            let (st, msg) = build(&p);
            assert_eq!(st, DSV4_STATUS_OK, "device {dev}, set {name}: {msg}");
        }

        let bogus = CString::new("turbo").unwrap();
        let mut p = params(dev);
        p.kernel_set = bogus.as_ptr();
        let (st, msg) = build(&p);
        assert_eq!(st, DSV4_STATUS_CONFIG, "device {dev}");
        assert!(
            msg.contains("params->kernel_set")
                && msg.contains("`turbo`")
                && msg.contains("reference")
                && msg.contains("fast"),
            "device {dev}: {msg}"
        );
    }
}

/// The fast set runs `official` numerics only: asking for it with `exact` is a CONFIG error
/// naming both, on every backend (the options are checked before any device work).
#[test]
fn fast_set_with_exact_numerics_is_a_config_error() {
    for dev in devices() {
        let fast = CString::new("fast").unwrap();
        let mut p = params(dev);
        p.kernel_set = fast.as_ptr();
        p.numerics = DSV4_NUMERICS_EXACT;
        let (st, msg) = build(&p);
        assert_eq!(st, DSV4_STATUS_CONFIG, "device {dev}: {msg}");
        assert!(
            msg.contains("params->kernel_set") && msg.contains("`fast`") && msg.contains("exact"),
            "device {dev}: {msg}"
        );
    }
}

#[test]
fn a_host_built_against_abi_1_0_still_creates_engines() {
    // ABI 1.0's dsv4_create_params ended at `cache_dir`: such a host passes the shorter
    // struct_size, and the fields it lacks take their defaults (the default kernel set).
    let v10 = std::mem::offset_of!(dsv4_create_params, kernel_set);
    for dev in devices() {
        let mut p = params(dev);
        p.struct_size = v10;
        // Bytes past the host's struct must not be read: poison them.
        p.kernel_set = std::ptr::dangling();
        let (st, msg) = build(&p);
        assert_eq!(st, DSV4_STATUS_OK, "device {dev}: {msg}");
        p.struct_size = v10 - 1;
        let (st, msg) = build(&p);
        assert_eq!(st, DSV4_STATUS_INVALID_ARGUMENT, "device {dev}: {msg}");
        assert!(msg.contains("struct_size"), "{msg}");
    }
}
