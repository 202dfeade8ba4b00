//! Rust side of the `attention` kernel family (kernels/attention.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "attention", source: include_str!("../../../kernels/attention.cu"), functions: &[] };
