//! Rust side of the `compressor` kernel family (kernels/compressor.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "compressor", source: include_str!("../../../kernels/compressor.cu"), functions: &[] };
