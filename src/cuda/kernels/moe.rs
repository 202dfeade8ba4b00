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
//! ([`ExpertsDev`]), so the kernels pick experts on the device.

use super::linear::{StorageFormat, strided_bytes};
use crate::config::{ModelConfig, ScoringFunc};
use crate::cuda::kernels::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "moe", include_str!("../../../kernels/moe.cu");

    /// Top-k selection (`bias` optional) or hash routing (`tid2eid` and `tokens`, both set).
    #[pdl(true)]
    fn router_kernel(
        x: *const f32, t: i32, d: i32, e: i32, k: i32, gate: *const f32, bias: Option<*const f32>,
        tid2eid: Option<*const i32>, tokens: Option<*const i32>, scoring: i32, renorm: bool,
        route_scale: f32, ids: *mut i32, weights: *mut f32,
    );
    /// `clear` (None: nothing): `clear_words` u32 zeroed too ([`Moe::plan_clearing`]).
    #[pdl(true)]
    fn moe_plan_kernel(
        ids: *const i32, t: i32, k: i32, e: i32, tile_rows: i32, offsets: *mut i32,
        rows: *mut i32, tiles: *mut i32, ntiles: *mut i32, clear: Option<*mut u32>,
        clear_words: i32,
    );
    /// The wide plan ([`Moe::plan_wide`]): counts and ranks, block by block.
    #[smem(PLAN_COUNT_SMEM_MAX as u32)]
    #[pdl(true)]
    fn moe_plan_count_kernel(ids: *const i32, n: i32, e: i32, counts: *mut i32, ranks: *mut i32);
    /// The wide plan: block bases, offsets and tiles.
    #[pdl(true)]
    fn moe_plan_scan_kernel(
        nb: i32, e: i32, tile_rows: i32, counts: *mut i32, offsets: *mut i32, tiles: *mut i32,
        ntiles: *mut i32,
    );
    /// The wide plan: every assignment into its row.
    #[pdl(true)]
    fn moe_plan_place_kernel(
        ids: *const i32, n: i32, e: i32, counts: *const i32, offsets: *const i32,
        ranks: *const i32, rows: *mut i32,
    );
    /// `w1`, `w3`, `s1`, `s3`: arrays of per-expert device addresses (`s*` NULL when the
    /// format has no scales).
    #[pdl(true)]
    fn moe_up_kernel(
        xq: *const f32, d: i32, i: i32, rows: *const i32, tiles: *const i32,
        ntiles: *const i32, k: i32, w1: *const u64, w3: *const u64, s1: Option<*const u64>,
        s3: Option<*const u64>, fmt: i32, br: i32, bc: i32, weights: *const f32, limit: f32,
        official: bool, h: *mut f32,
    );
    #[pdl(true)]
    fn moe_down_kernel(
        hq: *const f32, d: i32, i: i32, rows: *const i32, tiles: *const i32,
        ntiles: *const i32, w2: *const u64, s2: Option<*const u64>, fmt: i32, br: i32, bc: i32,
        official: bool, ya: *mut f32,
    );
    #[pdl(true)]
    fn swiglu_kernel(
        g: *const f32, v: *const f32, n: i64, limit: f32, official: bool, h: *mut f32,
    );
    #[pdl(true)]
    fn moe_combine_kernel(
        ya: *const f32, ys: Option<*const f32>, t: i32, k: i32, d: i32, round_out: bool,
        out: *mut f32,
    );
}

/// Rows per tile of the expert GEMMs (GT_BM): the `tile_rows` to plan with. Other values work
/// (the kernels loop over row blocks) but waste or split blocks.
pub const TILE_ROWS: usize = super::linear::TILE_T;
/// Outputs per grid row of `moe_up_kernel` (MOE_UP_BNS) and `moe_down_kernel` (MOE_DOWN_BNS): the
/// skinny path's block width (tiles of at most 8 rows); tiles of more rows are computed 64 outputs
/// per block by every (64 / this)-th block row.
pub const UP_GRID_N: usize = super::linear::SKINNY_N / 2;
pub const DOWN_GRID_N: usize = super::linear::SKINNY_N;
/// Tokens per `router_kernel` block (ROUTER_TOKENS).
pub const ROUTER_TOKENS: usize = 4;
/// Threads of an expert GEMM block (GEMM_THREADS, shared with linear_kernel).
pub const GEMM_THREADS: u32 = super::linear::LINEAR_THREADS;
/// Threads (and warps) of the single `moe_plan_kernel` block.
pub const PLAN_THREADS: u32 = 512;
pub const PLAN_WARPS: usize = 16;
/// Assignments (threads) of a `moe_plan_count_kernel` block, and the most experts the wide plan
/// takes (its per-warp count table is `PLAN_CHUNK / 32 x experts` ints of shared memory).
pub const PLAN_CHUNK: usize = 1024;
pub const PLAN_WIDE_MAX_EXPERTS: usize = 512;
const PLAN_COUNT_SMEM_MAX: usize = PLAN_CHUNK / 32 * PLAN_WIDE_MAX_EXPERTS * 4;
const _: () = assert!(
    PLAN_WIDE_MAX_EXPERTS <= PLAN_CHUNK,
    "moe_plan_scan_kernel: a thread or more an expert"
);
/// Largest experts_per_tok the router supports (ROUTER_MAX_K).
pub const MAX_TOPK: usize = 32;
/// Default dynamic shared memory allowance (the registry raises none for this family).
const SMEM_LIMIT: usize = 48 * 1024;
/// Static shared memory of router_kernel / moe_plan_kernel (chosen ids and weights; scan scratch).
const ROUTER_STATIC_SMEM: usize = ROUTER_TOKENS * 2 * MAX_TOPK * 4;
const PLAN_STATIC_SMEM: usize = 32 * 4;

/// `scoring` argument of `router_kernel` (SCORE_* in dsv4_consts.cuh).
pub const fn scoring_code(s: ScoringFunc) -> i32 {
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

/// Ints of the wide plan's scratch ([`Moe::plan_wide`]): its block counts
/// (`ceil(assignments / PLAN_CHUNK) x experts`) and its ranks (one per assignment).
pub fn plan_wide_scratch(assignments: usize, experts: usize) -> [usize; 2] {
    [assignments.div_ceil(PLAN_CHUNK) * experts, assignments]
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
    /// Top-k of `score + bias` (`bias` `f32[E]`; None: of the scores).
    TopK { bias: Option<DevicePtr> },
    /// Hash layer: `tid2eid` `i32[vocab, k]` indexed by `tokens` `i32[T]` (values must be < vocab and
    /// the table's ids < E: the loader validates both).
    Hash {
        tid2eid: DevicePtr,
        tokens: DevicePtr,
        vocab: usize,
    },
}

impl Selection {
    /// The router kernels' (bias, tid2eid, tokens) arguments for `t` tokens, `e` experts,
    /// top-`k`, after checking every buffer's size (`kernel` names the caller in errors).
    pub fn kernel_args(
        &self,
        kernel: &str,
        t: usize,
        e: usize,
        k: usize,
    ) -> Result<(Option<DevicePtr>, Option<DevicePtr>, Option<DevicePtr>)> {
        match *self {
            Selection::TopK { bias } => {
                if let Some(b) = bias {
                    need(kernel, "bias", b, e * 4)?;
                }
                Ok((bias, None, None))
            }
            Selection::Hash {
                tid2eid,
                tokens,
                vocab,
            } => {
                need(kernel, "tid2eid", tid2eid, vocab * k * 4)?;
                need(kernel, "tokens", tokens, t * 4)?;
                Ok((None, Some(tid2eid), Some(tokens)))
            }
        }
    }
}

/// The routed experts' weights of one projection (all experts share format and shape):
/// `ptrs` holds `count` u64 device addresses of each expert's data (values or codes), `scales`
/// `count` u64 addresses of its f32 scales (quantized formats only). The addressed buffers are
/// laid out as [`super::linear::WeightDev`] describes (`rows x cols` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsDev {
    pub format: StorageFormat,
    pub ptrs: DevicePtr,
    pub scales: Option<DevicePtr>,
    pub block: [usize; 2],
    pub rows: usize,
    pub cols: usize,
    pub count: usize,
}

impl ExpertsDev {
    fn validate(&self, kernel: &str, what: &str) -> Result<()> {
        need(kernel, what, self.ptrs, self.count * 8)?;
        if self.format.is_quantized() {
            let Some(s) = self.scales else {
                return Err(internal(format!(
                    "{kernel}: quantized `{what}` without scale pointers"
                )));
            };
            need(kernel, what, s, self.count * 8)?;
            if self.format == StorageFormat::Fp8 && (self.block[0] == 0 || self.block[1] == 0) {
                return Err(internal(format!(
                    "{kernel}: `{what}` FP8 block {:?}",
                    self.block
                )));
            }
        }
        Ok(())
    }

    fn scale_ptr(&self) -> Option<DevicePtr> {
        if self.format.is_quantized() {
            self.scales
        } else {
            None
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
    /// `i32[1]`: number of tiles.
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

    /// This plan's buffers for `tokens` tokens in tiles of `tile_rows` (a workspace's plan is
    /// sized for its most tokens and the smallest tiles).
    pub fn sized(&self, tokens: usize, tile_rows: usize) -> MoePlan {
        MoePlan {
            tokens,
            tile_rows,
            ..*self
        }
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

    /// Checks the plan's sizes and buffers for `kernel` (named in the error).
    pub(crate) fn validate(&self, kernel: &str) -> Result<()> {
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

crate::launchers! {
    /// The moe family's entry points, resolved from a loaded registry.
    pub struct Moe {
        router: router_kernel,
        plan: moe_plan_kernel,
        plan_count: moe_plan_count_kernel,
        plan_scan: moe_plan_scan_kernel,
        plan_place: moe_plan_place_kernel,
        up: moe_up_kernel,
        down: moe_down_kernel,
        swiglu: swiglu_kernel,
        combine: moe_combine_kernel,
    }
}

impl Moe {
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
        let (bias, table, tokens) = sel.kernel_args(K, t, e, k)?;
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
        let args = router_kernel::Args {
            x,
            t: t32,
            d: d32,
            e: e32,
            k: k32,
            gate,
            bias,
            tid2eid: table,
            tokens,
            scoring: scoring_code(p.scoring),
            renorm: p.renorm,
            route_scale: p.route_scale,
            ids,
            weights,
        };
        self.router
            .launch(blocks, threads, smem as u32, stream, args)
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
        self.plan_clearing(ctx, ids, plan, None, stream)
    }

    /// [`Moe::plan`], zeroing `clear`'s `(buffer, u32 words)` too in the same launch: the fast
    /// set's fused expert GEMMs need their synchronisation words zero when they start
    /// (`fast_moe_gemm::plan_cleared_sync_words`), and the plan is the launch just before them.
    pub fn plan_clearing(
        &self,
        ctx: &Context,
        ids: DevicePtr,
        plan: &MoePlan,
        clear: Option<(DevicePtr, usize)>,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_plan_kernel";
        plan.validate(K)?;
        need(K, "ids", ids, plan.assignments() * 4)?;
        if let Some((buf, words)) = clear {
            need(K, "clear", buf, words * 4)?;
        }
        let smem = plan_smem_bytes(plan.experts);
        if smem + PLAN_STATIC_SMEM > SMEM_LIMIT {
            return Err(internal(format!(
                "{K}: {} experts need {smem} bytes of shared memory",
                plan.experts
            )));
        }
        let _g = ctx.enter()?;
        // (`validate` checked the buffers and that tokens * k fits an int.)
        let args = moe_plan_kernel::Args {
            ids,
            t: plan.tokens as i32,
            k: plan.k as i32,
            e: plan.experts as i32,
            tile_rows: to_i32(K, "tile_rows", plan.tile_rows)?,
            offsets: plan.offsets,
            rows: plan.rows,
            tiles: plan.tiles,
            ntiles: plan.ntiles,
            clear: clear.map(|(buf, _)| buf),
            clear_words: to_i32(K, "clear words", clear.map_or(0, |(_, words)| words))?,
        };
        self.plan
            .launch(1u32, PLAN_THREADS, smem as u32, stream, args)
    }

    /// [`Moe::plan`]'s outputs, bit for bit, from three wide launches (kernels/moe.cu): for many
    /// assignments, where the one block of `moe_plan_kernel` walks them one step after another.
    /// `counts` and `ranks` are scratch of [`plan_wide_scratch`] ints.
    pub fn plan_wide(
        &self,
        ctx: &Context,
        ids: DevicePtr,
        plan: &MoePlan,
        counts: DevicePtr,
        ranks: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "moe_plan_count_kernel";
        plan.validate(K)?;
        let (n, e) = (plan.assignments(), plan.experts);
        if e > PLAN_WIDE_MAX_EXPERTS {
            return Err(internal(format!(
                "{K}: {e} experts (at most {PLAN_WIDE_MAX_EXPERTS})"
            )));
        }
        need(K, "ids", ids, n * 4)?;
        let [nc, nr] = plan_wide_scratch(n, e);
        need(K, "counts", counts, nc * 4)?;
        need(K, "ranks", ranks, nr * 4)?;
        if n == 0 {
            return self.plan(ctx, ids, plan, stream);
        }
        let _g = ctx.enter()?;
        // (`validate` checked that tokens * k fits an int.)
        let (n32, e32) = (n as i32, e as i32);
        let nb = n.div_ceil(PLAN_CHUNK);
        let args = moe_plan_count_kernel::Args {
            ids,
            n: n32,
            e: e32,
            counts,
            ranks,
        };
        let smem = (PLAN_CHUNK / 32 * e * 4) as u32;
        self.plan_count
            .launch(nb as u32, PLAN_CHUNK as u32, smem, stream, args)?;
        let args = moe_plan_scan_kernel::Args {
            nb: nb as i32,
            e: e32,
            tile_rows: to_i32(K, "tile_rows", plan.tile_rows)?,
            counts,
            offsets: plan.offsets,
            tiles: plan.tiles,
            ntiles: plan.ntiles,
        };
        let smem = ((e + 1 + PLAN_CHUNK) * 4) as u32;
        self.plan_scan
            .launch(1u32, PLAN_CHUNK as u32, smem, stream, args)?;
        let args = moe_plan_place_kernel::Args {
            ids,
            n: n32,
            e: e32,
            counts,
            offsets: plan.offsets,
            ranks,
            rows: plan.rows,
        };
        self.plan_place
            .launch(n.div_ceil(256) as u32, 256u32, 0, stream, args)
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
        w1: &ExpertsDev,
        w3: &ExpertsDev,
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
        // (The expert buffers behind the pointer arrays are the caller's contract.)
        let args = moe_up_kernel::Args {
            xq,
            d: d32,
            i: i32_,
            rows: plan.rows,
            tiles: plan.tiles,
            ntiles: plan.ntiles,
            k: plan.k as i32,
            w1: w1.ptrs,
            w3: w3.ptrs,
            s1: w1.scale_ptr(),
            s3: w3.scale_ptr(),
            fmt: w1.format.code(),
            br,
            bc,
            weights,
            limit,
            official,
            h,
        };
        let grid = (plan.grid_tiles() as u32, gy as u32);
        self.up.launch(grid, GEMM_THREADS, 0, stream, args)
    }

    /// Down projection of every assignment: `ya[a, :]` (f32 `[T*k, D]`, D = `w2.rows`) from `hq`
    /// (f32 `[T*k, I]`: h, or act_quant(h) in official mode with quantized experts).
    #[allow(clippy::too_many_arguments)]
    pub fn down(
        &self,
        ctx: &Context,
        plan: &MoePlan,
        hq: DevicePtr,
        w2: &ExpertsDev,
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
        let args = moe_down_kernel::Args {
            hq,
            d: d32,
            i: i32_,
            rows: plan.rows,
            tiles: plan.tiles,
            ntiles: plan.ntiles,
            w2: w2.ptrs,
            s2: w2.scale_ptr(),
            fmt: w2.format.code(),
            br,
            bc,
            official,
            ya,
        };
        let grid = (plan.grid_tiles() as u32, gy as u32);
        self.down.launch(grid, GEMM_THREADS, 0, stream, args)
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
        let args = swiglu_kernel::Args {
            g,
            v,
            n: n as i64,
            limit,
            official,
            h,
        };
        self.swiglu
            .launch(stride_blocks(n), 256u32, 0, stream, args)
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
        let args = moe_combine_kernel::Args {
            ya,
            ys,
            t: t32,
            k: k32,
            d: d32,
            round_out,
            out,
        };
        self.combine
            .launch(stride_blocks(t * d), 256u32, 0, stream, args)
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
