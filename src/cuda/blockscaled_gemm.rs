//! cuBLASLt GEMMs for the fast set's projections of many tokens (issue 12; PERF.md: cuBLASLt's
//! DeepSeek block scaling reaches 950-1325 TFLOP/s on these shapes at M = 8192): FP8 weights with
//! their 128 x 128 f32 block scales against e4m3 activations with an f32 scale per (token, 128 of
//! k) (`BLK128x128_32F` x `VEC128_32F`, cuBLAS 12.9+ on Hopper), and BF16 weights against BF16
//! activations; f32 accumulation and f32 output (`y`'s BF16 rounding, where the model has one, is
//! a separate pass: kernels/fast_dense.cu `fd_round_bf16_kernel`). A shape may ask for BF16 output
//! instead ([`GemmOut`]); the fast set's consumers read f32, so only `dsv4 bench dense` does.
//!
//! `y[t, j] = Σ_c a[t, c] · W[j, c]`. In cuBLAS's column-major terms: D (n x m, ld `ldy`) =
//! op(A) · B with A = W as stored (K x N column-major, ld K, transposed) and B = the activation
//! operand as stored (K x m column-major, ld K). The weight's block scales are its `[ceil(N/128),
//! K/128]` row-major grid as loaded (cuBLAS's K-block-fastest 128 x 128 layout); the activation
//! scales are `[K/128, m]`, token-fastest (kernels/fast_dense.cu `fd_lt_operand_kernel` writes
//! them so).
//!
//! Forward must neither allocate device memory nor sync the host, and must be capturable: the
//! descriptors live on the stack (cuBLASLt's `*Init` on caller-provided opaque storage); the
//! algorithm of each (shape, power-of-two bucket of m) is chosen once when the set loads; each
//! call validates it for its exact m with `cublasLtMatmulAlgoCheck` (host only) and reports "not
//! run" if it does not fit, so the caller's own kernels take the call. The workspace is a region
//! of the engine's arena, declared at create.

use crate::cuda::libs::{self, CudaLib};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use cudarc::cublaslt::sys;
use std::ffi::c_void;

/// What cuBLASLt multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKind {
    /// e4m3 weight codes with 128 x 128 f32 block scales, e4m3 activations with an f32 scale per
    /// (token, 128 of k).
    Fp8BlockScaled,
    /// BF16 weights and activations.
    Bf16,
}

/// What the GEMM writes: f32 (what the fast set's consumers read now), or BF16 (half the
/// bytes, rounded by cuBLASLt's epilogue: `dsv4 bench dense` measures what that would save).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmOut {
    F32,
    Bf16,
}

impl GemmOut {
    fn data_type(self) -> sys::cudaDataType_t {
        match self {
            GemmOut::F32 => sys::cudaDataType_t::CUDA_R_32F,
            GemmOut::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// Bytes of one output element.
    pub fn size(self) -> usize {
        match self {
            GemmOut::F32 => 4,
            GemmOut::Bf16 => 2,
        }
    }
}

/// A weight's shape: `n` rows (outputs) of `k`, and what the GEMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub kind: GemmKind,
    pub n: usize,
    pub k: usize,
    pub out: GemmOut,
}

impl GemmShape {
    /// Shapes these GEMMs take: K a multiple of 512 for FP8 (the scale grid's leading dimension
    /// K/128 must be a multiple of 4), of 128 for BF16; N a multiple of 16 (16-byte columns).
    pub fn supported(&self) -> bool {
        let kq = match self.kind {
            GemmKind::Fp8BlockScaled => 512,
            GemmKind::Bf16 => 128,
        };
        self.n > 0 && self.k > 0 && self.k.is_multiple_of(kq) && self.n.is_multiple_of(16)
    }

    fn data_type(&self) -> sys::cudaDataType_t {
        match self.kind {
            GemmKind::Fp8BlockScaled => sys::cudaDataType_t::CUDA_R_8F_E4M3,
            GemmKind::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// Bytes of one activation operand element.
    pub fn operand_size(&self) -> usize {
        match self.kind {
            GemmKind::Fp8BlockScaled => 1,
            GemmKind::Bf16 => 2,
        }
    }
}

/// One GEMM: `y[t, j] = Σ_c a[t, c] · W[j, c]` for `t < m`, `j < shape.n`.
#[derive(Clone, Copy, Debug)]
pub struct GemmCall {
    pub shape: GemmShape,
    pub m: usize,
    /// `[n, k]` e4m3 codes or BF16 values.
    pub w: DevicePtr,
    /// FP8: `[ceil(n/128), k/128]` f32.
    pub wscale: Option<DevicePtr>,
    /// `[m, k]` e4m3 codes or BF16 values, rows `lda` elements apart.
    pub a: DevicePtr,
    /// The activations' row stride in elements (`k` for a contiguous operand; more where `a` is
    /// a column range of wider rows, as wo_a's groups are of o).
    pub lda: usize,
    /// FP8: `[k/128, m]` f32, token-fastest.
    pub ascale: Option<DevicePtr>,
    /// `[m, ldy]` f32, or BF16 for [`GemmOut::Bf16`] shapes.
    pub y: DevicePtr,
    pub ldy: usize,
}

/// Smallest m planned: below it the fast set's gemv wins on every shape (bench dense).
pub const MIN_M: usize = 16;

/// Workspace cuBLASLt may use (split-K and stream-K schedules): NVIDIA's advice for Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Oldest cuBLASLt with block-scaled FP8 on Hopper (12.9).
const MIN_VERSION: usize = 120900;

const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

/// Storage for one opaque descriptor, larger than any cuBLASLt 13.x needs (13.0's layout is 64
/// bytes, 13.1's 112; matmul descriptors 256): `*Init` is told its size and fails if too small.
#[repr(C, align(16))]
struct Opaque([u64; 64]);

impl Opaque {
    fn new() -> Opaque {
        Opaque([0; 64])
    }
}

/// A matmul descriptor and its four matrix layouts, on the caller's stack.
struct Descriptors {
    desc: Opaque,
    a: Opaque,
    b: Opaque,
    d: Opaque,
}

fn check(what: &str, s: sys::cublasStatus_t) -> Result<()> {
    if s == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(
            Status::Internal,
            format!("cuBLASLt {what}: {s:?}"),
        ))
    }
}

impl Descriptors {
    fn desc(&mut self) -> sys::cublasLtMatmulDesc_t {
        (&mut self.desc as *mut Opaque).cast()
    }
    fn layout(o: &mut Opaque) -> sys::cublasLtMatrixLayout_t {
        (o as *mut Opaque).cast()
    }

    /// Descriptors of `shape` at `m` tokens with activation stride `lda`, output stride `ldy`
    /// and these scale pointers.
    fn new(
        shape: &GemmShape,
        m: usize,
        lda: usize,
        ldy: usize,
        wscale: u64,
        ascale: u64,
    ) -> Result<Descriptors> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let mut d = Descriptors {
            desc: Opaque::new(),
            a: Opaque::new(),
            b: Opaque::new(),
            d: Opaque::new(),
        };
        let size = std::mem::size_of::<Opaque>();
        // SAFETY: each descriptor points at `size` bytes of writable, aligned storage that
        // outlives every use (the struct is returned and used by the caller only).
        unsafe {
            check(
                "matmul descriptor",
                sys::cublasLtMatmulDescInit_internal(
                    d.desc(),
                    size,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType_t::CUDA_R_32F,
                ),
            )?;
            let set = |d: sys::cublasLtMatmulDesc_t, attr: A, p: *const c_void, n: usize| {
                check(
                    "descriptor attribute",
                    sys::cublasLtMatmulDescSetAttribute(d, attr, p, n),
                )
            };
            // cublasOperation_t (cublas_api.h, not in cudarc's cublasLt bindings): N = 0, T = 1.
            let (ta, tb) = (CUBLAS_OP_T, CUBLAS_OP_N);
            let op = std::mem::size_of::<i32>();
            set(
                d.desc(),
                A::CUBLASLT_MATMUL_DESC_TRANSA,
                (&ta as *const i32).cast(),
                op,
            )?;
            set(
                d.desc(),
                A::CUBLASLT_MATMUL_DESC_TRANSB,
                (&tb as *const i32).cast(),
                op,
            )?;
            if shape.kind == GemmKind::Fp8BlockScaled {
                let wmode =
                    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
                let amode =
                    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
                let ms = std::mem::size_of::<sys::cublasLtMatmulMatrixScale_t>();
                set(
                    d.desc(),
                    A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    (&wmode as *const sys::cublasLtMatmulMatrixScale_t).cast(),
                    ms,
                )?;
                set(
                    d.desc(),
                    A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    (&amode as *const sys::cublasLtMatmulMatrixScale_t).cast(),
                    ms,
                )?;
                set(
                    d.desc(),
                    A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    (&wscale as *const u64).cast(),
                    8,
                )?;
                set(
                    d.desc(),
                    A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    (&ascale as *const u64).cast(),
                    8,
                )?;
            }
            let (n, k) = (shape.n as u64, shape.k as u64);
            let dt = shape.data_type();
            check(
                "weight layout",
                sys::cublasLtMatrixLayoutInit_internal(
                    Self::layout(&mut d.a),
                    size,
                    dt,
                    k,
                    n,
                    k as i64,
                ),
            )?;
            check(
                "activation layout",
                sys::cublasLtMatrixLayoutInit_internal(
                    Self::layout(&mut d.b),
                    size,
                    dt,
                    k,
                    m as u64,
                    lda as i64,
                ),
            )?;
            check(
                "output layout",
                sys::cublasLtMatrixLayoutInit_internal(
                    Self::layout(&mut d.d),
                    size,
                    shape.out.data_type(),
                    n,
                    m as u64,
                    ldy as i64,
                ),
            )?;
        }
        Ok(d)
    }
}

/// One of cuBLASLt's algorithms for a shape ([`BlockScaledGemm::candidates`]).
#[derive(Clone, Copy)]
pub struct GemmAlgo(sys::cublasLtMatmulAlgo_t);

/// The algorithm chosen for a shape at m up to `m_max`.
#[derive(Clone, Copy)]
struct Plan {
    shape: GemmShape,
    m_max: usize,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle, its workspace, and the algorithm of every planned (shape, m bucket).
pub struct BlockScaledGemm {
    handle: sys::cublasLtHandle_t,
    workspace: DevicePtr,
    plans: Vec<Plan>,
    version: usize,
}

// SAFETY: a cuBLASLt handle may be used from any thread; the engine runs one forward at a time.
unsafe impl Send for BlockScaledGemm {}
unsafe impl Sync for BlockScaledGemm {}

/// The power-of-two bucket of m (at least [`MIN_M`]) whose plan runs m tokens.
pub fn bucket(m: usize) -> usize {
    m.max(MIN_M).next_power_of_two()
}

impl BlockScaledGemm {
    /// Loads cuBLASLt, makes a handle and picks an algorithm for every supported shape of
    /// `shapes` at each power-of-two bucket of m from [`MIN_M`] up to `max_m`. Err
    /// (`Unsupported`) when cuBLASLt cannot be loaded or is older than 12.9: the caller runs
    /// its own kernels then.
    pub fn new(
        ctx: &Context,
        shapes: &[GemmShape],
        max_m: usize,
        workspace: DevicePtr,
    ) -> Result<BlockScaledGemm> {
        libs::load(CudaLib::CublasLt)?;
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        if version < MIN_VERSION {
            return Err(Error::new(
                Status::Unsupported,
                format!("cuBLASLt {version} has no block-scaled FP8 GEMM (12.9 or later needed)"),
            ));
        }
        if workspace.bytes() < WORKSPACE_BYTES {
            return Err(Error::new(
                Status::Internal,
                format!("cuBLASLt workspace of {} bytes", workspace.bytes()),
            ));
        }
        let _g = ctx.enter()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: writes the new handle into `handle`.
        check("create", unsafe { sys::cublasLtCreate(&mut handle) })?;
        let mut gemm = BlockScaledGemm {
            handle,
            workspace,
            plans: Vec::new(),
            version,
        };
        let mut seen = Vec::new();
        for s in shapes.iter().filter(|s| s.supported()) {
            if seen.contains(s) {
                continue;
            }
            seen.push(*s);
            let mut m = MIN_M;
            while max_m >= MIN_M && m <= bucket(max_m) {
                if let Some(algo) = gemm.heuristic(s, m)? {
                    gemm.plans.push(Plan {
                        shape: *s,
                        m_max: m,
                        algo,
                    });
                }
                m *= 2;
            }
        }
        Ok(gemm)
    }

    /// cuBLASLt's version (e.g. 130100 for 13.1.0).
    pub fn version(&self) -> usize {
        self.version
    }

    /// cuBLASLt's first choice for `shape` at `m` tokens, or None when it has none.
    fn heuristic(&self, shape: &GemmShape, m: usize) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
        Ok(self.heuristics(shape, m, 1)?.into_iter().next())
    }

    /// cuBLASLt's first `count` choices for `shape` at `m` tokens, best first (`dsv4 bench dense
    /// --lt-candidates` times them: whether another algorithm beats the first).
    pub fn candidates(&self, shape: &GemmShape, m: usize, count: usize) -> Result<Vec<GemmAlgo>> {
        Ok(self
            .heuristics(shape, m, count)?
            .into_iter()
            .map(GemmAlgo)
            .collect())
    }

    fn heuristics(
        &self,
        shape: &GemmShape,
        m: usize,
        count: usize,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>> {
        // Placeholder scale addresses: the heuristic only reads the descriptor's modes.
        let ws = self.workspace.addr();
        let mut d = Descriptors::new(shape, m, shape.k, shape.n, ws, ws)?;
        let mut pref = Opaque::new();
        let p: sys::cublasLtMatmulPreference_t = (&mut pref as *mut Opaque).cast();
        let bytes = WORKSPACE_BYTES as u64;
        let count = count.clamp(1, 64);
        // SAFETY: an all-zero heuristic result is a valid value of this plain C struct.
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; count];
        let mut found = 0i32;
        // SAFETY: descriptors and preference point at live, large enough storage; `results`
        // holds the `count` results asked for.
        let status = unsafe {
            check(
                "preference",
                sys::cublasLtMatmulPreferenceInit_internal(p, std::mem::size_of::<Opaque>()),
            )?;
            check(
                "preference attribute",
                sys::cublasLtMatmulPreferenceSetAttribute(
                    p,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&bytes as *const u64).cast(),
                    8,
                ),
            )?;
            let (a, b, dd) = (
                Descriptors::layout(&mut d.a),
                Descriptors::layout(&mut d.b),
                Descriptors::layout(&mut d.d),
            );
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                d.desc(),
                a,
                b,
                dd,
                dd,
                p,
                count as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(Vec::new());
        }
        results.truncate(found.clamp(0, count as i32) as usize);
        Ok(results.into_iter().map(|r| r.algo).collect())
    }

    /// Whether an algorithm is planned for `shape` at `m` tokens (a call may still find it does
    /// not fit that exact m: see [`Self::run`]).
    pub fn covers(&self, shape: &GemmShape, m: usize) -> bool {
        self.plan(shape, m).is_some()
    }

    fn plan(&self, shape: &GemmShape, m: usize) -> Option<&Plan> {
        let b = bucket(m);
        self.plans
            .iter()
            .find(|p| p.shape == *shape && p.m_max == b)
    }

    /// Whether the algorithm planned for `shape` at `m` tokens accepts exactly m (host only).
    pub fn fits(&self, shape: &GemmShape, m: usize, ldy: usize) -> Result<bool> {
        let Some(plan) = self.plan(shape, m) else {
            return Ok(false);
        };
        let ws = self.workspace.addr();
        let mut d = Descriptors::new(shape, m, shape.k, ldy, ws, ws)?;
        Ok(self.check_algo(&mut d, plan))
    }

    fn check_algo(&self, d: &mut Descriptors, plan: &Plan) -> bool {
        let (a, b, dd) = (
            Descriptors::layout(&mut d.a),
            Descriptors::layout(&mut d.b),
            Descriptors::layout(&mut d.d),
        );
        let mut fit: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live descriptors; `fit` receives the check's result.
        let ok = unsafe {
            sys::cublasLtMatmulAlgoCheck(self.handle, d.desc(), a, b, dd, dd, &plan.algo, &mut fit)
        };
        ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && fit.workspaceSize <= WORKSPACE_BYTES
    }

    /// Runs `call` on `stream` and returns true, or returns false having launched nothing (no
    /// algorithm planned for this shape and m, or the planned one does not fit this exact m).
    pub fn run(&self, ctx: &Context, call: &GemmCall, stream: BorrowedStream) -> Result<bool> {
        self.run_with(ctx, call, None, stream)
    }

    /// [`Self::run`] with `algo` (one of [`Self::candidates`]) instead of the planned algorithm.
    pub fn run_with(
        &self,
        ctx: &Context,
        call: &GemmCall,
        algo: Option<GemmAlgo>,
        stream: BorrowedStream,
    ) -> Result<bool> {
        let s = &call.shape;
        let Some(planned) = self.plan(s, call.m) else {
            return Ok(false);
        };
        let chosen;
        let plan = match algo {
            Some(GemmAlgo(a)) => {
                chosen = Plan {
                    algo: a,
                    ..*planned
                };
                &chosen
            }
            None => planned,
        };
        let fp8 = s.kind == GemmKind::Fp8BlockScaled;
        let bad = |what: &str| {
            Err(Error::new(
                Status::Internal,
                format!("cuBLASLt GEMM {}x{} at m {}: {what}", s.n, s.k, call.m),
            ))
        };
        // Rows of y start 16-byte aligned.
        if call.ldy < s.n || !(call.ldy * s.out.size()).is_multiple_of(16) {
            return bad("output stride");
        }
        let esize = s.operand_size();
        // Rows of the activations start 16-byte aligned.
        if call.lda < s.k || !(call.lda * esize).is_multiple_of(16) {
            return bad("activation stride");
        }
        let a_bytes = if call.m == 0 {
            0
        } else {
            ((call.m - 1) * call.lda + s.k) * esize
        };
        if call.w.bytes() < s.n * s.k * esize || call.a.bytes() < a_bytes {
            return bad("operand smaller than its shape");
        }
        let y_bytes =
            crate::cuda::kernels::linear::strided_bytes(call.m, s.n, call.ldy) / 4 * s.out.size();
        if call.y.bytes() < y_bytes {
            return bad("output smaller than its shape");
        }
        let (wscale, ascale) = match (fp8, call.wscale, call.ascale) {
            (true, Some(w), Some(a)) => {
                if w.bytes() < s.n.div_ceil(128) * (s.k / 128) * 4
                    || a.bytes() < s.k / 128 * call.m * 4
                {
                    return bad("scales smaller than their grids");
                }
                (w.addr(), a.addr())
            }
            (false, _, _) => (0, 0),
            _ => return bad("FP8 without its scales"),
        };
        for p in [call.w, call.a, call.y] {
            if !p.addr().is_multiple_of(16) {
                return bad("operands must be 16-byte aligned");
            }
        }
        let mut d = Descriptors::new(s, call.m, call.lda, call.ldy, wscale, ascale)?;
        if !self.check_algo(&mut d, plan) {
            return Ok(false);
        }
        let (a, b, dd) = (
            Descriptors::layout(&mut d.a),
            Descriptors::layout(&mut d.b),
            Descriptors::layout(&mut d.d),
        );
        let (alpha, beta) = (1.0f32, 0.0f32);
        let _g = ctx.enter()?;
        // SAFETY: every pointer was checked against its shape above; alpha/beta are host
        // scalars (the default pointer mode); the stream is the caller's.
        check("matmul", unsafe {
            sys::cublasLtMatmul(
                self.handle,
                d.desc(),
                (&alpha as *const f32).cast(),
                call.w.addr() as *const c_void,
                a,
                call.a.addr() as *const c_void,
                b,
                (&beta as *const f32).cast(),
                call.y.addr() as *const c_void,
                dd,
                call.y.addr() as *mut c_void,
                dd,
                &plan.algo,
                self.workspace.addr() as *mut c_void,
                WORKSPACE_BYTES,
                stream.raw() as sys::cudaStream_t,
            )
        })?;
        Ok(true)
    }
}

impl Drop for BlockScaledGemm {
    fn drop(&mut self) {
        // SAFETY: the handle was made by cublasLtCreate and is destroyed once.
        unsafe {
            sys::cublasLtDestroy(self.handle);
        }
    }
}

/// Flash's FP8 projections as (N, K): wq_a, wq_b, wkv, wo_b, the indexer's wq_b (the tests of
/// the shapes cuBLASLt takes and of the plans the fast set makes).
#[cfg(test)]
pub(crate) const FLASH_FP8_PROJECTIONS: [(usize, usize); 5] = [
    (1024, 4096),
    (32768, 1024),
    (512, 4096),
    (4096, 8192),
    (8192, 1024),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_buckets() {
        let fp8 = |n, k| GemmShape {
            kind: GemmKind::Fp8BlockScaled,
            n,
            k,
            out: GemmOut::F32,
        };
        // Flash's FP8 projections are all covered.
        for (n, k) in FLASH_FP8_PROJECTIONS {
            assert!(fp8(n, k).supported(), "{n}x{k}");
        }
        // A scale grid whose leading dimension is not a multiple of 4, or ragged N, is not.
        assert!(!fp8(1024, 384).supported());
        assert!(!fp8(1000, 4096).supported());
        let bf16 = GemmShape {
            kind: GemmKind::Bf16,
            n: 64,
            k: 384,
            out: GemmOut::Bf16,
        };
        assert!(bf16.supported());
        assert_eq!(bucket(1), MIN_M);
        assert_eq!(bucket(16), 16);
        assert_eq!(bucket(17), 32);
        assert_eq!(bucket(4096), 4096);
        assert_eq!(bucket(4097), 8192);
    }
}
