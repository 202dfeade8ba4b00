//! Kernel sets (DESIGN.md §4): the operations one CUDA forward is made of, at the
//! granularity a fast set fuses at, and the sets that implement them.
//!
//! `cuda/forward.rs` is written once against [`KernelSet`]: it checks the batch on the
//! device (every set's input, kernels/SPEC.md), then runs embed -> (boundary, attention,
//! boundary, MoE) per layer -> slot commit -> head. Coarse ops (`attention`, `moe`,
//! `boundary`: the post of one sub-block with the pre + norm of the next) are where a fast set
//! fuses; the reference set runs today's f64 kernels, bit-identical to the CPU reference.
//!
//! A set declares, before anything is allocated, the NVRTC families it needs
//! ([`families`]) and its workspace ([`reserve_workspace`]); only the chosen set is compiled
//! and allocated. Adding an operation: its .cu kernel and declaration, a method here, and
//! its implementation in every set (see `reference/mod.rs`; `fast/mod.rs` runs the
//! reference set's kernels for the operations it has no fast kernel for yet).

pub mod fast;
pub mod reference;

use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, DevicePtr};
use crate::cuda::backend::DeviceModel;
use crate::cuda::context::{Context, DeviceInfo};
use crate::cuda::kernels::attention::{AttentionArgs, BatchMeta};
use crate::cuda::kernels::indexer::IndexerArgs;
use crate::cuda::kernels::linear::WeightDev;
use crate::cuda::memory_plan::MemoryPlan;
use crate::cuda::registry::{KernelSource, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::error::{Error, Result, Status};
use crate::options::{EngineOptions, KernelSetName};

/// A sub-block of a layer: what a residual boundary comes out of or leads into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    Attention(usize),
    Moe(usize),
}

/// Where the logits go: the caller's buffer, `rows x vocab` f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct LogitsTarget {
    pub ptr: DevicePtr,
    pub rows: usize,
    pub bf16: bool,
}

/// One forward as every set sees it: the engine's device model and the batch, already
/// checked and sanitized (`meta`, `tokens`, `rows` are the checked copies; kernels/SPEC.md).
pub struct Step<'a> {
    pub ctx: &'a Context,
    pub stream: BorrowedStream,
    pub cfg: &'a ModelConfig,
    pub opts: &'a EngineOptions,
    pub model: &'a DeviceModel,
    /// Sanitized positions, query_start, slots and seq_of; the token and sequence counts.
    pub meta: BatchMeta,
    /// Sanitized token ids `[T]`.
    pub tokens: DevicePtr,
    /// Sanitized logits rows `[num_logits]`.
    pub rows: DevicePtr,
}

/// The operations of one forward (see the module doc for their order).
pub trait KernelSet {
    /// The create-option name of the set.
    fn name(&self) -> &'static str;

    /// Rebuilds the derived tensors that only this set's kernels read and that a kernel builds
    /// from the weights on the device (finalize and every refit, after the weights and the
    /// backend's own derived tables are written). None by default.
    fn rebuild_derived(
        &self,
        _ctx: &Context,
        _cfg: &ModelConfig,
        _model: &DeviceModel,
        _stream: BorrowedStream,
    ) -> Result<()> {
        Ok(())
    }

    /// Token embeddings into every residual stream.
    fn embed(&self, s: &Step) -> Result<()>;

    /// A residual boundary: the post of the sub-block that ran (`done`; None before layer
    /// 0's attention), then the pre of `next` and its RMSNorm: `next`'s input. (A set may
    /// leave that norm to `next`'s sub-block, which then runs it first: the fast set does for
    /// its MoE at 8-1024 tokens, whose x codes it makes in the norm's own launch.)
    fn boundary(&self, s: &Step, done: Option<Branch>, next: Branch) -> Result<()>;

    /// The attention sub-block of layer `layer` (writes the window, compressor and indexer
    /// state of real sequences).
    fn attention(&self, s: &Step, layer: usize) -> Result<()>;

    /// The MoE sub-block of layer `layer`: routing, routed and shared experts, combine.
    fn moe(&self, s: &Step, layer: usize) -> Result<()>;

    /// Commits the slots' new lengths (after every layer ran).
    fn commit_slots(&self, s: &Step) -> Result<()>;

    /// The post of the last sub-block (`done`; None for a model without layers), the head
    /// collapse, the final norm and the LM head for the requested rows into `out` (the
    /// forward then fixes padding / bad rows).
    fn head(&self, s: &Step, done: Option<Branch>, out: &LogitsTarget) -> Result<()>;
}

/// One linear of a launch sequence: `y[t, gi*n + j] = x[t, gi*K + c] · W[gi*n + j, c]` summed over
/// `c < K = w.cols`, for tokens `t < t`, groups `gi < groups` and `j < n = w.rows / groups`
/// (docs/numerics.md `qlinear` with the activation quantisation when `quant_act` and W is
/// quantized, `blinear` otherwise), BF16-rounded when `round`.
#[derive(Clone, Copy, Debug)]
pub struct LinearCall {
    pub x: DevicePtr,
    pub ldx: usize,
    pub t: usize,
    pub w: WeightDev,
    pub groups: usize,
    pub quant_act: bool,
    pub round: bool,
    pub y: DevicePtr,
    pub ldy: usize,
    /// x's values already as BF16 (`[t, ldx]` 16-bit, the same columns), where the caller made
    /// them because the set asked ([`FastOps::reads_bf16_x`]); x holds the same values, so a
    /// set that does not read this copy runs the call from x.
    pub x_bf16: Option<DevicePtr>,
}

/// Most linears one [`LinearGroup`] holds: the seven of a CSA attention sub-block's input (wq_a,
/// wkv, both compressors' wkv / wgate, the indexer's weights_proj).
pub const LINEAR_GROUP_MAX: usize = 7;

/// Linears of the same input (`x`, `ldx`, `t`) that a fast set may run as one launch; a fixed
/// array, so building one allocates nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinearGroup {
    calls: [Option<LinearCall>; LINEAR_GROUP_MAX],
    len: usize,
}

impl LinearGroup {
    /// Appends `call`; an error past [`LINEAR_GROUP_MAX`].
    pub fn push(&mut self, call: LinearCall) -> Result<()> {
        let slot = self.calls.get_mut(self.len).ok_or_else(|| {
            Error::new(
                Status::Internal,
                format!("a linear group holds at most {LINEAR_GROUP_MAX} linears"),
            )
        })?;
        *slot = Some(call);
        self.len += 1;
        Ok(())
    }

    /// The linears in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = &LinearCall> {
        self.calls[..self.len].iter().flatten()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Operations a set runs with its own kernels inside the reference set's launch sequences (the
/// fast set's dense projections, indexer and attention core while the rest of its attention
/// sub-block is still the reference one).
pub trait FastOps {
    /// Runs `call` and returns true, or returns false having launched nothing: the reference
    /// kernels run it.
    fn try_linear(&self, ctx: &Context, call: &LinearCall, stream: BorrowedStream) -> Result<bool>;

    /// Whether this set, offered `call` with [`LinearCall::x_bf16`], would read that BF16 copy
    /// of x (so that the caller's kernel that writes x should make it).
    fn reads_bf16_x(&self, _call: &LinearCall) -> bool {
        false
    }

    /// Runs every linear of `group` (one input; outputs that overlap neither it nor each other)
    /// and returns true, or returns false having launched nothing: each then runs on its own
    /// ([`Self::try_linear`] first).
    fn try_linear_group(
        &self,
        _ctx: &Context,
        _group: &LinearGroup,
        _stream: BorrowedStream,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Runs `first`, then `second` on first's output (`second.x` is `first.y`, which has no
    /// other reader: the set may leave it unrounded where only second needs its rounding), and
    /// returns true, or returns false having launched nothing: each then runs on its own.
    fn try_linear_chain(
        &self,
        _ctx: &Context,
        _first: &LinearCall,
        _second: &LinearCall,
        _stream: BorrowedStream,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Runs the indexer's scoring and top-k (the reference `indexer_kernel`'s operation) and
    /// returns true, or returns false having launched nothing.
    fn try_select(
        &self,
        _ctx: &Context,
        _meta: &BatchMeta,
        _args: &IndexerArgs,
        _stream: BorrowedStream,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Where this set's attention core reads the queries as BF16: the buffer into which the
    /// caller's head_prep should write them ([`AttentionArgs::q_bf16`], then passed to
    /// [`Self::try_attention`]) in place of the f32 `args.q`. Some only where `try_attention`
    /// takes `args`' layer, since `args.q` is then never written.
    fn attention_q_bf16(&self, _args: &AttentionArgs) -> Option<DevicePtr> {
        None
    }

    /// Runs the attention core (the reference `attention_kernel`'s operation, its output
    /// before the inverse RoPE) and returns true, or returns false having launched nothing.
    fn try_attention(
        &self,
        _ctx: &Context,
        _meta: &BatchMeta,
        _args: &AttentionArgs,
        _stream: BorrowedStream,
    ) -> Result<bool> {
        Ok(false)
    }
}

/// The architecture the fast set's kernels need: its MoE GEMMs use `wgmma`, which only sm_90a
/// (Hopper: H100, H200) has.
pub const FAST_ARCH: &str = "sm_90a";

/// The set an engine on `device` runs. An explicit choice is kept, except `fast` on a device
/// without sm_90a, a CONFIG error naming the device. The default (none given) is
/// [`KernelSetName::default_for`] the numerics, with the reference set in place of the fast one
/// on such a device (said at INFO).
pub fn resolve(opts: &EngineOptions, device: &DeviceInfo) -> Result<KernelSetName> {
    let hopper = device.arch == FAST_ARCH;
    match opts.kernel_set {
        Some(KernelSetName::Fast) if !hopper => Err(Error::new(
            Status::Config,
            format!(
                "kernel_set = `fast` needs an {FAST_ARCH} GPU (Hopper: its MoE kernels use wgmma); device {} ({}) is {}: use kernel_set = `reference`",
                device.ordinal, device.name, device.arch
            ),
        )),
        Some(k) => Ok(k),
        None => {
            let k = KernelSetName::default_for(opts.numerics);
            if k == KernelSetName::Fast && !hopper {
                crate::log::info(&format!(
                    "device {} ({}) is {}, not {FAST_ARCH}: running the reference kernel set",
                    device.ordinal, device.name, device.arch
                ));
                return Ok(KernelSetName::Reference);
            }
            Ok(k)
        }
    }
}

/// The NVRTC families set `name` runs. Every set's list includes the `batch` family: the
/// forward's check and logits fix-up are every set's.
pub fn families(name: KernelSetName) -> &'static [&'static KernelSource] {
    match name {
        KernelSetName::Reference => reference::FAMILIES,
        KernelSetName::Fast => &fast::FAMILIES,
    }
}

/// A set's workspace, declared in the memory plan at create.
pub enum PlannedWorkspace {
    Reference(reference::WorkspaceIds),
    /// The fast set uses the reference set's workspace and its own.
    Fast(reference::WorkspaceIds, fast::WorkspaceIds),
}

/// A set's workspace at its arena addresses (kept by the backend from create on; one per
/// engine, so the variants' size difference costs nothing).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub enum SetWorkspace {
    Reference(reference::Workspace),
    Fast(reference::Workspace, fast::Workspace),
}

/// Declares set `name`'s workspace for `opts`' capacities.
pub fn reserve_workspace(
    name: KernelSetName,
    plan: &mut MemoryPlan,
    cfg: &ModelConfig,
    opts: &EngineOptions,
) -> Result<PlannedWorkspace> {
    match name {
        KernelSetName::Reference => Ok(PlannedWorkspace::Reference(reference::Workspace::reserve(
            plan, cfg, opts,
        )?)),
        KernelSetName::Fast => Ok(PlannedWorkspace::Fast(
            reference::Workspace::reserve(plan, cfg, opts)?,
            fast::Workspace::reserve(plan, cfg, opts)?,
        )),
    }
}

impl PlannedWorkspace {
    /// The workspace at its addresses in `arena`.
    pub fn resolve(&self, arena: &Arena) -> SetWorkspace {
        match self {
            PlannedWorkspace::Reference(ids) => {
                SetWorkspace::Reference(reference::Workspace::resolve(ids, arena))
            }
            PlannedWorkspace::Fast(r, f) => SetWorkspace::Fast(
                reference::Workspace::resolve(r, arena),
                fast::Workspace::resolve(f, arena),
            ),
        }
    }
}

/// Resolves the set's kernels from a loaded registry (finalize); the fast set also loads
/// cuBLASLt and plans its GEMMs for `cfg` and `opts`' token capacity.
pub fn load(
    ctx: &Context,
    reg: &Registry,
    ws: &SetWorkspace,
    cfg: &ModelConfig,
    opts: &EngineOptions,
) -> Result<Box<dyn KernelSet>> {
    match ws {
        SetWorkspace::Reference(w) => Ok(Box::new(reference::ReferenceSet::new(reg, *w)?)),
        SetWorkspace::Fast(r, f) => Ok(Box::new(fast::FastSet::new(
            ctx,
            reg,
            *r,
            *f,
            cfg,
            opts.max_num_tokens,
        )?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linear_group_holds_at_most_its_capacity() {
        // SAFETY: never dereferenced: the group only stores the records.
        let p = unsafe { DevicePtr::from_raw(1 << 32, 1 << 20) };
        let w = WeightDev {
            format: crate::weights::format::StorageFormat::Bf16,
            data: p,
            scales: None,
            block: [128, 128],
            rows: 16,
            cols: 128,
        };
        let call = |ldy| LinearCall {
            x: p,
            ldx: 128,
            t: 1,
            w,
            groups: 1,
            quant_act: false,
            round: false,
            y: p,
            ldy,
            x_bf16: None,
        };
        let mut g = LinearGroup::default();
        assert!(g.is_empty());
        for i in 0..LINEAR_GROUP_MAX {
            g.push(call(16 + i)).unwrap();
        }
        assert_eq!(g.len(), LINEAR_GROUP_MAX);
        let err = g.push(call(99)).unwrap_err();
        assert_eq!(err.status, Status::Internal);
        // In push order, the refused one not among them.
        let ldys: Vec<usize> = g.iter().map(|c| c.ldy).collect();
        assert_eq!(ldys, (16..16 + LINEAR_GROUP_MAX).collect::<Vec<_>>());
    }
    use crate::options::Numerics;

    fn device(arch: &str) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "test GPU".into(),
            compute_capability: (0, 0),
            arch: arch.into(),
            total_mem_bytes: 0,
            multiprocessors: 1,
            l2_cache_bytes: 0,
            max_shared_mem_per_block_optin: 0,
            driver_version: 0,
        }
    }

    fn opts(numerics: Numerics, kernel_set: Option<KernelSetName>) -> EngineOptions {
        EngineOptions {
            numerics,
            kernel_set,
            ..EngineOptions::default()
        }
    }

    #[test]
    fn the_fast_set_runs_only_where_wgmma_exists() {
        use KernelSetName::{Fast, Reference};
        let (hopper, ada) = (device("sm_90a"), device("sm_89"));
        // Defaults: fast on Hopper, the reference set elsewhere and for exact numerics.
        assert_eq!(
            resolve(&opts(Numerics::Official, None), &hopper).unwrap(),
            Fast
        );
        assert_eq!(
            resolve(&opts(Numerics::Official, None), &ada).unwrap(),
            Reference
        );
        assert_eq!(
            resolve(&opts(Numerics::Exact, None), &hopper).unwrap(),
            Reference
        );
        // Explicit choices are kept where they can run.
        assert_eq!(
            resolve(&opts(Numerics::Official, Some(Reference)), &hopper).unwrap(),
            Reference
        );
        assert_eq!(
            resolve(&opts(Numerics::Official, Some(Fast)), &hopper).unwrap(),
            Fast
        );
        assert_eq!(
            resolve(&opts(Numerics::Official, Some(Reference)), &ada).unwrap(),
            Reference
        );
        // Fast on a device without sm_90a is a CONFIG error naming the device and the way out.
        let e = resolve(&opts(Numerics::Official, Some(Fast)), &ada).unwrap_err();
        assert_eq!(e.status, Status::Config);
        let m = e.message;
        assert!(
            m.contains("sm_89") && m.contains("sm_90a") && m.contains("reference"),
            "{m}"
        );
    }
}
