//! The C ABI: the only place in the crate with `extern "C"`.
//!
//! - `status`: `DSV4_STATUS_*` (equal to [`crate::error::Status`]), the thread-local last
//!   error, the panic boundary every export runs in, NULL-check helpers.
//! - `params`: versioned `#[repr(C)]` structs, their defaults, integer enums and their
//!   validation into the engine's Rust types.
//! - `engine_api`: the exports (lifecycle, forward, refit, introspection, versions).
//! - `logging`: the host log callback.
//!
//! `include/dsv4.h` is generated from these files by cbindgen (build.rs); the header is
//! committed and `tests/header_drift.rs` fails when it is stale. Never call into the
//! engine without going through `ffi_boundary`, and never let a Rust type that is not
//! `#[repr(C)]` cross the boundary except behind the opaque `dsv4_engine` pointer.

#![allow(non_camel_case_types)]
// These doc comments are the C header's (cbindgen copies them): `[num_tokens]` there is an
// array extent, not an intra-doc link.
#![allow(rustdoc::broken_intra_doc_links)]

// Declaration order is the order of the generated header: statuses, structs, functions.
pub mod engine_api;
pub mod logging;
pub mod params;
pub mod status;

pub use engine_api::*;
pub use logging::*;
pub use params::{
    DSV4_DEVICE_CPU, DSV4_DTYPE_BF16, DSV4_DTYPE_E8M0, DSV4_DTYPE_F8_E4M3, DSV4_DTYPE_F16,
    DSV4_DTYPE_F32, DSV4_DTYPE_F64, DSV4_DTYPE_FP4_E2M1, DSV4_DTYPE_I32, DSV4_DTYPE_I64,
    DSV4_FIELD_LOGITS_ROWS, DSV4_FIELD_POSITIONS, DSV4_FIELD_QUERY_START, DSV4_FIELD_SEQ_SLOTS,
    DSV4_FIELD_TOKEN_IDS, DSV4_LOAD_AUTO, DSV4_LOAD_DUMMY, DSV4_LOAD_SAFETENSORS, DSV4_LOGITS_BF16,
    DSV4_LOGITS_F32, DSV4_MAX_DIMS, DSV4_MEMORY_DEVICE, DSV4_MEMORY_HOST, DSV4_NAME_FUSED_DOWN,
    DSV4_NAME_FUSED_GATE_UP, DSV4_NAME_SCALE, DSV4_NAME_SKIPPED, DSV4_NAME_WEIGHT,
    DSV4_NUMERICS_EXACT, DSV4_NUMERICS_OFFICIAL, DSV4_PAD_SLOT, DSV4_PHASE_CREATED,
    DSV4_PHASE_LOADED, DSV4_PHASE_READY, DSV4_PHASE_REFITTING, DSV4_RULE_DUPLICATE,
    DSV4_RULE_ENDPOINT, DSV4_RULE_NOT_CONSECUTIVE, DSV4_RULE_NOT_CONTINUING,
    DSV4_RULE_NOT_INCREASING, DSV4_RULE_RANGE, DSV4_WEIGHT_FORMAT_AS_STORED,
    DSV4_WEIGHT_FORMAT_BF16, DSV4_WEIGHT_FORMAT_QUANTIZE, dsv4_batch, dsv4_batch_fault,
    dsv4_create_params, dsv4_info, dsv4_memory_plan, dsv4_tensor, dsv4_weight_desc,
};
pub use status::{
    DSV4_STATUS_CAPACITY, DSV4_STATUS_CONFIG, DSV4_STATUS_CUDA, DSV4_STATUS_FORMAT,
    DSV4_STATUS_INTERNAL, DSV4_STATUS_INVALID_ARGUMENT, DSV4_STATUS_IO, DSV4_STATUS_NO_DEVICE,
    DSV4_STATUS_NULL_POINTER, DSV4_STATUS_OK, DSV4_STATUS_OUT_OF_MEMORY, DSV4_STATUS_STATE,
    DSV4_STATUS_TENSOR, DSV4_STATUS_UNSUPPORTED, dsv4_status,
};
