//! The device's PRIMARY context, retained for the engine's lifetime.
//!
//! We retain the primary context (cuDevicePrimaryCtxRetain) instead of creating our own, so
//! that pointers, streams and events of a host running on the CUDA runtime (PyTorch, a C++
//! server) are valid in our calls and ours in theirs. Every engine call enters the context
//! on the calling thread with [`Context::enter`], which restores whatever context the thread
//! had before when the guard drops, so a host with its own current context is not disturbed.
//!
//! Must never: create a non-primary context; reset the device (cuDevicePrimaryCtxReset would
//! destroy the host's allocations); synchronize anything from a forward call.

use super::{check, driver_error, require_device};
use crate::error::Result;
use cudarc::driver::{result, sys};
use std::sync::Arc;

/// What the engine reports about its device (dsv4_get_info, logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    /// Compute capability (major, minor): (9, 0) on H100/H200.
    pub compute_capability: (i32, i32),
    /// NVRTC architecture the kernels are compiled for, from [`arch_for`].
    pub arch: String,
    pub total_mem_bytes: usize,
    pub multiprocessors: i32,
    pub l2_cache_bytes: i32,
    /// Largest dynamic shared memory one block may opt in to.
    pub max_shared_mem_per_block_optin: i32,
    /// cuDriverGetVersion, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
}

/// NVRTC `--gpu-architecture` for a compute capability: `sm_90a` on Hopper 9.0 (so the
/// arch-specific wgmma/setmaxnreg instructions are available), else `sm_<major><minor>`.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

struct Inner {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    info: DeviceInfo,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe);
// calls on one engine are serialized by the host, and each call enters the context first.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // Everything holding a `Context` clone (arena, registry, staging) is gone by now.
        // SAFETY: `device` came from cuDeviceGet and we hold one retain on its primary context.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A retained primary context. Cheap to clone: the arena, the registry and the staging
/// buffer each hold a clone, so the context outlives every resource made in it.
#[derive(Clone)]
pub struct Context(Arc<Inner>);

impl Context {
    /// Retains the primary context of CUDA device `ordinal` and reads its properties.
    /// `NoDevice` when there is no driver or no such device; never panics.
    pub fn retain(ordinal: i32) -> Result<Context> {
        require_device(ordinal)?; // probes libcuda and runs cuInit first
        let device = result::device::get(ordinal)
            .map_err(|e| driver_error(format!("cuDeviceGet({ordinal})"), e))?;
        // SAFETY: `device` is a valid device handle from cuDeviceGet.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| driver_error(format!("cuDevicePrimaryCtxRetain(device {ordinal})"), e))?;
        let info = match query_info(ordinal, device) {
            Ok(i) => i,
            Err(e) => {
                // SAFETY: balances the retain above.
                let _ = unsafe { result::primary_ctx::release(device) };
                return Err(e);
            }
        };
        Ok(Context(Arc::new(Inner { device, ctx, info })))
    }

    /// Makes the context current on the calling thread until the guard drops; the guard then
    /// restores the thread's previous context (if it had a different one). Call at the top of
    /// every engine call that touches the device.
    pub fn enter(&self) -> Result<CurrentGuard> {
        let prev = result::ctx::get_current().map_err(|e| driver_error("cuCtxGetCurrent", e))?;
        if prev != Some(self.0.ctx) {
            // SAFETY: the context is retained for as long as `self` lives.
            check("cuCtxSetCurrent", unsafe {
                sys::cuCtxSetCurrent(self.0.ctx)
            })?;
        }
        Ok(CurrentGuard {
            restore: prev.filter(|&p| p != self.0.ctx),
            _ctx: self.clone(),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.0.info
    }

    pub fn arch(&self) -> &str {
        &self.0.info.arch
    }

    pub fn raw(&self) -> sys::CUcontext {
        self.0.ctx
    }

    pub fn device(&self) -> sys::CUdevice {
        self.0.device
    }

    /// (free, total) device memory in bytes (cuMemGetInfo), as seen by every process.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        let _g = self.enter()?;
        result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))
    }

    /// Waits for all work in the context. Only for create/finalize/destroy and tests:
    /// forward must never call this.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.enter()?;
        result::ctx::synchronize().map_err(|e| driver_error("cuCtxSynchronize", e))
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("ctx", &self.0.ctx)
            .field("info", &self.0.info)
            .finish()
    }
}

/// Keeps a context current on this thread; restores the previous one on drop.
#[must_use = "the context is only current while the guard lives"]
pub struct CurrentGuard {
    restore: Option<sys::CUcontext>,
    _ctx: Context,
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread when the guard was made; if the host
            // destroyed it meanwhile this fails harmlessly.
            let _ = unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

fn query_info(ordinal: i32, device: sys::CUdevice) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    let attr = |a: A| -> Result<i32> {
        // SAFETY: `device` is a valid device handle.
        unsafe { result::device::get_attribute(device, a) }
            .map_err(|e| driver_error(format!("cuDeviceGetAttribute({a:?})"), e))
    };
    let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let name = result::device::get_name(device).map_err(|e| driver_error("cuDeviceGetName", e))?;
    // SAFETY: as above.
    let total = unsafe { result::device::total_mem(device) }
        .map_err(|e| driver_error("cuDeviceTotalMem", e))?;
    let mut driver_version = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut driver_version)
    })?;
    Ok(DeviceInfo {
        ordinal,
        name,
        compute_capability: (major, minor),
        arch: arch_for(major, minor),
        total_mem_bytes: total,
        multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        l2_cache_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        max_shared_mem_per_block_optin: attr(
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        driver_version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_strings() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(10, 0), "sm_100");
    }
}
