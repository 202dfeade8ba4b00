//! CPU reference vs the transformers fp32 oracle (tests/fixtures), through the exported C
//! functions only (`dsv4::ffi::dsv4_*`): `dsv4_create` with `config_path` and
//! `DSV4_NUMERICS_EXACT`, `dsv4_load` (AUTO), `dsv4_finalize`, `dsv4_forward`.
//!
//! For `tiny` and `tiny_native`: one-shot (all 3 sequences in one batch, every row, and
//! again with a permuted `logits_rows`), chunked prefill with odd chunk sizes and the
//! sequences interleaved at different offsets in shared batches, and prefill + batched
//! single-token decode. Tolerance (DESIGN.md §4): max |dlogit| <= 1e-3; the measured
//! maximum is printed. The scenarios are common::parity::c_abi, the engine a
//! common::rig::Rig on the CPU (gpu_parity_oracle runs the same on CUDA).

mod common;

use common::Oracle;
use common::parity::{Scenario, abi_engine, c_abi};

/// Runs `scenario` on a fresh CPU engine of `model` driven through the C ABI.
fn on_cpu(scenario: Scenario, model: &str) {
    scenario(&mut abi_engine(model, -1), &Oracle::load(model), model);
}

parity_tests!(c_abi, on_cpu);
