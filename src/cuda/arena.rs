//! The engine's device memory: ONE cuMemAlloc made at create, carved into named regions
//! (weights in their stored formats, derived tensors, per-slot state, activation workspace,
//! cuBLAS(Lt) workspaces), plus host<->device copies on a given stream and the pinned host
//! staging buffer that loads go through.
//!
//! Create runs a plan first ([`ArenaPlan`]: sizes and alignments, no device calls), then
//! allocates once ([`Arena::from_plan`]) and seals the arena. Region addresses never change
//! afterwards, so a host can capture forward in a graph and tests can check pointer stability.
//!
//! Must never: allocate or free device memory after create (only `Drop`, i.e. destroy, frees);
//! hand out a region that overlaps another or runs past the allocation.

use super::stream::BorrowedStream;
use super::{Context, check};
use crate::error::{Error, Result, Status};
use cudarc::driver::sys;
use std::ffi::c_void;

/// Alignment of the arena's base (cuMemAlloc guarantees at least 256 bytes) and the default
/// region alignment (enough for 16-byte vector loads, TMA and cuBLASLt workspaces).
pub const BASE_ALIGN: usize = 256;

/// A device address with the size of what lives there. Copy; from an arena it stays valid
/// (same address) until the engine is destroyed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr {
    addr: u64,
    bytes: usize,
}

impl DevicePtr {
    /// Wraps a device address the engine does not own (a host's batch buffer, say).
    ///
    /// # Safety
    /// `addr..addr+bytes` must be device memory valid in the engine's context for as long
    /// as the handle is used.
    pub unsafe fn from_raw(addr: u64, bytes: usize) -> DevicePtr {
        DevicePtr { addr, bytes }
    }

    pub fn addr(self) -> u64 {
        self.addr
    }

    pub fn bytes(self) -> usize {
        self.bytes
    }

    /// The sub-range `offset..offset+bytes`, or an error if it does not fit.
    pub fn slice(self, offset: usize, bytes: usize) -> Result<DevicePtr> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.bytes => Ok(DevicePtr {
                addr: self.addr + offset as u64,
                bytes,
            }),
            _ => Err(Error::new(
                Status::Internal,
                format!(
                    "device slice {offset}+{bytes} is outside a {}-byte buffer at {:#x}",
                    self.bytes, self.addr
                ),
            )),
        }
    }
}

impl From<DevicePtr> for u64 {
    fn from(p: DevicePtr) -> u64 {
        p.addr
    }
}

/// One named region of the arena, as listed for dsv4_get_info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub name: String,
    pub ptr: DevicePtr,
    pub align: usize,
}

/// Index of a region in the plan, usable with the arena made from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId(pub usize);

/// Sizes and alignments of every region, computed before any device call.
#[derive(Clone, Debug, Default)]
pub struct ArenaPlan {
    regions: Vec<(String, usize, usize)>,
    /// Worst-case bytes needed so far (an upper bound of the arena's cursor; see `reserve`).
    bound: usize,
}

impl ArenaPlan {
    pub fn new() -> ArenaPlan {
        ArenaPlan::default()
    }

    /// Adds a region of `bytes` bytes aligned to `align` (a power of two). Names should be
    /// unique (they are what dsv4_get_info lists); duplicates are an error.
    pub fn reserve(
        &mut self,
        name: impl Into<String>,
        bytes: usize,
        align: usize,
    ) -> Result<RegionId> {
        let name = name.into();
        check_align(&name, align)?;
        if self.regions.iter().any(|(n, _, _)| *n == name) {
            return Err(Error::new(
                Status::Internal,
                format!("arena region `{name}` planned twice"),
            ));
        }
        // The arena base is BASE_ALIGN-aligned, so an alignment above it may cost up to
        // `align - BASE_ALIGN` more bytes than the plan can see; count the worst case.
        let start = align_up(self.bound, align.min(BASE_ALIGN)) + align.saturating_sub(BASE_ALIGN);
        self.bound = start.checked_add(bytes).ok_or_else(|| {
            Error::new(
                Status::OutOfMemory,
                format!("arena region `{name}` overflows usize"),
            )
        })?;
        self.regions.push((name, bytes, align));
        Ok(RegionId(self.regions.len() - 1))
    }

    /// Bytes the single allocation needs (an upper bound that every region fits in).
    pub fn total_bytes(&self) -> usize {
        align_up(self.bound.max(1), BASE_ALIGN)
    }

    /// `(offset, bytes)` of every region in reservation order, as [`Arena::from_plan`] will
    /// place them (its base is aligned to at least every region's alignment).
    pub fn offsets(&self) -> Vec<(usize, usize)> {
        let mut cursor = 0;
        self.regions
            .iter()
            .map(|(_, bytes, align)| {
                let start = align_up(cursor, *align);
                cursor = start + bytes;
                (start, *bytes)
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

/// The one device allocation and its regions. Freed only on drop (engine destroy).
pub struct Arena {
    base: u64,
    total: usize,
    cursor: usize,
    sealed: bool,
    regions: Vec<Region>,
    ctx: Context,
}

// SAFETY: holds a device address and a context; see Context's note on threads.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Makes the ONE device allocation of `total_bytes` (rounded up to BASE_ALIGN) and zeroes
    /// it (synchronously: this runs at create). Regions are then carved with [`Arena::reserve`].
    pub fn new(ctx: &Context, total_bytes: usize) -> Result<Arena> {
        let _g = ctx.enter()?;
        let total = align_up(total_bytes.max(1), BASE_ALIGN);
        let mut base = 0u64;
        // SAFETY: writes one device address.
        check(
            format!("cuMemAlloc({total} bytes) for the engine's arena"),
            unsafe { sys::cuMemAlloc_v2(&mut base, total) },
        )
        .map_err(|e| {
            let free = ctx.mem_info().map(|(f, _)| f).unwrap_or(0);
            e.context(format!("device has {free} bytes free"))
        })?;
        let arena = Arena {
            base,
            total,
            cursor: 0,
            sealed: false,
            regions: Vec::new(),
            ctx: ctx.clone(),
        };
        if !base.is_multiple_of(BASE_ALIGN as u64) {
            return Err(Error::new(
                Status::Cuda,
                format!("cuMemAlloc returned {base:#x}, not {BASE_ALIGN}-aligned"),
            ));
        }
        // SAFETY: the range is the allocation just made.
        check("cuMemsetD8 (zeroing the arena)", unsafe {
            sys::cuMemsetD8_v2(base, 0, total)
        })?;
        // cuMemsetD8 may return before the zeroing is done and runs on the legacy stream,
        // which a host's non-blocking stream does not wait for: finish it here (create time),
        // or a later upload on such a stream could be overwritten by the zeroing.
        check("cuCtxSynchronize (after zeroing the arena)", unsafe {
            sys::cuCtxSynchronize()
        })?;
        Ok(arena)
    }

    /// Allocates the arena for `plan` and reserves every planned region in order; the
    /// arena comes back sealed. `RegionId`s from the plan index [`Arena::region`].
    pub fn from_plan(ctx: &Context, plan: &ArenaPlan) -> Result<Arena> {
        let mut a = Arena::new(ctx, plan.total_bytes())?;
        for (name, bytes, align) in &plan.regions {
            a.reserve(name.clone(), *bytes, *align)?;
        }
        a.seal();
        Ok(a)
    }

    /// Carves the next region. Only during create: after [`Arena::seal`] this is a
    /// `State` error, because nothing may be allocated after create.
    pub fn reserve(
        &mut self,
        name: impl Into<String>,
        bytes: usize,
        align: usize,
    ) -> Result<DevicePtr> {
        let name = name.into();
        if self.sealed {
            return Err(Error::new(
                Status::State,
                format!(
                    "arena region `{name}` requested after create: device memory is only allocated at create"
                ),
            ));
        }
        check_align(&name, align)?;
        if self.regions.iter().any(|r| r.name == name) {
            return Err(Error::new(
                Status::Internal,
                format!("arena region `{name}` reserved twice"),
            ));
        }
        let start = align_up(self.base as usize + self.cursor, align) - self.base as usize;
        let end = start.checked_add(bytes).filter(|&e| e <= self.total).ok_or_else(|| {
            Error::new(
                Status::Capacity,
                format!(
                    "arena region `{name}` ({bytes} bytes, align {align}) does not fit: {} of {} bytes used",
                    self.cursor, self.total
                ),
            )
        })?;
        self.cursor = end;
        let ptr = DevicePtr {
            addr: self.base + start as u64,
            bytes,
        };
        self.regions.push(Region { name, ptr, align });
        Ok(ptr)
    }

    /// Ends create: any later [`Arena::reserve`] fails.
    pub fn seal(&mut self) {
        self.sealed = true;
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// The region reserved `id.0`-th (plan order).
    pub fn region(&self, id: RegionId) -> DevicePtr {
        self.regions[id.0].ptr
    }

    /// The region named `name`.
    pub fn find(&self, name: &str) -> Option<DevicePtr> {
        self.regions.iter().find(|r| r.name == name).map(|r| r.ptr)
    }

    /// Every region in reservation order (name, pointer, bytes) for dsv4_get_info.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// The whole allocation.
    pub fn whole(&self) -> DevicePtr {
        DevicePtr {
            addr: self.base,
            bytes: self.total,
        }
    }

    pub fn total_bytes(&self) -> usize {
        self.total
    }

    pub fn used_bytes(&self) -> usize {
        self.cursor
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: our one allocation, freed once (cuMemFree waits for work using it).
            let _ = unsafe { sys::cuMemFree_v2(self.base) };
        }
    }
}

fn check_align(name: &str, align: usize) -> Result<()> {
    if align == 0 || !align.is_power_of_two() {
        return Err(Error::new(
            Status::Internal,
            format!("arena region `{name}`: alignment {align} is not a power of two"),
        ));
    }
    Ok(())
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Plain-old-data element types that may be copied to and from device memory as bytes.
///
/// # Safety
/// Every bit pattern must be a valid value and the type must have no padding.
pub unsafe trait Pod: Copy + 'static {}
// SAFETY: primitive numbers: no padding, every bit pattern valid.
unsafe impl Pod for u8 {}
unsafe impl Pod for i8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for i16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for i32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for i64 {}
unsafe impl Pod for f32 {}
unsafe impl Pod for f64 {}

/// `bytes` to copy must fit the `device_bytes` of the device buffer involved.
fn check_fits(what: &str, device_bytes: usize, bytes: usize) -> Result<()> {
    if bytes > device_bytes {
        return Err(Error::new(
            Status::Internal,
            format!("{what}: {bytes} bytes do not fit a {device_bytes}-byte device buffer"),
        ));
    }
    Ok(())
}

/// Enqueues a host -> device copy of `bytes` bytes on `stream` (cuMemcpyHtoDAsync).
///
/// # Safety
/// `src..src+bytes` must stay valid and unchanged until the stream reaches the copy (for
/// pinned memory that is after the call returns; the driver stages pageable memory before
/// returning). The context must be current.
pub unsafe fn memcpy_htod_async(
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
    stream: BorrowedStream,
) -> Result<()> {
    check_fits("memcpy_htod_async", dst.bytes, bytes)?;
    // SAFETY: bounds checked above; the caller guarantees `src`.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst.addr, src as *const c_void, bytes, stream.raw())
    })
}

/// Enqueues a device -> host copy of `bytes` bytes on `stream` (cuMemcpyDtoHAsync).
///
/// # Safety
/// `dst..dst+bytes` must stay valid and untouched until the stream reaches the copy. The
/// context must be current.
pub unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
    stream: BorrowedStream,
) -> Result<()> {
    check_fits("memcpy_dtoh_async", src.bytes, bytes)?;
    // SAFETY: bounds checked above; the caller guarantees `dst`.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src.addr, bytes, stream.raw())
    })
}

/// Enqueues a device -> device copy of `src.bytes()` bytes on `stream`. The context must be current.
pub fn memcpy_dtod_async(dst: DevicePtr, src: DevicePtr, stream: BorrowedStream) -> Result<()> {
    check_fits("memcpy_dtod_async", dst.bytes, src.bytes)?;
    // SAFETY: both ranges are device memory of at least `src.bytes` bytes (DevicePtr contract).
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst.addr, src.addr, src.bytes, stream.raw())
    })
}

/// `[addr, addr + bytes)` as a [`DevicePtr`] once the driver confirms it lies inside one CUDA
/// allocation (cuPointerGetAttribute: the allocation's start and size), so that no copy or
/// kernel given a host's address reads past what the host owns: a bad address is a CUDA
/// error naming `what`, before anything runs (a kernel would fault and poison the context).
/// The context must be current.
pub fn checked_device_range(addr: u64, bytes: usize, what: &str) -> Result<DevicePtr> {
    let attr = |a: sys::CUpointer_attribute| -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: both attributes write one CUdeviceptr / size_t (8 bytes) into `v`.
        check(
            format!("{what}: address {addr:#x} is not CUDA memory"),
            unsafe { sys::cuPointerGetAttribute((&mut v as *mut u64).cast(), a, addr) },
        )?;
        Ok(v)
    };
    if bytes > 0 {
        let start = attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)?;
        let size = attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE)?;
        let end = addr.checked_add(bytes as u64);
        if end.is_none_or(|e| e > start.saturating_add(size)) {
            return Err(Error::new(
                Status::Cuda,
                format!(
                    "{what}: {bytes} bytes at {addr:#x} run past the end of their CUDA allocation ({size} bytes at {start:#x})"
                ),
            ));
        }
    }
    // SAFETY: checked above: the range is device-accessible memory of one allocation.
    Ok(unsafe { DevicePtr::from_raw(addr, bytes) })
}

/// Enqueues filling `dst` with the byte `value` on `stream`. The context must be current.
pub fn memset_async(dst: DevicePtr, value: u8, stream: BorrowedStream) -> Result<()> {
    // SAFETY: `dst` is device memory of `dst.bytes` bytes (DevicePtr contract).
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(dst.addr, value, dst.bytes, stream.raw())
    })
}

/// Copies `src` to the start of `dst` and waits for the stream. For create/load/tests, never
/// forward. The context must be current.
pub fn copy_to_device_sync<T: Pod>(
    dst: DevicePtr,
    src: &[T],
    stream: BorrowedStream,
) -> Result<()> {
    let bytes = std::mem::size_of_val(src);
    // SAFETY: `src` is borrowed until the stream has finished the copy (synchronized below).
    unsafe { memcpy_htod_async(dst, src.as_ptr() as *const u8, bytes, stream)? };
    stream.synchronize()
}

/// Copies the start of `src` into `dst` and waits for the stream. For load/tests/introspection,
/// never forward. The context must be current.
pub fn copy_to_host_sync<T: Pod>(
    dst: &mut [T],
    src: DevicePtr,
    stream: BorrowedStream,
) -> Result<()> {
    let bytes = std::mem::size_of_val(dst);
    // SAFETY: `dst` is borrowed mutably until the stream has finished the copy (synchronized
    // below); T: Pod accepts any bytes.
    unsafe { memcpy_dtoh_async(dst.as_mut_ptr() as *mut u8, src, bytes, stream)? };
    stream.synchronize()
}

/// Page-locked host memory, allocated at create, that checkpoint loads and host-side refits
/// stream through: two halves used alternately, each guarded by an event, so the host fills
/// one half while the device copies the other.
pub struct PinnedStaging {
    ptr: *mut u8,
    bytes: usize,
    events: [sys::CUevent; 2],
    ctx: Context,
}

// SAFETY: the buffer is only touched through &mut self; handles are thread-agnostic.
unsafe impl Send for PinnedStaging {}
unsafe impl Sync for PinnedStaging {}

impl PinnedStaging {
    /// cuMemHostAlloc of `bytes` (rounded up to an even count) and two events; create only.
    pub fn new(ctx: &Context, bytes: usize) -> Result<PinnedStaging> {
        let _g = ctx.enter()?;
        let bytes = align_up(bytes.max(2), 2);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: writes one host pointer.
        check(
            format!("cuMemHostAlloc({bytes} bytes) for the staging buffer"),
            unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, sys::CU_MEMHOSTALLOC_PORTABLE) },
        )?;
        // From here on, Drop frees whatever was made if a later step fails.
        let mut s = PinnedStaging {
            ptr: ptr as *mut u8,
            bytes,
            events: [std::ptr::null_mut(); 2],
            ctx: ctx.clone(),
        };
        for ev in s.events.iter_mut() {
            // SAFETY: writes one handle.
            check("cuEventCreate", unsafe {
                sys::cuEventCreate(ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            })?;
        }
        Ok(s)
    }

    pub fn capacity(&self) -> usize {
        self.bytes
    }

    fn half(&self, i: usize) -> (*mut u8, usize) {
        let h = self.bytes / 2;
        // SAFETY: both halves lie inside the allocation.
        (unsafe { self.ptr.add(i * h) }, h)
    }

    /// Copies `src` to the start of `dst` through the staging halves, enqueued on `stream`.
    /// Returns once `src` has been fully read (the host may reuse it); the device copy is
    /// complete in stream order. Blocks only while a half is still being copied out.
    /// The context must be current.
    pub fn upload<T: Pod>(
        &mut self,
        dst: DevicePtr,
        src: &[T],
        stream: BorrowedStream,
    ) -> Result<()> {
        // SAFETY: T: Pod, so its bytes may be read as u8.
        let src = unsafe {
            std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src))
        };
        check_fits("staged upload", dst.bytes, src.len())?;
        let (_, h) = self.half(0);
        for (k, chunk) in src.chunks(h).enumerate() {
            let i = k % 2;
            let (buf, _) = self.half(i);
            // SAFETY: the event was recorded after the last copy out of this half (or never).
            check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(self.events[i])
            })?;
            // SAFETY: `chunk.len() <= h`; the half is not in use by the device (waited above).
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), buf, chunk.len()) };
            let d = dst.slice(k * h, chunk.len())?;
            // SAFETY: pinned memory stays valid and untouched until the event below completes.
            unsafe { memcpy_htod_async(d, buf, chunk.len(), stream)? };
            check("cuEventRecord", unsafe {
                sys::cuEventRecord(self.events[i], stream.raw())
            })?;
        }
        Ok(())
    }

    /// Copies the start of `src` into `dst` through the staging buffer and waits for it.
    /// The context must be current.
    pub fn download<T: Pod>(
        &mut self,
        dst: &mut [T],
        src: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        // SAFETY: T: Pod accepts any bytes.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, std::mem::size_of_val(dst))
        };
        check_fits("staged download", src.bytes, dst.len())?;
        let (buf, h) = self.half(0);
        for i in 0..2 {
            // SAFETY: wait until no upload still reads from either half.
            check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(self.events[i])
            })?;
        }
        for (k, chunk) in dst.chunks_mut(2 * h).enumerate() {
            let s = src.slice(k * 2 * h, chunk.len())?;
            // SAFETY: the whole buffer is ours and idle; synchronized right after.
            unsafe { memcpy_dtoh_async(buf, s, chunk.len(), stream)? };
            stream.synchronize()?;
            // SAFETY: the copy finished; `chunk.len() <= 2h`.
            unsafe { std::ptr::copy_nonoverlapping(buf, chunk.as_mut_ptr(), chunk.len()) };
        }
        Ok(())
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: handles made in `new` (null ones are skipped), each freed once.
            unsafe {
                for &ev in &self.events {
                    if !ev.is_null() {
                        let _ = sys::cuEventSynchronize(ev);
                        let _ = sys::cuEventDestroy_v2(ev);
                    }
                }
                let _ = sys::cuMemFreeHost(self.ptr as *mut c_void);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_bounds_every_layout() {
        let mut p = ArenaPlan::new();
        p.reserve("a", 10, 16).unwrap();
        p.reserve("b", 1000, 256).unwrap();
        p.reserve("c", 3, 4096).unwrap();
        p.reserve("d", 0, 1).unwrap();
        p.reserve("e", 77, 128).unwrap();
        assert!(p.reserve("a", 1, 1).is_err(), "duplicate name");
        assert!(
            p.reserve("x", 1, 3).is_err(),
            "alignment not a power of two"
        );
        // Simulate the arena's carving for every BASE_ALIGN-aligned base: the plan's total
        // must always be enough.
        for base in (0..16384usize).step_by(BASE_ALIGN) {
            let mut cur = 0usize;
            for (_, bytes, align) in &p.regions {
                let start = align_up(base + cur, *align) - base;
                assert_eq!((base + start) % align, 0);
                cur = start + bytes;
            }
            assert!(
                cur <= p.total_bytes(),
                "base {base}: {cur} > {}",
                p.total_bytes()
            );
        }
        assert_eq!(p.total_bytes() % BASE_ALIGN, 0);
    }

    #[test]
    fn slices_are_bounds_checked() {
        // SAFETY: never dereferenced.
        let p = unsafe { DevicePtr::from_raw(0x1000, 100) };
        assert_eq!(p.slice(10, 90).unwrap().addr(), 0x100a);
        assert!(p.slice(10, 91).is_err());
        assert!(p.slice(usize::MAX, 2).is_err());
        assert_eq!(u64::from(p), 0x1000);
    }
}
