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
use common::parity::{abi_engine, c_abi};

fn one_shot(name: &str) {
    c_abi::one_shot(&mut abi_engine(name, -1), &Oracle::load(name), name);
}

fn chunked(name: &str) {
    c_abi::chunked(&mut abi_engine(name, -1), &Oracle::load(name), name);
}

fn prefill_then_decode(name: &str) {
    c_abi::prefill_then_decode(&mut abi_engine(name, -1), &Oracle::load(name), name);
}

#[test]
fn tiny_one_shot() {
    one_shot("tiny");
}

#[test]
fn tiny_chunked_interleaved() {
    chunked("tiny");
}

#[test]
fn tiny_prefill_decode() {
    prefill_then_decode("tiny");
}

#[test]
fn native_one_shot() {
    one_shot("tiny_native");
}

#[test]
fn native_chunked_interleaved() {
    chunked("tiny_native");
}

#[test]
fn native_prefill_decode() {
    prefill_then_decode("tiny_native");
}
