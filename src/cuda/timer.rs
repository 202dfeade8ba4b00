//! Device-side timing for the benches: two CUDA events recorded on a stream around the work,
//! their elapsed time read after the second completes. This is how PyTorch baselines and the
//! ceilings are timed (bench/moe_baseline.py `timed`), so ratios between them compare the same
//! thing. A host clock around `launch + synchronize` adds the launch call and the wake-up from
//! the sync to every measurement (measured: ~0.8 µs a call on a 10 µs projection replayed 8 to
//! a graph, ~4 µs on the 250 µs head replayed 2 to a graph).
//! Not used by the engine.

use super::check;
use super::stream::BorrowedStream;
use crate::error::Result;
use cudarc::driver::sys;

/// A start and an end event with timing enabled. The context must be current when it is
/// made, used and dropped.
pub struct DeviceTimer {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl DeviceTimer {
    pub fn new() -> Result<DeviceTimer> {
        let mut t = DeviceTimer {
            start: std::ptr::null_mut(),
            end: std::ptr::null_mut(),
        };
        for ev in [&mut t.start, &mut t.end] {
            // SAFETY: writes one handle; Drop destroys whichever were made.
            check("cuEventCreate", unsafe {
                sys::cuEventCreate(ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
            })?;
        }
        Ok(t)
    }

    /// Seconds on the device between the work `body` enqueues on `stream` starting and ending
    /// (waits for it).
    pub fn time(&self, stream: BorrowedStream, body: impl FnOnce() -> Result<()>) -> Result<f64> {
        // SAFETY: valid events and stream in the current context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.start, stream.raw())
        })?;
        body()?;
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.end, stream.raw())
        })?;
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.end)
        })?;
        let mut ms = 0.0f32;
        check("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, self.start, self.end)
        })?;
        Ok(ms as f64 * 1e-3)
    }
}

impl Drop for DeviceTimer {
    fn drop(&mut self) {
        for ev in [self.start, self.end] {
            if !ev.is_null() {
                // SAFETY: made by cuEventCreate, destroyed once.
                unsafe { sys::cuEventDestroy_v2(ev) };
            }
        }
    }
}
