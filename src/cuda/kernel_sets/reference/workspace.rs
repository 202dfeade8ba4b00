//! The reference set's activation workspace, declared once (element type and extent of each
//! buffer) and planned into the engine's memory plan at create.

use super::MOE_TILE_ROWS;
use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, DevicePtr, RegionId};
use crate::cuda::kernels::mhc;
use crate::cuda::kernels::moe::{self};
use crate::cuda::memory_plan::{BufferKind, Elem, MemoryPlan};
use crate::error::Result;
use crate::options::EngineOptions;

/// Declares the set's workspace ONCE: each field's element type and extent (a formula of
/// the sizes `$z`), from which [`Workspace::reserve`] plans it and [`Workspace::resolve`]
/// finds it in the arena. Names follow reference/mod.rs.
macro_rules! workspace {
    ($z:ident; $( $(#[$doc:meta])* $field:ident : $elem:ident [ $($dim:expr),+ ] ),* $(,)?) => {
        /// The reference set's activation workspace, for `max_num_tokens` tokens.
        #[derive(Clone, Copy, Debug)]
        pub struct Workspace { $( $(#[$doc])* pub $field: DevicePtr, )* }

        /// Arena ids of [`Workspace`]'s buffers.
        pub struct WorkspaceIds { $( $field: RegionId, )* }

        impl Workspace {
            /// Declares every buffer for `cfg` and `opts`.
            pub fn reserve(
                plan: &mut MemoryPlan,
                cfg: &ModelConfig,
                opts: &EngineOptions,
            ) -> Result<WorkspaceIds> {
                let $z = Sizes::new(cfg, opts);
                Ok(WorkspaceIds { $(
                    $field: plan.declare(
                        BufferKind::Workspace,
                        concat!("workspace:", stringify!($field)),
                        Elem::$elem,
                        &[$($dim),+],
                    )?,
                )* })
            }

            pub fn resolve(ids: &WorkspaceIds, arena: &Arena) -> Workspace {
                Workspace { $( $field: arena.region(ids.$field), )* }
            }
        }
    };
}

/// The sizes the workspace formulas use.
struct Sizes {
    /// max_num_tokens, and max_num_tokens x experts_per_tok (routed assignments).
    t: usize,
    tk: usize,
    n: usize,
    d: usize,
    h: usize,
    hd: usize,
    i: usize,
    e: usize,
    hi: usize,
    di: usize,
    ql: usize,
    /// o_groups x o_lora_rank.
    gr: usize,
    /// Widest activation act_quant quantizes.
    qk_max: usize,
    /// Most visible indexer entries of one token.
    max_entries: usize,
    topk: usize,
    max_tiles: usize,
    vocab: usize,
}

impl Sizes {
    fn new(cfg: &ModelConfig, opts: &EngineOptions) -> Sizes {
        let t = opts.max_num_tokens;
        let tk = t * cfg.experts_per_tok;
        let (h, hd) = (cfg.num_heads, cfg.head_dim);
        let qk_max = [
            cfg.hidden_size,
            cfg.q_lora_rank,
            cfg.o_groups * cfg.o_lora_rank,
            cfg.moe_inter,
            h * hd / cfg.o_groups,
        ]
        .into_iter()
        .max()
        .unwrap_or(1);
        let max_entries = crate::state::layout::layer_layouts(cfg, opts.max_seq_len)
            .iter()
            .filter(|l| l.index_keys.is_some())
            .map(|l| l.max_entries())
            .max()
            .unwrap_or(1)
            .max(1);
        Sizes {
            t,
            tk,
            n: cfg.hc_mult,
            d: cfg.hidden_size,
            h,
            hd,
            i: cfg.moe_inter,
            e: cfg.n_routed_experts,
            hi: cfg.index_n_heads,
            di: cfg.index_head_dim,
            ql: cfg.q_lora_rank,
            gr: cfg.o_groups * cfg.o_lora_rank,
            qk_max,
            max_entries,
            topk: cfg.index_topk.max(1),
            max_tiles: moe::max_tiles(tk, MOE_TILE_ROWS, cfg.n_routed_experts),
            vocab: cfg.vocab_size,
        }
    }
}

workspace! { z;
    /// Residual streams [T, N, D].
    x: F32[z.t, z.n, z.d],
    /// The sub-block input after pre + norm [T, D].
    u: F32[z.t, z.d],
    post: F32[z.t, z.n],
    comb: F32[z.t, z.n, z.n],
    /// Attention output [T, D].
    a: F32[z.t, z.d],
    /// FP8-simulated activations of act_quant.
    xq: F32[z.tk.max(z.t), z.qk_max],
    qr: F32[z.t, z.ql],
    q: F32[z.t, z.h, z.hd],
    kv: F32[z.t, z.hd],
    o: F32[z.t, z.h, z.hd],
    z: F32[z.t, z.gr],
    comp_a: F32[z.t, 2, z.hd],
    comp_z: F32[z.t, 2, z.hd],
    icomp_a: F32[z.t, 2, z.di],
    icomp_z: F32[z.t, 2, z.di],
    qi: F32[z.t, z.hi, z.di],
    iw: F32[z.t, z.hi],
    iscores: F32[z.t, z.max_entries],
    selected: I32[z.t, z.topk],
    nsel: I32[z.t],
    ids: I32[z.tk],
    rw: F32[z.tk],
    offsets: I32[z.e + 1],
    rows: I32[z.tk],
    tiles: I32[3, z.max_tiles],
    ntiles: I32[1],
    h: F32[z.tk, z.i],
    hq: F32[z.tk, z.i],
    ya: F32[z.tk, z.d],
    sg: F32[z.t, z.i],
    sv: F32[z.t, z.i],
    sh: F32[z.t, z.i],
    ys: F32[z.t, z.d],
    /// MoE output [T, D].
    f: F32[z.t, z.d],
    xr: F32[z.t, z.n, z.d],
    y: F32[z.t, z.d],
    logits_f32: F32[z.t, z.vocab],
    /// hc_pre / hc_head partial sums of a few tokens split over blocks.
    hc_partials: F64[mhc::PARTIALS],
}
