//! Rust side of the `moe` kernel family (kernels/moe.cu): typed launch wrappers. See
//! kernels/SPEC.md and src/reference/moe.rs.
//!
//! One MoE layer on the device, as `reference::moe::moe` computes it:
//! 1. [`Moe::router`]: expert ids and combine weights per token (`[T, k]` each);
//! 2. [`Moe::plan`]: assignments `a = t*k + j` grouped by expert into row tiles ([`MoePlan`]);
//! 3. official mode with quantized experts: `Linear::act_quant` of x (`[T, D]`) -> xq;
//! 4. [`Moe::up`]: `h[a] = w_a * silu(min(W1 x, L)) * clamp(W3 x, ±L)` (`[T*k, I]`);
//! 5. official mode with quantized experts: `Linear::act_quant` of h -> hq;
//! 6. [`Moe::down`]: `ya[a] = W2 hq[a]` (`[T*k, D]`);
//! 7. shared expert: `Linear::linear` (w1, w3) + [`Moe::swiglu`] + (act_quant) + `linear` (w2) -> ys;
//! 8. [`Moe::combine`]: `out[t] = ys[t] + Σ_j ya[t*k + j]` (f64 sum, bf16 in official mode).
//!
//! Routed-expert weights arrive as device arrays of u64 addresses, one per expert
//! ([`DevExperts`]), so the kernels pick experts on the device.

use super::linear::{WFormat, strided_bytes};
use crate::config::{ModelConfig, ScoringFunc};
use crate::cuda::kernels::{need, to_i32};
use crate::cuda::registry::{Kernel, KernelFn, KernelSource, Registry};
use crate::cuda::stream::{BorrowedStream, KernelArgs, launch};
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource {
    family: "moe",
    source: include_str!("../../../kernels/moe.cu"),
    functions: &[
        KernelFn::new("router_kernel"),
        KernelFn::new("moe_plan_kernel"),
        KernelFn::new("moe_up_kernel"),
        KernelFn::new("moe_down_kernel"),
        KernelFn::new("swiglu_kernel"),
        KernelFn::new("moe_combine_kernel"),
    ],
};

/// Rows per tile of the expert GEMMs (MOE_BM): the `tile_rows` to plan with. Other values work
/// (the kernels loop over row blocks) but waste or split blocks.
pub const TILE_ROWS: usize = 32;
/// Outputs per grid row of `moe_up_kernel` (MOE_UP_BNS) and `moe_down_kernel` (MOE_DOWN_BNS): the
/// skinny path's block width (tiles of at most 8 rows); tiles of more rows are computed 64 outputs
/// per block by every (64 / this)-th block row.
pub const UP_GRID_N: usize = 8;
pub const DOWN_GRID_N: usize = 16;
/// Tokens per `router_kernel` block (ROUTER_TOKENS).
pub const ROUTER_TOKENS: usize = 4;
/// Threads of an expert GEMM block (GEMM_THREADS).
pub const GEMM_THREADS: u32 = 256;
/// Threads (and warps) of the single `moe_plan_kernel` block.
pub const PLAN_THREADS: u32 = 512;
pub const PLAN_WARPS: usize = 16;
/// Largest experts_per_tok the router supports (ROUTER_MAX_K).
pub const MAX_TOPK: usize = 32;
/// Default dynamic shared memory allowance (the registry raises none for this family).
const SMEM_LIMIT: usize = 48 * 1024;
/// Static shared memory of router_kernel / moe_plan_kernel (chosen ids and weights; scan scratch).
const ROUTER_STATIC_SMEM: usize = ROUTER_TOKENS * 2 * MAX_TOPK * 4;
const PLAN_STATIC_SMEM: usize = 32 * 4;

/// `scoring` argument of `router_kernel` (SCORE_* in moe.cu).
pub fn scoring_code(s: ScoringFunc) -> i32 {
    match s {
        ScoringFunc::SqrtSoftplus => 0,
        ScoringFunc::Softmax => 1,
        ScoringFunc::Sigmoid => 2,
    }
}

/// Tiles the plan may produce for `assignments` rows: `ceil(assignments / tile_rows) + experts`.
pub fn max_tiles(assignments: usize, tile_rows: usize, experts: usize) -> usize {
    assignments.div_ceil(tile_rows.max(1)) + experts
}

/// Dynamic shared memory of `moe_plan_kernel` for `experts` experts.
pub fn plan_smem_bytes(experts: usize) -> usize {
    ((PLAN_WARPS + 1) * experts + 1) * 4
}

/// Router parameters of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    pub experts: usize,
    pub k: usize,
    pub scoring: ScoringFunc,
    /// Divide the selected scores by their sum (`norm_topk_prob`, never for softmax).
    pub renorm: bool,
    pub route_scale: f32,
}

impl RouterParams {
    /// The router of `cfg`, exactly as `reference::moe::route` applies it.
    pub fn from_config(cfg: &ModelConfig) -> RouterParams {
        RouterParams {
            experts: cfg.n_routed_experts,
            k: cfg.experts_per_tok,
            scoring: cfg.scoring_func,
            renorm: cfg.norm_topk_prob && cfg.scoring_func != ScoringFunc::Softmax,
            route_scale: cfg.routed_scaling_factor,
        }
    }
}

/// How a layer selects its experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Top-k of `score + bias` (`bias` f32[E]; None: of the scores).
    TopK { bias: Option<DevicePtr> },
    /// Hash layer: `tid2eid` i32[vocab, k] indexed by `tokens` i32[T] (values must be < vocab and
    /// the table's ids < E: the loader validates both).
    Hash {
        tid2eid: DevicePtr,
        tokens: DevicePtr,
        vocab: usize,
    },
}

/// The routed experts' weights of one projection (all experts share format and shape):
/// `ptrs` holds `count` u64 device addresses of each expert's data (values or codes), `scales`
/// `count` u64 addresses of its f32 scales (quantized formats only). The addressed buffers are
/// laid out as [`super::linear::DevWeight`] describes (`rows x cols` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevExperts {
    pub format: WFormat,
    pub ptrs: DevicePtr,
    pub scales: Option<DevicePtr>,
    pub block: [usize; 2],
    pub rows: usize,
    pub cols: usize,
    pub count: usize,
}

impl DevExperts {
    fn validate(&self, kernel: &str, what: &str) -> Result<()> {
        need(kernel, what, self.ptrs, self.count * 8)?;
        if self.format.is_quantized() {
            let Some(s) = self.scales else {
                return Err(internal(format!(
                    "{kernel}: quantized `{what}` without scale pointers"
                )));
            };
            need(kernel, what, s, self.count * 8)?;
            if self.format == WFormat::Fp8 && (self.block[0] == 0 || self.block[1] == 0) {
                return Err(internal(format!(
                    "{kernel}: `{what}` FP8 block {:?}",
                    self.block
                )));
            }
        }
        Ok(())
    }

    fn scale_ptr(&self) -> u64 {
        if self.format.is_quantized() {
            self.scales.map_or(0, u64::from)
        } else {
            0
        }
    }
}

/// The device buffers of one routing plan and the sizes they were planned for. Make them with
/// [`MoePlan::buffer_bytes`]; [`Moe::plan`] fills them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoePlan {
    /// i32[experts + 1]: expert e's rows are `rows[offsets[e]..offsets[e+1]]`.
    pub offsets: DevicePtr,
    /// i32[tokens * k]: assignments grouped by expert, stable.
    pub rows: DevicePtr,
    /// i32[max_tiles * 3]: (expert, start, count).
    pub tiles: DevicePtr,
    /// i32[1]: number of tiles.
    pub ntiles: DevicePtr,
    pub tokens: usize,
    pub k: usize,
    pub experts: usize,
    pub tile_rows: usize,
}

impl MoePlan {
    /// Bytes of (offsets, rows, tiles, ntiles) for a plan of these sizes.
    pub fn buffer_bytes(tokens: usize, k: usize, experts: usize, tile_rows: usize) -> [usize; 4] {
        [
            (experts + 1) * 4,
            tokens * k * 4,
            max_tiles(tokens * k, tile_rows, experts) * 3 * 4,
            4,
        ]
    }

    pub fn assignments(&self) -> usize {
        self.tokens * self.k
    }

    pub fn max_tiles(&self) -> usize {
        max_tiles(self.assignments(), self.tile_rows, self.experts)
    }

    /// Grid columns of the expert GEMMs: one per possible tile. Every tile holds at least one
    /// assignment, so there are at most `min(max_tiles, T*k)` of them.
    pub fn grid_tiles(&self) -> usize {
        self.max_tiles().min(self.assignments())
    }

    fn validate(&self, kernel: &str) -> Result<()> {
        if self.tile_rows == 0 || self.experts == 0 || self.k == 0 {
            return Err(internal(format!(
                "{kernel}: plan with tile_rows {}, experts {}, k {}",
                self.tile_rows, self.experts, self.k
            )));
        }
        let [o, r, t, n] = MoePlan::buffer_bytes(self.tokens, self.k, self.experts, self.tile_rows);
        need(kernel, "offsets", self.offsets, o)?;
        need(kernel, "rows", self.rows, r)?;
        need(kernel, "tiles", self.tiles, t)?;
        need(kernel, "ntiles", self.ntiles, n)?;
        to_i32(kernel, "tokens * k", self.assignments())?;
        to_i32(kernel, "tiles", self.max_tiles() * 3)?;
        Ok(())
    }
}

fn internal(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

/// Blocks of a grid-stride elementwise launch over `n` elements (256 threads each).
fn stride_blocks(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 132 * 32) as u32
}

/// The moe family's entry points, resolved from a loaded registry.
pub struct Moe {
    router: Kernel,
    plan: Kernel,
    up: Kernel,
    down: Kernel,
    swiglu: Kernel,
    combine: Kernel,
}

impl Moe {
    pub fn new(reg: &Registry) -> Result<Moe> {
        Ok(Moe {
            router: reg.get("moe", "router_kernel")?,
            plan: reg.get("moe", "moe_plan_kernel")?,
            up: reg.get("moe", "moe_up_kernel")?,
            down: reg.get("moe", "moe_down_kernel")?,
            swiglu: reg.get("moe", "swiglu_kernel")?,
            combine: reg.get("moe", "moe_combine_kernel")?,
        })
    }

    /// Routing of `t` tokens `x` (f32 `[t, d]`) with gate f32 `[E, d]`: expert ids i32 `[t, k]`
    /// and combine weights f32 `[t, k]`, as `reference::moe::route`.
    #[allow(clippy::too_many_arguments)]
    pub fn router(
        &self,
        ctx: &Context,
        x: DevicePtr,
        t: usize,
        d: usize,
        gate: DevicePtr,
        sel: Selection,
        p: &RouterParams,
        ids: DevicePtr,
        weights: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "router_kernel";
        let (e, k) = (p.experts, p.k);
        if e == 0 || k == 0 || k > e || k > MAX_TOPK {
            return Err(internal(format!(
                "{K}: {k} of {e} experts (at most {MAX_TOPK})"
            )));
        }
        let smem = ROUTER_TOKENS * 2 * e * 4;
        if smem + ROUTER_STATIC_SMEM > SMEM_LIMIT {
            return Err(internal(format!(
                "{K}: {e} experts need {smem} bytes of shared memory"
            )));
        }
        need(K, "x", x, t * d * 4)?;
        need(K, "gate", gate, e * d * 4)?;
        need(K, "ids", ids, t * k * 4)?;
        need(K, "weights", weights, t * k * 4)?;
        let (bias, table, tokens) = match sel {
            Selection::TopK { bias } => {
                if let Some(b) = bias {
                    need(K, "bias", b, e * 4)?;
                }
                (bias.map_or(0, u64::from), 0, 0)
            }
            Selection::Hash {
                tid2eid,
                tokens,
                vocab,
            } => {
                need(K, "tid2eid", tid2eid, vocab * k * 4)?;
                need(K, "tokens", tokens, t * 4)?;
                (0, tid2eid.addr(), tokens.addr())
            }
        };
        let (t32, d32, e32, k32) = (
            to_i32(K, "T", t)?,
            to_i32(K, "D", d)?,
            to_i32(K, "E", e)?,
            to_i32(K, "k", k)?,
        );
        to_i32(K, "T * k", t * k)?;
        if t == 0 {
            return Ok(());
        }
        let threads = (4 * e).div_ceil(32).clamp(ROUTER_TOKENS, 32) as u32 * 32;
        let blocks = t.div_ceil(ROUTER_TOKENS) as u32;
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(x)
            .i32(t32)
            .i32(d32)
            .i32(e32)
            .i32(k32)
            .ptr(gate)
            .ptr(bias)
            .ptr(table)
            .ptr(tokens)
            .i32(scoring_code(p.scoring))
            .i32(p.renorm as i32)
            .f32(p.route_scale)
            .ptr(ids)
            .ptr(weights);
        // SAFETY: arguments match `router_kernel(const float*, int, int, int, int, const float*,
        // const float*, const int*, const int*, int, int, float, int*, float*)`; sizes checked.
        unsafe { launch(&self.router, blocks, threads, smem as u32, stream, &a) }
    }

    /// Groups the assignments of `ids` (i32 `[plan.tokens, plan.k]`) by expert into `plan`'s
    /// buffers (one block, deterministic).
    pub fn plan(
        &self,
        ctx: &Context,
        ids: DevicePtr,
        plan: &MoePlan,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_plan_kernel";
        plan.validate(K)?;
        need(K, "ids", ids, plan.assignments() * 4)?;
        let smem = plan_smem_bytes(plan.experts);
        if smem + PLAN_STATIC_SMEM > SMEM_LIMIT {
            return Err(internal(format!(
                "{K}: {} experts need {smem} bytes of shared memory",
                plan.experts
            )));
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(ids)
            .i32(plan.tokens as i32)
            .i32(plan.k as i32)
            .i32(plan.experts as i32)
            .i32(to_i32(K, "tile_rows", plan.tile_rows)?)
            .ptr(plan.offsets)
            .ptr(plan.rows)
            .ptr(plan.tiles)
            .ptr(plan.ntiles);
        // SAFETY: arguments match `moe_plan_kernel(const int*, int, int, int, int, int*, int*, int*,
        // int*)`; buffer sizes checked by `validate`.
        unsafe { launch(&self.plan, 1u32, PLAN_THREADS, smem as u32, stream, &a) }
    }

    /// Up projection of every assignment: `h[a, :]` (f32 `[T*k, I]`, I = `w1.rows`) from `xq`
    /// (f32 `[T, D]`: x, or act_quant(x) in official mode with quantized experts), the routing
    /// `weights` (f32 `[T*k]`) and the clamp `limit` (none when <= 0).
    #[allow(clippy::too_many_arguments)]
    pub fn up(
        &self,
        ctx: &Context,
        plan: &MoePlan,
        xq: DevicePtr,
        w1: &DevExperts,
        w3: &DevExperts,
        weights: DevicePtr,
        limit: f32,
        official: bool,
        h: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_up_kernel";
        plan.validate(K)?;
        w1.validate(K, "w1")?;
        w3.validate(K, "w3")?;
        let (i, d) = (w1.rows, w1.cols);
        if (w3.format, w3.block, w3.rows, w3.cols) != (w1.format, w1.block, i, d) {
            return Err(internal(format!(
                "{K}: w1 {:?} {i}x{d} and w3 {:?} {}x{} differ",
                w1.format, w3.format, w3.rows, w3.cols
            )));
        }
        if w1.count < plan.experts || w3.count < plan.experts {
            return Err(internal(format!(
                "{K}: {} / {} expert pointers for {} experts",
                w1.count, w3.count, plan.experts
            )));
        }
        let n = plan.assignments();
        need(K, "xq", xq, strided_bytes(plan.tokens, d, d))?;
        need(K, "weights", weights, n * 4)?;
        need(K, "h", h, n * i * 4)?;
        let (d32, i32_) = (to_i32(K, "D", d)?, to_i32(K, "I", i)?);
        let (br, bc) = (
            to_i32(K, "block rows", w1.block[0])?,
            to_i32(K, "block cols", w1.block[1])?,
        );
        let gy = i.div_ceil(UP_GRID_N);
        if n == 0 || i == 0 {
            return Ok(());
        }
        if gy > 65_535 {
            return Err(internal(format!("{K}: I = {i} exceeds the grid")));
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(xq)
            .i32(d32)
            .i32(i32_)
            .ptr(plan.rows)
            .ptr(plan.tiles)
            .ptr(plan.ntiles)
            .i32(plan.k as i32)
            .ptr(w1.ptrs)
            .ptr(w3.ptrs)
            .ptr(w1.scale_ptr())
            .ptr(w3.scale_ptr())
            .i32(w1.format.code())
            .i32(br)
            .i32(bc)
            .ptr(weights)
            .f32(limit)
            .i32(official as i32)
            .ptr(h);
        // SAFETY: arguments match `moe_up_kernel(const float*, int, int, const int*, const int*,
        // const int*, int, const u64*, const u64*, const u64*, const u64*, int, int, int,
        // const float*, float, int, float*)`; sizes checked above (the expert buffers behind
        // the pointer arrays are the caller's contract).
        unsafe {
            launch(
                &self.up,
                (plan.grid_tiles() as u32, gy as u32),
                GEMM_THREADS,
                0,
                stream,
                &a,
            )
        }
    }

    /// Down projection of every assignment: `ya[a, :]` (f32 `[T*k, D]`, D = `w2.rows`) from `hq`
    /// (f32 `[T*k, I]`: h, or act_quant(h) in official mode with quantized experts).
    #[allow(clippy::too_many_arguments)]
    pub fn down(
        &self,
        ctx: &Context,
        plan: &MoePlan,
        hq: DevicePtr,
        w2: &DevExperts,
        official: bool,
        ya: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_down_kernel";
        plan.validate(K)?;
        w2.validate(K, "w2")?;
        if w2.count < plan.experts {
            return Err(internal(format!(
                "{K}: {} expert pointers for {} experts",
                w2.count, plan.experts
            )));
        }
        let (d, i) = (w2.rows, w2.cols);
        let n = plan.assignments();
        need(K, "hq", hq, n * i * 4)?;
        need(K, "ya", ya, n * d * 4)?;
        let (d32, i32_) = (to_i32(K, "D", d)?, to_i32(K, "I", i)?);
        let (br, bc) = (
            to_i32(K, "block rows", w2.block[0])?,
            to_i32(K, "block cols", w2.block[1])?,
        );
        let gy = d.div_ceil(DOWN_GRID_N);
        if n == 0 || d == 0 {
            return Ok(());
        }
        if gy > 65_535 {
            return Err(internal(format!("{K}: D = {d} exceeds the grid")));
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(hq)
            .i32(d32)
            .i32(i32_)
            .ptr(plan.rows)
            .ptr(plan.tiles)
            .ptr(plan.ntiles)
            .ptr(w2.ptrs)
            .ptr(w2.scale_ptr())
            .i32(w2.format.code())
            .i32(br)
            .i32(bc)
            .i32(official as i32)
            .ptr(ya);
        // SAFETY: arguments match `moe_down_kernel(const float*, int, int, const int*, const int*,
        // const int*, const u64*, const u64*, int, int, int, int, float*)`; sizes checked above.
        unsafe {
            launch(
                &self.down,
                (plan.grid_tiles() as u32, gy as u32),
                GEMM_THREADS,
                0,
                stream,
                &a,
            )
        }
    }

    /// Shared-expert activation on `n` elements: `h = silu(min(g, L)) * clamp(v, ±L)` (no clamps
    /// when `limit` <= 0), BF16-rounded if `official`. `h` may alias `g` or `v`.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        ctx: &Context,
        g: DevicePtr,
        v: DevicePtr,
        n: usize,
        limit: f32,
        official: bool,
        h: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "swiglu_kernel";
        need(K, "g", g, n * 4)?;
        need(K, "v", v, n * 4)?;
        need(K, "h", h, n * 4)?;
        if n == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(g)
            .ptr(v)
            .i64(n as i64)
            .f32(limit)
            .i32(official as i32)
            .ptr(h);
        // SAFETY: arguments match `swiglu_kernel(const float*, const float*, long long, float, int,
        // float*)`; sizes checked above.
        unsafe { launch(&self.swiglu, stride_blocks(n), 256u32, 0, stream, &a) }
    }

    /// `out[t, :] = f32(f64 ys[t, :] + Σ_j f64 ya[t*k + j, :])` (ys: the shared expert's
    /// output or None), BF16-rounded if `round_out`. `out` may alias `ys`.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        ctx: &Context,
        ya: DevicePtr,
        ys: Option<DevicePtr>,
        t: usize,
        k: usize,
        d: usize,
        round_out: bool,
        out: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_combine_kernel";
        need(K, "ya", ya, t * k * d * 4)?;
        if let Some(s) = ys {
            need(K, "ys", s, t * d * 4)?;
        }
        need(K, "out", out, t * d * 4)?;
        let (t32, k32, d32) = (to_i32(K, "T", t)?, to_i32(K, "k", k)?, to_i32(K, "D", d)?);
        if t == 0 || d == 0 {
            return Ok(());
        }
        let _g = ctx.enter()?;
        let mut a = KernelArgs::new();
        a.ptr(ya)
            .ptr(ys.map_or(0, u64::from))
            .i32(t32)
            .i32(k32)
            .i32(d32)
            .i32(round_out as i32)
            .ptr(out);
        // SAFETY: arguments match `moe_combine_kernel(const float*, const float*, int, int, int,
        // int, float*)`; sizes checked above.
        unsafe { launch(&self.combine, stride_blocks(t * d), 256u32, 0, stream, &a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_sizes() {
        assert_eq!(max_tiles(600, 32, 16), 19 + 16);
        assert_eq!(max_tiles(0, 32, 8), 8);
        assert_eq!(
            MoePlan::buffer_bytes(300, 4, 16, 32),
            [68, 4800, (38 + 16) * 12, 4]
        );
        assert_eq!(plan_smem_bytes(256), (17 * 256 + 1) * 4);
        assert!(plan_smem_bytes(640) + PLAN_STATIC_SMEM <= SMEM_LIMIT);
    }

    #[test]
    fn router_params_follow_the_reference() {
        let cfg = ModelConfig::tiny_default();
        let p = RouterParams::from_config(&cfg);
        assert_eq!((p.experts, p.k), (8, 2));
        assert!(p.renorm);
        assert_eq!(scoring_code(ScoringFunc::SqrtSoftplus), 0);
    }
}
