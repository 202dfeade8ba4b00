//! Rust side of the `moe` kernel family (kernels/moe.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "moe", source: include_str!("../../../kernels/moe.cu"), functions: &[] };
