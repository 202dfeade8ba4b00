//! The per-slot decode state's layout, shared by both backends: the CPU backend allocates
//! one set of these buffers per slot (`SlotState`), the CUDA backend one device buffer per
//! layer and kind with the slot as the leading dimension. Shapes are per slot.

use crate::config::{AttnKind, ModelConfig};

/// One compressor's streaming state (main: d_c = head_dim, indexer: d_c = index_head_dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressorLayout {
    pub ratio: usize,
    /// Overlapping windows (CSA): each token carries an A and a B half.
    pub overlap: bool,
    /// Output width d_c.
    pub dc: usize,
}

impl CompressorLayout {
    /// Width of one token's `a` / `z` row: 2 d_c with overlap, else d_c.
    pub fn width(&self) -> usize {
        if self.overlap { 2 * self.dc } else { self.dc }
    }

    /// `pending_a` / `pending_z`: the current window's rows, [ratio, width].
    pub fn pending(&self) -> [usize; 2] {
        [self.ratio, self.width()]
    }

    /// `prev_a` / `prev_z`: the previous window's A halves, [ratio, d_c] (overlap only).
    pub fn prev(&self) -> [usize; 2] {
        [if self.overlap { self.ratio } else { 0 }, self.dc]
    }
}

/// One layer's state for one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Window ring [W, head_dim]: position p lives at row p mod W.
    pub window: [usize; 2],
    pub compressor: Option<CompressorLayout>,
    pub index_compressor: Option<CompressorLayout>,
    /// Compressed KV entries [max_seq_len / ratio, head_dim] (compressed layers).
    pub entries: Option<[usize; 2]>,
    /// Indexer keys [max_seq_len / ratio, index_head_dim] (CSA).
    pub index_keys: Option<[usize; 2]>,
}

impl LayerLayout {
    /// Entries per slot (max_seq_len / ratio; 0 on sliding layers).
    pub fn max_entries(&self) -> usize {
        self.entries.map_or(0, |e| e[0])
    }
}

/// Every layer's state layout for `max_seq_len` positions per slot.
pub fn layer_layouts(cfg: &ModelConfig, max_seq_len: usize) -> Vec<LayerLayout> {
    let hd = cfg.head_dim;
    cfg.layers
        .iter()
        .map(|spec| {
            // Sliding layers (ratio 0) keep no compressed entries.
            let maxe = max_seq_len.checked_div(spec.ratio).unwrap_or(0);
            let comp = |overlap: bool, dc: usize| CompressorLayout {
                ratio: spec.ratio,
                overlap,
                dc,
            };
            let window = [cfg.sliding_window, hd];
            match spec.attn {
                AttnKind::Sliding => LayerLayout {
                    window,
                    compressor: None,
                    index_compressor: None,
                    entries: None,
                    index_keys: None,
                },
                AttnKind::Hca => LayerLayout {
                    window,
                    compressor: Some(comp(false, hd)),
                    index_compressor: None,
                    entries: Some([maxe, hd]),
                    index_keys: None,
                },
                AttnKind::Csa => LayerLayout {
                    window,
                    compressor: Some(comp(true, hd)),
                    index_compressor: Some(comp(true, cfg.index_head_dim)),
                    entries: Some([maxe, hd]),
                    index_keys: Some([maxe, cfg.index_head_dim]),
                },
            }
        })
        .collect()
}
