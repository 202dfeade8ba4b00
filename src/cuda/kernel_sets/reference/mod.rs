//! The reference kernel set: today's f64 kernels, bit-identical to the CPU reference in both
//! numerics modes (kernels/SPEC.md), run step for step as reference/mod.rs does. The device
//! oracle the fast set is checked against; `numerics = exact` always runs it.
//!
//! Files: the launch sequences of the attention sub-block (`attention_block.rs`) and of the MoE
//! sub-block (`moe_block.rs`), the declared workspace (`workspace.rs`); here, the set itself.

mod attention_block;
mod moe_block;
mod workspace;

pub use workspace::{Workspace, WorkspaceIds};

use crate::config::ModelConfig;
use crate::cuda::arena::DevicePtr;
use crate::cuda::backend::{ExpertTables, LayerStateDev, WeightDev};
use crate::cuda::context::Context;
use crate::cuda::kernel_sets::{Branch, FastOps, KernelSet, LinearCall, LogitsTarget, Step};
use crate::cuda::kernels::attention::Attention;
use crate::cuda::kernels::compressor::Compressor;
use crate::cuda::kernels::indexer::Indexer;
use crate::cuda::kernels::linear::Linear;
use crate::cuda::kernels::mhc::{HcSiteDev, Mhc};
use crate::cuda::kernels::moe::{self, Moe};
use crate::cuda::kernels::norm_rope::NormRope;
use crate::cuda::kernels::{MODEL_FAMILIES, batch};
use crate::cuda::registry::{KernelSource, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;
use crate::model::{HcSite, ModelWeights};
use crate::options::{EngineOptions, Numerics};
use crate::weights::format::StorageFormat;

/// The families this set runs: every model family (the batch check's included).
pub const FAMILIES: &[&KernelSource] = MODEL_FAMILIES;

/// Tile height of the grouped expert GEMMs (kernels/SPEC.md `moe_plan_kernel`).
const MOE_TILE_ROWS: usize = moe::TILE_ROWS;

/// Every kernel family, resolved once at finalize.
pub struct Kernels {
    pub batch: batch::BatchKernels,
    pub linear: Linear,
    pub nr: NormRope,
    pub mhc: Mhc,
    pub moe: Moe,
    pub attn: Attention,
    pub comp: Compressor,
    pub idx: Indexer,
}

impl Kernels {
    pub fn new(reg: &Registry) -> Result<Kernels> {
        Ok(Kernels {
            batch: batch::BatchKernels::new(reg)?,
            linear: Linear::new(reg)?,
            nr: NormRope::new(reg)?,
            mhc: Mhc::new(reg)?,
            moe: Moe::new(reg)?,
            attn: Attention::new(reg)?,
            comp: Compressor::new(reg)?,
            idx: Indexer::new(reg)?,
        })
    }
}

/// The reference set: its kernels (resolved at finalize) and workspace.
pub struct ReferenceSet {
    k: Kernels,
    ws: Workspace,
}

impl ReferenceSet {
    pub fn new(reg: &Registry, ws: Workspace) -> Result<ReferenceSet> {
        Ok(ReferenceSet {
            k: Kernels::new(reg)?,
            ws,
        })
    }

    /// The set's workspace (the fast set runs its own kernels on the same activations).
    pub fn workspace(&self) -> &Workspace {
        &self.ws
    }

    /// One forward's view: the engine's device model with this set's workspace, under the
    /// field names the launch sequences below use.
    fn run<'a>(&self, s: &'a Step) -> Run<'a> {
        self.run_with(s, None)
    }

    /// [`Self::run`] with `fast` offered every linear and attention core first.
    fn run_with<'a>(&self, s: &'a Step, fast: Option<&'a dyn FastOps>) -> Run<'a> {
        Run {
            fast,
            ctx: s.ctx,
            cfg: s.cfg,
            opts: s.opts,
            weights: &s.model.weights,
            handles: &s.model.handles,
            experts: &s.model.experts,
            layers: &s.model.layers,
            hc0_fold: s.model.hc0_fold,
            ws: self.ws,
        }
    }

    /// The attention sub-block with `fast` offered every linear and the attention core first
    /// (the fast set's dense projections and sparse attention).
    pub fn attention_with(&self, s: &Step, layer: usize, fast: &dyn FastOps) -> Result<()> {
        let r = self.run_with(s, Some(fast));
        r.attention(&self.k, layer, &r.handles.layers[layer], &s.meta, s.stream)
    }

    /// The buffer a sub-block writes its output to.
    fn output_of(&self, b: Branch) -> DevicePtr {
        match b {
            Branch::Attention(_) => self.ws.a,
            Branch::Moe(_) => self.ws.f,
        }
    }

    /// hc_post of the sub-block that ran: its output mixed back into the residual streams. In
    /// official mode the attention's output (wo_b's) is rounded to bf16 here, as read: its
    /// projection leaves that rounding to this, its only reader (`output_projection`).
    fn post(&self, s: &Step, done: Branch) -> Result<()> {
        let (cfg, ws) = (s.cfg, &self.ws);
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let official = s.opts.numerics == Numerics::Official;
        let round_in = official && matches!(done, Branch::Attention(_));
        self.k.mhc.hc_post(
            s.ctx,
            ws.x,
            self.output_of(done),
            ws.post,
            ws.comb,
            s.meta.num_tokens,
            n,
            d,
            (round_in, official),
            s.stream,
        )
    }
}

impl KernelSet for ReferenceSet {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn embed(&self, s: &Step) -> Result<()> {
        let cfg = s.cfg;
        let table = s.model.weights[s.model.handles.embed];
        self.k.nr.embed(
            s.ctx,
            s.tokens,
            s.meta.num_tokens,
            table.data,
            table.format == StorageFormat::Bf16,
            cfg.hidden_size,
            cfg.hc_mult,
            self.ws.x,
            s.stream,
        )
    }

    fn boundary(&self, s: &Step, done: Option<Branch>, next: Branch) -> Result<()> {
        self.boundary_with(s, done, next, true)
    }

    fn attention(&self, s: &Step, layer: usize) -> Result<()> {
        let r = self.run(s);
        r.attention(&self.k, layer, &r.handles.layers[layer], &s.meta, s.stream)
    }

    fn moe(&self, s: &Step, layer: usize) -> Result<()> {
        let r = self.run(s);
        let t = s.meta.num_tokens;
        r.moe(
            &self.k,
            layer,
            &r.handles.layers[layer],
            t,
            s.tokens,
            s.stream,
        )
    }

    fn commit_slots(&self, s: &Step) -> Result<()> {
        self.k.attn.slot_len(
            s.ctx,
            &s.meta,
            s.model.slot_len,
            s.opts.max_num_seqs,
            s.stream,
        )
    }

    fn head(&self, s: &Step, done: Option<Branch>, out: &LogitsTarget) -> Result<()> {
        self.head_with(s, done, out, None)
    }
}

impl ReferenceSet {
    /// [`KernelSet::boundary`], its last step, `next`'s RMSNorm, only where `norm_next`; else
    /// the caller's `next` runs it (the fast set's own MoE, with its input's quantisation).
    pub fn boundary_with(
        &self,
        s: &Step,
        done: Option<Branch>,
        next: Branch,
        norm_next: bool,
    ) -> Result<()> {
        if let Some(done) = done {
            self.post(s, done)?;
        }
        let r = self.run(s);
        let (cfg, ws) = (s.cfg, &self.ws);
        let (t, n, d) = (s.meta.num_tokens, cfg.hc_mult, cfg.hidden_size);
        let official = r.official();
        let eps = cfg.rms_norm_eps;
        let (site, norm) = match next {
            // Layer 0's streams all hold the embedding: read the derived folded projection.
            Branch::Attention(l) => {
                let lw = &r.handles.layers[l];
                let site = HcSiteDev {
                    fold: (l == 0).then_some(r.hc0_fold),
                    ..r.site(&lw.hc_attn)
                };
                (site, lw.attn_norm)
            }
            Branch::Moe(l) => {
                let lw = &r.handles.layers[l];
                (r.site(&lw.hc_ffn), lw.ffn_norm)
            }
        };
        self.k.mhc.hc_pre(
            s.ctx,
            ws.x,
            t,
            n,
            d,
            site,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            eps,
            official,
            ws.u,
            ws.post,
            ws.comb,
            ws.hc_partials,
            s.stream,
        )?;
        if !norm_next {
            return Ok(());
        }
        self.k.nr.rmsnorm(
            s.ctx,
            ws.u,
            t,
            d,
            d,
            Some(r.weights[norm].data),
            eps,
            official,
            s.stream,
        )
    }

    /// [`KernelSet::head`] with `fast` offered the LM head's linear first.
    pub fn head_with(
        &self,
        s: &Step,
        done: Option<Branch>,
        out: &LogitsTarget,
        fast: Option<&dyn FastOps>,
    ) -> Result<()> {
        if let Some(done) = done {
            self.post(s, done)?;
        }
        let r = self.run_with(s, fast);
        let (cfg, ws, st, k8) = (s.cfg, &self.ws, s.stream, &self.k);
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let official = r.official();
        let eps = cfg.rms_norm_eps;
        let rows = out.rows;
        k8.nr
            .gather_rows(s.ctx, ws.x, n * d, Some(s.rows), rows, ws.xr, st)?;
        let site = r.site(&r.handles.hc_head);
        k8.mhc.hc_head(
            s.ctx,
            ws.xr,
            rows,
            n,
            d,
            site,
            cfg.hc_eps,
            eps,
            official,
            ws.y,
            ws.hc_partials,
            st,
        )?;
        k8.nr.rmsnorm(
            s.ctx,
            ws.y,
            rows,
            d,
            d,
            Some(r.weights[r.handles.norm].data),
            eps,
            official,
            st,
        )?;
        let v = cfg.vocab_size;
        let head = r.weights[r.handles.head];
        if out.bf16 {
            r.linear(
                k8,
                ws.y,
                d,
                rows,
                &head,
                0,
                v,
                ws.logits_f32,
                v,
                false,
                false,
                st,
            )?;
            k8.nr.to_bf16(s.ctx, ws.logits_f32, out.ptr, rows * v, st)
        } else {
            r.linear(k8, ws.y, d, rows, &head, 0, v, out.ptr, v, false, false, st)
        }
    }
}

/// One forward's buffers under the names the launch sequences use.
struct Run<'a> {
    /// Tried first for every linear and attention core (None: the reference kernels run them
    /// all).
    fast: Option<&'a dyn FastOps>,
    ctx: &'a Context,
    cfg: &'a ModelConfig,
    opts: &'a EngineOptions,
    weights: &'a [WeightDev],
    handles: &'a ModelWeights,
    experts: &'a [ExpertTables],
    layers: &'a [LayerStateDev],
    hc0_fold: DevicePtr,
    ws: Workspace,
}

/// Buffer from byte `offset` to its end (a strided view's base).
fn from(p: DevicePtr, offset: usize) -> Result<DevicePtr> {
    p.slice(offset, p.bytes() - offset)
}

impl Run<'_> {
    fn official(&self) -> bool {
        self.opts.numerics == Numerics::Official
    }

    fn site(&self, s: &HcSite) -> HcSiteDev {
        HcSiteDev {
            proj: self.weights[s.proj].data,
            base: self.weights[s.base].data,
            scale: self.weights[s.scale].data,
            fold: None,
        }
    }

    /// `y[t, 0..n] = x[t, 0..k] . W[row0 + j, :]` (docs/numerics.md `qlinear` / `blinear` /
    /// `flinear`): activation quantisation when `quant_act` and the weight is FP8/FP4; BF16
    /// output when `round`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        k8: &Kernels,
        x: DevicePtr,
        ldx: usize,
        t: usize,
        w: &WeightDev,
        row0: usize,
        n: usize,
        y: DevicePtr,
        ldy: usize,
        quant_act: bool,
        round: bool,
        st: BorrowedStream,
    ) -> Result<()> {
        let k = w.cols;
        if let Some(fast) = self.fast {
            let call = LinearCall {
                x,
                ldx,
                t,
                w: if row0 == 0 && n == w.rows {
                    *w
                } else {
                    w.rows(row0, n)?
                },
                groups: 1,
                quant_act,
                round,
                y,
                ldy,
                x_bf16: None,
            };
            if fast.try_linear(self.ctx, &call, st)? {
                return Ok(());
            }
        }
        let (x, ldx) = if quant_act && w.format.is_quantized() {
            k8.linear
                .act_quant(self.ctx, x, ldx, t, k, self.ws.xq, st)?;
            (self.ws.xq, k)
        } else {
            (x, ldx)
        };
        let wr = if row0 == 0 && n == w.rows {
            *w
        } else {
            w.rows(row0, n)?
        };
        k8.linear
            .linear(self.ctx, x, ldx, t, &wr, n, round, y, ldy, st)
    }
}
