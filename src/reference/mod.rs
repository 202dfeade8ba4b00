//! The CPU reference backend (f32): every op of the forward and the whole model; the
//! numerical oracle for the CUDA backend and the backend CI runs. Knows nothing of CUDA.
//!
//! Weights and per-slot state are allocated at create and never move; per-call
//! activations are ordinary heap scratch (this backend is the oracle, not the fast path).

pub mod attention;
pub mod compressor;
pub mod mhc;
pub mod moe;
pub mod ops;
pub mod precision;

use crate::config::ModelConfig;
use crate::engine::{Batch, EngineOptions, LogitsOut, Numerics};
use crate::error::Result;
use crate::model::{ModelWeights, batch, rope};
use crate::state::SlotState;
use crate::weights::store::WeightStore;
use attention::AttnCtx;
use mhc::HcParams;
use ops::{Threads, rms_norm};
use precision::Prec;

/// dsv4_weight_info name of the derived layer-0 folded mHC projection (both backends).
pub const HC0_FOLD_NAME: &str = "derived:layers.0.hc_attn_fn.stream_fold";

pub struct CpuBackend {
    cfg: ModelConfig,
    opts: EngineOptions,
    handles: ModelWeights,
    slots: Vec<SlotState>,
    /// Inverse RoPE frequencies per layer.
    freqs: Vec<Vec<f32>>,
    /// Derived: layer 0's stream-folded hc_attn projection (`mhc::fold_projection`),
    /// allocated here at its final address, rebuilt by finalize / refit.
    hc0_fold: Vec<f64>,
    threads: Threads,
    prec: Prec,
}

impl CpuBackend {
    pub fn new(cfg: &ModelConfig, opts: &EngineOptions, weights: &WeightStore) -> Result<Self> {
        let slots = (0..opts.max_num_seqs)
            .map(|_| SlotState::new(cfg, opts.max_seq_len))
            .collect::<Result<_>>()?;
        let threads = match opts.num_threads {
            0 => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            n => n,
        };
        Ok(CpuBackend {
            cfg: cfg.clone(),
            opts: opts.clone(),
            handles: ModelWeights::resolve(cfg, weights)?,
            slots,
            freqs: cfg
                .layers
                .iter()
                .map(|l| rope::inv_freq(cfg, l.attn))
                .collect(),
            hc0_fold: vec![0.0; (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hidden_size],
            threads: Threads(threads),
            prec: Prec {
                official: opts.numerics == Numerics::Official,
            },
        })
    }

    /// Rebuilds derived data after weights changed: layer 0's folded mHC projection (the
    /// other weights are read as stored).
    pub fn finalize(&mut self, weights: &WeightStore) -> Result<()> {
        if let Some(l0) = self.handles.layers.first() {
            let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
            mhc::fold_projection(weights.f32(l0.hc_attn.proj), n, d, &mut self.hc0_fold);
        }
        Ok(())
    }

    /// Derived tensors (host memory, fixed addresses) for dsv4_weight_info.
    pub fn derived(&self) -> Vec<crate::engine::DerivedTensor> {
        let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        vec![crate::engine::DerivedTensor {
            name: HC0_FOLD_NAME.to_string(),
            dtype: crate::engine::DerivedDtype::F64,
            shape: vec![(2 + n) * n, d],
            addr: self.hc0_fold.as_ptr() as u64,
            nbytes: self.hc0_fold.len() * 8,
        }]
    }

    pub fn release_slot(&mut self, slot: usize) {
        self.slots[slot].reset();
    }

    /// Tokens currently held by each slot.
    pub fn slot_lengths(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.len).collect()
    }

    pub fn forward(&mut self, w: &WeightStore, b: &mut Batch) -> Result<()> {
        let seqs = batch::plan(&self.cfg, &self.opts, &self.slot_lengths(), b)?;
        for s in &seqs {
            if s.first_pos == 0 {
                self.slots[s.slot].reset();
            }
        }
        let cfg = &self.cfg;
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let (th, prec) = (self.threads, self.prec);
        let t = b.token_ids.len();
        let hw = &self.handles;

        // Embedding, copied into every residual stream.
        let embed = w.f32(hw.embed);
        let mut x = vec![0.0f32; t * n * d];
        for (ti, &tok) in b.token_ids.iter().enumerate() {
            let row = &embed[tok as usize * d..(tok as usize + 1) * d];
            (0..n).for_each(|s| x[(ti * n + s) * d..(ti * n + s + 1) * d].copy_from_slice(row));
        }
        let site = |s: &crate::model::HcSite| HcParams {
            proj: w.f32(s.proj),
            base: w.f32(s.base),
            scale: w.f32(s.scale),
            fold: None,
        };
        for (l, lw) in hw.layers.iter().enumerate() {
            let attn_site = HcParams {
                fold: (l == 0).then_some(self.hc0_fold.as_slice()),
                ..site(&lw.hc_attn)
            };
            let mut pre = mhc::hc_pre(
                th,
                &x,
                n,
                d,
                &attn_site,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                cfg.rms_norm_eps,
            );
            prec.bf16(&mut pre.u);
            rms_norm(&mut pre.u, d, Some(w.f32(lw.attn_norm)), cfg.rms_norm_eps);
            prec.bf16(&mut pre.u);
            let ctx = AttnCtx {
                cfg,
                w,
                lw,
                layer: l,
                freqs: &self.freqs[l],
                th,
                prec,
            };
            let a = attention::attention(&ctx, &pre.u, b.positions, &seqs, &mut self.slots);
            mhc::hc_post(&mut x, &a, &pre, n, d);
            prec.bf16(&mut x);

            let mut pre = mhc::hc_pre(
                th,
                &x,
                n,
                d,
                &site(&lw.hc_ffn),
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                cfg.rms_norm_eps,
            );
            prec.bf16(&mut pre.u);
            rms_norm(&mut pre.u, d, Some(w.f32(lw.ffn_norm)), cfg.rms_norm_eps);
            prec.bf16(&mut pre.u);
            let f = moe::moe(cfg, w, lw, th, prec, &pre.u, b.token_ids);
            mhc::hc_post(&mut x, &f, &pre, n, d);
            prec.bf16(&mut x);
        }
        for s in &seqs {
            self.slots[s.slot].len = s.first_pos + s.len;
        }

        // Head collapse, final norm, logits for the requested rows.
        let all: Vec<i32>;
        let rows = match b.logits_rows {
            Some(r) => r,
            None => {
                all = (0..t as i32).collect();
                &all
            }
        };
        let mut xr = Vec::with_capacity(rows.len() * n * d);
        rows.iter()
            .for_each(|&r| xr.extend_from_slice(&x[r as usize * n * d..(r as usize + 1) * n * d]));
        let mut y = mhc::hc_head(
            th,
            &xr,
            n,
            d,
            &site(&hw.hc_head),
            cfg.hc_eps,
            cfg.rms_norm_eps,
        );
        prec.bf16(&mut y);
        rms_norm(&mut y, d, Some(w.f32(hw.norm)), cfg.rms_norm_eps);
        prec.bf16(&mut y);
        match &mut b.logits {
            LogitsOut::F32(out) => ops::matmul(th, &y, d, w.f32(hw.head), out),
            LogitsOut::Bf16(out) => {
                let logits = ops::linear(th, &y, d, w.f32(hw.head));
                out.iter_mut()
                    .zip(&logits)
                    .for_each(|(o, v)| *o = half::bf16::from_f32(*v).to_bits());
            }
        }
        Ok(())
    }
}
