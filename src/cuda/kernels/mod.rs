//! The model's kernel families (kernels/*.cu, contract in kernels/SPEC.md): one Rust file per
//! family with its `SOURCE` (compiled by the registry at finalize) and typed launch wrappers.

pub mod attention;
pub mod batch;
pub mod compressor;
pub mod fast_attention;
pub mod fast_dense;
pub mod fast_dense_gemm;
pub mod fast_fp8_gemm;
pub mod fast_indexer;
pub mod fast_moe;
pub mod fast_moe_gemm;
pub mod fast_moe_wide;
pub mod indexer;
pub mod linear;
pub mod mhc;
pub mod moe;
pub mod norm_rope;
pub mod weight_convert;

use crate::cuda::arena::DevicePtr;
use crate::cuda::registry::KernelSource;
use crate::error::{Error, Result, Status};

/// Size check every wrapper makes before a launch: `what` must hold `bytes` bytes.
pub(crate) fn need(who: &str, what: &str, p: DevicePtr, bytes: usize) -> Result<()> {
    if p.bytes() < bytes {
        return Err(Error::new(
            Status::Internal,
            format!("{who}: `{what}` holds {} bytes, needs {bytes}", p.bytes()),
        ));
    }
    Ok(())
}

/// A size passed to a kernel as `int`.
pub(crate) fn to_i32(who: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::new(
            Status::Internal,
            format!("{who}: {what} = {v} does not fit an int"),
        )
    })
}

/// Every model family, in a fixed order.
pub static MODEL_FAMILIES: &[&KernelSource] = &[
    &batch::SOURCE,
    &linear::SOURCE,
    &norm_rope::NORM_SOURCE,
    &norm_rope::ROPE_SOURCE,
    &norm_rope::QUANT_SIM_SOURCE,
    &norm_rope::ELEMENTWISE_SOURCE,
    &norm_rope::HEAD_PREP_SOURCE,
    &mhc::SOURCE,
    &moe::SOURCE,
    &attention::SOURCE,
    &compressor::SOURCE,
    &indexer::SOURCE,
];

/// Families the backend itself runs (not a kernel set's): writing weights from device memory.
pub static BACKEND_FAMILIES: &[&KernelSource] = &[&weight_convert::SOURCE];

/// The fast set's own families (it runs every model family too).
pub static FAST_FAMILIES: &[&KernelSource] = &[
    &fast_attention::SOURCE,
    &fast_indexer::SOURCE,
    &fast_dense::SOURCE,
    &fast_fp8_gemm::SOURCE,
    &fast_moe::SOURCE,
    &fast_moe_gemm::SOURCE,
    &fast_moe_wide::SOURCE,
    &fast_moe_wide::NARROW_SOURCE,
];
