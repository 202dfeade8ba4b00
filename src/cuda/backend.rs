//! The CUDA backend: the engine's device model — weights in their stored format, derived
//! tables, per-slot decode state — and the chosen kernel set's workspace, declared in one
//! memory plan (memory_plan.rs) and carved from ONE arena at create. Nothing is allocated
//! later; finalize uploads weights, builds derived tables in place and loads the kernel set;
//! forward (forward.rs) only launches kernels on the host's stream.

use crate::backend::{
    Backend, Batch, BufferSpans, DerivedTensor, DeviceBatch, StreamHandle, WeightAddr,
};
use crate::config::ModelConfig;
use crate::cuda::arena::{Arena, DevicePtr, RegionId, copy_to_device_sync, memset_async};
use crate::cuda::context::Context;
use crate::cuda::kernel_sets::{self, KernelSet, SetWorkspace};
use crate::cuda::kernels::batch::{BatchKernels, CheckedBatch};
use crate::cuda::memory_plan::{BufferKind, Buffers, Elem, MemoryPlan};
use crate::cuda::registry::{KernelCache, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::error::{Error, Result, Status};
use crate::model::ModelWeights;
use crate::model::batch::{BatchFault, FAULT_RECORD_INTS};
use crate::model::hc_fold::{HC0_FOLD_NAME, fold_projection};
use crate::model::rope;
use crate::options::EngineOptions;
use crate::state::layout::{CompressorLayout, layer_layouts};
use crate::weights::qmatrix::{FP4_BLOCK, QFormat};
use crate::weights::store::{TensorData, WeightStore};

pub use crate::cuda::kernels::linear::{StorageFormat, WeightDev};

/// Arena name of the device error record (dsv4_get_info reports its address).
pub const DEVICE_ERROR_NAME: &str = "state:device_error";

/// Which part of the model this engine holds: every layer and expert today. The multi-GPU
/// work gives an engine a slice (its layers, its experts); the plan then declares only those.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub layers: std::ops::Range<usize>,
    pub experts: std::ops::Range<usize>,
}

impl Placement {
    pub fn all(cfg: &ModelConfig) -> Placement {
        Placement {
            layers: 0..cfg.num_layers,
            experts: 0..cfg.n_routed_experts,
        }
    }
}

/// Per-layer device tables of expert weight addresses (derived: rebuilt at finalize).
#[derive(Clone, Copy, Debug)]
pub struct ExpertTables {
    /// `u64[E]` each: code pointers of w1, w2, w3 and their scale pointers.
    pub w1: DevicePtr,
    pub w2: DevicePtr,
    pub w3: DevicePtr,
    pub s1: DevicePtr,
    pub s2: DevicePtr,
    pub s3: DevicePtr,
}

/// One compressor's per-slot streaming state.
#[derive(Clone, Copy, Debug)]
pub struct CompressorDev {
    pub ratio: usize,
    pub overlap: bool,
    pub dc: usize,
    pub pend_a: DevicePtr,
    pub pend_z: DevicePtr,
    pub prev_a: DevicePtr,
    pub prev_z: DevicePtr,
    pub has_prev: DevicePtr,
}

/// One layer's per-slot state.
#[derive(Clone, Copy, Debug)]
pub struct LayerStateDev {
    pub ring: DevicePtr,
    pub compressor: Option<CompressorDev>,
    pub index_compressor: Option<CompressorDev>,
    /// Compressed entries [slots, maxe, hd] and indexer keys [slots, maxe, di].
    pub entries: Option<DevicePtr>,
    pub index_keys: Option<DevicePtr>,
    /// Entries per slot (max_seq_len / ratio).
    pub maxe: usize,
    pub inv_freq: DevicePtr,
}

/// The engine's device model, which every kernel set reads: weights, derived tables and
/// the per-slot state, at fixed addresses.
pub struct DeviceModel {
    pub handles: ModelWeights,
    /// Device copy of every weight, indexed like the host store.
    pub weights: Vec<WeightDev>,
    pub experts: Vec<ExpertTables>,
    pub layers: Vec<LayerStateDev>,
    /// `int[num_slots]`: tokens each slot holds.
    pub slot_len: DevicePtr,
    /// Derived f64 [(2+N)*N, D]: layer 0's stream-folded hc_attn projection.
    pub hc0_fold: DevicePtr,
}

pub struct CudaBackend {
    ctx: Context,
    cfg: ModelConfig,
    opts: EngineOptions,
    buffers: Buffers,
    model: DeviceModel,
    /// The batch check's sanitized copies and the device error record.
    batch: CheckedBatch,
    set_ws: SetWorkspace,
    /// Kept so the kernels' modules stay loaded.
    registry: Option<Registry>,
    /// The batch check every forward starts with (every set compiles its family).
    checker: Option<BatchKernels>,
    set: Option<Box<dyn KernelSet>>,
}

/// Format, byte count, scale count and scale block of a weight's device copy (the host
/// store's layout).
fn weight_layout(data: &TensorData) -> (StorageFormat, usize, Option<usize>, [usize; 2]) {
    match data {
        TensorData::F32(v) => (StorageFormat::F32, v.len() * 4, None, [0, 0]),
        // Index tables are raw int32 words; only their address is used.
        TensorData::I32(v) => (StorageFormat::F32, v.len() * 4, None, [0, 0]),
        TensorData::Bf16(v) => (StorageFormat::Bf16, v.len() * 2, None, [0, 0]),
        TensorData::Quant(q) => match q.format {
            QFormat::Fp8 { block } => (
                StorageFormat::Fp8,
                q.codes.len(),
                Some(q.scales.len()),
                block,
            ),
            QFormat::Fp4 => (
                StorageFormat::Fp4,
                q.codes.len(),
                Some(q.scales.len()),
                [1, FP4_BLOCK],
            ),
        },
    }
}

/// Region ids of one compressor's state.
type CompressorIds = [RegionId; 5];

impl CudaBackend {
    /// Plans and allocates every device buffer for `cfg` and `opts` (create time).
    pub fn new(
        cfg: &ModelConfig,
        opts: &EngineOptions,
        store: &WeightStore,
    ) -> Result<CudaBackend> {
        let placement = Placement::all(cfg);
        let ctx = Context::retain(opts.device)?;
        let _g = ctx.enter()?;
        let mut plan = MemoryPlan::new();
        let slots = opts.max_num_seqs;
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);

        // Weights, in their stored format.
        let mut wids = Vec::with_capacity(store.len());
        for tns in store.tensors() {
            let (fmt, bytes, scales, block) = weight_layout(&tns.data);
            let name = &tns.spec.name;
            let r = plan.declare(
                BufferKind::Weights,
                format!("weight:{name}"),
                Elem::U8,
                &[bytes],
            )?;
            let s = scales
                .map(|k| {
                    plan.declare(
                        BufferKind::Weights,
                        format!("scale:{name}"),
                        Elem::F32,
                        &[k],
                    )
                })
                .transpose()?;
            let cols = *tns.spec.shape.last().unwrap_or(&1);
            let rows = tns.spec.numel() / cols.max(1);
            wids.push((r, s, fmt, block, rows, cols));
        }

        // Derived tensors (rebuilt by finalize / refit from the weights).
        let mut eids = vec![];
        for l in placement.layers.clone() {
            let mut ids = [RegionId(0); 6];
            for (j, nm) in ["w1", "w2", "w3", "s1", "s2", "s3"].iter().enumerate() {
                ids[j] = plan.declare(
                    BufferKind::Derived,
                    format!("derived:layers.{l}.experts.{nm}_ptrs"),
                    Elem::U64,
                    &[placement.experts.len()],
                )?;
            }
            eids.push(ids);
        }
        let inv_ids = placement
            .layers
            .clone()
            .map(|l| {
                plan.declare(
                    BufferKind::Derived,
                    format!("derived:layers.{l}.inv_freq"),
                    Elem::F32,
                    &[cfg.rope_dim / 2],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let hc0_fold = plan.declare(
            BufferKind::Derived,
            HC0_FOLD_NAME,
            Elem::F64,
            &[(2 + n) * n, d],
        )?;

        // Per-slot state: the shared layout (state/layout.rs) with the slot leading.
        let layouts = layer_layouts(cfg, opts.max_seq_len);
        let mut lids = vec![];
        for l in placement.layers.clone() {
            let lay = layouts[l];
            let st = |plan: &mut MemoryPlan, what: &str, elem: Elem, shape: &[usize]| {
                let mut s = vec![slots];
                s.extend_from_slice(shape);
                plan.declare(
                    BufferKind::State,
                    format!("state:layers.{l}.{what}"),
                    elem,
                    &s,
                )
            };
            let comp =
                |plan: &mut MemoryPlan, name: &str, c: CompressorLayout| -> Result<CompressorIds> {
                    Ok([
                        st(plan, &format!("{name}.pend_a"), Elem::F32, &c.pending())?,
                        st(plan, &format!("{name}.pend_z"), Elem::F32, &c.pending())?,
                        st(plan, &format!("{name}.prev_a"), Elem::F32, &c.prev())?,
                        st(plan, &format!("{name}.prev_z"), Elem::F32, &c.prev())?,
                        st(plan, &format!("{name}.has_prev"), Elem::I32, &[])?,
                    ])
                };
            let ring = st(&mut plan, "ring", Elem::F32, &lay.window)?;
            let c = lay
                .compressor
                .map(|c| comp(&mut plan, "compressor", c))
                .transpose()?;
            let ic = lay
                .index_compressor
                .map(|c| comp(&mut plan, "index_compressor", c))
                .transpose()?;
            let ent = lay
                .entries
                .map(|s| st(&mut plan, "entries", Elem::F32, &s))
                .transpose()?;
            let ik = lay
                .index_keys
                .map(|s| st(&mut plan, "index_keys", Elem::F32, &s))
                .transpose()?;
            lids.push((ring, c, ic, ent, ik));
        }
        let slot_len = plan.declare(BufferKind::State, "state:slot_len", Elem::I32, &[slots])?;
        // The device error record of bad batches: sticky across forwards, so it is state.
        let record = plan.declare(
            BufferKind::State,
            DEVICE_ERROR_NAME,
            Elem::I32,
            &[FAULT_RECORD_INTS],
        )?;

        // Workspace: the batch check's sanitized batch, then the kernel set's own.
        let t = opts.max_num_tokens;
        let ws = |plan: &mut MemoryPlan, name: &str, len: usize| {
            plan.declare(
                BufferKind::Workspace,
                format!("workspace:batch.{name}"),
                Elem::I32,
                &[len],
            )
        };
        let batch_ids = [
            ws(&mut plan, "tokens", t)?,
            ws(&mut plan, "positions", t)?,
            ws(&mut plan, "seq_of", t)?,
            ws(&mut plan, "seq_slots", slots)?,
            ws(&mut plan, "query_start", slots + 1)?,
            ws(&mut plan, "rows", t)?,
            ws(&mut plan, "verdict", 1)?,
            ws(&mut plan, "claim", slots)?,
        ];
        let set_name = opts.kernel_set();
        let set_ws = kernel_sets::reserve_workspace(set_name, &mut plan, cfg, opts)?;

        let (free, _) = ctx.mem_info()?;
        if plan.total_bytes() > free {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "the engine needs {:.2} GiB of device memory but {:.2} GiB are free on device {}; lower max_num_tokens / max_num_seqs / max_seq_len",
                    plan.total_bytes() as f64 / (1u64 << 30) as f64,
                    free as f64 / (1u64 << 30) as f64,
                    opts.device
                ),
            ));
        }
        let arena = Arena::from_plan(&ctx, plan.arena_plan())?;
        let set_ws = set_ws.resolve(&arena);
        let buffers = Buffers::new(arena, plan);
        let p = |id: RegionId| buffers.ptr(id);

        let weights = wids
            .iter()
            .map(|&(r, s, format, block, rows, cols)| WeightDev {
                format,
                data: p(r),
                scales: s.map(p),
                block,
                rows,
                cols,
            })
            .collect();
        let experts = eids
            .iter()
            .map(|ids| ExpertTables {
                w1: p(ids[0]),
                w2: p(ids[1]),
                w3: p(ids[2]),
                s1: p(ids[3]),
                s2: p(ids[4]),
                s3: p(ids[5]),
            })
            .collect();
        let cdev = |ids: Option<CompressorIds>, c: Option<CompressorLayout>| {
            ids.zip(c).map(|(ids, c)| CompressorDev {
                ratio: c.ratio,
                overlap: c.overlap,
                dc: c.dc,
                pend_a: p(ids[0]),
                pend_z: p(ids[1]),
                prev_a: p(ids[2]),
                prev_z: p(ids[3]),
                has_prev: p(ids[4]),
            })
        };
        let layers = lids
            .iter()
            .zip(placement.layers.clone())
            .map(|(&(ring, c, ic, ent, ik), l)| LayerStateDev {
                ring: p(ring),
                compressor: cdev(c, layouts[l].compressor),
                index_compressor: cdev(ic, layouts[l].index_compressor),
                entries: ent.map(p),
                index_keys: ik.map(p),
                maxe: layouts[l].max_entries(),
                inv_freq: p(inv_ids[l]),
            })
            .collect();
        let batch = CheckedBatch {
            tokens: p(batch_ids[0]),
            positions: p(batch_ids[1]),
            seq_of: p(batch_ids[2]),
            seq_slots: p(batch_ids[3]),
            query_start: p(batch_ids[4]),
            rows: p(batch_ids[5]),
            verdict: p(batch_ids[6]),
            claim: p(batch_ids[7]),
            record: p(record),
        };
        let model = DeviceModel {
            handles: ModelWeights::resolve(cfg, store)?,
            weights,
            experts,
            layers,
            slot_len: p(slot_len),
            hc0_fold: p(hc0_fold),
        };
        drop(_g);
        Ok(CudaBackend {
            ctx,
            cfg: cfg.clone(),
            opts: opts.clone(),
            buffers,
            model,
            batch,
            set_ws,
            registry: None,
            checker: None,
            set: None,
        })
    }

    /// Uploads weights, builds derived tables (expert pointer tables, RoPE frequencies),
    /// resets the decode state and loads the kernel set. Idempotent; blocks the host (this
    /// is not forward). Pointers never change.
    fn finalize_on(&mut self, store: &WeightStore, stream: BorrowedStream) -> Result<()> {
        let _g = self.ctx.enter()?;
        if self.registry.is_none() {
            // Only the chosen set's families (the runtime's smoke family is for tests).
            let fams = kernel_sets::families(self.opts.kernel_set());
            let cache = KernelCache::new(self.opts.cache_dir.as_deref());
            let reg = Registry::load_families(&self.ctx, fams, &cache)?;
            self.checker = Some(BatchKernels::new(&reg)?);
            self.set = Some(kernel_sets::load(&reg, &self.set_ws)?);
            self.registry = Some(reg);
        }
        for i in 0..store.len() {
            self.upload_weight(store, i, stream)?;
        }
        self.rebuild_derived_on(store, stream)?;
        self.reset_state(stream)?;
        stream.synchronize()
    }

    /// Copies weight `i` of the host store to its device buffers.
    fn upload_weight(&self, store: &WeightStore, i: usize, stream: BorrowedStream) -> Result<()> {
        let dw = self.model.weights[i];
        match &store.tensor(i).data {
            TensorData::F32(v) => copy_to_device_sync(dw.data, v, stream),
            TensorData::I32(v) => copy_to_device_sync(dw.data, v, stream),
            TensorData::Bf16(v) => copy_to_device_sync(dw.data, v, stream),
            TensorData::Quant(q) => {
                copy_to_device_sync(dw.data, &q.codes, stream)?;
                let s = dw.scales.ok_or_else(|| {
                    Error::new(Status::Internal, "quantized weight without scale buffer")
                })?;
                copy_to_device_sync(s, &q.scales, stream)
            }
        }
    }

    /// Every derived tensor, from the host store (already uploaded): expert weight address
    /// tables, per-layer RoPE frequencies and layer 0's folded mHC projection.
    fn rebuild_derived_on(&self, store: &WeightStore, stream: BorrowedStream) -> Result<()> {
        let m = &self.model;
        if let Some(l0) = m.handles.layers.first() {
            let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
            let mut fold = vec![0.0f64; m.hc0_fold.bytes() / 8];
            fold_projection(store.f32(l0.hc_attn.proj), n, d, &mut fold);
            copy_to_device_sync(m.hc0_fold, &fold, stream)?;
        }
        for (l, lw) in m.handles.layers.iter().enumerate() {
            let t = m.experts[l];
            let addr =
                |f: &dyn Fn(&crate::model::ExpertWeights) -> usize, scale: bool| -> Vec<u64> {
                    lw.experts
                        .iter()
                        .map(|ew| {
                            let dw = m.weights[f(ew)];
                            if scale {
                                dw.scales.map_or(0, |p| p.addr())
                            } else {
                                dw.data.addr()
                            }
                        })
                        .collect()
                };
            copy_to_device_sync(t.w1, &addr(&|e| e.w1, false), stream)?;
            copy_to_device_sync(t.w2, &addr(&|e| e.w2, false), stream)?;
            copy_to_device_sync(t.w3, &addr(&|e| e.w3, false), stream)?;
            copy_to_device_sync(t.s1, &addr(&|e| e.w1, true), stream)?;
            copy_to_device_sync(t.s2, &addr(&|e| e.w2, true), stream)?;
            copy_to_device_sync(t.s3, &addr(&|e| e.w3, true), stream)?;
            let freqs = rope::inv_freq(&self.cfg, self.cfg.layers[l].attn);
            copy_to_device_sync(m.layers[l].inv_freq, &freqs, stream)?;
        }
        Ok(())
    }

    /// Zeroes every slot's length and overlap flag (fresh engine).
    fn reset_state(&self, stream: BorrowedStream) -> Result<()> {
        memset_async(self.model.slot_len, 0, stream)?;
        for l in &self.model.layers {
            for c in [l.compressor, l.index_compressor].into_iter().flatten() {
                memset_async(c.has_prev, 0, stream)?;
            }
        }
        Ok(())
    }

    /// Frees `slot`: its next sequence must start at position 0 (a batch continuing it is
    /// then bad, as on the CPU backend). Waits for all work queued in the engine's context
    /// (the host's forwards may still use the slot on any stream), then clears its length
    /// and overlap flags; blocks the host (never inside a capture).
    fn clear_slot(&self, slot: usize) -> Result<()> {
        let _g = self.ctx.enter()?;
        self.ctx.synchronize()?;
        let stream = BorrowedStream::from_raw(std::ptr::null_mut());
        let len = self.model.slot_len.slice(slot * 4, 4)?;
        memset_async(len, 0, stream)?;
        for l in &self.model.layers {
            for c in [l.compressor, l.index_compressor].into_iter().flatten() {
                memset_async(c.has_prev.slice(slot * 4, 4)?, 0, stream)?;
            }
        }
        stream.synchronize()
    }

    /// Reads the device error record once all work enqueued on `stream` has run, and clears
    /// it (blocks the host: not for use inside a graph capture).
    fn take_device_record(&self, stream: BorrowedStream) -> Result<[i32; FAULT_RECORD_INTS]> {
        let _g = self.ctx.enter()?;
        let mut rec = [0i32; FAULT_RECORD_INTS];
        crate::cuda::arena::copy_to_host_sync(&mut rec, self.batch.record, stream)?;
        if rec[0] != 0 {
            memset_async(self.batch.record, 0, stream)?;
            stream.synchronize()?;
        }
        Ok(rec)
    }

    /// What one forward needs (forward.rs): context, config, options, the device model,
    /// the batch buffers and the loaded kernel set.
    pub(in crate::cuda) fn parts(
        &self,
    ) -> Result<(
        &Context,
        &ModelConfig,
        &EngineOptions,
        &DeviceModel,
        &CheckedBatch,
        &dyn KernelSet,
    )> {
        let set = self.set.as_deref().ok_or_else(|| {
            Error::new(Status::State, "kernels are not loaded: call dsv4_finalize")
        })?;
        Ok((
            &self.ctx,
            &self.cfg,
            &self.opts,
            &self.model,
            &self.batch,
            set,
        ))
    }

    /// The batch check's kernels (loaded at finalize).
    pub(in crate::cuda) fn batch_kernels(&self) -> Result<&BatchKernels> {
        self.checker
            .as_ref()
            .ok_or_else(|| Error::new(Status::State, "kernels are not loaded: call dsv4_finalize"))
    }
}

impl Backend for CudaBackend {
    fn device_name(&self) -> String {
        format!("cuda:{}", self.opts.device)
    }

    fn is_device(&self) -> bool {
        true
    }

    fn finalize(&mut self, store: &WeightStore, stream: StreamHandle) -> Result<()> {
        self.finalize_on(store, BorrowedStream::from_raw(stream))
    }

    /// Copies the touched weights from the host store in place (then derived tensors), and
    /// waits: the host may free or reuse its refit buffers when the call returns.
    fn apply_refit(
        &mut self,
        store: &WeightStore,
        touched: &[usize],
        rebuild: bool,
        stream: StreamHandle,
    ) -> Result<()> {
        let st = BorrowedStream::from_raw(stream);
        let _g = self.ctx.enter()?;
        for &i in touched {
            self.upload_weight(store, i, st)?;
        }
        if rebuild {
            self.rebuild_derived_on(store, st)?;
        }
        st.synchronize()
    }

    fn rebuild_derived(&mut self, store: &WeightStore, stream: StreamHandle) -> Result<()> {
        let st = BorrowedStream::from_raw(stream);
        let _g = self.ctx.enter()?;
        self.rebuild_derived_on(store, st)?;
        st.synchronize()
    }

    fn forward_host(&mut self, _store: &WeightStore, _batch: &mut Batch) -> Result<()> {
        Err(Error::new(
            Status::InvalidArgument,
            "this engine runs on CUDA: the batch must hold device pointers (forward_device)",
        ))
    }

    fn forward_device(&mut self, batch: &DeviceBatch, stream: StreamHandle) -> Result<()> {
        crate::cuda::forward::forward(self, batch, BorrowedStream::from_raw(stream))
    }

    /// The device slot length must read 0 too: the batch check refuses to continue a
    /// released slot, as the CPU backend does.
    fn release_slot(&mut self, slot: usize) -> Result<()> {
        self.clear_slot(slot)
    }

    fn take_device_error(&mut self, stream: StreamHandle) -> Result<Option<BatchFault>> {
        let rec = self.take_device_record(BorrowedStream::from_raw(stream))?;
        BatchFault::from_record(&rec)
    }

    /// The device copy (same layout as the host store).
    fn weight_addr(&self, _store: &WeightStore, i: usize) -> WeightAddr {
        let w = self.model.weights[i];
        WeightAddr {
            data: w.data.addr(),
            scales: w.scales.map_or(0, |p| p.addr()),
        }
    }

    fn derived(&self) -> Vec<DerivedTensor> {
        self.buffers.derived()
    }

    fn spans(&self) -> BufferSpans {
        let b = &self.buffers;
        BufferSpans {
            weights: b.span(BufferKind::Weights),
            derived: b.span(BufferKind::Derived),
            state: b.span(BufferKind::State),
            workspace: b.span(BufferKind::Workspace),
            device_error: b.named(DEVICE_ERROR_NAME),
        }
    }

    fn stage_device_bytes(
        &self,
        addr: u64,
        nbytes: usize,
        stream: StreamHandle,
        what: &str,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; nbytes];
        if nbytes == 0 {
            return Ok(out);
        }
        let _g = self.ctx.enter()?;
        let st = BorrowedStream::from_raw(stream);
        // SAFETY: the host promises `nbytes` readable device bytes at `addr` for the call; a
        // wrong address fails in the driver (checked) without side effects.
        let src = unsafe { DevicePtr::from_raw(addr, nbytes) };
        crate::cuda::arena::copy_to_host_sync(&mut out, src, st)
            .map_err(|e| e.context(what.to_string()))?;
        Ok(out)
    }
}
