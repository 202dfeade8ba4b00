//! Rust side of the `fast_moe` kernel family (kernels/fast_moe.cu) and the fast MoE layer it
//! drives with [`super::fast_moe_gemm`] (DESIGN.md §5 "MegaMoE", ../shared/KERNELS.md §3):
//!
//! 1. `fmoe_logits_kernel` (few tokens: f32 dot products) or `fmoe_logits_tc_kernel` (many: BF16
//!    tensor cores on x's BF16 values and the gate split exactly into three BF16 planes, a derived
//!    tensor): router logits in f32 and their scores, and (the first) x quantized to FP8 per 128;
//! 2. `fmoe_select_kernel`: scores, top-k or hash selection, weights (and x's quantisation after
//!    the tensor-core router);
//! 3. `moe_plan_kernel` (which on the fused decode path also clears that launch's synchronisation
//!    words), or from [`WIDE_PLAN_MIN_TOKENS`] (the prefill path's batches) the wide plan's three
//!    launches (the moe family): assignments grouped by expert into tiles of the GEMM path's
//!    tokens per item ([`GemmPath::tile_rows`]);
//! 4. GEMM1 + SwiGLU x routing weight + FP8 quantisation of h, with the shared expert as more
//!    tiles, and GEMM2 into bf16 rows per (token, slot), on the path [`GemmPath::for_tokens`]
//!    picks: `fmoe_experts_kernel`, whose down items wait for their tile's up items (fused decode,
//!    [`fast_moe_gemm::FUSED_TOKENS`]; the same items as `fmoe_up_kernel` then `fmoe_down_kernel`,
//!    the decode path, which the tests and the bench run), or from
//!    [`fast_moe_wide::MIN_TOKENS`](super::fast_moe_wide) tokens on `fmw_up_kernel` then
//!    `fmw_down_kernel` (prefill);
//! 5. `fmoe_combine_kernel`: the fixed-order f32 sum per token, rounded to bf16.
//!
//! On the routed decode path (up to [`fast_moe_gemm::ROUTED_MAX_TOKENS`]; no batch takes it by
//! default: measured slower) steps 1-4 are one launch, `fmoe_route_experts_kernel` (the same
//! device functions, the same bits), so the shared expert's weights stream while other blocks
//! route ([`FastMoe::route_and_experts`]).
//!
//! Six launches on the two-launch decode path (five on the fused one, two on the routed one, nine
//! on the prefill path with its gather and the wide plan), each a programmatic dependent of the
//! one before (`#[pdl(true)]`: its launch and block start overlap the previous kernel's tail), no
//! host sync, nothing allocated: the workspace is sized at create for `max_num_tokens`. Experts
//! are read in their stored layout (FP4 e2m1 with f32 per-32 scales, or FP8 e4m3 with f32
//! 128x128 block scales) through the per-layer tensor maps and scale tables the backend rebuilds
//! at finalize and refit (with the router's gate planes: [`FastMoe::derive`]). A layer the kernels
//! cannot run ([`FastMoeLayer::unsupported`]) runs the reference kernels instead.

use super::fast_moe_gemm::{self, FastMoeGemm, GemmPath};
use super::fast_moe_wide;
use super::linear::WeightDev;
use super::moe::{self, Moe, MoePlan, RouterParams, Selection};
use super::norm_rope::{RMSNORM_ROWS_THREADS, RmsnormBlock, register_block};
use super::{need, to_i32};
use crate::backend::Elem;
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::format::StorageFormat;
use std::ops::Range;

/// Warps of a `fmoe_logits_kernel` block (FMOE_LOGIT_WARPS): LOGIT_EXPERTS experts x LOGIT_SPLIT
/// parts of the hidden dimension each.
pub const LOGIT_WARPS: usize = 8;
pub const LOGIT_EXPERTS: usize = 2;
pub const LOGIT_SPLIT: usize = 4;
/// Tokens per `fmoe_logits_kernel` block (FMOE_LOGIT_TOKENS).
pub const LOGIT_TOKENS: usize = 8;
/// Experts each `fmoe_logits_grouped_kernel` warp takes (FMOE_LOGIT_GROUP; `fmoe_logits_kernel`
/// takes one): each x word a lane loads serves them all, so the kernel reads x a quarter as often
/// (the same bits: kernels/fast_moe_route.cuh `fmoe_logits_tile`).
pub const LOGIT_GROUP: usize = 4;
/// Fewest tokens whose router logits run `fmoe_logits_grouped_kernel` ([`LOGIT_GROUP`] experts a
/// warp) rather than `fmoe_logits_kernel` (one). The router chain (the input's norm, the logits,
/// the selection) at Flash shapes, µs one / four experts a warp (H100, best of two rounds, one
/// call; fortieth session): B = 1 6.97 / 8.61, 8 13.08 / 16.99, 16 14.03 / 17.52, 32 17.33 /
/// 19.26, 64 27.60 / 22.51, 128 43.72 / 34.36, 256 80.65 / 59.01, 512 150.26 / 107.86. Below,
/// a quarter as many blocks stream the gate, which bounds the few-token router.
pub const LOGIT_GROUP_MIN_TOKENS: usize = 64;
/// `fmoe_logits_tc_kernel` (many tokens, BF16 tensor cores): tokens per block (FMOE_TC_TOKENS, one
/// m64 tile) and experts per warpgroup (FMOE_TC_WG_EXPERTS, the wgmma's N; two consumer warpgroups
/// a block, so a block takes twice as many experts). 64 rather than 128: twice the blocks, each
/// item's slot half the gate bytes; kernel µs 128 / 64 (H200, same call): 1024 tokens 73.4 / 44.4,
/// 4096 74.2 / 45.5, 16384 135.8 / 177.6; the layer at 16384 0.5-0.7% slower with 64, 1.6-1.8%
/// faster at 1024-4096 (BENCHMARKS.md, issue 11 twentieth version; the kernel takes 64 only).
pub const TC_TOKENS: usize = 64;
pub const TC_WG_EXPERTS: usize = 64;
/// Producer warps of a `fmoe_logits_tc_kernel` block (FMOE_TC_PRODUCERS: 16 of x's rows each), and
/// its threads: two consumer warpgroups, then the producers.
pub const TC_PRODUCERS: usize = 4;
pub const TC_THREADS: usize = 256 + 32 * TC_PRODUCERS;
/// Experts of one chunk of the derived gate planes (FMOE_GATE_TILE; [`gate_planes_bytes`]).
pub const GATE_TILE: usize = 128;
/// Most 64-k stages (D / 64) `fmoe_logits_tc_kernel` takes (FMOE_TC_MAX_STAGES: its per-stage
/// flags sit in shared memory).
pub const TC_MAX_STAGES: usize = 256;
/// One ring slot of `fmoe_logits_tc_kernel`: x's 64 rows of a stage in f32 at a 288-byte stride,
/// then one BF16 plane of the block's experts (128 bytes a row).
const TC_SLOT: usize = TC_TOKENS * 288 + 2 * TC_WG_EXPERTS * 128;
/// Its ring slots (FMOE_TC_SLOTS): as many as fit beside the stage flags and the mbarriers.
pub const TC_SLOTS: usize = (227 * 1024 - 4 * TC_MAX_STAGES - 16 * 8) / TC_SLOT;
/// Dynamic shared memory of a `fmoe_logits_tc_kernel` block (FMOE_TC_SMEM_BYTES).
pub const TC_SMEM_BYTES: usize = TC_SLOTS * TC_SLOT + 4 * TC_MAX_STAGES + 16 * TC_SLOTS;
const _: () = assert!(
    TC_SMEM_BYTES <= 227 * 1024 && TC_SLOTS >= 2,
    "an sm_90 block takes at most 227 KiB; the ring needs two slots"
);

/// Bytes of a layer's derived gate planes (`fmoe_gate_planes_kernel`, kernels/fast_moe.cu): the
/// f32 gate `[E, D]` split exactly into three BF16 planes, in chunks of [`GATE_TILE`] experts x 64
/// k laid out as the tensor-core router's shared memory reads them (rows past E zero; E rounded
/// up to 256), then one u32 a chunk of stage flags. 1.5x the f32 gate's bytes: the price of a
/// router that converts nothing per token block (BENCHMARKS.md, issue 11 twentieth version).
pub fn gate_planes_bytes(e: usize, d: usize) -> usize {
    let chunks = 2 * e.div_ceil(256) * (d / 64);
    chunks * (3 * GATE_TILE * 128 + 4)
}

/// Fewest tokens routed by the tensor-core routers ([`RouterPath::for_tokens`]): below, their few
/// blocks (two per 64 tokens, times [`TC_KSPLIT`] split) leave SMs idle. The layer at Flash shapes,
/// uniform routing, µs with `fmoe_logits_grouped_kernel` / the split tensor-core router (H100, best
/// of two rounds, one call each; forty-second session): B = 96 1080.7 / 1083.8, 128 1157.7 /
/// 1161.1, 144 1182.6 / 1179.5, 160 1209.6 / 1201.4, 192 1229.8 / 1219.3, 256 1267.7 / 1246.0, 288
/// 1282.6 / 1255.0; its router chain (the input's norm making x's codes, the logits, the
/// selection) 33.9 / 26.5 at 128 (a shorter chain, yet not a shorter layer), 48.1 / 30.5 at 160,
/// 60.3 / 30.3 at 256. (Unsplit, the tensor-core router took the layer from 320 tokens, 1024
/// before the forty-first session; before it, a register-tiled f32 GEMM was 6-10% slower from 1024
/// tokens up: BENCHMARKS.md, issue 11 sixteenth version.)
pub const TC_MIN_TOKENS: usize = 160;

/// Blocks (a thread-block cluster) that split D's 64-k stages of one `fmoe_logits_tc_split_kernel`
/// tile ([`RouterPath::TensorSplit`]): 4, so 512 tokens' 16 tiles run on 64 blocks of 16 stages
/// each instead of 16 blocks of 64 (the unsplit kernel takes ~45 µs at 320-4096 tokens, the
/// latency of its 64 stages: `ncu` 55.6 µs at 320 tokens, 56.3 at 512, forty-first session). A
/// constant, so a token's logits do not depend on the batch. The router chain (the input's norm
/// making x's codes, the logits, the selection) at Flash shapes, µs unsplit / split (H100, best of
/// two rounds, one call; forty-second session): 320 58.8 / 34.8, 512 62.5 / 37.1, 1024 75.6 /
/// 70.6, 4096 158.6 / 214.4.
pub const TC_KSPLIT: usize = 4;

/// Most tokens the split tensor-core router takes ([`RouterPath::for_tokens`]); from 1024 its 4x
/// the blocks (64 a 64-token tile column at Flash shapes) outnumber what the SMs run at once. The
/// layer at Flash shapes, uniform routing, µs unsplit / split (H100, best of two rounds, one call
/// each; forty-second session): fused decode path 320 1289.5 / 1265.2, 512 1409.3 / 1377.8;
/// prefill path 640 1535.3 / 1516.3, 768 1549.8 / 1534.6, 896 1570.9 / 1560.3, 1024 1588.2 /
/// 1589.8 (and 1565.1 / 1583.7 in an earlier call), 1536 1717.5 / 1713.1, 4096 2369.1 / 2408.9.
/// The router chain (the input's norm making x's codes, the logits, the selection) 66.4 / 43.2 at
/// 640, 75.1 / 68.3 at 1024, 158.6 / 214.4 at 4096.
pub const TC_SPLIT_MAX_TOKENS: usize = 1023;

/// Blocks (a pair) that split D's stages for [`RouterPath::TensorPair`]: from 1024 tokens four a
/// tile outnumber what the SMs hold at once (clusters of four share a GPC), while pairs of the
/// 2 x 16-32 tile columns of 1024-2048 tokens still fit one wave (64-128 blocks).
pub const TC_PAIR_SPLIT: usize = 2;

/// Most tokens the paired tensor-core router takes ([`RouterPath::for_tokens`]); above, the
/// unsplit kernel's blocks fill the SMs by themselves and pairs run in two waves. The router chain
/// (the input's norm making x's codes, the logits, the selection) and the layer at Flash shapes,
/// uniform routing, prefill path, µs unsplit / paired (H100, best of three alternating rounds, one
/// call; fifty-first session): chain 1024 76.3 / 59.6, 1536 90.9 / 74.9, 2048 103.6 / 89.1, 2560
/// 117.1 / 127.3, 3072 132.0 / 145.0; layer 1024 1413.5 / 1396.2, 1536 1533.6 / 1524.5, 2048 1684.6
/// / 1685.1, 2560 1909.7 / 1917.3, 3072 2037.3 / 2037.6.
pub const TC_PAIR_MAX_TOKENS: usize = 2048;

/// Which kernel computes the router's logits (and, `Few`, x's quantisation; after a tensor-core
/// router, `fmoe_select_kernel` makes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterPath {
    /// `fmoe_logits_kernel`: 8 tokens a block, every block streams its experts' gate rows.
    Few,
    /// `fmoe_logits_tc_kernel`: tiles of a BF16 tensor-core GEMM, the f32 gate split exactly into
    /// three BF16 planes (x must hold BF16 values, as the fast set's official numerics give).
    Tensor,
    /// `fmoe_logits_tc_split_kernel`: `Tensor`'s products and stage sums, each tile's stages
    /// split over [`TC_KSPLIT`] blocks of a cluster and their partial logits added in rank order
    /// (so not `Tensor`'s bits). Requires D / 64 to be a multiple of [`TC_KSPLIT`].
    TensorSplit,
    /// The same kernel on clusters of [`TC_PAIR_SPLIT`] blocks (neither `Tensor`'s nor
    /// `TensorSplit`'s bits). Requires D / 64 to be even.
    TensorPair,
}

impl RouterPath {
    /// The path `FastMoe::route` takes for `t` tokens of width `d`: below [`TC_MIN_TOKENS`] the
    /// few-token router; up to [`TC_SPLIT_MAX_TOKENS`] the split tensor-core router (where D's
    /// stages split over [`TC_KSPLIT`]), whose 4x the blocks finish the logits sooner; up to
    /// [`TC_PAIR_MAX_TOKENS`] the paired one (where they split in two); above (and wherever D
    /// does not split) the unsplit one.
    pub fn for_tokens(t: usize, d: usize) -> RouterPath {
        let splits = |ks: usize| (d / 64).is_multiple_of(ks);
        if t < TC_MIN_TOKENS {
            RouterPath::Few
        } else if t <= TC_SPLIT_MAX_TOKENS && splits(TC_KSPLIT) {
            RouterPath::TensorSplit
        } else if t <= TC_PAIR_MAX_TOKENS && splits(TC_PAIR_SPLIT) {
            RouterPath::TensorPair
        } else {
            RouterPath::Tensor
        }
    }

    /// The blocks of a cluster that split a tensor-core tile's stages (1: not split).
    pub fn stage_split(self) -> usize {
        match self {
            RouterPath::TensorSplit => TC_KSPLIT,
            RouterPath::TensorPair => TC_PAIR_SPLIT,
            RouterPath::Few | RouterPath::Tensor => 1,
        }
    }

    /// The bound, in units of `2^-24 · Σ_d |x_d·g_ed|`, of the f32 error of the logits this
    /// router computes (kernels/fast_moe.cu: each kernel's order of sums).
    pub fn logit_error_terms(self, d: usize) -> usize {
        match self {
            RouterPath::Few => d / 128 + 9,
            // The split adds the same D/64 stage sums in another order (kernels/fast_moe.cu).
            RouterPath::Tensor | RouterPath::TensorSplit | RouterPath::TensorPair => 280 + d / 64,
        }
    }

    /// Whether the logits come from the tensor cores (x's quantisation then from the selection).
    pub fn tensor_cores(self) -> bool {
        self != RouterPath::Few
    }
}

/// Experts each warp of the few-token router's logits takes for `t` tokens: [`LOGIT_GROUP`] from
/// [`LOGIT_GROUP_MIN_TOKENS`] (`fmoe_logits_grouped_kernel`), else 1 (`fmoe_logits_kernel`).
pub fn logit_group(t: usize) -> usize {
    if t >= LOGIT_GROUP_MIN_TOKENS {
        LOGIT_GROUP
    } else {
        1
    }
}

/// The few-token router's logits kernel for warps of `group` experts (for errors).
fn logits_kernel_name(group: usize) -> &'static str {
    if group == 1 {
        "fmoe_logits_kernel"
    } else {
        "fmoe_logits_grouped_kernel"
    }
}

/// Fewest tokens whose routing plan [`FastMoe::experts_on`] makes with the wide plan
/// ([`Moe::plan_wide`]: three launches over many blocks) rather than `moe_plan_kernel`'s one block:
/// every batch of the prefill GEMMs. (The fused decode launch below them always takes the one
/// block's plan, which also clears its synchronisation words.) The layer on the prefill path at
/// Flash shapes, µs with the one block's plan / the wide one (H100, best of two rounds, one call;
/// forty-first session): B = 608 1538.9 / 1534.9, 768 1560.7 / 1553.1, 1000 1593.3 / 1586.7.
pub const WIDE_PLAN_MIN_TOKENS: usize = fast_moe_wide::MIN_TOKENS;
const _: () = assert!(
    32 * MAX_EPL <= moe::PLAN_WIDE_MAX_EXPERTS,
    "the wide plan takes every layer the fast kernels take"
);

/// Tokens (warps) per `fmoe_select_kernel` block (FMOE_SELECT_WARPS).
pub const SELECT_WARPS: usize = 4;
/// Router entries each lane holds (FMOE_MAX_EPL): at most 32 x this many experts.
pub const MAX_EPL: usize = 16;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_moe", include_str!("../../../kernels/fast_moe.cu");

    /// Router scores (logits for softmax scoring) and x's FP8 quantisation (none without `xq`),
    /// each warp on one expert.
    #[pdl(true)]
    fn fmoe_logits_kernel(
        x: *const f32, t: i32, d: i32, e: i32, gate: *const f32, scoring: i32, scores: *mut f32,
        halves: bool, xq: Option<*mut u8>, xs: Option<*mut f32>,
    );
    /// The same, each warp on [`LOGIT_GROUP`] experts (the same bits).
    #[pdl(true)]
    fn fmoe_logits_grouped_kernel(
        x: *const f32, t: i32, d: i32, e: i32, gate: *const f32, scoring: i32, scores: *mut f32,
        halves: bool, xq: Option<*mut u8>, xs: Option<*mut f32>,
    );
    /// The MoE input's RMSNorm in place with x's FP8 quantisation, on `rmsnorm_kernel`'s block
    /// ([`MoeNorm`]).
    #[pdl(true)]
    fn fmoe_norm_x_kernel(
        x: *mut f32, rows: i32, dim: i32, weight: Option<*const f32>, eps: f32, round_out: bool,
        halves: bool, xq: *mut u8, xs: *mut f32,
    );
    /// The same on `rmsnorm_rows_kernel`'s block (a prefill's rows).
    #[pdl(true)]
    fn fmoe_norm_x_rows_kernel(
        x: *mut f32, rows: i32, dim: i32, weight: Option<*const f32>, eps: f32, round_out: bool,
        halves: bool, xq: *mut u8, xs: *mut f32,
    );
    /// The same on the BF16 tensor cores (x's values BF16), from the derived gate planes.
    #[smem(TC_SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_logits_tc_kernel(
        x: *const f32, t: i32, d: i32, e: i32, planes: *const u8, scoring: i32, scores: *mut f32,
    );
    /// The same with D's stages split over the blocks of a cluster ([`RouterPath::TensorSplit`],
    /// [`RouterPath::TensorPair`]: the cluster's size is the split).
    #[smem(TC_SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_logits_tc_split_kernel(
        x: *const f32, t: i32, d: i32, e: i32, planes: *const u8, scoring: i32, scores: *mut f32,
    );
    /// Builds the derived gate planes ([`gate_planes_bytes`]) from the f32 gate.
    fn fmoe_gate_planes_kernel(gate: *const f32, e: i32, d: i32, planes: *mut u8);
    /// Top-k selection (`bias` optional) or hash routing (`tid2eid` and `tokens`, both set);
    /// with `x`, also x's FP8 quantisation (the tensor-core router leaves it to this kernel).
    #[pdl(true)]
    fn fmoe_select_kernel(
        scores: *const f32, t: i32, e: i32, k: i32, bias: Option<*const f32>,
        tid2eid: Option<*const i32>, tokens: Option<*const i32>, scoring: i32, renorm: bool,
        route_scale: f32, ids: *mut i32, weights: *mut f32, x: Option<*const f32>, d: i32,
        halves: bool, xq: *mut u8, xs: *mut f32,
    );
    /// The per-token sum of the expert rows; with `clear`, also zeroes the synchronisation words
    /// of the `fmoe_route_experts_kernel` launch before it.
    #[pdl(true)]
    fn fmoe_combine_kernel(
        y: *const u16, ids: *const i32, t: i32, k: i32, e: i32, d: i32, has_shared: bool,
        out: *mut f32, clear: Option<*mut u32>, clear_words: i32,
    );
}

crate::launchers! {
    /// The fast_moe family's entry points, resolved from a loaded registry.
    pub struct FastMoeRoute {
        logits: fmoe_logits_kernel,
        logits_grouped: fmoe_logits_grouped_kernel,
        norm_x: fmoe_norm_x_kernel,
        norm_x_rows: fmoe_norm_x_rows_kernel,
        logits_tc: fmoe_logits_tc_kernel,
        logits_tc_split: fmoe_logits_tc_split_kernel,
        gate_planes: fmoe_gate_planes_kernel,
        select: fmoe_select_kernel,
        combine: fmoe_combine_kernel,
    }
}

impl FastMoeRoute {
    /// Builds `layer.gate_planes` from `layer.gate` (finalize, refit: after the gate was written).
    pub fn derive_gate_planes(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_gate_planes_kernel";
        let (d, e) = (layer.d, layer.experts);
        if !d.is_multiple_of(64) || d / 64 > TC_MAX_STAGES || e == 0 {
            return Err(internal(format!("{K}: D {d}, E {e}")));
        }
        need(K, "gate", layer.gate, e * d * 4)?;
        need(K, "planes", layer.gate_planes, gate_planes_bytes(e, d))?;
        let _g = ctx.enter()?;
        let grid = ((2 * e.div_ceil(256)) as u32, (d / 64) as u32, 1);
        let args = fmoe_gate_planes_kernel::Args {
            gate: layer.gate,
            e: to_i32(K, "E", e)?,
            d: to_i32(K, "D", d)?,
            planes: layer.gate_planes,
        };
        self.gate_planes.launch(grid, 256, 0, stream, args)
    }
}

/// One projection of the routed experts as the fast kernels read it: its format and a `u64` table
/// of each local expert's scale address (FP8 experts' 128x128 block scales are read through it; the
/// codes and FP4 scales through the layer's tensor maps).
#[derive(Clone, Copy, Debug)]
pub struct FastExperts {
    pub format: StorageFormat,
    pub scales: DevicePtr,
}

/// The shared expert's three projections.
#[derive(Clone, Copy, Debug)]
pub struct FastShared {
    pub w1: WeightDev,
    pub w3: WeightDev,
    pub w2: WeightDev,
}

/// One MoE layer's device operands.
#[derive(Clone, Debug)]
pub struct FastMoeLayer {
    pub d: usize,
    pub i: usize,
    pub k: usize,
    /// Experts the router chooses from.
    pub experts: usize,
    /// The experts this device computes (expert parallelism: tiles of other experts are skipped;
    /// the tables hold `local.len()` entries, entry 0 = expert `local.start`).
    pub local: Range<usize>,
    /// `f32[E, D]`.
    pub gate: DevicePtr,
    /// The gate's derived BF16 planes ([`gate_planes_bytes`], built by [`FastMoe::derive`]), which
    /// the tensor-core router reads.
    pub gate_planes: DevicePtr,
    pub selection: Selection,
    pub router: RouterParams,
    pub w1: FastExperts,
    pub w3: FastExperts,
    pub w2: FastExperts,
    pub shared: Option<FastShared>,
    /// The layer's tensor map table ([`fast_moe_gemm::tensor_maps`]): the local experts', then
    /// the shared expert's.
    pub maps: DevicePtr,
    /// The layer's UE8M0 scale table ([`fast_moe_gemm::scales8_bytes`], built by
    /// [`FastMoeGemm::derive_scales8`]); None: the GEMMs read FP4 scales as f32.
    pub scales8: Option<DevicePtr>,
    /// SwiGLU clamp (0 = none).
    pub limit: f32,
}

/// The formats the fast GEMMs read: FP4 (per-32 scales) or FP8 with 128x128 blocks.
fn fast_format(format: StorageFormat, block: [usize; 2]) -> bool {
    match format {
        StorageFormat::Fp4 => true,
        StorageFormat::Fp8 => block == [128, 128],
        StorageFormat::F32 | StorageFormat::Bf16 => false,
    }
}

impl FastMoeLayer {
    /// Err where the router kernels cannot take this layer's shapes ([`FastMoeLayer::unsupported`])
    /// or a buffer the router reads or writes for `t` tokens of `x` is short (`who`: the kernel,
    /// for errors).
    pub fn check_router(
        &self,
        who: &str,
        x: DevicePtr,
        t: usize,
        ws: &FastMoeWorkspace,
    ) -> Result<()> {
        let (d, e, k) = (self.d, self.experts, self.k);
        let routed = (self.w1.format, [128, 128]);
        if let Some(why) = FastMoeLayer::unsupported(d, self.i, k, e, routed, None) {
            return Err(internal(format!("fast MoE layer: {why}")));
        }
        need(who, "x", x, t * d * 4)?;
        need(who, "gate", self.gate, e * d * 4)?;
        need(who, "logits", ws.logits, t * e * 4)?;
        need(who, "ids", ws.ids, t * k * 4)?;
        need(who, "weights", ws.weights, t * k * 4)?;
        need(who, "xq", ws.xq, t * d)?;
        need(who, "xs", ws.xs, t * d / 128 * 4)
    }

    /// Why the fast kernels cannot run a layer of these shapes and formats (None: they can).
    /// `routed` is (format, FP8 block) of the routed experts, `shared` the shared expert's.
    pub fn unsupported(
        d: usize,
        i: usize,
        k: usize,
        experts: usize,
        routed: (StorageFormat, [usize; 2]),
        shared: Option<(StorageFormat, [usize; 2])>,
    ) -> Option<Unsupported> {
        if !d.is_multiple_of(128) || !i.is_multiple_of(128) {
            return Some(Unsupported::NotMultipleOf128 { d, i });
        }
        if d > 64 * TC_MAX_STAGES {
            return Some(Unsupported::Hidden(d));
        }
        if experts == 0 || experts > 32 * MAX_EPL {
            return Some(Unsupported::Experts(experts));
        }
        if k == 0 || k > moe::MAX_TOPK.min(32) {
            return Some(Unsupported::TopK(k));
        }
        if !fast_format(routed.0, routed.1) {
            return Some(Unsupported::Routed(routed.0, routed.1));
        }
        if let Some((f, b)) = shared
            && !fast_format(f, b)
        {
            return Some(Unsupported::Shared(f, b));
        }
        None
    }
}

/// Why the fast kernels cannot run a MoE layer ([`FastMoeLayer::unsupported`]): a value, so
/// the per-forward check allocates nothing; it is formatted only when reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsupported {
    NotMultipleOf128 { d: usize, i: usize },
    Hidden(usize),
    Experts(usize),
    TopK(usize),
    Routed(StorageFormat, [usize; 2]),
    Shared(StorageFormat, [usize; 2]),
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Unsupported::NotMultipleOf128 { d, i } => {
                write!(f, "hidden {d} and moe_inter {i} must be multiples of 128")
            }
            Unsupported::Hidden(d) => write!(f, "hidden {d} (at most {})", 64 * TC_MAX_STAGES),
            Unsupported::Experts(e) => write!(f, "{e} experts (1..={})", 32 * MAX_EPL),
            Unsupported::TopK(k) => write!(f, "experts_per_tok {k}"),
            Unsupported::Routed(fm, b) => write!(f, "routed experts stored {fm:?} {b:?}"),
            Unsupported::Shared(fm, b) => write!(f, "shared expert stored {fm:?} {b:?}"),
        }
    }
}

/// The fast MoE layer's workspace for `t` tokens (sized for `max_num_tokens` at create).
#[derive(Clone, Copy, Debug)]
pub struct FastMoeWorkspace {
    /// Router scores `f32[T, E]` (logits for softmax scoring).
    pub logits: DevicePtr,
    /// `i32[T, k]`, `f32[T, k]`.
    pub ids: DevicePtr,
    pub weights: DevicePtr,
    /// x's e4m3 codes `u8[T, D]`, in the order of the GEMM path that reads them (the fragment
    /// order, or the prefill path's halves order: [`GemmPath::halves_order`], kernels/fp8_mma.cuh),
    /// and its per-128 scales `f32[T, D/128]`.
    pub xq: DevicePtr,
    pub xs: DevicePtr,
    /// The routing plan, sized for the decode path's tiles (fast_moe_gemm::TOKENS, the smallest:
    /// the most tiles); [`FastMoe::experts_on`] plans with its path's tile size.
    pub plan: MoePlan,
    /// h likewise: `u8[T*k + T, I]` and scales `f32[T*k + T, I/128]` (routed rows, then shared),
    /// on the prefill path in its own layout ([`fast_moe_wide::act_scale_index`]; `hs` is sized
    /// for both).
    pub hq: DevicePtr,
    pub hs: DevicePtr,
    /// Expert outputs `bf16[T*k + T, D]`. On the prefill path its first `(T*k + T) * D` bytes
    /// hold x's codes in that path's layout before that (`fmw_gather_x_kernel`, read by the up
    /// GEMM): only the down GEMM writes y, and it touches memory only after its programmatic
    /// wait, once the up GEMM has finished (kernels/SPEC.md, fast_moe: every kernel of the layer
    /// begins with `dsv4_pdl_begin`), so the two never overlap and x costs no memory of its own.
    pub y: DevicePtr,
    /// The GEMMs' synchronisation words (`u32[`[`fast_moe_gemm::sync_words`]`]`): the fused
    /// decode path's plan zeroes all but the first before each launch ([`FastMoe::experts_on`]);
    /// the first, the blocks' start ticket, is zero from the arena on and each launch leaves it so.
    /// The prefill path's two item queues sit in the words after it
    /// ([`fast_moe_gemm::PREFILL_QUEUE_WORD`]), zeroed by its gather kernel before the up GEMM.
    pub sync: DevicePtr,
    /// The wide plan's scratch ([`moe::plan_wide_scratch`]): block counts and ranks.
    pub plan_counts: DevicePtr,
    pub plan_ranks: DevicePtr,
    /// The prefill path's x scales in its layout (`f32[`[`fast_moe_wide::act_scale_floats`]`]`).
    pub xs_plan: DevicePtr,
    /// The prefill path's tensor maps over its x codes (in `y`), over x's codes by token (`xq`:
    /// the shared expert's rows) and over `hq`, 128 bytes each ([`FastMoeWorkspace::write_act_maps`]).
    pub act_maps: DevicePtr,
    /// The routed decode path's synchronisation words (`u32[`[`fast_moe_gemm::route_sync_words`]`]`):
    /// zero when its launch starts; the arena starts them so and the layer's combine zeroes them
    /// after each launch ([`FastMoe::route_and_experts`]).
    pub route_sync: DevicePtr,
}

impl FastMoeWorkspace {
    /// The workspace at the addresses of [`workspace_buffers`]'s buffers (in its order), sized
    /// for `t` tokens.
    pub fn at(p: &[DevicePtr], t: usize, k: usize, experts: usize) -> FastMoeWorkspace {
        FastMoeWorkspace {
            logits: p[0],
            ids: p[1],
            weights: p[2],
            xq: p[3],
            xs: p[4],
            plan: MoePlan {
                offsets: p[5],
                rows: p[6],
                tiles: p[7],
                ntiles: p[8],
                tokens: t,
                k,
                experts,
                tile_rows: fast_moe_gemm::TOKENS,
            },
            hq: p[9],
            hs: p[10],
            y: p[11],
            sync: p[12],
            plan_counts: p[13],
            plan_ranks: p[14],
            xs_plan: p[15],
            act_maps: p[16],
            route_sync: p[17],
        }
    }

    /// The prefill up GEMM's tensor maps over x's codes: the first two of `act_maps`, the routed
    /// tiles' rows (in `y`, where `fmw_gather_x_kernel` puts them) and then, the kernel finds it
    /// right after, x's rows by token (`xq`, which the shared expert's tiles read in place).
    pub fn x_map(&self) -> Result<DevicePtr> {
        self.act_maps.slice(0, 2 * fast_moe_gemm::MAP_BYTES)
    }

    /// The prefill down GEMM's tensor map over h's codes: the third of `act_maps`.
    pub fn h_map(&self) -> Result<DevicePtr> {
        self.act_maps
            .slice(2 * fast_moe_gemm::MAP_BYTES, fast_moe_gemm::MAP_BYTES)
    }

    /// Writes `act_maps`: the prefill path's tensor maps over all of x's rows of `d` bytes (in
    /// `y`, then in `xq`) and `hq`'s of `i` ([`fast_moe_wide::act_tensor_map`]). Once the
    /// buffers' addresses are final (the fast set's finalize and refit; tests and benches after
    /// [`FastMoeWorkspace::at`]) and before any prefill-path GEMM; host work and one small copy,
    /// never in a forward.
    pub fn write_act_maps(
        &self,
        ctx: &Context,
        d: usize,
        i: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        if d == 0 || i == 0 || self.hq.bytes() < i || self.y.bytes() < d || self.xq.bytes() < d {
            return Ok(()); // no experts: no GEMM reads them
        }
        let x = fast_moe_wide::act_tensor_map(self.y.addr(), self.y.bytes() / d, d)?;
        let x_tokens = fast_moe_wide::act_tensor_map(self.xq.addr(), self.xq.bytes() / d, d)?;
        let h = fast_moe_wide::act_tensor_map(self.hq.addr(), self.hq.bytes() / i, i)?;
        let _g = ctx.enter()?;
        crate::cuda::arena::copy_to_device_sync(self.act_maps, &[x, x_tokens, h].concat(), stream)
    }
}

/// The workspace buffers for `t` tokens, in [`FastMoeWorkspace`]'s field order (the plan as
/// offsets, rows, tiles, ntiles): (name, element type, elements).
pub fn workspace_buffers(
    t: usize,
    d: usize,
    i: usize,
    k: usize,
    experts: usize,
) -> [(&'static str, Elem, usize); 18] {
    let plan = MoePlan::buffer_bytes(t, k, experts, fast_moe_gemm::TOKENS).map(|b| b / 4);
    let [counts, ranks] = moe::plan_wide_scratch(t * k, experts);
    let rows = t * k + t;
    [
        ("logits", Elem::F32, t * experts),
        ("ids", Elem::I32, t * k),
        ("weights", Elem::F32, t * k),
        ("xq", Elem::U8, t * d),
        ("xs", Elem::F32, t * d / 128),
        ("plan_offsets", Elem::I32, plan[0]),
        ("plan_rows", Elem::I32, plan[1]),
        ("plan_tiles", Elem::I32, plan[2]),
        ("plan_ntiles", Elem::I32, plan[3]),
        ("hq", Elem::U8, rows * i),
        (
            "hs",
            Elem::F32,
            (rows * i / 128).max(fast_moe_wide::act_scale_floats(t, k, experts, i)),
        ),
        ("y", Elem::Bf16, rows * d),
        // u32 words, declared as I32 (the same bytes; the fused path's plan zeroes all but the
        // start ticket, which is zero from the arena on).
        (
            "gemm_sync",
            Elem::I32,
            fast_moe_gemm::sync_words(t, k, experts),
        ),
        ("plan_counts", Elem::I32, counts),
        ("plan_ranks", Elem::I32, ranks),
        (
            "xs_plan",
            Elem::F32,
            fast_moe_wide::act_scale_floats(t, k, experts, d),
        ),
        ("act_maps", Elem::U8, 3 * fast_moe_gemm::MAP_BYTES),
        // u32 words likewise (zero from the arena on; each routed layer's combine re-zeroes them).
        (
            "route_sync",
            Elem::I32,
            fast_moe_gemm::route_sync_words(t, k, experts),
        ),
    ]
}

/// The RMSNorm that makes a MoE layer's input ([`FastMoe::layer`], [`FastMoe::norm_x`]): x's
/// rows times `weight` (None: none), with `eps`, rounded to BF16 when `round_out`.
#[derive(Clone, Copy, Debug)]
pub struct MoeNorm {
    pub weight: Option<DevicePtr>,
    pub eps: f32,
    pub round_out: bool,
}

/// The block [`FastMoe::norm_x`] runs `t` rows of `d` values on ([`register_block`]: so the
/// normed values are [`NormRope::rmsnorm`]'s), or None where it does not take them.
///
/// [`NormRope::rmsnorm`]: super::norm_rope::NormRope::rmsnorm
fn norm_x_block(t: usize, d: usize) -> Option<RmsnormBlock> {
    register_block(t, d)
}

/// Whether [`FastMoe::norm_x`] takes `t` rows of `d` values.
pub fn norm_x_covers(t: usize, d: usize) -> bool {
    norm_x_block(t, d).is_some()
}

/// Most blocks of an `fmoe_norm_x_kernel` launch (a block a row, grid-stride beyond).
const NORM_X_MAX_BLOCKS: usize = 1 << 20;
/// `fmoe_norm_x_rows_kernel` blocks an SM: as many as its registers let an SM hold (128 a
/// thread, 256 threads), so the launch is one wave of blocks that each prefetch their rows.
const NORM_X_ROWS_BLOCKS_PER_SM: usize = 2;

/// The fast MoE: routing + combine kernels, the GEMMs, and the moe family's plan.
pub struct FastMoe {
    route: FastMoeRoute,
    gemm: FastMoeGemm,
    moe: Moe,
}

fn internal(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

impl FastMoe {
    /// Kernel launches of one [`FastMoe::layer`] of `t` tokens whose expert GEMMs take `path`
    /// (without the input's norm): the fused decode path runs both GEMMs in one, the routed one
    /// the router too, the wide plan takes three launches for one.
    pub fn launches_per_layer(path: GemmPath, t: usize) -> usize {
        let plan = if t >= WIDE_PLAN_MIN_TOKENS { 3 } else { 1 };
        match path {
            GemmPath::DecodeRouted => 2, // the router and GEMMs, the combine
            GemmPath::DecodeFused => 5,  // the one block's plan, whatever t
            GemmPath::Decode => plan + 5,
            GemmPath::Prefill => plan + 6, // and x's gather
        }
    }

    /// Resolves the kernels; `reg` must hold the fast_moe, fast_moe_gemm and moe families.
    pub fn new(reg: &crate::cuda::registry::Registry) -> Result<FastMoe> {
        Ok(FastMoe {
            route: FastMoeRoute::new(reg)?,
            gemm: FastMoeGemm::new(reg)?,
            moe: Moe::new(reg)?,
        })
    }

    /// Rebuilds the layer's derived tensors that need a kernel (the router's gate planes and the
    /// experts' UE8M0 scale table), after its weights were written (finalize, refit).
    pub fn derive(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.route.derive_gate_planes(ctx, layer, stream)?;
        self.gemm.derive_scales8(ctx, layer, stream)
    }

    /// One MoE layer: `out[t] = MoE(x[t])` for `t` tokens (`x`, `out`: `f32[T, D]`, x's values BF16;
    /// hash layers read the token ids of `layer.selection`). With `norm`, x is the input before its
    /// RMSNorm, which runs first, in place, with x's quantisation ([`FastMoe::norm_x`]). Launches
    /// only; no host sync.
    #[allow(clippy::too_many_arguments)]
    pub fn layer(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        norm: Option<&MoeNorm>,
        ws: &FastMoeWorkspace,
        out: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let (router, path) = (RouterPath::for_tokens(t, layer.d), GemmPath::for_tokens(t));
        if let Some(norm) = norm {
            self.norm_x(ctx, layer, x, t, norm, path, ws, stream)?;
        }
        self.route_and_experts(ctx, layer, x, t, ws, router, path, norm.is_some(), stream)?;
        self.combine_on(ctx, layer, t, ws, path, out, stream)
    }

    /// Steps 1-5 on `path` with `router` (tests, `dsv4 bench moe`; [`FastMoe::layer`] picks both
    /// by the tokens): [`FastMoe::route_on`] then [`FastMoe::experts_on`], or on
    /// [`GemmPath::DecodeRouted`] (the f32 router only) one launch that makes the same bits. Then
    /// [`FastMoe::combine_on`] on the same path must follow (the routed path's synchronisation
    /// words are zeroed there). `x_made` as [`FastMoe::route_on`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn route_and_experts(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        ws: &FastMoeWorkspace,
        router: RouterPath,
        path: GemmPath,
        x_made: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        if path != GemmPath::DecodeRouted {
            self.route_on(ctx, layer, x, t, ws, router, path, x_made, stream)?;
            return self.experts_on(ctx, layer, t, ws, path, stream);
        }
        if router != RouterPath::Few {
            return Err(internal(format!(
                "fast MoE: the routed decode path computes the router in f32 ({router:?} asked)"
            )));
        }
        self.gemm
            .route_up_down(ctx, layer, x, t, x_made, ws, stream)
    }

    /// The layer's input RMSNorm (`norm`) of x's `t` rows in place, with the bits and block
    /// [`NormRope::rmsnorm`] gives them ([`rmsnorm_block`]), and x's FP8 quantisation from the
    /// normed values into `ws.xq` / `ws.xs` in the order of `path`'s GEMMs: the codes and scales
    /// the router kernels would make ([`FastMoe::route_on`] with `x_made` then skips them). One
    /// launch; [`norm_x_covers`] the shapes it takes.
    ///
    /// [`NormRope::rmsnorm`]: super::norm_rope::NormRope::rmsnorm
    #[allow(clippy::too_many_arguments)]
    pub fn norm_x(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        norm: &MoeNorm,
        path: GemmPath,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_norm_x_kernel";
        let d = layer.d;
        let Some(block) = norm_x_block(t, d) else {
            return Err(internal(format!("{K}: {t} rows of {d}")));
        };
        need(K, "x", x, t * d * 4)?;
        if block == RmsnormBlock::Rows && !x.addr().is_multiple_of(16) {
            // The rows kernel copies its rows ahead by 16-byte cp.async.
            return Err(internal(format!(
                "{K}: x at {:#x} is not 16-byte aligned",
                x.addr()
            )));
        }
        if let Some(w) = norm.weight {
            need(K, "weight", w, d * 4)?;
        }
        need(K, "xq", ws.xq, t * d)?;
        need(K, "xs", ws.xs, t * d / 128 * 4)?;
        let (rows, dim) = (to_i32(K, "rows", t)?, to_i32(K, "dim", d)?);
        let _g = ctx.enter()?;
        let grid = t.min(NORM_X_MAX_BLOCKS) as u32;
        // The rows kernel copies each block's next row ahead while it works on one
        // (kernels/fast_moe.cu fmoe_norm_x): as many blocks as the SMs hold at once, each taking
        // every grid-th row.
        let rows_grid =
            t.min(NORM_X_ROWS_BLOCKS_PER_SM * ctx.info().multiprocessors.max(1) as usize) as u32;
        let (halves, xq, xs) = (path.halves_order(), ws.xq, ws.xs);
        let (weight, eps, round_out) = (norm.weight, norm.eps, norm.round_out);
        match block {
            RmsnormBlock::Rows => {
                let args = fmoe_norm_x_rows_kernel::Args {
                    x,
                    rows,
                    dim,
                    weight,
                    eps,
                    round_out,
                    halves,
                    xq,
                    xs,
                };
                let threads = RMSNORM_ROWS_THREADS as u32;
                self.route
                    .norm_x_rows
                    .launch(rows_grid, threads, 0, stream, args)
            }
            RmsnormBlock::Row { threads, .. } => {
                let args = fmoe_norm_x_kernel::Args {
                    x,
                    rows,
                    dim,
                    weight,
                    eps,
                    round_out,
                    halves,
                    xq,
                    xs,
                };
                self.route.norm_x.launch(grid, threads, 0, stream, args)
            }
        }
    }

    /// Steps 1-2: logits, selection and weights into `ws.ids` / `ws.weights`, x into `ws.xq` / `ws.xs`.
    pub fn route(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        let (router, path) = (RouterPath::for_tokens(t, layer.d), GemmPath::for_tokens(t));
        self.route_on(ctx, layer, x, t, ws, router, path, false, stream)
    }

    /// [`FastMoe::route`] with the router kernel chosen by the caller (tests, `dsv4 bench moe`).
    /// x's codes are written in the order of the GEMMs of `path` ([`GemmPath::halves_order`]):
    /// [`FastMoe::experts_on`] must then run that path. `x_made`: [`FastMoe::norm_x`] made them
    /// already (in that order), and the router kernels leave them.
    #[allow(clippy::too_many_arguments)]
    pub fn route_on(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        ws: &FastMoeWorkspace,
        router: RouterPath,
        path: GemmPath,
        x_made: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_select_kernel";
        let (d, e, k) = (layer.d, layer.experts, layer.k);
        let (t32, d32, e32, k32) = (
            to_i32(K, "T", t)?,
            to_i32(K, "D", d)?,
            to_i32(K, "E", e)?,
            to_i32(K, "k", k)?,
        );
        let (bias, tid2eid, toks) = layer.selection.kernel_args(K, t, e, k)?;
        let _g = ctx.enter()?;
        let scoring = moe::scoring_code(layer.router.scoring);
        // Each branch checks the router's buffers (the selection's too) before its first launch.
        if router.tensor_cores() {
            layer.check_router(K, x, t, ws)?;
            need(K, "gate_planes", layer.gate_planes, gate_planes_bytes(e, d))?;
            let ks = router.stage_split();
            let split = ks > 1;
            if !(d / 64).is_multiple_of(ks) {
                return Err(internal(format!(
                    "fmoe_logits_tc_split_kernel: D / 64 = {} stages do not split over {ks} blocks",
                    d / 64
                )));
            }
            let blocks = e.div_ceil(2 * TC_WG_EXPERTS) * ks;
            let grid = (blocks as u32, t.div_ceil(TC_TOKENS) as u32, 1);
            let (threads, smem) = (TC_THREADS as u32, TC_SMEM_BYTES as u32);
            // Both kernels take the same arguments.
            macro_rules! args {
                ($kernel:ident) => {
                    $kernel::Args {
                        x,
                        t: t32,
                        d: d32,
                        e: e32,
                        planes: layer.gate_planes,
                        scoring,
                        scores: ws.logits,
                    }
                };
            }
            if split {
                let args = args!(fmoe_logits_tc_split_kernel);
                let cluster = (ks as u32, 1, 1);
                self.route
                    .logits_tc_split
                    .launch_clustered(grid, threads, smem, stream, args, cluster)?;
            } else {
                let args = args!(fmoe_logits_tc_kernel);
                self.route
                    .logits_tc
                    .launch(grid, threads, smem, stream, args)?;
            }
        } else {
            let group = logit_group(t);
            self.logits_few(ctx, layer, x, t, ws, group, path, x_made, stream)?;
        }
        let r = &layer.router;
        self.route.select.launch(
            t.div_ceil(SELECT_WARPS) as u32,
            (SELECT_WARPS * 32) as u32,
            0,
            stream,
            fmoe_select_kernel::Args {
                scores: ws.logits,
                t: t32,
                e: e32,
                k: k32,
                bias,
                tid2eid,
                tokens: toks,
                scoring,
                renorm: r.renorm,
                route_scale: r.route_scale,
                ids: ws.ids,
                weights: ws.weights,
                x: (router.tensor_cores() && !x_made).then_some(x),
                d: d32,
                halves: path.halves_order(),
                xq: ws.xq,
                xs: ws.xs,
            },
        )
    }

    /// The few-token router's logits ([`RouterPath::Few`]) into `ws.logits`, each warp on `group`
    /// experts: 1 (`fmoe_logits_kernel`) or [`LOGIT_GROUP`] (`fmoe_logits_grouped_kernel`), the
    /// same bits ([`FastMoe::route_on`] takes [`logit_group`]); and x's codes unless `x_made`, in
    /// `path`'s order. Checks the router's buffers first, the selection's included.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_few(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        ws: &FastMoeWorkspace,
        group: usize,
        path: GemmPath,
        x_made: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        if group != 1 && group != LOGIT_GROUP {
            return Err(internal(format!(
                "fast MoE router logits: experts a warp takes must be 1 or {LOGIT_GROUP}, got {group}"
            )));
        }
        let k_name = logits_kernel_name(group);
        layer.check_router(k_name, x, t, ws)?;
        let (d, e) = (layer.d, layer.experts);
        let grid = (
            e.div_ceil(LOGIT_EXPERTS * group)
                .max((d / 128).div_ceil(LOGIT_WARPS)) as u32,
            t.div_ceil(LOGIT_TOKENS) as u32,
            1,
        );
        let (t32, d32, e32) = (
            to_i32(k_name, "T", t)?,
            to_i32(k_name, "D", d)?,
            to_i32(k_name, "E", e)?,
        );
        // Both kernels take the same arguments.
        macro_rules! args {
            ($kernel:ident) => {
                $kernel::Args {
                    x,
                    t: t32,
                    d: d32,
                    e: e32,
                    gate: layer.gate,
                    scoring: moe::scoring_code(layer.router.scoring),
                    scores: ws.logits,
                    halves: path.halves_order(),
                    xq: (!x_made).then_some(ws.xq),
                    xs: (!x_made).then_some(ws.xs),
                }
            };
        }
        let _g = ctx.enter()?;
        let block = (LOGIT_WARPS * 32) as u32;
        if group == 1 {
            let args = args!(fmoe_logits_kernel);
            self.route.logits.launch(grid, block, 0, stream, args)
        } else {
            let args = args!(fmoe_logits_grouped_kernel);
            self.route
                .logits_grouped
                .launch(grid, block, 0, stream, args)
        }
    }

    /// Step 6: `out[t] = bf16(Σ_j y[t*k + j] + y[T*k + t])` as f32.
    pub fn combine(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        out: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.combine_on(ctx, layer, t, ws, GemmPath::Decode, out, stream)
    }

    /// [`FastMoe::combine`] after the experts of `path`: after [`GemmPath::DecodeRouted`]'s
    /// launch it also zeroes that launch's synchronisation words (`ws.route_sync`) for the next.
    #[allow(clippy::too_many_arguments)]
    pub fn combine_on(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        path: GemmPath,
        out: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_combine_kernel";
        let (d, k) = (layer.d, layer.k);
        need(K, "y", ws.y, (t * k + t) * d * 2)?;
        need(K, "out", out, t * d * 4)?;
        let (clear, clear_words) = if path == GemmPath::DecodeRouted {
            let words = fast_moe_gemm::route_sync_words(t, k, layer.experts);
            need(K, "route_sync", ws.route_sync, words * 4)?;
            (Some(ws.route_sync), to_i32(K, "clear_words", words)?)
        } else {
            (None, 0)
        };
        let _g = ctx.enter()?;
        self.route.combine.launch(
            (d.div_ceil(8 * 128) as u32, t as u32, 1),
            128u32,
            0,
            stream,
            fmoe_combine_kernel::Args {
                y: ws.y,
                ids: ws.ids,
                t: to_i32(K, "T", t)?,
                k: to_i32(K, "k", k)?,
                e: to_i32(K, "E", layer.experts)?,
                d: to_i32(K, "D", d)?,
                has_shared: layer.shared.is_some(),
                out,
                clear,
                clear_words,
            },
        )
    }

    /// Steps 3-5 on an existing routing (ids / weights / xq / xs in `ws`): the plan and both GEMMs,
    /// on the path [`GemmPath::for_tokens`] picks.
    pub fn experts(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.experts_on(ctx, layer, t, ws, GemmPath::for_tokens(t), stream)
    }

    /// [`FastMoe::experts`] on the given path (tests and benchmarks compare both).
    pub fn experts_on(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        path: GemmPath,
        stream: BorrowedStream,
    ) -> Result<()> {
        if path == GemmPath::DecodeRouted {
            return Err(internal(
                "fast MoE: the routed decode path runs the router too (route_and_experts)".into(),
            ));
        }
        let plan = ws.plan.sized(t, path.tile_rows(t));
        if path == GemmPath::DecodeFused {
            // The fused GEMMs' synchronisation words after the start ticket zeroed by the plan, the
            // launch before theirs (one block's plan at any token count: the fused path is the
            // decode path's).
            let words = fast_moe_gemm::plan_cleared_sync_words(t, layer.k, layer.experts);
            let cleared = ws.sync.slice(4, words * 4)?;
            self.moe
                .plan_clearing(ctx, ws.ids, &plan, Some((cleared, words)), stream)?;
        } else if t >= WIDE_PLAN_MIN_TOKENS || path == GemmPath::Prefill {
            // (The prefill path's gather places x's rows from the wide plan's scratch, so that
            // path takes it at any count.)
            let (counts, ranks) = (ws.plan_counts, ws.plan_ranks);
            self.moe
                .plan_wide(ctx, ws.ids, &plan, counts, ranks, stream)?;
        } else {
            self.moe.plan(ctx, ws.ids, &plan, stream)?;
        }
        let ws = FastMoeWorkspace { plan, ..*ws };
        match path {
            GemmPath::DecodeFused => self.gemm.up_down(ctx, layer, t, &ws, stream),
            GemmPath::DecodeRouted | GemmPath::Decode | GemmPath::Prefill => {
                self.gemm.up(ctx, layer, t, &ws, path, stream)?;
                self.gemm.down(ctx, layer, t, &ws, path, stream)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_path_follows_the_token_count_and_what_d_splits_into() {
        let at = |t| RouterPath::for_tokens(t, 4096);
        assert_eq!(at(TC_MIN_TOKENS - 1), RouterPath::Few);
        assert_eq!(at(TC_MIN_TOKENS), RouterPath::TensorSplit);
        assert_eq!(at(TC_SPLIT_MAX_TOKENS), RouterPath::TensorSplit);
        assert_eq!(at(TC_SPLIT_MAX_TOKENS + 1), RouterPath::TensorPair);
        assert_eq!(at(TC_PAIR_MAX_TOKENS), RouterPath::TensorPair);
        assert_eq!(at(TC_PAIR_MAX_TOKENS + 1), RouterPath::Tensor);
        // D / 64 = 6 splits in two, not in four; 5 in neither.
        assert_eq!(RouterPath::for_tokens(500, 384), RouterPath::TensorPair);
        assert_eq!(RouterPath::for_tokens(500, 320), RouterPath::Tensor);
        assert_eq!(RouterPath::for_tokens(1500, 320), RouterPath::Tensor);
        let splits = [
            RouterPath::Few,
            RouterPath::Tensor,
            RouterPath::TensorSplit,
            RouterPath::TensorPair,
        ]
        .map(RouterPath::stage_split);
        assert_eq!(splits, [1, 1, TC_KSPLIT, TC_PAIR_SPLIT]);
    }
}
