//! The CUDA forward: the launch sequence of one batch, mirroring reference/mod.rs step for
//! step (same numerics: the kernels follow kernels/SPEC.md). Launches only on the host's
//! stream; no allocation, no host synchronization, no host-visible branching on device
//! values: the launch sequence depends only on (num_tokens, num_seqs, num_logits) and the
//! config, so a host can capture it in a CUDA graph.

use crate::cuda::arena::DevicePtr;
use crate::cuda::backend::{CompressorDev, CudaBackend, DevWeight, LayerStateDev, MOE_TILE_ROWS};
use crate::cuda::kernels::attention::{Attention, AttentionArgs, BatchMeta, RingArgs};
use crate::cuda::kernels::batch::{BatchKernels, BatchLimits, RawBatch};
use crate::cuda::kernels::compressor::{CompressArgs, CompressKind, Compressor};
use crate::cuda::kernels::indexer::{Indexer, IndexerArgs};
use crate::cuda::kernels::linear::Linear;
use crate::cuda::kernels::mhc::{HcSiteDev, Mhc};
use crate::cuda::kernels::moe::{DevExperts, Moe, MoePlan, RouterParams, Selection};
use crate::cuda::kernels::norm_rope::NormRope;
use crate::cuda::registry::Registry;
use crate::cuda::stream::BorrowedStream;
use crate::engine::{DeviceBatch, Numerics};
use crate::error::{Error, Result, Status};
use crate::model::{CompressorWeights, HcSite, LayerWeights};

/// Every kernel family, resolved once at finalize.
pub struct Kernels {
    pub batch: BatchKernels,
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
            batch: BatchKernels::new(reg)?,
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

/// A device array the host passed in a batch (its extent known from the counts).
fn host_buf(addr: u64, bytes: usize) -> DevicePtr {
    // SAFETY: the host guarantees `bytes` accessible bytes at `addr` for the call (DESIGN.md
    // §3); kernels only touch that range.
    unsafe { DevicePtr::from_raw(addr, bytes) }
}

/// Buffer from byte `off` to its end (a strided view's base).
fn from(p: DevicePtr, off: usize) -> Result<DevicePtr> {
    p.slice(off, p.bytes() - off)
}

impl CudaBackend {
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
        w: &DevWeight,
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
                .act_quant(&self.ctx, x, ldx, t, k, self.ws.xq, st)?;
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
            .linear(&self.ctx, x, ldx, t, &wr, n, round, y, ldy, st)
    }

    /// One forward step on the device (DESIGN.md §3).
    pub fn forward(&mut self, b: &DeviceBatch, st: BorrowedStream) -> Result<()> {
        let k8 = self.kernels.as_ref().ok_or_else(|| {
            Error::new(Status::State, "kernels are not loaded: call dsv4_finalize")
        })?;
        let _g = self.ctx.enter()?;
        let cfg = &self.cfg;
        let (t, s) = (b.num_tokens, b.num_seqs);
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let off = self.official();
        let eps = cfg.rms_norm_eps;
        let ws = self.ws;
        // First the device-side check (kernels/batch.cu): from here on every kernel reads the
        // sanitized batch, never the host's arrays; a bad batch has become all padding.
        let raw = RawBatch {
            tokens: host_buf(b.token_ids, t * 4),
            positions: host_buf(b.positions, t * 4),
            seq_slots: host_buf(b.seq_slots, s * 4),
            query_start: host_buf(b.query_start, (s + 1) * 4),
            logits_rows: (b.logits_rows != 0).then(|| host_buf(b.logits_rows, b.num_logits * 4)),
            num_tokens: t,
            num_seqs: s,
            num_logits: b.num_logits,
        };
        let limits = BatchLimits {
            vocab: cfg.vocab_size,
            max_seq_len: self.opts.max_seq_len,
            num_slots: self.opts.max_num_seqs,
            slot_len: self.slot_len,
        };
        let chk = self.batch;
        k8.batch.check(&self.ctx, &raw, &limits, &chk, st)?;
        let tokens = chk.tokens;
        let meta = BatchMeta {
            positions: chk.positions,
            query_start: chk.query_start,
            seq_slots: chk.seq_slots,
            seq_of: chk.seq_of,
            num_tokens: t,
            num_seqs: s,
        };
        k8.nr.embed(
            &self.ctx,
            tokens,
            t,
            self.weights[self.handles.embed].data,
            d,
            n,
            ws.x,
            st,
        )?;
        for (l, lw) in self.handles.layers.iter().enumerate() {
            // Layer 0's streams all hold the embedding: read the derived folded projection.
            let site = HcSiteDev {
                fold: (l == 0).then_some(self.hc0_fold),
                ..self.site(&lw.hc_attn)
            };
            k8.mhc.hc_pre(
                &self.ctx,
                ws.x,
                t,
                n,
                d,
                site,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                eps,
                off,
                ws.u,
                ws.post,
                ws.comb,
                st,
            )?;
            k8.nr.rmsnorm(
                &self.ctx,
                ws.u,
                t,
                d,
                d,
                Some(self.weights[lw.attn_norm].data),
                eps,
                off,
                st,
            )?;
            self.attention(k8, l, lw, &meta, st)?;
            k8.mhc
                .hc_post(&self.ctx, ws.x, ws.a, ws.post, ws.comb, t, n, d, off, st)?;

            let site = self.site(&lw.hc_ffn);
            k8.mhc.hc_pre(
                &self.ctx,
                ws.x,
                t,
                n,
                d,
                site,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                eps,
                off,
                ws.u,
                ws.post,
                ws.comb,
                st,
            )?;
            k8.nr.rmsnorm(
                &self.ctx,
                ws.u,
                t,
                d,
                d,
                Some(self.weights[lw.ffn_norm].data),
                eps,
                off,
                st,
            )?;
            self.moe(k8, l, lw, t, tokens, st)?;
            k8.mhc
                .hc_post(&self.ctx, ws.x, ws.f, ws.post, ws.comb, t, n, d, off, st)?;
        }
        k8.attn
            .slot_len(&self.ctx, &meta, self.slot_len, self.opts.max_num_seqs, st)?;

        // Head collapse, final norm, logits of the requested rows.
        let rows = b.num_logits;
        if rows == 0 {
            return Ok(());
        }
        k8.nr
            .gather_rows(&self.ctx, ws.x, n * d, Some(chk.rows), rows, ws.xr, st)?;
        let site = self.site(&self.handles.hc_head);
        k8.mhc.hc_head(
            &self.ctx, ws.xr, rows, n, d, site, cfg.hc_eps, eps, off, ws.y, st,
        )?;
        k8.nr.rmsnorm(
            &self.ctx,
            ws.y,
            rows,
            d,
            d,
            Some(self.weights[self.handles.norm].data),
            eps,
            off,
            st,
        )?;
        let v = cfg.vocab_size;
        let head = self.weights[self.handles.head];
        let elem = if b.logits_bf16 { 2 } else { 4 };
        let logits = host_buf(b.logits, rows * v * elem);
        if b.logits_bf16 {
            self.linear(
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
            k8.nr
                .to_bf16(&self.ctx, ws.logits_f32, logits, rows * v, st)?;
        } else {
            self.linear(k8, ws.y, d, rows, &head, 0, v, logits, v, false, false, st)?;
        }
        // Padding rows become zeros; every row of a bad batch NaN.
        k8.batch
            .finish_logits(&self.ctx, &chk, rows, v, b.logits_bf16, logits, st)
    }

    /// Attention sub-block of layer `l`: `ws.u` -> `ws.a` (reference/attention.rs).
    fn attention(
        &self,
        k8: &Kernels,
        l: usize,
        lw: &LayerWeights,
        meta: &BatchMeta,
        st: BorrowedStream,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let ws = self.ws;
        let off = self.official();
        let t = meta.num_tokens;
        let (d, h, hd, ql) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.head_dim,
            cfg.q_lora_rank,
        );
        let eps = cfg.rms_norm_eps;
        let ls = self.layers[l];
        let half = cfg.rope_dim / 2;
        let pos = meta.positions;
        let w = |i: usize| self.weights[i];
        // Query path.
        self.linear(k8, ws.u, d, t, &w(lw.wq_a), 0, ql, ws.qr, ql, off, off, st)?;
        k8.nr.rmsnorm(
            &self.ctx,
            ws.qr,
            t,
            ql,
            ql,
            Some(w(lw.q_norm).data),
            eps,
            off,
            st,
        )?;
        self.linear(
            k8,
            ws.qr,
            ql,
            t,
            &w(lw.wq_b),
            0,
            h * hd,
            ws.q,
            h * hd,
            off,
            off,
            st,
        )?;
        k8.nr
            .rmsnorm(&self.ctx, ws.q, t * h, hd, hd, None, eps, off, st)?;
        k8.nr.rope(
            &self.ctx,
            ws.q,
            t,
            h * hd,
            h,
            hd,
            pos,
            ls.inv_freq,
            half,
            1.0,
            off,
            st,
        )?;
        // Window KV.
        self.linear(k8, ws.u, d, t, &w(lw.wkv), 0, hd, ws.kv, hd, off, off, st)?;
        k8.nr.rmsnorm(
            &self.ctx,
            ws.kv,
            t,
            hd,
            hd,
            Some(w(lw.kv_norm).data),
            eps,
            off,
            st,
        )?;
        k8.nr.rope(
            &self.ctx,
            ws.kv,
            t,
            hd,
            1,
            hd,
            pos,
            ls.inv_freq,
            half,
            1.0,
            off,
            st,
        )?;
        if off {
            k8.nr.kv_sim(&self.ctx, ws.kv, t, hd, cfg.nope_dim(), st)?;
        }
        // Compressors (f32 projections), tokens in order per sequence.
        if let (Some(cw), Some(cs), Some(entries)) = (lw.compressor, ls.compressor, ls.entries) {
            self.compress(
                k8,
                &cw,
                &cs,
                ws.comp_a,
                ws.comp_z,
                entries,
                &ls,
                CompressKind::Kv,
                meta,
                st,
            )?;
        }
        let mut selected = None;
        if let (Some(ix), Some(cs), Some(keys)) = (lw.indexer, ls.index_compressor, ls.index_keys) {
            self.compress(
                k8,
                &ix.compressor,
                &cs,
                ws.icomp_a,
                ws.icomp_z,
                keys,
                &ls,
                CompressKind::IndexKey,
                meta,
                st,
            )?;
            let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
            self.linear(
                k8,
                ws.qr,
                ql,
                t,
                &w(ix.wq_b),
                0,
                hi * di,
                ws.qi,
                hi * di,
                off,
                off,
                st,
            )?;
            k8.nr.rope(
                &self.ctx,
                ws.qi,
                t,
                hi * di,
                hi,
                di,
                pos,
                ls.inv_freq,
                half,
                1.0,
                off,
                st,
            )?;
            if off {
                k8.nr.index_sim(&self.ctx, ws.qi, t * hi, di, st)?;
            }
            self.linear(
                k8,
                ws.u,
                d,
                t,
                &w(ix.weights_proj),
                0,
                hi,
                ws.iw,
                hi,
                false,
                off,
                st,
            )?;
            let s1 = (di as f64).powf(-0.5) as f32;
            let s2 = (hi as f64).powf(-0.5) as f32;
            k8.nr.scale2(&self.ctx, ws.iw, t * hi, s1, s2, st)?;
            let args = IndexerArgs {
                qi: ws.qi,
                iw: ws.iw,
                ikeys: keys,
                heads: hi,
                dim: di,
                ratio: cfg.layers[l].ratio,
                topk: cfg.index_topk,
                maxe: ls.maxe,
                num_slots: self.opts.max_num_seqs,
                official: off,
                scores: ws.iscores,
                selected: ws.selected,
                nsel: ws.nsel,
            };
            k8.idx.select(&self.ctx, meta, &args, st)?;
            selected = Some((ws.selected, ws.nsel));
        }
        // One softmax over window + compressed keys, with the per-head sink.
        let args = AttentionArgs {
            q: ws.q,
            kv: ws.kv,
            ring: ls.ring,
            entries: ls.entries,
            selected,
            sinks: w(lw.sink).data,
            heads: h,
            head_dim: hd,
            window: cfg.sliding_window,
            ratio: cfg.layers[l].ratio,
            maxe: ls.maxe,
            topk: cfg.index_topk,
            num_slots: self.opts.max_num_seqs,
            official: off,
            o: ws.o,
        };
        k8.attn.attention(&self.ctx, meta, &args, st)?;
        let ring = RingArgs {
            kv: ws.kv,
            ring: ls.ring,
            window: cfg.sliding_window,
            head_dim: hd,
            num_slots: self.opts.max_num_seqs,
        };
        k8.attn.ring_update(&self.ctx, meta, &ring, st)?;
        k8.nr.rope(
            &self.ctx,
            ws.o,
            t,
            h * hd,
            h,
            hd,
            pos,
            ls.inv_freq,
            half,
            -1.0,
            off,
            st,
        )?;
        // Grouped output projection: heads of group g through rows g*R.. of wo_a, then wo_b.
        let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
        let gin = h * hd / g;
        for gi in 0..g {
            let xg = from(ws.o, gi * gin * 4)?;
            let zg = from(ws.z, gi * r * 4)?;
            self.linear(
                k8,
                xg,
                h * hd,
                t,
                &w(lw.wo_a),
                gi * r,
                r,
                zg,
                g * r,
                false,
                off,
                st,
            )?;
        }
        self.linear(k8, ws.z, g * r, t, &w(lw.wo_b), 0, d, ws.a, d, off, off, st)
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
        k8.comp.compress(&self.ctx, meta, &args, st)
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
        let off = self.official();
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
            &self.ctx,
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
        k8.moe.plan(&self.ctx, ws.ids, &plan, st)?;
        let tb = self.experts[l];
        let proto = |w: usize| self.weights[w];
        let experts = |ptrs: DevicePtr, scales: DevicePtr, w: DevWeight| DevExperts {
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
        let xq = if off && w1.format.is_quantized() {
            k8.linear.act_quant(&self.ctx, ws.u, d, t, d, ws.xq, st)?;
            ws.xq
        } else {
            ws.u
        };
        k8.moe.up(
            &self.ctx,
            &plan,
            xq,
            &e1,
            &e3,
            ws.rw,
            cfg.swiglu_limit,
            off,
            ws.h,
            st,
        )?;
        let hq = if off && w2.format.is_quantized() {
            k8.linear
                .act_quant(&self.ctx, ws.h, i, t * k, i, ws.hq, st)?;
            ws.hq
        } else {
            ws.h
        };
        k8.moe.down(&self.ctx, &plan, hq, &e2, off, ws.ya, st)?;
        let ys = match &lw.shared {
            Some(sw) => {
                self.linear(k8, ws.u, d, t, &proto(sw.w1), 0, i, ws.sg, i, off, off, st)?;
                self.linear(k8, ws.u, d, t, &proto(sw.w3), 0, i, ws.sv, i, off, off, st)?;
                k8.moe.swiglu(
                    &self.ctx,
                    ws.sg,
                    ws.sv,
                    t * i,
                    cfg.swiglu_limit,
                    off,
                    ws.sh,
                    st,
                )?;
                self.linear(k8, ws.sh, i, t, &proto(sw.w2), 0, d, ws.ys, d, off, off, st)?;
                Some(ws.ys)
            }
            None => None,
        };
        k8.moe.combine(&self.ctx, ws.ya, ys, t, k, d, off, ws.f, st)
    }
}
