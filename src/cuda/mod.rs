//! CUDA runtime of the GPU backend, split by job:
//!
//! - [`context`]: the device's PRIMARY context (shared with the host, so its pointers and
//!   streams are valid here), made current for every engine call.
//! - [`stream`]: the host's `CUstream`, borrowed per call, and the typed kernel launch.
//! - [`arena`]: the ONE device allocation made at create, carved into named regions, plus
//!   host<->device copies and the pinned staging buffer used by loads.
//! - [`libs`]: finds and loads libcuda and libnvrtc (no LD_LIBRARY_PATH needed) before
//!   cudarc touches them.
//! - [`registry`]: kernels/*.cu compiled with NVRTC to CUBIN for the device's exact arch,
//!   cached on disk, loaded and resolved at finalize.
//! - [`smoke`]: the runtime's own tiny kernel family (tests only).
//! - [`kernels`]: the model's kernel families (one Rust wrapper per `kernels/<family>.cu`);
//!   [`backend`] and [`forward`]: the CUDA backend built on the runtime above.
//!
//! Rules every file here follows: nothing allocates device memory after create except
//! destroy; forward never synchronizes the host and launches only on the borrowed stream;
//! nothing below `ffi/` sees C types. We use cudarc's `sys`/`result` layers only, never its
//! safe `CudaContext`/`CudaStream` layer, so cudarc's event tracking (which records events
//! around every access and would break graph capture of forward) is never involved.
//!
//! cudarc's dynamic loader panics when a library is absent: every entry point that may be
//! the first to touch libcuda goes through [`device_count`], and NVRTC through
//! [`registry::nvrtc_version`], which load the libraries first with [`libs::load`].

pub mod arena;
pub mod backend;
pub mod blockscaled_gemm;
pub mod consts;
pub mod context;
pub mod decl;
pub mod device_model;
pub mod forward;
pub mod graph;
pub mod kernel_sets;
pub mod kernels;
pub mod kv_pages;
pub mod libs;
pub mod memory_plan;
pub mod read_probe;
pub mod registry;
pub mod smoke;
pub mod stream;
pub mod synthetic_moe;
pub mod timer;
pub mod upload;
pub mod wgmma_probe;

pub use arena::{Arena, ArenaPlan, DevicePtr, PinnedStaging, Region};
pub use context::{Context, CurrentGuard, DeviceInfo, arch_for};
pub use registry::{
    CacheOutcome, Kernel, KernelCache, KernelFn, KernelSource, Registry, RegistryStats,
};
pub use stream::{BorrowedStream, Dim3, KernelArgs, OwnedStream, TmaMap, launch};

use crate::error::{Error, Result, Status};
use cudarc::driver::result::DriverError;

/// Number of CUDA devices, or an error saying why there are none usable.
/// Never panics: cudarc's dynamic loader panics when libcuda is absent, so check first.
pub fn device_count() -> Result<usize> {
    libs::load(libs::CudaLib::Driver)?;
    let r = std::panic::catch_unwind(|| -> Result<usize> {
        cudarc::driver::result::init()
            .map_err(|e| Error::new(Status::NoDevice, format!("cuInit failed: {e:?}")))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(|e| Error::new(Status::NoDevice, format!("cuDeviceGetCount failed: {e:?}")))?;
        Ok(n.max(0) as usize)
    });
    r.unwrap_or_else(|_| {
        Err(Error::new(
            Status::NoDevice,
            "the CUDA driver library could not be initialised",
        ))
    })
}

/// Ok if CUDA device `ordinal` exists, else `NoDevice` naming the reason.
pub fn require_device(ordinal: i32) -> Result<()> {
    let n = device_count()?;
    if ordinal < 0 || ordinal as usize >= n {
        return Err(Error::new(
            Status::NoDevice,
            format!("CUDA device {ordinal} does not exist ({n} device(s) visible)"),
        ));
    }
    Ok(())
}

/// A driver error as `Status::Cuda`, naming the call that failed:
/// "cuMemAlloc(1024 bytes): CUDA_ERROR_OUT_OF_MEMORY: out of memory".
pub(crate) fn driver_error(what: impl std::fmt::Display, e: DriverError) -> Error {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Out of device memory is the host's to act on (lower the capacities), not a driver fault.
    let status = if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Status::OutOfMemory
    } else {
        Status::Cuda
    };
    Error::new(status, format!("{what}: {name}: {text}"))
}

/// Turns a raw `CUresult` into our `Result`, naming the call (`what`) on failure.
pub(crate) fn check(what: impl std::fmt::Display, r: cudarc::driver::sys::CUresult) -> Result<()> {
    r.result().map_err(|e| driver_error(what, e))
}
