//! The reference set's MoE sub-block: router, per-expert plan, grouped expert GEMMs,
//! shared expert, combine.

use super::{Kernels, MOE_TILE_ROWS, Run};
use crate::cuda::arena::DevicePtr;
use crate::cuda::backend::WeightDev;
use crate::cuda::kernels::moe::{ExpertsDev, MoePlan, RouterParams, Selection};
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;
use crate::model::LayerWeights;

impl Run<'_> {
    /// MoE sub-block: `ws.u` -> `ws.f` (reference/moe.rs).
    pub(super) fn moe(
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
