//! Rust side of the `mhc` kernel family (kernels/mhc.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "mhc", source: include_str!("../../../kernels/mhc.cu"), functions: &[] };
