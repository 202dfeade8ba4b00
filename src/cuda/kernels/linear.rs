//! Rust side of the `linear` kernel family (kernels/linear.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "linear", source: include_str!("../../../kernels/linear.cu"), functions: &[] };
