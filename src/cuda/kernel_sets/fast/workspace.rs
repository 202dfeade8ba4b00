//! The fast set's own workspace (beside the reference set's, which it shares): the fast MoE's
//! buffers for `max_num_tokens`, declared in the engine's memory plan at create.

use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, RegionId};
use crate::cuda::kernels::fast_moe::{self, FastMoeWorkspace};
use crate::cuda::memory_plan::{BufferKind, MemoryPlan};
use crate::error::Result;
use crate::options::EngineOptions;

/// The fast set's workspace at its arena addresses.
#[derive(Clone, Copy, Debug)]
pub struct Workspace {
    pub moe: FastMoeWorkspace,
}

/// Arena ids of [`Workspace`]'s buffers ([`fast_moe::workspace_buffers`] order).
pub struct WorkspaceIds {
    ids: Vec<RegionId>,
    t: usize,
    k: usize,
    experts: usize,
}

impl Workspace {
    /// Declares every buffer for `cfg` and `opts`.
    pub fn reserve(
        plan: &mut MemoryPlan,
        cfg: &ModelConfig,
        opts: &EngineOptions,
    ) -> Result<WorkspaceIds> {
        let t = opts.max_num_tokens;
        let (k, e) = (cfg.experts_per_tok, cfg.n_routed_experts);
        let buffers = fast_moe::workspace_buffers(t, cfg.hidden_size, cfg.moe_inter, k, e);
        let mut ids = Vec::with_capacity(buffers.len());
        for (name, elem, n) in buffers {
            ids.push(plan.declare(
                BufferKind::Workspace,
                format!("workspace:fast_moe.{name}"),
                elem,
                &[n.max(1)],
            )?);
        }
        Ok(WorkspaceIds {
            ids,
            t,
            k,
            experts: e,
        })
    }

    pub fn resolve(w: &WorkspaceIds, arena: &Arena) -> Workspace {
        let ids: Vec<_> = w.ids.iter().map(|&id| arena.region(id)).collect();
        Workspace {
            moe: FastMoeWorkspace::at(&ids, w.t, w.k, w.experts),
        }
    }
}
