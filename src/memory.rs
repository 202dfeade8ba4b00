//! The memory an engine uses, by kind: planned from the config and the create options alone
//! (dsv4_plan_memory: nothing is allocated) and reported after create (dsv4_get_info), with
//! the same figures. Hosts size `max_num_seqs` to a memory budget with it, the way serving
//! engines size their KV pool.
//!
//! - CPU backend: host memory. Weights are the weight store's values and f32 scales,
//!   derived is layer 0's folded mHC projection, state is every slot's decode state; the
//!   forward's scratch is allocated per call and not counted (workspace 0).
//! - CUDA backend: the create-time device arena, by the span each kind occupies in it
//!   (padding between buffers included), so `device` is the one allocation's size; `host`
//!   is the pinned staging that load and refit write through (held while they run: there
//!   is no host copy of the weights).

use crate::config::ModelConfig;
use crate::error::Result;
use crate::options::EngineOptions;
use crate::state::SlotState;
use crate::weights::table::WeightTable;

/// Bytes by kind (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryFigures {
    pub weights: u64,
    pub derived: u64,
    /// Decode state of all `max_num_seqs` slots ...
    pub state: u64,
    /// ... and of one slot at `max_seq_len` (CUDA: what one more slot adds to `state`).
    pub state_per_slot: u64,
    pub workspace: u64,
    /// Device memory the engine allocates (CUDA: the arena; CPU: 0).
    pub device: u64,
    /// Host memory the engine's buffers take.
    pub host: u64,
}

/// Layer 0's stream-folded hc_attn projection, f64 `[(2 + N) N, D]` (both backends).
pub fn hc0_fold_bytes(cfg: &ModelConfig) -> u64 {
    let n = cfg.hc_mult;
    ((2 + n) * n * cfg.hidden_size * 8) as u64
}

/// The figures an engine created with `cfg` and `opts` will have, allocating nothing.
pub fn plan(cfg: &ModelConfig, opts: &EngineOptions) -> Result<MemoryFigures> {
    let table = WeightTable::new(cfg, opts.weight_format)?;
    let weights = table.total_bytes();
    if opts.device >= 0 {
        return crate::cuda::backend::plan_memory(cfg, opts, &table.layouts());
    }
    let per_slot = SlotState::planned_bytes(cfg, opts.max_seq_len) as u64;
    let state = per_slot * opts.max_num_seqs as u64;
    let derived = hc0_fold_bytes(cfg);
    Ok(MemoryFigures {
        weights,
        derived,
        state,
        state_per_slot: per_slot,
        workspace: 0,
        device: 0,
        host: weights + derived + state,
    })
}
