//! Mixture of experts on the CPU (MODEL.md §7): sqrtsoftplus router with selection bias
//! or hash table, clamped SwiGLU experts, routed scaling, shared expert.

use super::ops::{Threads, linear, silu, softplus, sum, top_k};
use super::precision::Prec;
use crate::config::{ModelConfig, ScoringFunc};
use crate::model::{ExpertWeights, LayerWeights};
use crate::weights::store::WeightStore;

/// Expert ids and combine weights per token: ([T, k], [T, k]).
pub fn route(
    cfg: &ModelConfig,
    w: &WeightStore,
    lw: &LayerWeights,
    th: Threads,
    x: &[f32],
    tokens: &[i32],
) -> (Vec<usize>, Vec<f32>) {
    let (d, e, k) = (cfg.hidden_size, cfg.n_routed_experts, cfg.experts_per_tok);
    let logits = linear(th, x, d, w.f32(lw.gate));
    let t = x.len() / d;
    let mut ids = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    for ti in 0..t {
        let l = &logits[ti * e..(ti + 1) * e];
        let scores: Vec<f32> = match cfg.scoring_func {
            ScoringFunc::SqrtSoftplus => l.iter().map(|&v| softplus(v).sqrt()).collect(),
            ScoringFunc::Sigmoid => l.iter().map(|&v| super::ops::sigmoid(v)).collect(),
            ScoringFunc::Softmax => {
                let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f32> = l.iter().map(|v| super::ops::exp(v - m)).collect();
                let s = sum(ex.iter().copied());
                ex.into_iter().map(|v| v / s).collect()
            }
        };
        let chosen: Vec<usize> = match (lw.tid2eid, lw.gate_bias) {
            (Some(table), _) => {
                let row = tokens[ti] as usize * k;
                w.i32(table)[row..row + k]
                    .iter()
                    .map(|&v| v as usize)
                    .collect()
            }
            (None, Some(bias)) => {
                let b = w.f32(bias);
                let biased: Vec<f32> = scores.iter().zip(b).map(|(s, b)| s + b).collect();
                top_k(&biased, k)
            }
            (None, None) => top_k(&scores, k),
        };
        let mut sel: Vec<f32> = chosen.iter().map(|&c| scores[c]).collect();
        if cfg.norm_topk_prob && cfg.scoring_func != ScoringFunc::Softmax {
            let s = sum(sel.iter().copied());
            sel.iter_mut().for_each(|v| *v /= s);
        }
        sel.iter_mut().for_each(|v| *v *= cfg.routed_scaling_factor);
        ids.extend(chosen);
        weights.extend(sel);
    }
    (ids, weights)
}

/// Clamped SwiGLU expert on rows x: [n, D] -> [n, D]:
/// W2 (route_w * SiLU(min(W1 x, L)) * clamp(W3 x, -L, L)); `route_w` holds one routing
/// weight per row (applied before W2, as the official code does) or is None (shared expert).
fn expert(
    cfg: &ModelConfig,
    w: &WeightStore,
    ew: &ExpertWeights,
    th: Threads,
    prec: Prec,
    x: &[f32],
    route_w: Option<&[f32]>,
) -> Vec<f32> {
    let (d, i) = (cfg.hidden_size, cfg.moe_inter);
    let limit = cfg.swiglu_limit;
    let mut g = prec.linear(th, w, ew.w1, x, d);
    let v = prec.linear(th, w, ew.w3, x, d);
    for (g, v) in g.iter_mut().zip(&v) {
        let (mut gv, mut vv) = (*g, *v);
        if limit > 0.0 {
            gv = gv.min(limit);
            vv = vv.clamp(-limit, limit);
        }
        *g = silu(gv) * vv;
    }
    if let Some(rw) = route_w {
        g.chunks_exact_mut(i)
            .zip(rw)
            .for_each(|(row, &wt)| row.iter_mut().for_each(|v| *v *= wt));
    }
    prec.bf16(&mut g);
    prec.linear(th, w, ew.w2, &g, i)
}

/// MoE output [T, D] for ffn-normed input `x` [T, D].
pub fn moe(
    cfg: &ModelConfig,
    w: &WeightStore,
    lw: &LayerWeights,
    th: Threads,
    prec: Prec,
    x: &[f32],
    tokens: &[i32],
) -> Vec<f32> {
    let d = cfg.hidden_size;
    let k = cfg.experts_per_tok;
    let (ids, weights) = route(cfg, w, lw, th, x, tokens);
    // Expert outputs are summed in f64 and rounded once (order-independent).
    let mut acc: Vec<f64> = match &lw.shared {
        Some(sw) => expert(cfg, w, sw, th, prec, x, None)
            .into_iter()
            .map(f64::from)
            .collect(),
        None => vec![0.0; x.len()],
    };
    // Gather the tokens of each expert, run it once (routing weight applied inside), add.
    for (e, ew) in lw.experts.iter().enumerate() {
        let rows: Vec<(usize, f32)> = ids
            .iter()
            .zip(&weights)
            .enumerate()
            .filter(|(_, (id, _))| **id == e)
            .map(|(j, (_, &wt))| (j / k, wt))
            .collect();
        if rows.is_empty() {
            continue;
        }
        let mut xe = Vec::with_capacity(rows.len() * d);
        rows.iter()
            .for_each(|&(t, _)| xe.extend_from_slice(&x[t * d..(t + 1) * d]));
        let route_w: Vec<f32> = rows.iter().map(|&(_, wt)| wt).collect();
        let ye = expert(cfg, w, ew, th, prec, &xe, Some(&route_w));
        for (r, &(t, _)) in rows.iter().enumerate() {
            acc[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&ye[r * d..(r + 1) * d])
                .for_each(|(o, &v)| *o += v as f64);
        }
    }
    let mut out: Vec<f32> = acc.into_iter().map(|v| v as f32).collect();
    prec.bf16(&mut out);
    out
}
