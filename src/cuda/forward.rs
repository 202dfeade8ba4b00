//! The CUDA forward: the launch sequence of one batch, mirroring reference/mod.rs step for
//! step (in progress: lands once every kernel family exists).

use crate::cuda::backend::CudaBackend;
use crate::cuda::registry::Registry;
use crate::cuda::stream::BorrowedStream;
use crate::engine::DeviceBatch;
use crate::error::{Error, Result, Status};

/// Every kernel family, resolved once at finalize.
pub struct Kernels;

impl Kernels {
    pub fn new(_reg: &Registry) -> Result<Kernels> {
        Ok(Kernels)
    }
}

impl CudaBackend {
    pub fn forward(&mut self, b: &DeviceBatch, stream: BorrowedStream) -> Result<()> {
        let _ = (b, stream);
        Err(Error::new(Status::Unsupported, "the CUDA forward is not complete yet"))
    }
}
