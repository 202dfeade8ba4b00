//! The fast set's own workspace (beside the reference set's, which it shares): the fast MoE's
//! buffers for `max_num_tokens`, declared in the engine's memory plan at create.

use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, RegionId};
use crate::cuda::kernels::fast_moe::{self, FastMoeWorkspace};
use crate::cuda::kernels::fast_moe_gemm;
use crate::cuda::kernels::moe::MoePlan;
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
        let r = |i: usize| arena.region(w.ids[i]);
        Workspace {
            moe: FastMoeWorkspace {
                logits: r(0),
                ids: r(1),
                weights: r(2),
                xq: r(3),
                xs: r(4),
                plan: MoePlan {
                    offsets: r(5),
                    rows: r(6),
                    tiles: r(7),
                    ntiles: r(8),
                    tokens: w.t,
                    k: w.k,
                    experts: w.experts,
                    tile_rows: fast_moe_gemm::TOKENS,
                },
                hq: r(9),
                hs: r(10),
                y: r(11),
            },
        }
    }
}
