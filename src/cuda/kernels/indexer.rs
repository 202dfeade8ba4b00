//! Rust side of the `indexer` kernel family (kernels/indexer.cu): typed launch wrappers. See kernels/SPEC.md.

use crate::cuda::registry::KernelSource;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource { family: "indexer", source: include_str!("../../../kernels/indexer.cu"), functions: &[] };
