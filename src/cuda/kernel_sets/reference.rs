//! The reference kernel set: today's f64 kernels, bit-identical to the CPU reference in both
//! numerics modes (kernels/SPEC.md), run step for step as reference/mod.rs does. The device
//! oracle the fast set is checked against; `numerics = exact` always runs it.

use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, DevicePtr, RegionId};
use crate::cuda::backend::{CompressorDev, ExpertTables, LayerStateDev, WeightDev};
use crate::cuda::context::Context;
use crate::cuda::kernel_sets::{Branch, KernelSet, LogitsTarget, Step};
use crate::cuda::kernels::attention::{Attention, AttentionArgs, BatchMeta, RingArgs};
use crate::cuda::kernels::compressor::{CompressArgs, CompressKind, Compressor};
use crate::cuda::kernels::indexer::{Indexer, IndexerArgs};
use crate::cuda::kernels::linear::Linear;
use crate::cuda::kernels::mhc::{HcSiteDev, Mhc};
use crate::cuda::kernels::moe::{self, ExpertsDev, Moe, MoePlan, RouterParams, Selection};
use crate::cuda::kernels::norm_rope::NormRope;
use crate::cuda::kernels::{MODEL_FAMILIES, batch};
use crate::cuda::memory_plan::{BufferKind, Elem, MemoryPlan};
use crate::cuda::registry::{KernelSource, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;
use crate::model::{CompressorWeights, HcSite, LayerWeights, ModelWeights};
use crate::options::{EngineOptions, Numerics};

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

/// Declares the set's workspace ONCE: each field's element type and extent (a formula of
/// the sizes `$z`), from which [`Workspace::reserve`] plans it and [`Workspace::resolve`]
/// finds it in the arena. Names follow reference/mod.rs.
macro_rules! workspace {
    ($z:ident; $( $(#[$doc:meta])* $field:ident : $elem:ident [ $($dim:expr),+ ] ),* $(,)?) => {
        /// The reference set's activation workspace, for `max_num_tokens` tokens.
        #[derive(Clone, Copy, Debug)]
        pub struct Workspace { $( $(#[$doc])* pub $field: DevicePtr, )* }

        /// Arena ids of [`Workspace`]'s buffers.
        pub struct WorkspaceIds { $( $field: RegionId, )* }

        impl Workspace {
            /// Declares every buffer for `cfg` and `opts`.
            pub fn reserve(
                plan: &mut MemoryPlan,
                cfg: &ModelConfig,
                opts: &EngineOptions,
            ) -> Result<WorkspaceIds> {
                let $z = Sizes::new(cfg, opts);
                Ok(WorkspaceIds { $(
                    $field: plan.declare(
                        BufferKind::Workspace,
                        concat!("workspace:", stringify!($field)),
                        Elem::$elem,
                        &[$($dim),+],
                    )?,
                )* })
            }

            pub fn resolve(ids: &WorkspaceIds, arena: &Arena) -> Workspace {
                Workspace { $( $field: arena.region(ids.$field), )* }
            }
        }
    };
}

/// The sizes the workspace formulas use.
struct Sizes {
    /// max_num_tokens, and max_num_tokens x experts_per_tok (routed assignments).
    t: usize,
    tk: usize,
    n: usize,
    d: usize,
    h: usize,
    hd: usize,
    i: usize,
    e: usize,
    hi: usize,
    di: usize,
    ql: usize,
    /// o_groups x o_lora_rank.
    gr: usize,
    /// Widest activation act_quant quantizes.
    qk_max: usize,
    /// Most visible indexer entries of one token.
    max_entries: usize,
    topk: usize,
    max_tiles: usize,
    vocab: usize,
}

impl Sizes {
    fn new(cfg: &ModelConfig, opts: &EngineOptions) -> Sizes {
        let t = opts.max_num_tokens;
        let tk = t * cfg.experts_per_tok;
        let (h, hd) = (cfg.num_heads, cfg.head_dim);
        let qk_max = [
            cfg.hidden_size,
            cfg.q_lora_rank,
            cfg.o_groups * cfg.o_lora_rank,
            cfg.moe_inter,
            h * hd / cfg.o_groups,
        ]
        .into_iter()
        .max()
        .unwrap_or(1);
        let max_entries = crate::state::layout::layer_layouts(cfg, opts.max_seq_len)
            .iter()
            .filter(|l| l.index_keys.is_some())
            .map(|l| l.max_entries())
            .max()
            .unwrap_or(1)
            .max(1);
        Sizes {
            t,
            tk,
            n: cfg.hc_mult,
            d: cfg.hidden_size,
            h,
            hd,
            i: cfg.moe_inter,
            e: cfg.n_routed_experts,
            hi: cfg.index_n_heads,
            di: cfg.index_head_dim,
            ql: cfg.q_lora_rank,
            gr: cfg.o_groups * cfg.o_lora_rank,
            qk_max,
            max_entries,
            topk: cfg.index_topk.max(1),
            max_tiles: moe::max_tiles(tk, MOE_TILE_ROWS, cfg.n_routed_experts),
            vocab: cfg.vocab_size,
        }
    }
}

workspace! { z;
    /// Residual streams [T, N, D].
    x: F32[z.t, z.n, z.d],
    /// The sub-block input after pre + norm [T, D].
    u: F32[z.t, z.d],
    post: F32[z.t, z.n],
    comb: F32[z.t, z.n, z.n],
    /// Attention output [T, D].
    a: F32[z.t, z.d],
    /// FP8-simulated activations of act_quant.
    xq: F32[z.tk.max(z.t), z.qk_max],
    qr: F32[z.t, z.ql],
    q: F32[z.t, z.h, z.hd],
    kv: F32[z.t, z.hd],
    o: F32[z.t, z.h, z.hd],
    z: F32[z.t, z.gr],
    comp_a: F32[z.t, 2, z.hd],
    comp_z: F32[z.t, 2, z.hd],
    icomp_a: F32[z.t, 2, z.di],
    icomp_z: F32[z.t, 2, z.di],
    qi: F32[z.t, z.hi, z.di],
    iw: F32[z.t, z.hi],
    iscores: F32[z.t, z.max_entries],
    selected: I32[z.t, z.topk],
    nsel: I32[z.t],
    ids: I32[z.tk],
    rw: F32[z.tk],
    offsets: I32[z.e + 1],
    rows: I32[z.tk],
    tiles: I32[3, z.max_tiles],
    ntiles: I32[1],
    h: F32[z.tk, z.i],
    hq: F32[z.tk, z.i],
    ya: F32[z.tk, z.d],
    sg: F32[z.t, z.i],
    sv: F32[z.t, z.i],
    sh: F32[z.t, z.i],
    ys: F32[z.t, z.d],
    /// MoE output [T, D].
    f: F32[z.t, z.d],
    xr: F32[z.t, z.n, z.d],
    y: F32[z.t, z.d],
    logits_f32: F32[z.t, z.vocab],
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

    /// One forward's view: the engine's device model with this set's workspace, under the
    /// field names the launch sequences below use.
    fn run<'a>(&self, s: &'a Step) -> Run<'a> {
        Run {
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

    /// The buffer a sub-block writes its output to.
    fn output_of(&self, b: Branch) -> DevicePtr {
        match b {
            Branch::Attention(_) => self.ws.a,
            Branch::Moe(_) => self.ws.f,
        }
    }

    /// hc_post of the sub-block that ran: its output mixed back into the residual streams.
    fn post(&self, s: &Step, done: Branch) -> Result<()> {
        let (cfg, ws) = (s.cfg, &self.ws);
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let official = s.opts.numerics == Numerics::Official;
        self.k.mhc.hc_post(
            s.ctx,
            ws.x,
            self.output_of(done),
            ws.post,
            ws.comb,
            s.meta.num_tokens,
            n,
            d,
            official,
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
        self.k.nr.embed(
            s.ctx,
            s.tokens,
            s.meta.num_tokens,
            s.model.weights[s.model.handles.embed].data,
            cfg.hidden_size,
            cfg.hc_mult,
            self.ws.x,
            s.stream,
        )
    }

    fn boundary(&self, s: &Step, done: Option<Branch>, next: Branch) -> Result<()> {
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
            s.stream,
        )?;
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
        if let Some(done) = done {
            self.post(s, done)?;
        }
        let r = self.run(s);
        let (cfg, ws, st, k8) = (s.cfg, &self.ws, s.stream, &self.k);
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let official = r.official();
        let eps = cfg.rms_norm_eps;
        let rows = out.rows;
        k8.nr
            .gather_rows(s.ctx, ws.x, n * d, Some(s.rows), rows, ws.xr, st)?;
        let site = r.site(&r.handles.hc_head);
        k8.mhc.hc_head(
            s.ctx, ws.xr, rows, n, d, site, cfg.hc_eps, eps, official, ws.y, st,
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

/// One layer's attention sub-block as its parts see it.
struct AttnLayer<'a> {
    k8: &'a Kernels,
    l: usize,
    lw: &'a LayerWeights,
    ls: LayerStateDev,
    meta: &'a BatchMeta,
    st: BorrowedStream,
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

    /// Attention sub-block of layer `l`: `ws.u` -> `ws.a` (reference/attention.rs): the
    /// query path, the window KV, the compressors (and the indexer's selection on CSA
    /// layers), one softmax over window + compressed keys, the grouped output projection.
    fn attention(
        &self,
        k8: &Kernels,
        l: usize,
        lw: &LayerWeights,
        meta: &BatchMeta,
        st: BorrowedStream,
    ) -> Result<()> {
        let a = AttnLayer {
            k8,
            l,
            lw,
            ls: self.layers[l],
            meta,
            st,
        };
        self.query(&a)?;
        self.window_kv(&a)?;
        let selected = self.compress_and_select(&a)?;
        self.attend(&a, selected)?;
        self.output_projection(&a)
    }

    /// RoPE (`sign` 1) or its inverse (-1) on `heads` heads of `head_dim` per token row of
    /// `x` (row stride `ld`), at the batch's positions with this layer's frequencies.
    fn rope(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        ld: usize,
        heads: usize,
        head_dim: usize,
        sign: f32,
    ) -> Result<()> {
        a.k8.nr.rope(
            self.ctx,
            x,
            a.meta.num_tokens,
            ld,
            heads,
            head_dim,
            a.meta.positions,
            a.ls.inv_freq,
            self.cfg.rope_dim / 2,
            sign,
            self.official(),
            a.st,
        )
    }

    /// RMSNorm of `rows` rows of `dim` values of `x`, with `weight` (the norm's weight index).
    fn norm(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        rows: usize,
        dim: usize,
        weight: Option<usize>,
    ) -> Result<()> {
        let w = weight.map(|i| self.weights[i].data);
        a.k8.nr.rmsnorm(
            self.ctx,
            x,
            rows,
            dim,
            dim,
            w,
            self.cfg.rms_norm_eps,
            self.official(),
            a.st,
        )
    }

    /// `y[t, 0..n] = x[t, 0..k] . W[row0 + j, :]` with this layer's token count, BF16 output
    /// and activation quantisation in official mode.
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        ldx: usize,
        w: usize,
        row0: usize,
        n: usize,
        y: DevicePtr,
        ldy: usize,
    ) -> Result<()> {
        let official = self.official();
        let t = a.meta.num_tokens;
        let w = self.weights[w];
        self.linear(
            a.k8, x, ldx, t, &w, row0, n, y, ldy, official, official, a.st,
        )
    }

    /// Query path: q_norm(u wq_a) -> wq_b -> per-head unit RMS -> RoPE.
    fn query(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (d, h, hd, ql) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.head_dim,
            cfg.q_lora_rank,
        );
        let t = a.meta.num_tokens;
        self.project(a, ws.u, d, lw.wq_a, 0, ql, ws.qr, ql)?;
        self.norm(a, ws.qr, t, ql, Some(lw.q_norm))?;
        self.project(a, ws.qr, ql, lw.wq_b, 0, h * hd, ws.q, h * hd)?;
        self.norm(a, ws.q, t * h, hd, None)?;
        self.rope(a, ws.q, h * hd, h, hd, 1.0)
    }

    /// Window KV: one vector per token (key and value), normed, RoPE'd, FP8-simulated.
    fn window_kv(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let t = a.meta.num_tokens;
        self.project(a, ws.u, d, lw.wkv, 0, hd, ws.kv, hd)?;
        self.norm(a, ws.kv, t, hd, Some(lw.kv_norm))?;
        self.rope(a, ws.kv, hd, 1, hd, 1.0)?;
        if self.official() {
            a.k8.nr
                .kv_sim(self.ctx, ws.kv, t, hd, cfg.nope_dim(), a.st)?;
        }
        Ok(())
    }

    /// The compressors (f32 projections, tokens in order per sequence), then on CSA layers
    /// the indexer's top-k: its `(selected, nsel)` buffers.
    fn compress_and_select(&self, a: &AttnLayer) -> Result<Option<(DevicePtr, DevicePtr)>> {
        let (cfg, ws, lw, ls) = (self.cfg, self.ws, a.lw, &a.ls);
        let (k8, meta, st) = (a.k8, a.meta, a.st);
        let official = self.official();
        if let (Some(cw), Some(cs), Some(entries)) = (lw.compressor, ls.compressor, ls.entries) {
            let bufs = (ws.comp_a, ws.comp_z);
            self.compress(
                k8,
                &cw,
                &cs,
                bufs.0,
                bufs.1,
                entries,
                ls,
                CompressKind::Kv,
                meta,
                st,
            )?;
        }
        let (Some(ix), Some(cs), Some(keys)) = (lw.indexer, ls.index_compressor, ls.index_keys)
        else {
            return Ok(None);
        };
        let kind = CompressKind::IndexKey;
        self.compress(
            k8,
            &ix.compressor,
            &cs,
            ws.icomp_a,
            ws.icomp_z,
            keys,
            ls,
            kind,
            meta,
            st,
        )?;
        let (d, ql, t) = (cfg.hidden_size, cfg.q_lora_rank, meta.num_tokens);
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
        self.project(a, ws.qr, ql, ix.wq_b, 0, hi * di, ws.qi, hi * di)?;
        self.rope(a, ws.qi, hi * di, hi, di, 1.0)?;
        if official {
            k8.nr.index_sim(self.ctx, ws.qi, t * hi, di, st)?;
        }
        // The head weights: f32 input (no activation quantisation), BF16 output.
        let wp = self.weights[ix.weights_proj];
        self.linear(k8, ws.u, d, t, &wp, 0, hi, ws.iw, hi, false, official, st)?;
        let s1 = (di as f64).powf(-0.5) as f32;
        let s2 = (hi as f64).powf(-0.5) as f32;
        k8.nr.scale2(self.ctx, ws.iw, t * hi, s1, s2, st)?;
        let args = IndexerArgs {
            qi: ws.qi,
            iw: ws.iw,
            ikeys: keys,
            heads: hi,
            dim: di,
            ratio: cfg.layers[a.l].ratio,
            topk: cfg.index_topk,
            maxe: ls.maxe,
            num_slots: self.opts.max_num_seqs,
            official,
            scores: ws.iscores,
            selected: ws.selected,
            nsel: ws.nsel,
        };
        k8.idx.select(self.ctx, meta, &args, st)?;
        Ok(Some((ws.selected, ws.nsel)))
    }

    /// One softmax over window + compressed keys with the per-head sink, the ring update,
    /// then the inverse RoPE of the output.
    fn attend(&self, a: &AttnLayer, selected: Option<(DevicePtr, DevicePtr)>) -> Result<()> {
        let (cfg, ws, ls) = (self.cfg, self.ws, &a.ls);
        let (h, hd) = (cfg.num_heads, cfg.head_dim);
        let args = AttentionArgs {
            q: ws.q,
            kv: ws.kv,
            ring: ls.ring,
            entries: ls.entries,
            selected,
            sinks: self.weights[a.lw.sink].data,
            heads: h,
            head_dim: hd,
            window: cfg.sliding_window,
            ratio: cfg.layers[a.l].ratio,
            maxe: ls.maxe,
            topk: cfg.index_topk,
            num_slots: self.opts.max_num_seqs,
            official: self.official(),
            o: ws.o,
        };
        a.k8.attn.attention(self.ctx, a.meta, &args, a.st)?;
        let ring = RingArgs {
            kv: ws.kv,
            ring: ls.ring,
            window: cfg.sliding_window,
            head_dim: hd,
            num_slots: self.opts.max_num_seqs,
        };
        a.k8.attn.ring_update(self.ctx, a.meta, &ring, a.st)?;
        self.rope(a, ws.o, h * hd, h, hd, -1.0)
    }

    /// Grouped output projection: the heads of group g through rows g*R.. of wo_a (BF16
    /// einsum: no activation quantisation), then wo_b into `ws.a`.
    fn output_projection(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (h, hd, d) = (cfg.num_heads, cfg.head_dim, cfg.hidden_size);
        let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
        let (t, official) = (a.meta.num_tokens, self.official());
        let wo_a = self.weights[lw.wo_a];
        let gin = h * hd / g;
        for gi in 0..g {
            let xg = from(ws.o, gi * gin * 4)?;
            let zg = from(ws.z, gi * r * 4)?;
            self.linear(
                a.k8,
                xg,
                h * hd,
                t,
                &wo_a,
                gi * r,
                r,
                zg,
                g * r,
                false,
                official,
                a.st,
            )?;
        }
        self.project(a, ws.z, g * r, lw.wo_b, 0, d, ws.a, d)
    }

    /// One compressor (main KV or indexer keys) over the batch's tokens.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        k8: &Kernels,
        cw: &CompressorWeights,
        cs: &CompressorDev,
        a: DevicePtr,
        z: DevicePtr,
        out: DevicePtr,
        ls: &LayerStateDev,
        kind: CompressKind,
        meta: &BatchMeta,
        st: BorrowedStream,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (d, t) = (cfg.hidden_size, meta.num_tokens);
        let width = if cs.overlap { 2 * cs.dc } else { cs.dc };
        self.linear(
            k8,
            self.ws.u,
            d,
            t,
            &self.weights[cw.wkv],
            0,
            width,
            a,
            width,
            false,
            false,
            st,
        )?;
        self.linear(
            k8,
            self.ws.u,
            d,
            t,
            &self.weights[cw.wgate],
            0,
            width,
            z,
            width,
            false,
            false,
            st,
        )?;
        let args = CompressArgs {
            a,
            z,
            pend_a: cs.pend_a,
            pend_z: cs.pend_z,
            prev_a: cs.overlap.then_some(cs.prev_a),
            prev_z: cs.overlap.then_some(cs.prev_z),
            has_prev: cs.overlap.then_some(cs.has_prev),
            ape: self.weights[cw.ape].data,
            norm_w: self.weights[cw.norm].data,
            inv_freq: ls.inv_freq,
            rope_dim: cfg.rope_dim,
            ratio: cs.ratio,
            overlap: cs.overlap,
            dc: cs.dc,
            eps: cfg.rms_norm_eps,
            kind,
            nope: cs.dc.saturating_sub(cfg.rope_dim),
            official: self.official(),
            entries: out,
            maxe: ls.maxe,
            num_slots: self.opts.max_num_seqs,
        };
        k8.comp.compress(self.ctx, meta, &args, st)
    }

    /// MoE sub-block: `ws.u` -> `ws.f` (reference/moe.rs).
    fn moe(
        &self,
        k8: &Kernels,
        l: usize,
        lw: &LayerWeights,
        t: usize,
        tokens: DevicePtr,
        st: BorrowedStream,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let ws = self.ws;
        let official = self.official();
        let (d, i, e, k) = (
            cfg.hidden_size,
            cfg.moe_inter,
            cfg.n_routed_experts,
            cfg.experts_per_tok,
        );
        let sel = match (lw.tid2eid, lw.gate_bias) {
            (Some(tab), _) => Selection::Hash {
                tid2eid: self.weights[tab].data,
                tokens,
                vocab: cfg.vocab_size,
            },
            (None, bias) => Selection::TopK {
                bias: bias.map(|b| self.weights[b].data),
            },
        };
        let params = RouterParams::from_config(cfg);
        k8.moe.router(
            self.ctx,
            ws.u,
            t,
            d,
            self.weights[lw.gate].data,
            sel,
            &params,
            ws.ids,
            ws.rw,
            st,
        )?;
        let plan = MoePlan {
            offsets: ws.offsets,
            rows: ws.rows,
            tiles: ws.tiles,
            ntiles: ws.ntiles,
            tokens: t,
            k,
            experts: e,
            tile_rows: MOE_TILE_ROWS,
        };
        k8.moe.plan(self.ctx, ws.ids, &plan, st)?;
        let tb = self.experts[l];
        let proto = |w: usize| self.weights[w];
        let experts = |ptrs: DevicePtr, scales: DevicePtr, w: WeightDev| ExpertsDev {
            format: w.format,
            ptrs,
            scales: w.scales.map(|_| scales),
            block: w.block,
            rows: w.rows,
            cols: w.cols,
            count: e,
        };
        let (w1, w2, w3) = (
            proto(lw.experts[0].w1),
            proto(lw.experts[0].w2),
            proto(lw.experts[0].w3),
        );
        let (e1, e2, e3) = (
            experts(tb.w1, tb.s1, w1),
            experts(tb.w2, tb.s2, w2),
            experts(tb.w3, tb.s3, w3),
        );
        let xq = if official && w1.format.is_quantized() {
            k8.linear.act_quant(self.ctx, ws.u, d, t, d, ws.xq, st)?;
            ws.xq
        } else {
            ws.u
        };
        k8.moe.up(
            self.ctx,
            &plan,
            xq,
            &e1,
            &e3,
            ws.rw,
            cfg.swiglu_limit,
            official,
            ws.h,
            st,
        )?;
        let hq = if official && w2.format.is_quantized() {
            k8.linear
                .act_quant(self.ctx, ws.h, i, t * k, i, ws.hq, st)?;
            ws.hq
        } else {
            ws.h
        };
        k8.moe.down(self.ctx, &plan, hq, &e2, official, ws.ya, st)?;
        let ys = match &lw.shared {
            Some(sw) => {
                self.linear(
                    k8,
                    ws.u,
                    d,
                    t,
                    &proto(sw.w1),
                    0,
                    i,
                    ws.sg,
                    i,
                    official,
                    official,
                    st,
                )?;
                self.linear(
                    k8,
                    ws.u,
                    d,
                    t,
                    &proto(sw.w3),
                    0,
                    i,
                    ws.sv,
                    i,
                    official,
                    official,
                    st,
                )?;
                k8.moe.swiglu(
                    self.ctx,
                    ws.sg,
                    ws.sv,
                    t * i,
                    cfg.swiglu_limit,
                    official,
                    ws.sh,
                    st,
                )?;
                self.linear(
                    k8,
                    ws.sh,
                    i,
                    t,
                    &proto(sw.w2),
                    0,
                    d,
                    ws.ys,
                    d,
                    official,
                    official,
                    st,
                )?;
                Some(ws.ys)
            }
            None => None,
        };
        k8.moe
            .combine(self.ctx, ws.ya, ys, t, k, d, official, ws.f, st)
    }
}
