//! One attention sub-block on the CPU (MODEL.md §6): q-LoRA + per-head q norm + RoPE,
//! shared K=V window vector, compressors, lightning indexer, one softmax over window and
//! compressed keys with a per-head sink, inverse RoPE, grouped output projection.
//!
//! Per sequence the order is: compress every token of the chunk into the slot's entry
//! lists (entries become visible by the w < floor((p+1)/r) rule), attend for every token
//! (window keys from the ring for past chunks, from this chunk otherwise), then move the
//! chunk's last W window vectors into the ring.

use super::compressor;
use super::ops::{Threads, dot, exp, inv_sqrt, linear_weight, rms_norm, sum, top_k};
use super::precision::Prec;
use crate::config::{AttnKind, LayerSpec, ModelConfig};
use crate::model::LayerWeights;
use crate::model::batch::SeqRange;
use crate::model::rope;
use crate::state::{CompressorState, SlotState};
use crate::weights::store::WeightStore;

/// Per-layer constants of the forward.
pub struct AttnCtx<'a> {
    pub cfg: &'a ModelConfig,
    pub w: &'a WeightStore,
    pub lw: &'a LayerWeights,
    pub layer: usize,
    /// Inverse RoPE frequencies of this layer's kind.
    pub freqs: &'a [f32],
    pub th: Threads,
    pub prec: Prec,
}

/// Attention output [T, D] for attn-normed input `u` [T, D].
pub fn attention(
    ctx: &AttnCtx,
    u: &[f32],
    positions: &[i32],
    seqs: &[SeqRange],
    slots: &mut [SlotState],
) -> Vec<f32> {
    let (cfg, w, lw, th, prec) = (ctx.cfg, ctx.w, ctx.lw, ctx.th, ctx.prec);
    let d = cfg.hidden_size;
    let (h, hd) = (cfg.num_heads, cfg.head_dim);
    let t = u.len() / d;
    let eps = cfg.rms_norm_eps;
    let pos = |i: usize| positions[i] as usize;

    // Query path: qr = q_norm(u wq_a), q = per-head unit RMS of (qr wq_b), RoPE.
    let mut qr = prec.linear(th, w, lw.wq_a, u, d);
    rms_norm(&mut qr, cfg.q_lora_rank, Some(w.f32(lw.q_norm)), eps);
    prec.bf16(&mut qr);
    let mut q = prec.linear(th, w, lw.wq_b, &qr, cfg.q_lora_rank);
    rms_norm(&mut q, hd, None, eps);
    prec.bf16(&mut q);
    for (i, qt) in q.chunks_exact_mut(h * hd).enumerate() {
        qt.chunks_exact_mut(hd)
            .for_each(|qh| rope::apply(qh, ctx.freqs, pos(i), 1.0));
    }
    prec.bf16(&mut q);
    // Window KV: one vector per token, used as key and value.
    let mut kv = prec.linear(th, w, lw.wkv, u, d);
    rms_norm(&mut kv, hd, Some(w.f32(lw.kv_norm)), eps);
    prec.bf16(&mut kv);
    for (i, row) in kv.chunks_exact_mut(hd).enumerate() {
        rope::apply(row, ctx.freqs, pos(i), 1.0);
    }
    prec.bf16(&mut kv);
    prec.kv_nope_sim(&mut kv, hd, cfg.nope_dim());
    // Compressor inputs for the whole batch (projections are per token, f32 in both modes).
    let comp_in = lw.compressor.map(|c| {
        (
            linear_weight(th, u, d, w, c.wkv),
            linear_weight(th, u, d, w, c.wgate),
        )
    });
    let indexer_in = lw.indexer.map(|ix| {
        let (di, hi) = (cfg.index_head_dim, cfg.index_n_heads);
        let a = linear_weight(th, u, d, w, ix.compressor.wkv);
        let z = linear_weight(th, u, d, w, ix.compressor.wgate);
        let mut qi = prec.linear(th, w, ix.wq_b, &qr, cfg.q_lora_rank);
        for (i, qt) in qi.chunks_exact_mut(hi * di).enumerate() {
            qt.chunks_exact_mut(di)
                .for_each(|qh| rope::apply(qh, ctx.freqs, pos(i), 1.0));
        }
        prec.bf16(&mut qi);
        prec.index_sim(&mut qi, di);
        let mut weights = prec.linear_bf16(th, w, ix.weights_proj, 0, hi, u, d);
        let (s1, s2) = (inv_sqrt(di), inv_sqrt(hi));
        weights.iter_mut().for_each(|v| *v = *v * s1 * s2);
        (a, z, qi, weights)
    });

    let params = CoreParams {
        cfg,
        spec: lw.spec,
        layer: ctx.layer,
        freqs: ctx.freqs,
        prec,
        sink: w.f32(lw.sink),
        compressor: lw.compressor.map(|c| CompressorParams {
            ape: w.f32(c.ape),
            norm: w.f32(c.norm),
        }),
        index_compressor: lw.indexer.map(|ix| CompressorParams {
            ape: w.f32(ix.compressor.ape),
            norm: w.f32(ix.compressor.norm),
        }),
    };
    let inputs = CoreInputs {
        q: &q,
        kv: &kv,
        comp: comp_in.as_ref().map(|(a, z)| (&a[..], &z[..])),
        indexer: indexer_in.as_ref().map(|(a, z, qi, iw)| IndexerInputs {
            a,
            z,
            qi,
            weights: iw,
        }),
    };
    let mut o = attention_core(&params, &inputs, positions, seqs, slots);
    // Inverse RoPE of every head's output by the query position.
    for (i, ot) in o.chunks_exact_mut(h * hd).enumerate() {
        for oh in ot.chunks_exact_mut(hd) {
            rope::apply(oh, ctx.freqs, pos(i), -1.0);
            prec.bf16(oh);
        }
    }
    output_projection(ctx, &o, t)
}

/// A compressor's weights as plain slices: `ape` [ratio, width], `norm` `[d_c]`.
#[derive(Clone, Copy)]
pub struct CompressorParams<'a> {
    pub ape: &'a [f32],
    pub norm: &'a [f32],
}

/// Everything [`attention_core`] needs besides the per-token activations.
pub struct CoreParams<'a> {
    pub cfg: &'a ModelConfig,
    /// The layer's kind and compression ratio.
    pub spec: LayerSpec,
    /// Index of the layer in each slot's state.
    pub layer: usize,
    /// Inverse RoPE frequencies of this layer's kind.
    pub freqs: &'a [f32],
    pub prec: Prec,
    /// Per-head sink logits `[H]`.
    pub sink: &'a [f32],
    /// Main compressor (HCA and CSA layers).
    pub compressor: Option<CompressorParams<'a>>,
    /// The indexer's compressor (CSA layers).
    pub index_compressor: Option<CompressorParams<'a>>,
}

/// Lightning-indexer activations of a batch.
#[derive(Clone, Copy)]
pub struct IndexerInputs<'a> {
    /// Indexer compressor inputs `a`, raw gate logits `z`: [T, 2 * index_head_dim].
    pub a: &'a [f32],
    pub z: &'a [f32],
    /// Indexer queries after RoPE and the official quantisation: [T, HI, DI].
    pub qi: &'a [f32],
    /// Head weights, already scaled by DI^-1/2 * HI^-1/2: [T, HI].
    pub weights: &'a [f32],
}

/// Per-token activations entering the attention core.
#[derive(Clone, Copy)]
pub struct CoreInputs<'a> {
    /// Queries after norm and RoPE: [T, H, head_dim].
    pub q: &'a [f32],
    /// Window KV vectors (keys = values): [T, head_dim].
    pub kv: &'a [f32],
    /// Main compressor inputs `a`, raw gate logits `z`: [T, width] each.
    pub comp: Option<(&'a [f32], &'a [f32])>,
    pub indexer: Option<IndexerInputs<'a>>,
}

/// The core of [`attention`] after the projections: per sequence, compress the chunk into
/// the slot's entry lists, attend for every token (window + compressed keys, sink), then
/// move the chunk's last W window vectors into the ring. Returns o [T, H, head_dim] before
/// the inverse RoPE (BF16-rounded in official mode). Slots whose sequence starts at 0 must
/// have been reset by the caller.
pub fn attention_core(
    p: &CoreParams,
    x: &CoreInputs,
    positions: &[i32],
    seqs: &[SeqRange],
    slots: &mut [SlotState],
) -> Vec<f32> {
    let (cfg, prec) = (p.cfg, p.prec);
    let (h, hd) = (cfg.num_heads, cfg.head_dim);
    let t = x.kv.len() / hd;
    let pos = |i: usize| positions[i] as usize;
    let mut o = vec![0.0f32; t * h * hd];
    let win = cfg.sliding_window;
    for s in seqs {
        let slot = &mut slots[s.slot];
        let ls = &mut slot.layers[p.layer];
        // 1. Compress this chunk's tokens into the slot's entry lists.
        if let (Some(cw), Some((a, z))) = (&p.compressor, &x.comp) {
            let st = ls
                .compressor
                .as_mut()
                .expect("compressed layer has compressor state");
            compress_chunk(
                p,
                cw,
                st,
                a,
                z,
                s,
                positions,
                &mut ls.entries,
                EntryKind::Kv,
            );
        }
        if let (Some(cw), Some(ix)) = (&p.index_compressor, &x.indexer) {
            let st = ls
                .index_compressor
                .as_mut()
                .expect("CSA layer has indexer state");
            compress_chunk(
                p,
                cw,
                st,
                ix.a,
                ix.z,
                s,
                positions,
                &mut ls.index_keys,
                EntryKind::IndexKey,
            );
        }
        // 2. Attend for every token of the chunk.
        let mut keys: Vec<&[f32]> = Vec::with_capacity(win + cfg.index_topk.max(1));
        for i in s.token_start..s.token_start + s.len {
            let pi = pos(i);
            keys.clear();
            for kp in pi.saturating_sub(win - 1)..=pi {
                if kp < s.first_pos {
                    keys.push(&ls.window[(kp % win) * hd..(kp % win + 1) * hd]);
                } else {
                    let ti = s.token_start + (kp - s.first_pos);
                    keys.push(&x.kv[ti * hd..(ti + 1) * hd]);
                }
            }
            let ratio = p.spec.ratio;
            if let Some(visible) = (pi + 1).checked_div(ratio) {
                let entry = |e: usize| &ls.entries[e * hd..(e + 1) * hd];
                match p.spec.attn {
                    AttnKind::Hca => (0..visible).for_each(|e| keys.push(entry(e))),
                    AttnKind::Csa => {
                        let ix = x.indexer.as_ref().expect("CSA layer has indexer inputs");
                        let chosen = select_entries(
                            cfg,
                            prec,
                            &ls.index_keys,
                            visible,
                            ix.qi,
                            ix.weights,
                            i,
                        );
                        chosen.into_iter().for_each(|e| keys.push(entry(e)));
                    }
                    AttnKind::Sliding => {}
                }
            }
            let ot = &mut o[i * h * hd..(i + 1) * h * hd];
            for head in 0..h {
                let qh = &x.q[(i * h + head) * hd..(i * h + head + 1) * hd];
                let oh = &mut ot[head * hd..(head + 1) * hd];
                attend_with_sink(prec, qh, &keys, p.sink[head], oh);
                prec.bf16(oh);
            }
        }
        // 3. Keep the chunk's last W window vectors in the ring.
        let keep = s.len.min(win);
        for i in s.token_start + s.len - keep..s.token_start + s.len {
            let r = pos(i) % win;
            ls.window[r * hd..(r + 1) * hd].copy_from_slice(&x.kv[i * hd..(i + 1) * hd]);
        }
    }
    o
}

/// What a compressor produces: main KV entries or indexer keys (they differ only in the
/// official fake-quantisation).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EntryKind {
    Kv,
    IndexKey,
}

/// Runs the chunk's tokens through one compressor; each completed window's entry is
/// RMS-normalised, rotated at the window's first position and stored at its index.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)] // i indexes positions and the a/z rows together
pub fn compress_chunk(
    p: &CoreParams,
    cw: &CompressorParams,
    st: &mut CompressorState,
    a: &[f32],
    z: &[f32],
    s: &SeqRange,
    positions: &[i32],
    store: &mut [f32],
    kind: EntryKind,
) {
    let prec = p.prec;
    let width = st.width();
    let (dc, r) = (st.dc, st.ratio);
    let mut entry = vec![0.0f32; dc];
    for i in s.token_start..s.token_start + s.len {
        let pos = positions[i] as usize;
        let row = i * width..(i + 1) * width;
        if compressor::push(st, cw.ape, pos, &a[row.clone()], &z[row], &mut entry) {
            prec.bf16(&mut entry);
            rms_norm(&mut entry, dc, Some(cw.norm), p.cfg.rms_norm_eps);
            prec.bf16(&mut entry);
            let e = pos / r;
            rope::apply(&mut entry, p.freqs, e * r, 1.0);
            prec.bf16(&mut entry);
            match kind {
                EntryKind::Kv => prec.kv_nope_sim(&mut entry, dc, p.cfg.nope_dim()),
                EntryKind::IndexKey => prec.index_sim(&mut entry, dc),
            }
            store[e * dc..(e + 1) * dc].copy_from_slice(&entry);
        }
    }
}

/// Lightning indexer for token `i`: score every visible indexer key and keep the top
/// min(index_topk, visible), ties toward the lower entry index.
pub fn select_entries(
    cfg: &ModelConfig,
    prec: Prec,
    keys: &[f32],
    visible: usize,
    qi: &[f32],
    iw: &[f32],
    i: usize,
) -> Vec<usize> {
    let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
    let qt = &qi[i * hi * di..(i + 1) * hi * di];
    let wt = &iw[i * hi..(i + 1) * hi];
    let mut head = vec![0.0f32; hi];
    let mut scores: Vec<f32> = (0..visible)
        .map(|e| {
            let k = &keys[e * di..(e + 1) * di];
            head.iter_mut()
                .enumerate()
                .for_each(|(hh, s)| *s = dot(&qt[hh * di..(hh + 1) * di], k));
            prec.bf16(&mut head);
            sum((0..hi).map(|hh| head[hh].max(0.0) * wt[hh]))
        })
        .collect();
    prec.bf16(&mut scores);
    top_k(&scores, cfg.index_topk.min(visible))
}

/// One head: softmax over keys (scale head_dim^-1/2) with the sink logit in the
/// denominator only; values are the keys themselves.
pub fn attend_with_sink(prec: Prec, q: &[f32], keys: &[&[f32]], sink: f32, out: &mut [f32]) {
    let scale = inv_sqrt(q.len());
    let logits: Vec<f32> = keys.iter().map(|k| dot(q, k) * scale).collect();
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| exp(l - m)).collect();
    let den = sum(e.iter().copied()) + exp(sink - m);
    // P.V accumulated in f64 (rounded once), like every reduction of the reference.
    let mut acc = vec![0.0f64; out.len()];
    for (k, &p) in keys.iter().zip(&e) {
        // Official: probabilities enter the P.V product as BF16; the denominator stays f32.
        let pv = if prec.official {
            half::bf16::from_f32(p).to_f32()
        } else {
            p
        } as f64;
        acc.iter_mut()
            .zip(k.iter())
            .for_each(|(o, &v)| *o += pv * v as f64);
    }
    out.iter_mut()
        .zip(&acc)
        .for_each(|(o, &a)| *o = a as f32 / den);
}

/// Grouped output projection: heads grouped contiguously, group g through rows
/// g*R..(g+1)*R of wo_a, then wo_b over the concatenated groups.
fn output_projection(ctx: &AttnCtx, o: &[f32], t: usize) -> Vec<f32> {
    let (cfg, w, lw) = (ctx.cfg, ctx.w, ctx.lw);
    let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
    let gin = cfg.num_heads * cfg.head_dim / g;
    let mut z = vec![0.0f32; t * g * r];
    let mut og = vec![0.0f32; t * gin];
    for gi in 0..g {
        for ti in 0..t {
            let src = ti * g * gin + gi * gin;
            og[ti * gin..(ti + 1) * gin].copy_from_slice(&o[src..src + gin]);
        }
        let zg = ctx
            .prec
            .linear_bf16(ctx.th, w, lw.wo_a, gi * r, r, &og, gin);
        for ti in 0..t {
            z[ti * g * r + gi * r..ti * g * r + (gi + 1) * r]
                .copy_from_slice(&zg[ti * r..(ti + 1) * r]);
        }
    }
    ctx.prec.linear(ctx.th, w, lw.wo_b, &z, g * r)
}
