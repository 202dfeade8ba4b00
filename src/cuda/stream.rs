//! The host's stream, borrowed for one call, and the typed kernel launch over cuLaunchKernel.
//!
//! The engine never owns the stream forward runs on: the host passes its `CUstream` (a
//! `cudaStream_t` is the same handle) with each call, and every launch and copy of that call
//! is enqueued on it, so a host can capture forward in a CUDA graph. [`OwnedStream`] exists
//! for tests and tools that play the host's part.
//!
//! Must never: synchronize the host inside forward; launch on any stream but the borrowed one;
//! allocate device memory.

use super::{check, driver_error};
use crate::error::{Error, Result, Status};
use cudarc::driver::sys;
use std::ffi::c_void;

/// A host-owned `CUstream`, borrowed for the duration of one engine call.
///
/// NULL means the LEGACY default stream (the driver API's NULL handle; it synchronizes with
/// every other blocking stream of the context). A host that wants its thread's per-thread
/// default stream passes `CU_STREAM_PER_THREAD` (handle value 2) explicitly; `CU_STREAM_LEGACY`
/// (handle value 1) is accepted too. The engine never creates, destroys or synchronizes it
/// during forward.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BorrowedStream(pub sys::CUstream);

// SAFETY: a stream handle is just a name the driver resolves; the driver API is thread-safe.
unsafe impl Send for BorrowedStream {}
unsafe impl Sync for BorrowedStream {}

impl BorrowedStream {
    /// The legacy default stream (NULL handle).
    pub const LEGACY_DEFAULT: BorrowedStream = BorrowedStream(std::ptr::null_mut());

    /// Wraps a host's `cudaStream_t` / `CUstream` as passed through the C ABI (may be NULL).
    pub fn from_raw(ptr: *mut c_void) -> BorrowedStream {
        BorrowedStream(ptr as sys::CUstream)
    }

    pub fn raw(self) -> sys::CUstream {
        self.0
    }

    pub fn is_legacy_default(self) -> bool {
        self.0.is_null()
    }

    /// Blocks the host until the stream's work is done. For load/finalize/tests only: forward
    /// must never call this.
    pub fn synchronize(self) -> Result<()> {
        // SAFETY: the host guarantees the stream is valid in the current context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.0)
        })
    }
}

/// A stream the engine itself owns, for tests and tools standing in for a host
/// (cuStreamCreate, non-blocking). Destroyed on drop; the context must be current.
pub struct OwnedStream {
    stream: sys::CUstream,
    _ctx: super::Context,
}

impl OwnedStream {
    pub fn new(ctx: &super::Context) -> Result<OwnedStream> {
        let _g = ctx.enter()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(OwnedStream {
            stream,
            _ctx: ctx.clone(),
        })
    }

    pub fn borrow(&self) -> BorrowedStream {
        BorrowedStream(self.stream)
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Ok(_g) = self._ctx.enter() {
            // SAFETY: created by us, destroyed once.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

/// Grid or block dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Dim3 {
        Dim3 { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Dim3 {
        Dim3 { x, y, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Dim3 {
        Dim3 { x, y, z }
    }
}

/// Most parameters one kernel may take through [`KernelArgs`].
pub const MAX_KERNEL_ARGS: usize = 48;

/// 8-byte slots [`KernelArgs`] holds: every parameter's, and the [`TMA_MAP_SLOTS`] of each
/// tensor map passed by value ([`KernelArgs::tma_map`]) at a 64-byte boundary.
const ARG_SLOTS: usize = 96;

/// Slots of one tensor map parameter (a `CUtensorMap`: 128 bytes).
pub const TMA_MAP_SLOTS: usize = 16;

/// A `CUtensorMap` as `cuTensorMapEncodeTiled` wrote it, passed to a kernel by value (a
/// `const __grid_constant__ DsvTmaMap` parameter, kernels/fast_fp8_gemm.cu): the map lives in
/// the launch's parameter space, so it needs no device memory and no copy before the launch,
/// and a captured graph keeps it with the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct TmaMap(pub [u64; TMA_MAP_SLOTS]);

/// Kernel parameters in declaration order. A scalar of at most 8 bytes is stored in its own
/// 8-byte slot (the driver reads `sizeof(param)` bytes from the slot's start, which on
/// little-endian hosts is the value); a tensor map in [`TMA_MAP_SLOTS`] consecutive slots from
/// a 64-byte boundary (its C type's alignment). Fixed capacity: building args allocates
/// nothing.
///
/// ```ignore
/// let mut a = KernelArgs::new();
/// a.ptr(out).ptr(inp).i32(n).f32(eps);
/// ```
#[derive(Clone)]
#[repr(C, align(64))]
pub struct KernelArgs {
    slots: [u64; ARG_SLOTS],
    /// The first slot of each parameter.
    starts: [u8; MAX_KERNEL_ARGS],
    /// Parameters pushed.
    len: usize,
    /// Slots used.
    used: usize,
}

impl Default for KernelArgs {
    fn default() -> Self {
        Self::new()
    }
}

impl KernelArgs {
    pub fn new() -> KernelArgs {
        KernelArgs {
            slots: [0; ARG_SLOTS],
            starts: [0; MAX_KERNEL_ARGS],
            len: 0,
            used: 0,
        }
    }

    /// Records a parameter of `words` slots starting at slot `at`.
    fn push_words(&mut self, at: usize, words: &[u64]) -> &mut Self {
        assert!(
            self.len < MAX_KERNEL_ARGS && at + words.len() <= ARG_SLOTS,
            "more than {MAX_KERNEL_ARGS} kernel arguments or {ARG_SLOTS} argument slots"
        );
        self.slots[at..at + words.len()].copy_from_slice(words);
        self.starts[self.len] = at as u8;
        self.len += 1;
        self.used = at + words.len();
        self
    }

    fn push(&mut self, v: u64) -> &mut Self {
        self.push_words(self.used, &[v])
    }

    /// A tensor map by value (`const __grid_constant__ DsvTmaMap`): 128 bytes from the next
    /// 64-byte boundary of the slots (the struct is 64-byte aligned).
    pub fn tma_map(&mut self, m: &TmaMap) -> &mut Self {
        self.push_words(self.used.next_multiple_of(8), &m.0)
    }

    /// A device pointer (`T*` in the kernel).
    pub fn ptr(&mut self, p: impl Into<u64>) -> &mut Self {
        self.push(p.into())
    }

    /// `int` / `int32_t`.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.push(v as u32 as u64)
    }

    /// `unsigned int` / `uint32_t`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.push(v as u64)
    }

    /// `float`.
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.push(v.to_bits() as u64)
    }

    /// `unsigned long long` / `uint64_t` / `size_t`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.push(v)
    }

    /// `long long` / `int64_t`.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.push(v as u64)
    }

    /// Parameters pushed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Enqueues `kernel` on `stream` (cuLaunchKernel). Checks the dynamic shared memory against
/// what the registry configured for the kernel and the block size against its limit.
///
/// # Safety
/// The arguments are not type-checked against the kernel's signature: `args` must match it
/// in number, order and size, and every pointer must be valid for what the kernel accesses.
/// The context must be current ([`super::Context::enter`]).
pub unsafe fn launch(
    kernel: &super::Kernel,
    grid: impl Into<Dim3>,
    block: impl Into<Dim3>,
    dynamic_smem: u32,
    stream: BorrowedStream,
    args: &KernelArgs,
) -> Result<()> {
    // SAFETY: forwarded, the caller's guarantees.
    unsafe { launch_clustered(kernel, grid, block, dynamic_smem, stream, args, None) }
}

/// [`launch`] with the blocks grouped into thread-block clusters of `cluster` blocks (sm_90:
/// they are co-scheduled and read each other's shared memory); `grid` must be a multiple of
/// it in each dimension.
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_clustered(
    kernel: &super::Kernel,
    grid: impl Into<Dim3>,
    block: impl Into<Dim3>,
    dynamic_smem: u32,
    stream: BorrowedStream,
    args: &KernelArgs,
    cluster: Option<Dim3>,
) -> Result<()> {
    let (grid, block) = (grid.into(), block.into());
    if let Some(c) = cluster
        && (c.x == 0
            || c.y == 0
            || c.z == 0
            || !grid.x.is_multiple_of(c.x)
            || !grid.y.is_multiple_of(c.y)
            || !grid.z.is_multiple_of(c.z))
    {
        return Err(launch_error(
            kernel,
            grid,
            block,
            dynamic_smem,
            "grid not a multiple of the cluster",
        ));
    }
    if let Some(c) = cluster
        && c.x as u64 * c.y as u64 * c.z as u64 > kernel.max_cluster as u64
    {
        return Err(launch_error(
            kernel,
            grid,
            block,
            dynamic_smem,
            "cluster above the kernel's declared size (KernelFn::max_cluster)",
        ));
    }
    let threads = block.x as u64 * block.y as u64 * block.z as u64;
    if threads == 0
        || threads > kernel.max_threads_per_block as u64
        || grid.x == 0
        || grid.y == 0
        || grid.z == 0
    {
        return Err(launch_error(
            kernel,
            grid,
            block,
            dynamic_smem,
            "empty grid/block or block above the kernel's thread limit",
        ));
    }
    if dynamic_smem > kernel.max_dynamic_smem {
        return Err(launch_error(
            kernel,
            grid,
            block,
            dynamic_smem,
            "dynamic shared memory above what the registry configured",
        ));
    }
    // A copy the driver reads from, 64-byte aligned like `args` (a tensor map's slots start
    // on a 64-byte boundary of it).
    let mut own = args.clone();
    let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
    for (p, &at) in ptrs.iter_mut().zip(&own.starts).take(own.len) {
        *p = (&mut own.slots[at as usize]) as *mut u64 as *mut c_void;
    }
    // A programmatic dependent (KernelFn::pdl) may start before the previous kernel on the
    // stream has finished, and waits for it itself (kernels/common.cuh dsv4_pdl_begin);
    // captured into graphs as a programmatic edge.
    let mut attrs = [sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            programmaticStreamSerializationAllowed: 1,
        },
    }; 2];
    let mut num_attrs = 0;
    if kernel.pdl {
        num_attrs += 1;
    }
    if let Some(c) = cluster {
        attrs[num_attrs] = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                    x: c.x,
                    y: c.y,
                    z: c.z,
                },
            },
        };
        num_attrs += 1;
    }
    let (r, what) = if num_attrs > 0 {
        let config = sys::CUlaunchConfig {
            gridDimX: grid.x,
            gridDimY: grid.y,
            gridDimZ: grid.z,
            blockDimX: block.x,
            blockDimY: block.y,
            blockDimZ: block.z,
            sharedMemBytes: dynamic_smem,
            hStream: stream.0,
            attrs: attrs.as_mut_ptr(),
            numAttrs: num_attrs as u32,
        };
        // SAFETY: as below; `config` and `attrs` outlive the call (the driver copies them).
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                kernel.func,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        (r, "cuLaunchKernelEx")
    } else {
        // SAFETY: the caller guarantees the arguments match the kernel; `ptrs` points into
        // `own`, which outlives the call (cuLaunchKernel copies the values before returning).
        let r = unsafe {
            sys::cuLaunchKernel(
                kernel.func,
                grid.x,
                grid.y,
                grid.z,
                block.x,
                block.y,
                block.z,
                dynamic_smem,
                stream.0,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        (r, "cuLaunchKernel")
    };
    r.result().map_err(|e| {
        let base = driver_error(what, e);
        launch_error(kernel, grid, block, dynamic_smem, &base.message)
    })
}

fn launch_error(k: &super::Kernel, grid: Dim3, block: Dim3, smem: u32, why: &str) -> Error {
    Error::new(
        Status::Cuda,
        format!(
            "launching {}::{} grid ({},{},{}) block ({},{},{}) smem {smem}: {why}",
            k.family, k.name, grid.x, grid.y, grid.z, block.x, block.y, block.z
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clusters the kernel was not declared for, and grids they do not divide, are refused before
    /// anything reaches the driver (so no device is needed here).
    #[test]
    fn clusters_past_the_declared_size_are_refused() {
        let kernel = |max_cluster| super::super::Kernel {
            family: "probe",
            name: "k",
            func: std::ptr::null_mut(),
            max_dynamic_smem: 0,
            max_threads_per_block: 1024,
            num_regs: 32,
            static_smem: 0,
            local_bytes: 0,
            pdl: false,
            max_cluster,
        };
        let stream = BorrowedStream::from_raw(std::ptr::null_mut());
        let args = KernelArgs::new();
        let refused = |k: &super::super::Kernel, grid: (u32, u32), cluster: (u32, u32, u32)| {
            // SAFETY: every case below is refused before the launch.
            let e = unsafe {
                launch_clustered(k, grid, 256u32, 0, stream, &args, Some(cluster.into()))
            };
            e.expect_err("refused").to_string()
        };
        let portable = kernel(super::super::registry::PORTABLE_CLUSTER);
        assert!(refused(&portable, (4, 16), (1, 16, 1)).contains("declared size"));
        assert!(refused(&portable, (4, 10), (1, 3, 1)).contains("not a multiple"));
        assert!(refused(&kernel(16), (4, 32), (1, 17, 1)).contains("not a multiple"));
        assert!(refused(&kernel(16), (4, 34), (1, 17, 1)).contains("declared size"));
    }

    #[test]
    fn args_pack_values_little_endian() {
        let mut a = KernelArgs::new();
        a.ptr(0xdead_beef_u64)
            .i32(-2)
            .f32(1.5)
            .u64(u64::MAX)
            .u32(7)
            .i64(-1);
        assert_eq!(a.len(), 6);
        assert_eq!(a.slots[0], 0xdead_beef);
        assert_eq!(a.slots[1] as u32 as i32, -2);
        assert_eq!(f32::from_bits(a.slots[2] as u32), 1.5);
        assert_eq!(a.slots[3], u64::MAX);
        assert_eq!(a.slots[4], 7);
        assert_eq!(a.slots[5] as i64, -1);
        // The first 4 bytes of a slot are the 32-bit value (what the driver copies).
        let b = a.slots[1].to_ne_bytes();
        assert_eq!(i32::from_ne_bytes([b[0], b[1], b[2], b[3]]), -2);
    }

    /// A tensor map takes 16 slots from a 64-byte boundary; the parameters around it keep one
    /// slot each, and each parameter's start is where the driver will read it.
    #[test]
    fn tensor_maps_take_sixteen_aligned_slots() {
        let map = |b: u64| TmaMap(std::array::from_fn(|i| b + i as u64));
        let mut a = KernelArgs::new();
        a.tma_map(&map(100)).tma_map(&map(200)).ptr(7u64).i32(3);
        assert_eq!(a.len(), 4);
        assert_eq!(&a.starts[..4], &[0, 16, 32, 33]);
        assert_eq!(&a.slots[..16], &map(100).0);
        assert_eq!(&a.slots[16..32], &map(200).0);
        assert_eq!((a.slots[32], a.slots[33]), (7, 3));
        // After a scalar, the next map starts at the next multiple of 8 slots (64 bytes).
        let mut b = KernelArgs::new();
        b.i32(1).tma_map(&map(0)).i32(2);
        assert_eq!(&b.starts[..3], &[0, 8, 24]);
        let base = b.slots.as_ptr() as usize;
        assert_eq!(base % 64, 0, "the slots start 64-byte aligned");
        assert_eq!((base + 8 * b.starts[1] as usize) % 64, 0);
    }

    #[test]
    fn null_stream_is_legacy_default() {
        assert!(BorrowedStream::from_raw(std::ptr::null_mut()).is_legacy_default());
        assert_eq!(BorrowedStream::LEGACY_DEFAULT.raw(), std::ptr::null_mut());
    }
}
