//! The model's kernel families (kernels/*.cu, contract in kernels/SPEC.md): one Rust file per
//! family with its `SOURCE` (compiled by the registry at finalize) and typed launch wrappers.

pub mod attention;
pub mod compressor;
pub mod indexer;
pub mod linear;
pub mod mhc;
pub mod moe;
pub mod norm_rope;

use crate::cuda::registry::KernelSource;

/// Every model family, in a fixed order.
pub static MODEL_FAMILIES: &[&KernelSource] = &[
    &linear::SOURCE,
    &norm_rope::SOURCE,
    &mhc::SOURCE,
    &moe::SOURCE,
    &attention::SOURCE,
    &compressor::SOURCE,
    &indexer::SOURCE,
];
