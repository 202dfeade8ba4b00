//! The reference set's attention sub-block: query path, window KV, compressors and the
//! indexer's selection, attention with sinks, grouped output projection.

use super::{Kernels, Run, from};
use crate::cuda::arena::DevicePtr;
use crate::cuda::backend::{CompressorDev, LayerStateDev};
use crate::cuda::kernel_sets::{LinearCall, LinearGroup};
use crate::cuda::kernels::attention::{AttentionArgs, BatchMeta, RingArgs};
use crate::cuda::kernels::compressor::{CompressArgs, CompressKind};
use crate::cuda::kernels::indexer::IndexerArgs;
use crate::cuda::kernels::norm_rope::{NormRope, RmsNorm};
use crate::cuda::kv_pages::KvPagesDev;
use crate::cuda::stream::BorrowedStream;
use crate::error::{Error, Result, Status};
use crate::model::{CompressorWeights, IndexerWeights, LayerWeights};

/// One layer's attention sub-block as its parts see it.
struct AttnLayer<'a> {
    k8: &'a Kernels,
    l: usize,
    lw: &'a LayerWeights,
    ls: LayerStateDev,
    meta: &'a BatchMeta,
    st: BorrowedStream,
}

impl Run<'_> {
    /// Attention sub-block of layer `l`: `ws.u` -> `ws.a` (reference/attention.rs): the
    /// projections of u, the query path, the window KV, the compressors (and the indexer's
    /// selection on CSA layers), one softmax over window + compressed keys, the grouped
    /// output projection.
    pub(super) fn attention(
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
        // (Known before the query is made: whether the attention core reads it as BF16.)
        let args = self.attention_args(&a);
        self.input_projections(&a)?;
        self.query(&a, args.q_bf16)?;
        self.window_kv(&a)?;
        self.compress_and_select(&a)?;
        self.attend(&a, &args)?;
        self.output_projection(&a)
    }

    /// RoPE (`sign` 1) or its inverse (-1) on `heads` heads of `head_dim` per token row of
    /// `x` (row stride `ld`), at the batch's positions with this layer's frequencies.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        ld: usize,
        heads: usize,
        head_dim: usize,
        sign: f32,
        round_in: bool,
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
            round_in,
            a.st,
        )
    }

    /// RMSNorm of `rows` rows of `dim` values of `x`, with `weight` (the norm's weight index).
    fn norm_call(&self, x: DevicePtr, rows: usize, dim: usize, weight: Option<usize>) -> RmsNorm {
        RmsNorm {
            x,
            rows,
            dim,
            ld: dim,
            weight: weight.map(|i| self.weights[i].data),
            eps: self.cfg.rms_norm_eps,
            round_out: self.official(),
        }
    }

    /// Runs `norm` with the reference kernel.
    fn norm(&self, a: &AttnLayer, norm: &RmsNorm) -> Result<()> {
        a.k8.nr.run(self.ctx, norm, a.st)
    }

    /// The linear `y[t, 0..n] = x[t, :] . W[j, :]` of weight index `w`'s first `n` rows, for a
    /// [`LinearGroup`].
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        ldx: usize,
        w: usize,
        n: usize,
        y: DevicePtr,
        quant_act: bool,
        round: bool,
    ) -> Result<LinearCall> {
        let w = self.weights[w];
        Ok(LinearCall {
            x,
            ldx,
            t: a.meta.num_tokens,
            w: if n == w.rows { w } else { w.rows(0, n)? },
            groups: 1,
            quant_act,
            round,
            y,
            ldy: n,
            x_bf16: None,
        })
    }

    /// Runs the linears of `group` (one input): offered to the fast set as one launch first,
    /// else each on its own as [`Self::linear`] runs it.
    fn linear_group(&self, a: &AttnLayer, group: &LinearGroup) -> Result<()> {
        if let Some(f) = self.fast
            && f.try_linear_group(self.ctx, group, a.st)?
        {
            return Ok(());
        }
        for c in group.iter() {
            let rows = c.w.rows;
            self.linear(
                a.k8,
                c.x,
                c.ldx,
                c.t,
                &c.w,
                0,
                rows,
                c.y,
                c.ldy,
                c.quant_act,
                c.round,
                a.st,
            )?;
        }
        Ok(())
    }

    /// The indexer of a CSA layer with its key compressor's state and key pages.
    fn indexer(&self, a: &AttnLayer) -> Option<(IndexerWeights, CompressorDev, KvPagesDev)> {
        match (a.lw.indexer, a.ls.index_compressor, a.ls.index_keys) {
            (Some(ix), Some(cs), Some(keys)) => Some((ix, cs, keys)),
            _ => None,
        }
    }

    /// The KV compressor of a compressed layer with its state and entry pages.
    fn kv_compressor(
        &self,
        a: &AttnLayer,
    ) -> Option<(CompressorWeights, CompressorDev, KvPagesDev)> {
        match (a.lw.compressor, a.ls.compressor, a.ls.entries) {
            (Some(cw), Some(cs), Some(entries)) => Some((cw, cs, entries)),
            _ => None,
        }
    }

    /// Every projection of the sub-block's input u, as one group: wq_a -> qr and wkv -> kv
    /// (official act_quant and BF16 outputs in official mode), the compressors' wkv / wgate ->
    /// comp_a / comp_z and icomp_a / icomp_z (f32 in and out), the indexer's weights_proj -> iw
    /// (f32 in, BF16 out in official mode).
    fn input_projections(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (d, official) = (cfg.hidden_size, self.official());
        let mut group = LinearGroup::default();
        let from_u = |w, n, y, quant, round| self.call(a, ws.u, d, w, n, y, quant, round);
        group.push(from_u(lw.wq_a, cfg.q_lora_rank, ws.qr, official, official)?)?;
        group.push(from_u(lw.wkv, cfg.head_dim, ws.kv, official, official)?)?;
        let compressor = |cw: &CompressorWeights, cs: &CompressorDev, a, z| {
            let width = if cs.overlap { 2 * cs.dc } else { cs.dc };
            Ok::<_, crate::error::Error>([
                from_u(cw.wkv, width, a, false, false)?,
                from_u(cw.wgate, width, z, false, false)?,
            ])
        };
        if let Some((cw, cs, _)) = self.kv_compressor(a) {
            for c in compressor(&cw, &cs, ws.comp_a, ws.comp_z)? {
                group.push(c)?;
            }
        }
        if let Some((ix, cs, _)) = self.indexer(a) {
            for c in compressor(&ix.compressor, &cs, ws.icomp_a, ws.icomp_z)? {
                group.push(c)?;
            }
            let hi = cfg.index_n_heads;
            group.push(from_u(ix.weights_proj, hi, ws.iw, false, official)?)?;
        }
        self.linear_group(a, &group)
    }

    /// Query path: q_norm(u wq_a) -> wq_b -> per-head unit RMS -> RoPE; on CSA layers the
    /// indexer's queries from the same normed q_lora (wq_b -> qi, with the main wq_b as one
    /// group). wq_b's official bf16 rounding is done by [`Self::head_prep`] as it loads q (q's
    /// only reader): the same values, and a many-token wq_b through cuBLASLt then needs no
    /// rounding pass over its f32 output (0.5 GB at 4096 tokens).
    /// `q_bf16`: the queries go there as BF16 instead of into `ws.q`
    /// ([`FastOps::attention_q_bf16`]).
    fn query(&self, a: &AttnLayer, q_bf16: Option<DevicePtr>) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (h, hd, ql) = (cfg.num_heads, cfg.head_dim, cfg.q_lora_rank);
        let (t, official) = (a.meta.num_tokens, self.official());
        let mut group = LinearGroup::default();
        group.push(self.call(a, ws.qr, ql, lw.wq_b, h * hd, ws.q, official, false)?)?;
        if let Some((ix, _, _)) = self.indexer(a) {
            let n = cfg.index_n_heads * cfg.index_head_dim;
            // Rounded by rope_kernel as it loads qi, its first reader (compress_and_select).
            group.push(self.call(a, ws.qr, ql, ix.wq_b, n, ws.qi, official, false)?)?;
        }
        self.norm(a, &self.norm_call(ws.qr, t, ql, Some(lw.q_norm)))?;
        self.linear_group(a, &group)?;
        self.head_prep(a, ws.q, h, None, false, official, q_bf16)
    }

    /// Per head of `heads` of every token row of `x`: unit RMS (`weight` None) or RMSNorm,
    /// RoPE, and with `kv_sim` (official numerics) the FP8 simulation of the nope channels; one
    /// `head_prep_kernel` launch where it covers the head (bit for bit the three kernels), else
    /// the three. `round_in`: x is first rounded to bf16 (by `head_prep_kernel` as it loads x,
    /// else by a rounding pass), so the projection that wrote x may leave that rounding to it.
    /// `out_bf16`: the results go there as BF16 instead of back into x (official numerics: they
    /// are bf16 values, so the copy is exact).
    #[allow(clippy::too_many_arguments)]
    fn head_prep(
        &self,
        a: &AttnLayer,
        x: DevicePtr,
        heads: usize,
        weight: Option<usize>,
        kv_sim: bool,
        round_in: bool,
        out_bf16: Option<DevicePtr>,
    ) -> Result<()> {
        let cfg = self.cfg;
        let (hd, half, t) = (cfg.head_dim, cfg.rope_dim / 2, a.meta.num_tokens);
        let sim_nope = if kv_sim && self.official() {
            cfg.nope_dim()
        } else {
            0
        };
        if NormRope::head_prep_covers(hd, half) {
            return a.k8.nr.head_prep(
                self.ctx,
                x,
                t,
                heads * hd,
                heads,
                hd,
                weight.map(|i| self.weights[i].data),
                cfg.rms_norm_eps,
                a.meta.positions,
                a.ls.inv_freq,
                half,
                sim_nope,
                self.official(),
                round_in,
                out_bf16,
                a.st,
            );
        }
        if round_in {
            a.k8.nr.round_bf16(self.ctx, x, t * heads * hd, a.st)?;
        }
        self.norm(a, &self.norm_call(x, t * heads, hd, weight))?;
        self.rope(a, x, heads * hd, heads, hd, 1.0, false)?;
        if sim_nope > 0 {
            a.k8.nr.kv_sim(self.ctx, x, t, hd, sim_nope, a.st)?;
        }
        match out_bf16 {
            Some(out) => a.k8.nr.to_bf16(self.ctx, x, out, t * heads * hd, a.st),
            None => Ok(()),
        }
    }

    /// Window KV: one vector per token (key and value), normed, RoPE'd, FP8-simulated.
    fn window_kv(&self, a: &AttnLayer) -> Result<()> {
        self.head_prep(a, self.ws.kv, 1, Some(a.lw.kv_norm), true, false, None)
    }

    /// The compressors (f32 projections, tokens in order per sequence), then on CSA layers
    /// the indexer's top-k into `ws.selected` / `ws.nsel` ([`Self::attention_args`]'s selection).
    fn compress_and_select(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, ls) = (self.cfg, self.ws, &a.ls);
        let (k8, meta, st) = (a.k8, a.meta, a.st);
        let official = self.official();
        if let Some((cw, cs, entries)) = self.kv_compressor(a) {
            let bufs = (ws.comp_a, ws.comp_z);
            self.compress(k8, &cw, &cs, bufs, entries, ls, CompressKind::Kv, meta, st)?;
        }
        let Some((ix, cs, keys)) = self.indexer(a) else {
            return Ok(());
        };
        let (cw, bufs) = (&ix.compressor, (ws.icomp_a, ws.icomp_z));
        self.compress(
            k8,
            cw,
            &cs,
            bufs,
            keys,
            ls,
            CompressKind::IndexKey,
            meta,
            st,
        )?;
        let t = meta.num_tokens;
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
        // qi (query) and iw (input_projections) are already projected.
        // qi's official bf16 rounding: here, as rope_kernel loads it (see query).
        self.rope(a, ws.qi, hi * di, hi, di, 1.0, official)?;
        if official {
            k8.nr.index_sim(self.ctx, ws.qi, t * hi, di, st)?;
        }
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
        let fast = match self.fast {
            Some(f) => f.try_select(self.ctx, meta, &args, st)?,
            None => false,
        };
        if !fast {
            k8.idx.select(self.ctx, meta, &args, st)?;
        }
        Ok(())
    }

    /// The attention core's arguments for layer `a`: the selection buffers on CSA layers (which
    /// [`Self::compress_and_select`] writes), and `q_bf16` where the fast set reads the queries
    /// as BF16 ([`FastOps::attention_q_bf16`]: [`Self::query`] then writes only those).
    fn attention_args(&self, a: &AttnLayer) -> AttentionArgs {
        let (cfg, ws, ls) = (self.cfg, self.ws, &a.ls);
        let mut args = AttentionArgs {
            q: ws.q,
            q_bf16: None,
            kv: ws.kv,
            ring: ls.ring,
            entries: ls.entries,
            selected: self.indexer(a).map(|_| (ws.selected, ws.nsel)),
            sinks: self.weights[a.lw.sink].data,
            heads: cfg.num_heads,
            head_dim: cfg.head_dim,
            window: cfg.sliding_window,
            ratio: cfg.layers[a.l].ratio,
            maxe: ls.maxe,
            topk: cfg.index_topk,
            num_slots: self.opts.max_num_seqs,
            official: self.official(),
            o: ws.o,
        };
        args.q_bf16 = self.fast.and_then(|f| f.attention_q_bf16(&args));
        args
    }

    /// One softmax over window + compressed keys with the per-head sink, then the ring update
    /// (the output's inverse RoPE is [`Self::output_projection`]'s).
    fn attend(&self, a: &AttnLayer, args: &AttentionArgs) -> Result<()> {
        let (cfg, ws) = (self.cfg, self.ws);
        let hd = cfg.head_dim;
        let fast = match self.fast {
            Some(f) => f.try_attention(self.ctx, a.meta, args, a.st)?,
            None => false,
        };
        if !fast {
            if args.q_bf16.is_some() {
                // (attention_q_bf16 promised the layer: `q` was never written.)
                return Err(Error::new(
                    Status::Internal,
                    format!(
                        "layer {}: the fast attention asked for BF16 queries, then did not take the layer",
                        a.l
                    ),
                ));
            }
            a.k8.attn.attention(self.ctx, a.meta, args, a.st)?;
        }
        let ring = RingArgs {
            kv: ws.kv,
            ring: a.ls.ring,
            window: cfg.sliding_window,
            head_dim: hd,
            num_slots: self.opts.max_num_seqs,
            official: self.official(),
        };
        a.k8.attn.ring_update(self.ctx, a.meta, &ring, a.st)
    }

    /// The inverse RoPE of the attention's output o, then the grouped output projection: the
    /// heads of group g through rows g*R.. of wo_a (BF16 einsum: no activation quantisation),
    /// then wo_b into `ws.a`. Where the fast set reads wo_a's input as BF16
    /// ([`FastOps::reads_bf16_x`]), the inverse RoPE also writes o's BF16 copy, into q's buffer
    /// (q is dead once the attention has run): the values are bf16 already (official rounding),
    /// so the copy is exact and wo_a's GEMMs need no conversion pass of their own. Offered to the
    /// fast set as one chain first (`ws.z`, wo_a's output, has no reader but wo_b). wo_b's
    /// official bf16 rounding is left to `ws.a`'s only reader, the hc_post after the sub-block
    /// (`post`: the same values; a many-token wo_b through cuBLASLt then needs no rounding pass).
    fn output_projection(&self, a: &AttnLayer) -> Result<()> {
        let (cfg, ws, lw) = (self.cfg, self.ws, a.lw);
        let (h, hd, d) = (cfg.num_heads, cfg.head_dim, cfg.hidden_size);
        let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
        let (t, official) = (a.meta.num_tokens, self.official());
        let wo_a = self.weights[lw.wo_a];
        let gin = h * hd / g;
        let mut grouped = LinearCall {
            x: ws.o,
            ldx: h * hd,
            t,
            w: wo_a.rows(0, g * r)?,
            groups: g,
            quant_act: false,
            round: official,
            y: ws.z,
            ldy: g * r,
            x_bf16: Some(ws.q),
        };
        let copy = official && self.fast.is_some_and(|f| f.reads_bf16_x(&grouped));
        if copy {
            a.k8.nr.rope_with_bf16_copy(
                self.ctx,
                ws.o,
                t,
                h * hd,
                h,
                hd,
                a.meta.positions,
                a.ls.inv_freq,
                cfg.rope_dim / 2,
                -1.0,
                (ws.q, h * hd),
                a.st,
            )?;
        } else {
            grouped.x_bf16 = None;
            self.rope(a, ws.o, h * hd, h, hd, -1.0, false)?;
        }
        let wo_b = self.weights[lw.wo_b];
        let second = LinearCall {
            x: ws.z,
            ldx: g * r,
            t,
            w: if wo_b.rows == d {
                wo_b
            } else {
                wo_b.rows(0, d)?
            },
            groups: 1,
            quant_act: official,
            round: false,
            y: ws.a,
            ldy: d,
            x_bf16: None,
        };
        if let Some(f) = self.fast
            && f.try_linear_chain(self.ctx, &grouped, &second, a.st)?
        {
            return Ok(());
        }
        let fast = match self.fast {
            Some(f) => f.try_linear(self.ctx, &grouped, a.st)?,
            None => false,
        };
        for gi in (0..g).filter(|_| !fast) {
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
        self.linear(
            a.k8,
            second.x,
            second.ldx,
            t,
            &wo_b,
            0,
            d,
            second.y,
            second.ldy,
            second.quant_act,
            second.round,
            a.st,
        )
    }

    /// One compressor (main KV or indexer keys) over the batch's tokens, from its projections
    /// `(a, z)` (input_projections made them).
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        k8: &Kernels,
        cw: &CompressorWeights,
        cs: &CompressorDev,
        (a, z): (DevicePtr, DevicePtr),
        out: KvPagesDev,
        ls: &LayerStateDev,
        kind: CompressKind,
        meta: &BatchMeta,
        st: BorrowedStream,
    ) -> Result<()> {
        let cfg = &self.cfg;
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
}
