//! Per-slot decode state of the CPU backend (MODEL.md §11.1), laid out as [`layout`]
//! says (the CUDA backend uses the same layout): the sliding-window ring, the compressors'
//! partial windows and overlap halves, compressed KV entries and indexer keys.
//!
//! Allocated once at create for `max_num_seqs x max_seq_len`; restarting a sequence
//! (position 0) only resets counters — stale rows are never read before being rewritten.

pub mod layout;

use crate::config::ModelConfig;
use crate::error::{Error, Result, Status};
use layout::CompressorLayout;

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
    fn new(l: CompressorLayout) -> Result<Self> {
        let [r, w] = l.pending();
        let [pr, pd] = l.prev();
        Ok(CompressorState {
            ratio: l.ratio,
            overlap: l.overlap,
            dc: l.dc,
            pending_a: zeros(r * w)?,
            pending_z: zeros(r * w)?,
            prev_a: zeros(pr * pd)?,
            prev_z: zeros(pr * pd)?,
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
        for l in layout::layer_layouts(cfg, max_seq_len) {
            let numel = |s: Option<[usize; 2]>| s.map_or(0, |[a, b]| a * b);
            layers.push(LayerState {
                window: zeros(l.window[0] * l.window[1])?,
                compressor: l.compressor.map(CompressorState::new).transpose()?,
                index_compressor: l.index_compressor.map(CompressorState::new).transpose()?,
                entries: zeros(numel(l.entries))?,
                index_keys: zeros(numel(l.index_keys))?,
            });
        }
        Ok(SlotState { len: 0, layers })
    }

    /// Bytes [`SlotState::new`] allocates for one slot, computed without allocating.
    pub fn planned_bytes(cfg: &ModelConfig, max_seq_len: usize) -> usize {
        let numel = |s: Option<[usize; 2]>| s.map_or(0, |[a, b]| a * b);
        let comp = |c: Option<CompressorLayout>| {
            c.map_or(0, |l| {
                let ([r, w], [pr, pd]) = (l.pending(), l.prev());
                2 * r * w + 2 * pr * pd
            })
        };
        let floats: usize = layout::layer_layouts(cfg, max_seq_len)
            .iter()
            .map(|l| {
                l.window[0] * l.window[1]
                    + comp(l.compressor)
                    + comp(l.index_compressor)
                    + numel(l.entries)
                    + numel(l.index_keys)
            })
            .sum();
        floats * 4
    }

    /// Bytes this slot's buffers hold.
    pub fn nbytes(&self) -> usize {
        let comp = |c: &Option<CompressorState>| {
            c.as_ref().map_or(0, |c| {
                c.pending_a.len() + c.pending_z.len() + c.prev_a.len() + c.prev_z.len()
            })
        };
        let floats: usize = self
            .layers
            .iter()
            .map(|l| {
                l.window.len()
                    + comp(&l.compressor)
                    + comp(&l.index_compressor)
                    + l.entries.len()
                    + l.index_keys.len()
            })
            .sum();
        floats * 4
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
            Status::OutOfMemory,
            format!("cannot allocate {n} floats of decode state"),
        )
    })?;
    v.resize(n, 0.0);
    Ok(v)
}
