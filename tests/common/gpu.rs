//! CUDA helpers of the tests: "is there a device" with the skip line every GPU test prints
//! without one (`skipped: no CUDA device`, which scripts/gpu-check.sh counts as a failure on
//! the GPU machine), and the shared device of a kernel family's op tests.

use std::sync::OnceLock;

use dsv4::cuda::arena::{self, ArenaPlan, Pod};
use dsv4::cuda::kernels::linear::{StorageFormat, WeightDev};
use dsv4::cuda::registry::{KernelCache, KernelSource, Registry, cubin_defines, nvrtc_version};
use dsv4::cuda::{Arena, BorrowedStream, Context, DevicePtr, OwnedStream};

/// True when CUDA device 0 exists; otherwise prints the skip line and returns false.
pub fn has_cuda() -> bool {
    match dsv4::cuda::device_count() {
        Ok(n) if n > 0 => true,
        _ => {
            println!("skipped: no CUDA device");
            false
        }
    }
}

/// The CPU reference (-1) always; CUDA device 0 too when present (otherwise prints the skip
/// line of the CUDA half).
pub fn devices() -> Vec<i32> {
    match dsv4::cuda::device_count() {
        Ok(n) if n > 0 => vec![-1, 0],
        _ => {
            println!("skipped: no CUDA device (CUDA half; the CPU half ran)");
            vec![-1]
        }
    }
}

/// Device 0's context, or None after printing the skip line (with the driver's reason when
/// it gave one). A visible device whose context fails is a test failure.
pub fn device_or_skip() -> Option<Context> {
    match dsv4::cuda::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            println!("skipped: no CUDA device");
            return None;
        }
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return None;
        }
    }
    Some(
        Context::retain(0)
            .unwrap_or_else(|e| panic!("a device is visible but its context failed: {e}")),
    )
}

/// Fails unless `cubin` (the family's compiled image) defines every entry point the family
/// declares.
pub fn assert_cubin_defines(fam: &KernelSource, cubin: &[u8]) {
    for f in fam.functions {
        assert!(
            cubin_defines(cubin, f.name),
            "family `{}` lists `{}` but its CUBIN does not define it (missing extern \"C\"?)",
            fam.family,
            f.name
        );
    }
}

/// Compiles each family for sm_90a with NVRTC (no GPU needed) and checks its CUBIN defines
/// every declared entry point; prints a skip line instead where NVRTC is not installed.
pub fn assert_families_compile(families: &[&KernelSource]) {
    if let Err(e) = nvrtc_version() {
        println!("skipped: NVRTC not found ({e})");
        return;
    }
    for fam in families {
        let cubin = fam.compile("sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert_cubin_defines(fam, &cubin);
        println!(
            "{}: {} bytes CUBIN, {} entry points",
            fam.family,
            cubin.len(),
            fam.functions.len()
        );
    }
}

/// The device context and a registry holding the families of one test binary, shared by
/// its tests.
pub struct FamilyGpu {
    pub ctx: Context,
    pub reg: Registry,
}

/// The shared device with `families` compiled and loaded (on first use; a test binary
/// passes the same families every time), or None after printing the skip line.
/// The skip line carries the driver's reason when it gave one.
pub fn family_gpu(families: &[&KernelSource]) -> Option<&'static FamilyGpu> {
    static GPU: OnceLock<Result<FamilyGpu, String>> = OnceLock::new();
    let g = GPU.get_or_init(|| {
        match dsv4::cuda::device_count() {
            Ok(n) if n > 0 => {}
            Ok(_) => return Err(String::new()),
            Err(e) => return Err(format!(" ({e})")),
        }
        let ctx = Context::retain(0)
            .unwrap_or_else(|e| panic!("a device is visible but its context failed: {e}"));
        let reg = Registry::load_families(&ctx, families, &KernelCache::disabled())
            .unwrap_or_else(|e| panic!("{e}"));
        Ok(FamilyGpu { ctx, reg })
    });
    match g {
        Ok(g) => Some(g),
        Err(why) => {
            println!("skipped: no CUDA device{why}");
            None
        }
    }
}

/// Prints what the compiler made of each loaded kernel (registers, static shared memory,
/// local memory): spills and smem growth show up in the op tests' logs.
pub fn print_kernel_resources(reg: &Registry) {
    for k in reg.kernels() {
        println!(
            "{}::{}: {} registers, {} B static smem, {} B local",
            k.family, k.name, k.num_regs, k.static_smem, k.local_bytes
        );
    }
}

/// Free memory of device `dev` (bytes), as the driver reports it.
pub fn free_memory(dev: i32) -> u64 {
    let ctx = Context::retain(dev).expect("context");
    ctx.mem_info().expect("cuMemGetInfo").0 as u64
}

/// One arena in `ctx` with a region per byte size (each at least 4 bytes).
pub fn alloc(ctx: &Context, bytes: &[usize]) -> (Arena, Vec<DevicePtr>) {
    let mut plan = ArenaPlan::new();
    let ids: Vec<_> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| plan.reserve(format!("buf{i}"), b.max(4), 256).unwrap())
        .collect();
    let a = Arena::from_plan(ctx, &plan).unwrap();
    let ptrs = ids.iter().map(|&i| a.region(i)).collect();
    (a, ptrs)
}

/// A weight matrix `[rows, cols]` in device memory: `data` and, for quantized formats only,
/// `scales`, each cut to its byte size.
pub fn weight_dev(
    format: StorageFormat,
    [rows, cols]: [usize; 2],
    block: [usize; 2],
    (data, data_bytes): (DevicePtr, usize),
    (scales, scale_bytes): (DevicePtr, usize),
) -> WeightDev {
    WeightDev {
        format,
        data: data.slice(0, data_bytes).unwrap(),
        scales: format
            .is_quantized()
            .then(|| scales.slice(0, scale_bytes).unwrap()),
        block,
        rows,
        cols,
    }
}

/// One test's device state: the family's kernels `k`, its own stream and buffers.
pub struct Dev<K> {
    pub g: &'static FamilyGpu,
    pub k: K,
    pub stream: OwnedStream,
}

impl<K> Dev<K> {
    pub fn new(g: &'static FamilyGpu, k: K) -> Dev<K> {
        Dev {
            g,
            k,
            stream: OwnedStream::new(&g.ctx).unwrap(),
        }
    }

    pub fn ctx(&self) -> &Context {
        &self.g.ctx
    }

    pub fn s(&self) -> BorrowedStream {
        self.stream.borrow()
    }

    /// One arena with a region per byte size.
    pub fn alloc(&self, bytes: &[usize]) -> (Arena, Vec<DevicePtr>) {
        alloc(&self.g.ctx, bytes)
    }

    pub fn put<T: Pod>(&self, p: DevicePtr, v: &[T]) {
        let _g = self.ctx().enter().unwrap();
        arena::copy_to_device_sync(p, v, self.s()).unwrap();
    }

    pub fn get<T: Pod + Default>(&self, p: DevicePtr, n: usize) -> Vec<T> {
        let _g = self.ctx().enter().unwrap();
        self.s().synchronize().unwrap();
        let mut v = vec![T::default(); n];
        arena::copy_to_host_sync(&mut v, p, self.s()).unwrap();
        v
    }

    /// Runs an in-place op `f` on a fresh device copy of `x`; returns the buffer after it.
    pub fn in_place<E: std::fmt::Debug>(
        &self,
        x: &[f32],
        f: impl FnOnce(DevicePtr) -> Result<(), E>,
    ) -> Vec<f32> {
        let (_a, p) = self.alloc(&[x.len() * 4]);
        self.put(p[0], x);
        f(p[0]).unwrap();
        self.get(p[0], x.len())
    }

    /// Fills the buffer with 0xff bytes (NaN as f32).
    pub fn poison(&self, p: DevicePtr) {
        let _g = self.ctx().enter().unwrap();
        arena::memset_async(p, 0xff, self.s()).unwrap();
    }
}

/// The GPU tests of one binary take turns where they must (`cargo test` runs tests on parallel
/// threads): a graph capture, which is global-mode, fails when another thread synchronizes
/// meanwhile, and a test that reads the device's free memory sees the others' allocations. A
/// test that failed holding the turn does not fail the others.
pub fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}
