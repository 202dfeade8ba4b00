//! Per-slot decode state (MODEL.md §11.1): the sliding-window ring, the compressors'
//! partial windows and overlap halves, compressed KV entries and indexer keys.
//!
//! Allocated once at create for `max_num_seqs x max_seq_len`; restarting a sequence
//! (position 0) only resets counters — stale rows are never read before being rewritten.

use crate::config::{AttnKind, ModelConfig};
use crate::error::{Error, Result, Status};

/// One compressor's streaming state (main: d_c = head_dim, indexer: d_c = index_head_dim).
pub struct CompressorState {
    pub ratio: usize,
    /// Overlapping windows (CSA, ratio 4): each token carries an A and a B half.
    pub overlap: bool,
    /// Output width d_c.
    pub dc: usize,
    /// `a_t` rows of the current window: [ratio, c * d_c], c = 2 if overlap.
    pub pending_a: Vec<f32>,
    /// Gate logits `z_t + ape[t mod r]` of the current window: [ratio, c * d_c].
    pub pending_z: Vec<f32>,
    /// A halves of the previous complete window (overlap only): [ratio, d_c].
    pub prev_a: Vec<f32>,
    pub prev_z: Vec<f32>,
    pub has_prev: bool,
}

impl CompressorState {
    fn new(ratio: usize, overlap: bool, dc: usize) -> Result<Self> {
        let c = if overlap { 2 } else { 1 };
        let prev = if overlap { ratio * dc } else { 0 };
        Ok(CompressorState {
            ratio,
            overlap,
            dc,
            pending_a: zeros(ratio * c * dc)?,
            pending_z: zeros(ratio * c * dc)?,
            prev_a: zeros(prev)?,
            prev_z: zeros(prev)?,
            has_prev: false,
        })
    }

    /// Width of one token's `a`/`z` row.
    pub fn width(&self) -> usize {
        if self.overlap { 2 * self.dc } else { self.dc }
    }
}

/// State of one layer for one slot.
pub struct LayerState {
    /// Window ring [W, head_dim]: position p lives at row p mod W.
    pub window: Vec<f32>,
    pub compressor: Option<CompressorState>,
    pub index_compressor: Option<CompressorState>,
    /// Compressed KV entries [max_seq_len / ratio, head_dim].
    pub entries: Vec<f32>,
    /// Indexer keys [max_seq_len / 4, index_head_dim] (CSA only).
    pub index_keys: Vec<f32>,
}

pub struct SlotState {
    /// Tokens held: the next position this slot continues at.
    pub len: usize,
    pub layers: Vec<LayerState>,
}

impl SlotState {
    pub fn new(cfg: &ModelConfig, max_seq_len: usize) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for spec in &cfg.layers {
            let hd = cfg.head_dim;
            let (compressor, index_compressor, entries, index_keys) = match spec.attn {
                AttnKind::Sliding => (None, None, Vec::new(), Vec::new()),
                AttnKind::Hca => (
                    Some(CompressorState::new(spec.ratio, false, hd)?),
                    None,
                    zeros(max_seq_len / spec.ratio * hd)?,
                    Vec::new(),
                ),
                AttnKind::Csa => (
                    Some(CompressorState::new(spec.ratio, true, hd)?),
                    Some(CompressorState::new(spec.ratio, true, cfg.index_head_dim)?),
                    zeros(max_seq_len / spec.ratio * hd)?,
                    zeros(max_seq_len / spec.ratio * cfg.index_head_dim)?,
                ),
            };
            layers.push(LayerState {
                window: zeros(cfg.sliding_window * hd)?,
                compressor,
                index_compressor,
                entries,
                index_keys,
            });
        }
        Ok(SlotState { len: 0, layers })
    }

    /// Starts a fresh sequence: counters only, buffers keep their addresses.
    pub fn reset(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            for c in [&mut l.compressor, &mut l.index_compressor]
                .into_iter()
                .flatten()
            {
                c.has_prev = false;
            }
        }
    }
}

fn zeros(n: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::new(
            Status::Capacity,
            format!("cannot allocate {n} floats of decode state"),
        )
    })?;
    v.resize(n, 0.0);
    Ok(v)
}
