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

use crate::backend::{
    Backend, Batch, BufferSpans, DerivedTensor, DeviceBatch, Elem, LogitsOut, StreamHandle,
    WeightAddr,
};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::error::{Error, Status};
use crate::model::batch::BatchFault;
use crate::model::batch::SeqRange;
use crate::model::{ModelWeights, batch, rope};
use crate::options::{EngineOptions, Numerics};
use crate::state::SlotState;
use crate::weights::store::{TensorData, WeightStore};
use crate::weights::table::WeightTable;
use crate::weights::values::{Progress, WeightValues, write_to_store};
use attention::AttnCtx;
use mhc::HcParams;
use ops::{Threads, rms_norm};
use precision::Prec;

pub use crate::model::hc_fold::HC0_FOLD_NAME;

pub struct CpuBackend {
    /// The weights themselves (host memory, allocated at create, written in place).
    store: WeightStore,
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
    /// Bytes of the weight store's values and scales (fixed at create).
    weight_bytes: u64,
}

impl CpuBackend {
    pub fn new(cfg: &ModelConfig, opts: &EngineOptions) -> Result<Self> {
        let weights = WeightStore::allocate_with(cfg, opts.weight_format)?;
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
            handles: ModelWeights::resolve(cfg, weights.table())?,
            slots,
            freqs: cfg
                .layers
                .iter()
                .map(|l| rope::inv_freq(cfg, l.attn))
                .collect(),
            hc0_fold: vec![0.0; (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hidden_size],
            threads: Threads(threads),
            weight_bytes: weights.table().total_bytes(),
            prec: Prec {
                official: opts.numerics == Numerics::Official,
            },
            store: weights,
        })
    }

    /// Rebuilds derived data after weights changed: layer 0's folded mHC projection (the
    /// other weights are read as stored).
    fn rebuild_fold(&mut self) -> Result<()> {
        if let Some(l0) = self.handles.layers.first() {
            let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
            mhc::fold_projection(self.store.f32(l0.hc_attn.proj), n, d, &mut self.hc0_fold);
        }
        Ok(())
    }

    /// Derived tensors (host memory, fixed addresses) for dsv4_weight_info.
    fn derived_list(&self) -> Vec<DerivedTensor> {
        let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        vec![DerivedTensor {
            name: HC0_FOLD_NAME.to_string(),
            dtype: Elem::F64,
            shape: vec![(2 + n) * n, d],
            addr: self.hc0_fold.as_ptr() as u64,
            nbytes: self.hc0_fold.len() * 8,
        }]
    }

    /// Tokens currently held by each slot.
    pub fn slot_lengths(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.len).collect()
    }

    fn forward(&mut self, w: &WeightStore, b: &mut Batch) -> Result<()> {
        let seqs = batch::plan(&self.cfg, &self.opts, &self.slot_lengths(), b)?;
        let real = RealTokens::new(&seqs, b);
        let all: Vec<i32>;
        let rows = match b.logits_rows {
            Some(r) => r,
            None => {
                all = (0..b.token_ids.len() as i32).collect();
                &all
            }
        };
        // Logits rows of real tokens, as rows of the real-token batch.
        let real_rows: Vec<i32> = rows
            .iter()
            .filter_map(|&r| real.row_of[r as usize].map(|c| c as i32))
            .collect();
        let logits = if real.tokens.is_empty() {
            vec![]
        } else {
            self.forward_real(w, &real, &real_rows)
        };
        // Scatter: padding rows are zeros.
        let v = self.cfg.vocab_size;
        let mut next = logits.chunks_exact(v);
        for (k, &r) in rows.iter().enumerate() {
            let src = match real.row_of[r as usize] {
                Some(_) => next.next(),
                None => None,
            };
            match &mut b.logits {
                LogitsOut::F32(out) => {
                    let dst = &mut out[k * v..(k + 1) * v];
                    match src {
                        Some(src) => dst.copy_from_slice(src),
                        None => dst.fill(0.0),
                    }
                }
                LogitsOut::Bf16(out) => {
                    let dst = &mut out[k * v..(k + 1) * v];
                    match src {
                        Some(src) => dst
                            .iter_mut()
                            .zip(src)
                            .for_each(|(o, x)| *o = half::bf16::from_f32(*x).to_bits()),
                        None => dst.fill(0),
                    }
                }
            }
        }
        Ok(())
    }

    /// The model over the batch's real tokens (padding removed): updates their slots and
    /// returns the f32 logits of `rows` (rows of the real-token batch).
    fn forward_real(&mut self, w: &WeightStore, b: &RealTokens, rows: &[i32]) -> Vec<f32> {
        let seqs = &b.seqs;
        for s in seqs {
            if s.first_pos == 0 {
                self.slots[s.slot].reset();
            }
        }
        let cfg = &self.cfg;
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let (th, prec) = (self.threads, self.prec);
        let t = b.tokens.len();
        let hw = &self.handles;

        // Embedding (a row of the BF16 table, exactly), copied into every residual stream.
        let embed = w.matrix(hw.embed);
        let mut x = vec![0.0f32; t * n * d];
        let mut row = vec![0.0f32; d];
        for (ti, &tok) in b.tokens.iter().enumerate() {
            embed.row_into(tok as usize, d, &mut row);
            (0..n).for_each(|s| x[(ti * n + s) * d..(ti * n + s + 1) * d].copy_from_slice(&row));
        }
        let site = |s: &crate::model::HcSite| HcParams {
            proj: w.f32(s.proj),
            base: w.f32(s.base),
            scale: w.f32(s.scale),
            fold: None,
        };
        // A block's input: hc_pre of the streams at its mHC site, then its RMSNorm (weight
        // `norm`), rounded to BF16 before and after the norm in official mode.
        let block_input = |x: &[f32], site: &HcParams, norm: usize| {
            let mut pre = mhc::hc_pre(
                th,
                x,
                n,
                d,
                site,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                cfg.rms_norm_eps,
            );
            prec.bf16(&mut pre.u);
            rms_norm(&mut pre.u, d, Some(w.f32(norm)), cfg.rms_norm_eps);
            prec.bf16(&mut pre.u);
            pre
        };
        // A block's output `out` merged back into the streams (hc_post), rounded in official mode.
        let block_output = |x: &mut [f32], out: &[f32], pre: &mhc::HcPre| {
            mhc::hc_post(x, out, pre, n, d);
            prec.bf16(x);
        };
        for (l, lw) in hw.layers.iter().enumerate() {
            let attn_site = HcParams {
                fold: (l == 0).then_some(self.hc0_fold.as_slice()),
                ..site(&lw.hc_attn)
            };
            let pre = block_input(&x, &attn_site, lw.attn_norm);
            let ctx = AttnCtx {
                cfg,
                w,
                lw,
                layer: l,
                freqs: &self.freqs[l],
                th,
                prec,
            };
            let a = attention::attention(&ctx, &pre.u, &b.positions, seqs, &mut self.slots);
            block_output(&mut x, &a, &pre);

            let pre = block_input(&x, &site(&lw.hc_ffn), lw.ffn_norm);
            let f = moe::moe(cfg, w, lw, th, prec, &pre.u, &b.tokens);
            block_output(&mut x, &f, &pre);
        }
        for s in seqs {
            self.slots[s.slot].len = s.first_pos + s.len;
        }

        // Head collapse, final norm, logits for the requested rows.
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
        ops::linear_weight(th, &y, d, w, hw.head)
    }
}

impl Backend for CpuBackend {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn is_device(&self) -> bool {
        false
    }

    /// The weights ARE the store here: values are written in place.
    fn write_weights(
        &mut self,
        _table: &WeightTable,
        values: &dyn WeightValues,
        progress: &Progress,
        _stream: StreamHandle,
    ) -> Result<()> {
        write_to_store(&mut self.store, values, progress);
        Ok(())
    }

    fn finalize(&mut self, _stream: StreamHandle) -> Result<()> {
        self.rebuild_fold()
    }

    fn rebuild_derived(&mut self, _stream: StreamHandle) -> Result<()> {
        self.rebuild_fold()
    }

    fn forward_host(&mut self, batch: &mut Batch) -> Result<()> {
        // The forward reads the store while it updates the slots: lend it out for the call
        // (moving the store moves no weight: its buffers stay where they are).
        let store = std::mem::replace(&mut self.store, WeightStore::empty());
        let r = self.forward(&store, batch);
        self.store = store;
        r
    }

    fn forward_device(&mut self, _batch: &DeviceBatch, _stream: StreamHandle) -> Result<()> {
        Err(Error::new(
            Status::InvalidArgument,
            "this engine runs on the CPU: the batch must hold host pointers",
        ))
    }

    fn release_slot(&mut self, slot: usize) -> Result<()> {
        self.slots[slot].reset();
        Ok(())
    }

    fn memory(&self) -> crate::memory::MemoryFigures {
        let state: u64 = self.slots.iter().map(|s| s.nbytes() as u64).sum();
        let derived = (self.hc0_fold.len() * 8) as u64;
        crate::memory::MemoryFigures {
            weights: self.weight_bytes,
            derived,
            state,
            state_per_slot: self.slots.first().map_or(0, |s| s.nbytes() as u64),
            workspace: 0,
            device: 0,
            host: self.weight_bytes + derived + state,
        }
    }

    fn slot_length(&self, slot: usize, _stream: StreamHandle) -> Result<usize> {
        Ok(self.slot_lengths()[slot])
    }

    /// The CPU backend reports a bad batch from forward itself.
    fn take_device_error(&mut self, _stream: StreamHandle) -> Result<Option<BatchFault>> {
        Ok(None)
    }

    fn weight_addr(&self, i: usize) -> WeightAddr {
        let data = &self.store.tensor(i).data;
        WeightAddr {
            data: data.as_ptr() as u64,
            scales: match data {
                TensorData::Quant(q) => q.scales.as_ptr() as u64,
                _ => 0,
            },
        }
    }

    fn host_store(&self) -> Option<&WeightStore> {
        Some(&self.store)
    }

    fn derived(&self) -> Vec<DerivedTensor> {
        self.derived_list()
    }

    /// Separate heap blocks: no single span per kind.
    fn spans(&self) -> BufferSpans {
        BufferSpans::default()
    }

    fn stage_device_bytes(
        &self,
        _addr: u64,
        _nbytes: usize,
        _stream: StreamHandle,
        what: &str,
    ) -> Result<Vec<u8>> {
        Err(Error::new(
            Status::Unsupported,
            format!("{what}: DSV4_MEMORY_DEVICE on the CPU backend (it reads host memory only)"),
        ))
    }
}

/// The real (non-padding) tokens of a batch, in batch order, as a batch of their own: every op
/// of the model is per token or per sequence, so their results equal the unpadded batch's.
struct RealTokens {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    /// The real sequences, token ranges in this batch.
    seqs: Vec<SeqRange>,
    /// For each row of the original batch, its row here (None: padding).
    row_of: Vec<Option<usize>>,
}

impl RealTokens {
    fn new(seqs: &[SeqRange], b: &Batch) -> RealTokens {
        let mut r = RealTokens {
            tokens: vec![],
            positions: vec![],
            seqs: vec![],
            row_of: vec![None; b.token_ids.len()],
        };
        for s in seqs.iter().filter(|s| !s.pad) {
            let start = r.tokens.len();
            for i in s.token_start..s.token_start + s.len {
                r.row_of[i] = Some(r.tokens.len());
                r.tokens.push(b.token_ids[i]);
                r.positions.push(b.positions[i]);
            }
            r.seqs.push(SeqRange {
                token_start: start,
                ..*s
            });
        }
        r
    }
}
