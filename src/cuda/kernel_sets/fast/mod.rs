//! The fast kernel set (DESIGN.md §4): `official` numerics on tensor cores, checked op by op
//! against the reference set. Today it replaces the MoE sub-block (kernels/fast_moe*.cu: FP4/FP8
//! experts decoded exactly to e4m3 on chip, FP8 wgmma promoted to f32 every 32 of K) and, inside
//! the reference attention sequence through [`FastOps`], the dense projections
//! (kernels/fast_dense.cu: FP8 and BF16 weights streamed once into f16/bf16 MMAs), the
//! indexer (kernels/fast_indexer.cu: scores on BF16 tensor cores, exact radix top-k) and the
//! attention core (kernels/fast_attention.cu: all heads of a token per block over the paged FP8
//! state, BF16 tensor cores, split over blocks for few tokens); every other operation still runs
//! the reference set's kernels until its fast kernel lands (issues 12, 13), on the same
//! workspace.
//!
//! A MoE layer whose shapes or stored formats the fast kernels do not cover
//! ([`FastMoeLayer::unsupported`]: BF16/F32 experts, FP8 blocks other than 128x128, widths not
//! a multiple of 128) runs the reference kernels.

mod workspace;

pub use workspace::{Workspace, WorkspaceIds, gemm_shapes};

use crate::config::ModelConfig;
use crate::cuda::blockscaled_gemm::BlockScaledGemm;
use crate::cuda::device_model::DeviceModel;
use crate::cuda::kernel_sets::reference::{self, ReferenceSet};
use crate::cuda::kernel_sets::{
    Branch, FastOps, KernelSet, LinearCall, LinearGroup, LogitsTarget, Step,
};
use crate::cuda::kernels::attention::{AttentionArgs, BatchMeta};
use crate::cuda::kernels::fast_attention::FastAttention;
use crate::cuda::kernels::fast_dense::{
    DenseOp, FUSED_ACT_MAX_T, FastDense, GROUP_MAX, GROUP_MAX_T,
};
use crate::cuda::kernels::fast_dense_gemm::{
    GEMM_MIN_TOKENS, GemmWorkspace, grouped_reads_bf16, run_gemm_chain, run_gemm_group,
    run_grouped_gemm, run_linear,
};
use crate::cuda::kernels::fast_indexer::FastIndexer;
use crate::cuda::kernels::fast_moe::{
    FastExperts, FastMoe, FastMoeLayer, FastShared, MoeNorm, Unsupported, norm_x_covers,
};
use crate::cuda::kernels::indexer::IndexerArgs;
use crate::cuda::kernels::moe::{RouterParams, Selection};
use crate::cuda::kernels::{FAST_FAMILIES, MODEL_FAMILIES};
use crate::cuda::registry::{KernelSource, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::Result;
use crate::error::Status;
use crate::log::{self, Level, log};
use crate::model::ModelWeights;
use crate::options::Numerics;
use crate::weights::format::StorageFormat;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The families this set runs: every model family (the reference set's, which it still uses
/// for all but the MoE) and its own.
pub static FAMILIES: LazyLock<Vec<&'static KernelSource>> = LazyLock::new(|| {
    MODEL_FAMILIES
        .iter()
        .chain(FAST_FAMILIES.iter())
        .copied()
        .collect()
});

/// The fast set: the reference set for the operations without a fast kernel yet, the fast MoE.
pub struct FastSet {
    reference: ReferenceSet,
    moe: FastMoe,
    attention: FastAttention,
    indexer: FastIndexer,
    dense: FastDense,
    /// cuBLASLt's GEMMs for projections of many tokens ([`run_linear`]); None when the
    /// engine's token capacity stays below that or cuBLASLt cannot be loaded (said at WARN):
    /// the gemv runs every projection then.
    gemm: Option<(BlockScaledGemm, GemmWorkspace)>,
    ws: Workspace,
    /// Whether the first forward has logged which MoE layers run the fast kernels.
    reported: AtomicBool,
}

impl FastSet {
    pub fn new(
        ctx: &Context,
        reg: &Registry,
        reference_ws: reference::Workspace,
        ws: Workspace,
        cfg: &ModelConfig,
        max_num_tokens: usize,
    ) -> Result<FastSet> {
        let gemm = match ws.gemm {
            None => None,
            Some((operand, lt_ws)) => {
                match BlockScaledGemm::new(ctx, &gemm_shapes(cfg), max_num_tokens, lt_ws) {
                    Ok(g) => {
                        log(
                            Level::Info,
                            &format!(
                                "fast set: projections of {GEMM_MIN_TOKENS} tokens or more (small FP8 ones from 128) run through cuBLASLt {}",
                                g.version()
                            ),
                        );
                        Some((g, operand))
                    }
                    Err(e) if e.status == Status::Unsupported => {
                        crate::log::warn(&format!(
                            "fast set: projections of many tokens run the gemv kernels, not cuBLASLt: {}",
                            e.message
                        ));
                        None
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        Ok(FastSet {
            reference: ReferenceSet::new(reg, reference_ws)?,
            moe: FastMoe::new(reg)?,
            attention: FastAttention::new(reg)?,
            indexer: FastIndexer::new(reg)?,
            dense: FastDense::new(reg)?,
            gemm,
            ws,
            reported: AtomicBool::new(false),
        })
    }

    /// Runs `op` through cuBLASLt where that pays and cuBLASLt takes it ([`run_linear`]), else
    /// through the gemv; returns true.
    fn linear_op(&self, ctx: &Context, op: &DenseOp, stream: BorrowedStream) -> Result<bool> {
        let lt = self.gemm.as_ref().map(|(gemm, operand)| (gemm, operand));
        // (Our FP8 GEMM, fast_fp8_gemm, is not offered: cuBLASLt measured as fast or faster on
        // every Flash projection, BENCHMARKS.md 2026-12-05.)
        run_linear(&self.dense, lt, None, ctx, op, &self.ws.dense, stream)?;
        Ok(true)
    }
}

/// Why a MoE layer runs the reference kernels: a value (moe runs every forward and must not
/// allocate), formatted only for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    NoExperts,
    /// The engine's plan holds no tensor maps or gate planes (only a fast-set engine declares
    /// them).
    NoTensorMaps,
    MixedRouted([StorageFormat; 3]),
    MixedShared,
    Kernels(Unsupported),
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fallback::NoExperts => write!(f, "no routed experts"),
            Fallback::NoTensorMaps => {
                write!(f, "no expert tensor maps or gate planes in this engine")
            }
            Fallback::MixedRouted([a, b, c]) => {
                write!(f, "routed projections stored {a:?}/{b:?}/{c:?}")
            }
            Fallback::MixedShared => {
                write!(f, "shared expert projections stored in different formats")
            }
            Fallback::Kernels(why) => write!(f, "{why}"),
        }
    }
}

/// Layer `l`'s MoE as the fast kernels read it in forward `s`, or why they cannot run it.
pub fn moe_layer(s: &Step, l: usize) -> std::result::Result<FastMoeLayer, Fallback> {
    moe_layer_of(s.cfg, s.model, s.tokens, l)
}

/// Layer `l`'s MoE in `model`, hash layers reading token ids at `tokens`.
fn moe_layer_of(
    cfg: &ModelConfig,
    model: &DeviceModel,
    tokens: DevicePtr,
    l: usize,
) -> std::result::Result<FastMoeLayer, Fallback> {
    let handles: &ModelWeights = &model.handles;
    let lw = &handles.layers[l];
    let weights = &model.weights;
    let proto = |w: usize| weights[w];
    let first = lw.experts.first().ok_or(Fallback::NoExperts)?;
    let (w1, w2, w3) = (proto(first.w1), proto(first.w2), proto(first.w3));
    let shared = lw.shared.as_ref().map(|sw| FastShared {
        w1: proto(sw.w1),
        w3: proto(sw.w3),
        w2: proto(sw.w2),
    });
    if w1.format != w2.format || w1.format != w3.format {
        return Err(Fallback::MixedRouted([w1.format, w2.format, w3.format]));
    }
    if let Some(sh) = shared
        && (sh.w1.format != sh.w2.format || sh.w1.format != sh.w3.format)
    {
        return Err(Fallback::MixedShared);
    }
    if let Some(why) = FastMoeLayer::unsupported(
        cfg.hidden_size,
        cfg.moe_inter,
        cfg.experts_per_tok,
        cfg.n_routed_experts,
        (w1.format, w1.block),
        shared.map(|sh| (sh.w1.format, sh.w1.block)),
    ) {
        return Err(Fallback::Kernels(why));
    }
    let tables = model.experts[l];
    let selection = match (lw.tid2eid, lw.gate_bias) {
        (Some(tab), _) => Selection::Hash {
            tid2eid: weights[tab].data,
            tokens,
            vocab: cfg.vocab_size,
        },
        (None, bias) => Selection::TopK {
            bias: bias.map(|b| weights[b].data),
        },
    };
    let maps = tables.maps.ok_or(Fallback::NoTensorMaps)?;
    let gate_planes = tables.gate_planes.ok_or(Fallback::NoTensorMaps)?;
    let experts = |scales, w: crate::cuda::kernels::linear::WeightDev| FastExperts {
        format: w.format,
        scales,
    };
    Ok(FastMoeLayer {
        d: cfg.hidden_size,
        i: cfg.moe_inter,
        k: cfg.experts_per_tok,
        experts: cfg.n_routed_experts,
        local: 0..cfg.n_routed_experts,
        gate: weights[lw.gate].data,
        gate_planes,
        selection,
        router: RouterParams::from_config(cfg),
        w1: experts(tables.s1, w1),
        w3: experts(tables.s3, w3),
        w2: experts(tables.s2, w2),
        shared,
        maps,
        scales8: tables.scales8,
        limit: cfg.swiglu_limit,
    })
}

impl KernelSet for FastSet {
    fn name(&self) -> &'static str {
        "fast"
    }

    fn rebuild_derived(
        &self,
        ctx: &Context,
        cfg: &ModelConfig,
        model: &DeviceModel,
        stream: BorrowedStream,
    ) -> Result<()> {
        // Not derived from the weights, but written at the same times: after the workspace's
        // addresses are final, and again (the same bytes) at each refit.
        self.ws
            .moe
            .write_act_maps(ctx, cfg.hidden_size, cfg.moe_inter, stream)?;
        // The token ids are read by routing only, never by the derived tensors.
        let no_tokens = model.slot_len;
        for l in 0..model.experts.len() {
            if let Ok(fl) = moe_layer_of(cfg, model, no_tokens, l) {
                self.moe.derive(ctx, &fl, stream)?;
            }
        }
        Ok(())
    }

    fn embed(&self, s: &Step) -> Result<()> {
        self.reference.embed(s)
    }

    fn boundary(&self, s: &Step, done: Option<Branch>, next: Branch) -> Result<()> {
        let sub_block_norms = match next {
            Branch::Attention(_) => false,
            Branch::Moe(l) => norms_moe_input(s, l),
        };
        self.reference
            .boundary_with(s, done, next, !sub_block_norms)
    }

    fn attention(&self, s: &Step, layer: usize) -> Result<()> {
        // The fast set runs official numerics only (create refuses it with exact ones), where
        // every activation the dense kernels take holds BF16 values (docs/numerics.md).
        self.reference.attention_with(s, layer, self)
    }

    fn moe(&self, s: &Step, layer: usize) -> Result<()> {
        // Once per set, and only formatted when an Info sink listens (forward must not allocate).
        if log::enabled(Level::Info) && !self.reported.swap(true, Ordering::Relaxed) {
            for l in 0..s.cfg.num_layers {
                match moe_layer(s, l) {
                    Ok(_) => log(
                        Level::Info,
                        &format!("fast set: layer {l} MoE runs the fast kernels"),
                    ),
                    Err(why) => log(
                        Level::Info,
                        &format!("fast set: layer {l} MoE runs the reference kernels ({why})"),
                    ),
                }
            }
        }
        let fl = match moe_layer(s, layer) {
            Ok(fl) => fl,
            Err(_) => return self.reference.moe(s, layer),
        };
        let rws = self.reference.workspace();
        // The input's norm with x's quantisation where the boundary left it (norms_moe_input: the
        // fast MoE takes this layer, as `fl` says).
        let norm = moe_input_norm_fits(s).then(|| MoeNorm {
            weight: Some(s.model.weights[s.model.handles.layers[layer].ffn_norm].data),
            eps: s.cfg.rms_norm_eps,
            round_out: s.opts.numerics == Numerics::Official,
        });
        self.moe.layer(
            s.ctx,
            &fl,
            rws.u,
            s.meta.num_tokens,
            norm.as_ref(),
            &self.ws.moe,
            rws.f,
            s.stream,
        )
    }

    fn commit_slots(&self, s: &Step) -> Result<()> {
        self.reference.commit_slots(s)
    }

    fn head(&self, s: &Step, done: Option<Branch>, out: &LogitsTarget) -> Result<()> {
        self.reference.head_with(s, done, out, Some(self))
    }
}

/// Whether the MoE sub-block of layer `l` in forward `s` runs its input's RMSNorm itself (the
/// boundary before it leaves it: [`ReferenceSet::boundary_with`]), with x's FP8 quantisation in
/// the same launch ([`FastMoe::norm_x`]): where the fast MoE takes the layer ([`moe_layer`]), the
/// norm's block ([`norm_x_covers`]) and the tokens ([`norm_x_tokens`]). A pure function of the
/// step and the layer, asked by both the boundary and the sub-block, so the two always agree on
/// who runs the norm.
fn norms_moe_input(s: &Step, l: usize) -> bool {
    moe_input_norm_fits(s) && moe_layer(s, l).is_ok()
}

/// [`norms_moe_input`]'s part that does not depend on the layer: the tokens and the norm's block.
fn moe_input_norm_fits(s: &Step) -> bool {
    let t = s.meta.num_tokens;
    norm_x_tokens(t) && norm_x_covers(t, s.cfg.hidden_size)
}

/// Whether, at `t` tokens, the MoE input's norm makes x's codes ([`norms_moe_input`]): at 8-1024
/// tokens. Measured (`dsv4 bench moe`, `moe_norm_route` lines: the norm and the routing, µs, H100),
/// the norm making them / the router making them: B = 1 12.67 / 10.90, 8 13.87 / 15.20, 64 27.84
/// / 28.19, 4096 175.01 / 161.26 (BENCHMARKS.md 2026-12-05, thirty-third part); with the
/// tensor-core router, whose selection otherwise quantises x a warp a token, 320 59.64 / 66.24, 512
/// 62.09 / 69.10, 768 68.31 / 72.84, 1024 75.33 / 78.65 (forty-first session); split, 160 30.5 /
/// 39.3, 256 30.3 / 39.3 (forty-second session). A sweep of the few-token router (forty-second
/// session, two rounds agreeing to 0.4 µs): 4 10.4 / 9.7, 8 12.3 / 13.1, 12 12.8 / 11.6, 16 13.4 /
/// 14.1, 24 14.4 / 15.7, 32 19.5 / 17.2, 40 20.4 / 20.6, 48 21.5 / 22.8, 56 26.4 / 24.4, 64 21.9 /
/// 22.5, 96 31.9 / 32.6, 128 33.9 / 34.9: faster but at 12, 32 and 56 tokens (1-2 µs of a 320-880
/// µs layer; why those counts is not understood yet). At one token the added work lengthens the
/// norm's one block where the router's four quantising blocks had overlapped the others' gate
/// rows; at 4096 rows the rows block's longer chain costs more than the selection's read of x.
/// With the rows kernel copying each next row ahead and the banked tensor-core router (fifty-seventh
/// session): 1024 58.7 / 57.7, 4096 150.0 / 139.1, 16384 582.1 / 531.8 (before 59.8 / 60.2, 157.8
/// / 141.5, 643.2 / 547.0): at 1024 the router making the codes is now 1 µs ahead; the range is
/// not re-swept.
fn norm_x_tokens(t: usize) -> bool {
    (8..=1024).contains(&t)
}

/// `call` as the dense kernels run it (operands made in the gemv blocks up to `fused_act_max_t`
/// tokens), or None when they do not cover its weight ([`FastDense::mode_for`]) or its
/// activations are not 16-byte aligned rows.
fn dense_op(call: &LinearCall, fused_act_max_t: usize) -> Option<DenseOp> {
    let mode = FastDense::mode_for(&call.w, call.groups, call.quant_act)?;
    if !call.ldx.is_multiple_of(4) || !call.x.addr().is_multiple_of(16) {
        return None;
    }
    Some(DenseOp {
        x: call.x,
        ldx: call.ldx,
        t: call.t,
        w: call.w,
        groups: call.groups,
        mode,
        round: call.round,
        y: call.y,
        ldy: call.ldy,
        fused_act_max_t,
        warp_split_max_t: crate::cuda::kernels::fast_dense::WARP_SPLIT_MAX_T,
    })
}

impl FastOps for FastSet {
    /// The dense kernels run every linear whose weight format and shape they cover
    /// ([`FastDense::mode_for`]) and whose activations are 16-byte aligned rows.
    fn try_linear(&self, ctx: &Context, call: &LinearCall, stream: BorrowedStream) -> Result<bool> {
        let Some(op) = dense_op(call, FUSED_ACT_MAX_T) else {
            return Ok(false);
        };
        if let (Some(x_bf16), Some((gemm, operand))) = (call.x_bf16, &self.gemm)
            && grouped_reads_bf16(gemm, operand, &op)
            && run_grouped_gemm(
                &self.dense,
                gemm,
                ctx,
                &op,
                Some(x_bf16),
                operand,
                &self.ws.dense,
                stream,
            )?
        {
            return Ok(true);
        }
        self.linear_op(ctx, &op, stream)
    }

    /// A grouped projection (wo_a) the GEMM path takes at its tokens
    /// ([`grouped_reads_bf16`]): its groups' GEMMs read the BF16 copy in place of their
    /// operand passes.
    fn reads_bf16_x(&self, call: &LinearCall) -> bool {
        dense_op(call, FUSED_ACT_MAX_T).is_some_and(|op| {
            self.gemm
                .as_ref()
                .is_some_and(|(gemm, operand)| grouped_reads_bf16(gemm, operand, &op))
        })
    }

    /// From cuBLASLt's crossover ([`GEMM_MIN_TOKENS`]) a group whose every linear the dense
    /// kernels cover runs its GEMMs with one operand per input, K and mode
    /// ([`run_gemm_group`]), and the gemv the members below their crossover. Up to
    /// [`GROUP_MAX_T`] tokens, one grouped gemv launch runs a group whose every linear the gemv
    /// covers ([`FastDense::group_covers`]) where it beats one call each
    /// ([`FastDense::group_pays`]). Otherwise each linear runs on its own.
    fn try_linear_group(
        &self,
        ctx: &Context,
        group: &LinearGroup,
        stream: BorrowedStream,
    ) -> Result<bool> {
        let Some(first) = group.iter().next() else {
            return Ok(false);
        };
        let many = first.t >= GEMM_MIN_TOKENS;
        if (!many && first.t > GROUP_MAX_T) || group.len() > GROUP_MAX {
            return Ok(false);
        }
        let fused_act_max_t = if many { FUSED_ACT_MAX_T } else { GROUP_MAX_T };
        let Some(first_op) = dense_op(first, fused_act_max_t) else {
            return Ok(false);
        };
        let mut ops = [first_op; GROUP_MAX];
        for (slot, call) in ops.iter_mut().zip(group.iter()).skip(1) {
            let Some(op) = dense_op(call, fused_act_max_t) else {
                return Ok(false);
            };
            *slot = op;
        }
        let members = &ops[..group.len()];
        if many {
            let Some((gemm, operand)) = &self.gemm else {
                return Ok(false);
            };
            let ran = run_gemm_group(
                &self.dense,
                gemm,
                None,
                ctx,
                members,
                operand,
                &self.ws.dense,
                stream,
            )?;
            for (op, _) in members.iter().zip(ran).filter(|(_, ran)| !ran) {
                self.linear_op(ctx, op, stream)?;
            }
            return Ok(true);
        }
        if !FastDense::group_covers(members) || !FastDense::group_pays(members) {
            return Ok(false);
        }
        self.dense.run_group(ctx, members, &self.ws.dense, stream)?;
        Ok(true)
    }

    /// The output projection of many tokens (wo_a then wo_b): wo_b's act_quant made by the
    /// pass that finishes wo_a, from its unrounded sums, where the GEMM path takes both
    /// ([`run_gemm_chain`]; the bits of the two calls).
    fn try_linear_chain(
        &self,
        ctx: &Context,
        first: &LinearCall,
        second: &LinearCall,
        stream: BorrowedStream,
    ) -> Result<bool> {
        let (Some((gemm, operand)), Some(a), Some(b)) = (
            &self.gemm,
            dense_op(first, FUSED_ACT_MAX_T),
            dense_op(second, FUSED_ACT_MAX_T),
        ) else {
            return Ok(false);
        };
        run_gemm_chain(
            &self.dense,
            gemm,
            None,
            ctx,
            &a,
            first.x_bf16,
            &b,
            operand,
            &self.ws.dense,
            stream,
        )
    }

    /// The fast indexer runs every CSA layer whose heads, dims, top-k and stored format it
    /// covers ([`FastIndexer::covers`]).
    fn try_select(
        &self,
        ctx: &Context,
        meta: &BatchMeta,
        args: &IndexerArgs,
        stream: BorrowedStream,
    ) -> Result<bool> {
        if !FastIndexer::covers(args) {
            return Ok(false);
        }
        self.indexer.select(ctx, meta, args, stream)?;
        Ok(true)
    }

    /// The fast attention reads the queries as BF16 wherever it takes the layer: head_prep
    /// writes them into the workspace's copy (half the f32 bytes for every split block to read,
    /// and copied into shared memory as they are).
    fn attention_q_bf16(&self, args: &AttentionArgs) -> Option<DevicePtr> {
        FastAttention::covers(args).then_some(self.ws.attention.q_bf16)
    }

    /// The fast attention runs every layer whose heads, dims and stored format it covers
    /// ([`FastAttention::covers`]).
    fn try_attention(
        &self,
        ctx: &Context,
        meta: &BatchMeta,
        args: &AttentionArgs,
        stream: BorrowedStream,
    ) -> Result<bool> {
        if !FastAttention::covers(args) {
            return Ok(false);
        }
        self.attention
            .attention(ctx, meta, args, &self.ws.attention, stream)?;
        Ok(true)
    }
}
