//! Rust side of the `norm_rope` kernel family (kernels/norm_rope.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "norm_rope", source: include_str!("../../../kernels/norm_rope.cu"), functions: &[] };
