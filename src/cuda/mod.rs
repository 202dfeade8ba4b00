//! CUDA runtime: device discovery for now. The CUDA backend (arena, kernel registry,
//! borrowed stream) lands here; nothing in this module may be touched by `reference/`.

use crate::error::{Error, Result, Status};

/// Number of CUDA devices, or an error saying why there are none usable.
/// Never panics: cudarc's dynamic loader panics when libcuda is absent, so check first.
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::new(Status::NoDevice, "no CUDA driver library (libcuda.so) found on this machine"));
    }
    let r = std::panic::catch_unwind(|| -> Result<usize> {
        cudarc::driver::result::init()
            .map_err(|e| Error::new(Status::NoDevice, format!("cuInit failed: {e:?}")))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(|e| Error::new(Status::NoDevice, format!("cuDeviceGetCount failed: {e:?}")))?;
        Ok(n.max(0) as usize)
    });
    r.unwrap_or_else(|_| Err(Error::new(Status::NoDevice, "the CUDA driver library could not be initialised")))
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
