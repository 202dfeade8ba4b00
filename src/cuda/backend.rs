//! The CUDA backend: the engine's device model (device_model.rs) and the chosen kernel
//! set's workspace, declared in one memory plan (memory_plan.rs) and carved from ONE arena
//! at create. Nothing is allocated in device memory later. Loads and refits write weights
//! straight into the arena, with no host copy of the weights: host values through bounded
//! pinned staging (upload.rs), device values by copies and kernels (weight_convert.rs).
//! Finalize builds derived tables in place and loads the kernel set; forward (forward.rs) only
//! launches kernels on the host's stream.

use crate::backend::{
    Backend, Batch, BufferSpans, DerivedTensor, DeviceBatch, StreamHandle, WeightAddr,
};
use crate::config::ModelConfig;
use crate::cuda::arena::{
    Arena, DevicePtr, checked_device_range, copy_to_device_sync, memcpy_dtod_async, memset_async,
};
use crate::cuda::context::Context;
use crate::cuda::kernel_sets::{self, KernelSet, SetWorkspace};
use crate::cuda::kernels::batch::{BatchKernels, CheckedBatch};
use crate::cuda::kernels::fast_moe_gemm::{self, ExpertMatrices};
use crate::cuda::kernels::mhc::Hc0Fold;
use crate::cuda::kernels::weight_convert::{
    self, DestWeight, DeviceScale, SourceRows, WeightConvert,
};
use crate::cuda::kv_pages::static_block_table;
use crate::cuda::memory_plan::{BufferKind, Buffers, MemoryPlan};
use crate::cuda::registry::{KernelCache, Registry};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::upload::{DEFAULT_STAGING_BYTES, StagingPool};
use crate::error::{Error, Result, Status};
use crate::memory::MemoryFigures;
use crate::model::batch::{BatchFault, FAULT_RECORD_INTS};
use crate::model::rope;
use crate::options::EngineOptions;
use crate::state::layout::layer_layouts;
use crate::weights::load::{DeviceCheck, DeviceEnc, DeviceWrite};
use crate::weights::rows::Geometry;
use crate::weights::table::{StorageKind, WeightLayout, WeightTable};
use crate::weights::values::{Progress, WeightValues};

pub use crate::cuda::device_model::{
    CompressorDev, DeviceModel, ExpertTables, LayerStateDev, Placement, WeightDev,
};
use crate::cuda::device_model::{WEIGHT_CHECKS, plan_model};

/// Arena name of the device error record (dsv4_get_info reports its address).
pub const DEVICE_ERROR_NAME: &str = "state:device_error";

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
    /// Builds layer 0's folded mHC projection from the device weights (every set compiles
    /// the mhc family).
    fold: Option<Hc0Fold>,
    /// Pinned buffers weights are written through, from the first write until finalize or
    /// the end of a refit (upload.rs).
    staging: Option<StagingPool>,
    /// The weight_convert family (writes from device memory), with its own registry: loaded
    /// on the first device write, which may come before finalize.
    convert: Option<(Registry, WeightConvert)>,
    set: Option<Box<dyn KernelSet>>,
    /// What one more slot adds to the state (crate::memory), computed at create.
    state_per_slot: u64,
    /// Host bytes a load or refit stages weights through (the pool's size).
    staging_bytes: u64,
}

/// The staging size `opts` asks for.
fn staging_bytes(opts: &EngineOptions) -> usize {
    match opts.staging_bytes {
        0 => DEFAULT_STAGING_BYTES,
        b => b,
    }
}

/// The memory plan of a CUDA engine (crate::memory), without a device: the same declarations
/// as [`CudaBackend::new`] makes, laid out as its arena will be. It plans the kernel set the
/// options name (by default the fast set for `official`); on a GPU without sm_90a the engine
/// runs the reference set instead ([`kernel_sets::resolve`]), whose workspace differs.
pub fn plan_memory(
    cfg: &ModelConfig,
    opts: &EngineOptions,
    weights: &[(String, Vec<usize>, WeightLayout)],
) -> Result<MemoryFigures> {
    let plan_for = |slots: usize| -> Result<MemoryPlan> {
        let o = EngineOptions {
            max_num_seqs: slots,
            ..opts.clone()
        };
        let placement = Placement::all(cfg);
        let layouts = layer_layouts(cfg, o.max_seq_len);
        let mut plan = MemoryPlan::new();
        plan_model(&mut plan, cfg, &o, weights, &placement, &layouts)?;
        kernel_sets::reserve_workspace(o.kernel_set(), &mut plan, cfg, &o)?;
        Ok(plan)
    };
    let plan = plan_for(opts.max_num_seqs)?;
    let state = plan.kind_span(BufferKind::State);
    let (one, two) = (
        plan_for(1)?.kind_span(BufferKind::State),
        plan_for(2)?.kind_span(BufferKind::State),
    );
    Ok(MemoryFigures {
        weights: plan.kind_span(BufferKind::Weights),
        derived: plan.kind_span(BufferKind::Derived),
        state,
        state_per_slot: two - one,
        workspace: plan.kind_span(BufferKind::Workspace),
        device: plan.total_bytes() as u64,
        host: staging_bytes(opts) as u64,
    })
}

impl CudaBackend {
    /// Plans and allocates every device buffer for `cfg` and `opts` (create time).
    pub fn new(
        cfg: &ModelConfig,
        opts: &EngineOptions,
        table: &WeightTable,
    ) -> Result<CudaBackend> {
        let ctx = Context::retain(opts.device)?;
        // The engine runs the set its device can run: from here on `opts` names it.
        let opts = &EngineOptions {
            kernel_set: Some(kernel_sets::resolve(opts, ctx.info())?),
            ..opts.clone()
        };
        let placement = Placement::all(cfg);
        let layouts = layer_layouts(cfg, opts.max_seq_len);
        let weight_layouts = table.layouts();
        let state_per_slot = plan_memory(cfg, opts, &weight_layouts)?.state_per_slot;
        let _g = ctx.enter()?;
        let mut plan = MemoryPlan::new();
        let planned = plan_model(&mut plan, cfg, opts, &weight_layouts, &placement, &layouts)?;
        let set_ws = kernel_sets::reserve_workspace(opts.kernel_set(), &mut plan, cfg, opts)?;
        let (free, _) = ctx.mem_info()?;
        if plan.total_bytes() > free {
            return Err(Error::new(
                Status::OutOfMemory,
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
        let model = planned.model(&buffers, cfg, table, &layouts)?;
        let batch = planned.checked_batch(&buffers);
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
            fold: None,
            staging: None,
            convert: None,
            set: None,
            state_per_slot,
            staging_bytes: staging_bytes(opts) as u64,
        })
    }

    /// Loads the kernel set, builds derived tables from the weights as written (expert
    /// pointer tables, RoPE frequencies, layer 0's folded mHC projection, the fast set's tensor
    /// maps and scale tables), resets the decode state. Idempotent; blocks the host (this is
    /// not forward). Pointers never change.
    fn finalize_on(&mut self, stream: BorrowedStream) -> Result<()> {
        let _g = self.ctx.enter()?;
        if self.registry.is_none() {
            // Only the chosen set's families (the runtime's smoke family is for tests).
            let fams = kernel_sets::families(self.opts.kernel_set());
            let cache = KernelCache::new(self.opts.cache_dir.as_deref());
            let reg = Registry::load_families(&self.ctx, fams, &cache)?;
            self.checker = Some(BatchKernels::new(&reg)?);
            self.fold = Some(Hc0Fold::new(&reg)?);
            self.set = Some(kernel_sets::load(
                &self.ctx,
                &reg,
                &self.set_ws,
                &self.cfg,
                &self.opts,
            )?);
            self.registry = Some(reg);
        }
        self.rebuild_derived_on(stream)?;
        self.reset_state(stream)?;
        stream.synchronize()
    }

    /// Every derived tensor, from the device weights as written: layer 0's folded mHC
    /// projection (a kernel), expert weight address tables (and the fast set's tensor maps),
    /// per-layer RoPE frequencies, then the kernel set's own (the fast set's UE8M0 scale
    /// tables). Needs the kernels (finalize loads them first).
    fn rebuild_derived_on(&self, stream: BorrowedStream) -> Result<()> {
        let m = &self.model;
        if let Some(l0) = m.handles.layers.first() {
            let fold = self.fold.as_ref().ok_or_else(|| {
                Error::new(Status::State, "kernels are not loaded: call dsv4_finalize")
            })?;
            let proj = m.weights[l0.hc_attn.proj].data;
            fold.launch(
                proj,
                self.cfg.hc_mult,
                self.cfg.hidden_size,
                m.hc0_fold,
                stream,
            )?;
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
            if let Some(maps) = t.maps {
                let matrices = |ew: &crate::model::ExpertWeights| {
                    let [w1, w3, w2] = [ew.w1, ew.w3, ew.w2].map(|w| m.weights[w]);
                    let scale = |w: WeightDev| w.scales.map_or(0, |p| p.addr());
                    ExpertMatrices {
                        format: w1.format,
                        w1: w1.data.addr(),
                        w3: w3.data.addr(),
                        w2: w2.data.addr(),
                        s1: scale(w1),
                        s3: scale(w3),
                        s2: scale(w2),
                    }
                };
                // The table's shared entry stays zeros without a shared expert (never read).
                let mut all: Vec<ExpertMatrices> = lw.experts.iter().map(matrices).collect();
                all.push(lw.shared.as_ref().map_or(ExpertMatrices::NONE, matrices));
                let table =
                    fast_moe_gemm::tensor_maps(self.cfg.hidden_size, self.cfg.moe_inter, &all)?;
                copy_to_device_sync(maps, &table, stream)?;
            }
            let freqs = rope::inv_freq(&self.cfg, self.cfg.layers[l].attn);
            copy_to_device_sync(m.layers[l].inv_freq, &freqs, stream)?;
        }
        // The kernel set's own derived tensors (built on the device from the weights above).
        if let Some(set) = &self.set {
            set.rebuild_derived(&self.ctx, &self.cfg, m, stream)?;
        }
        Ok(())
    }

    /// The weight_convert kernels, compiled / loaded on first use. The context must be current.
    fn converter(&mut self) -> Result<&WeightConvert> {
        if self.convert.is_none() {
            let cache = KernelCache::new(self.opts.cache_dir.as_deref());
            let reg = Registry::load_families(&self.ctx, &[&weight_convert::SOURCE], &cache)?;
            let kernels = WeightConvert::new(&reg)?;
            self.convert = Some((reg, kernels));
        }
        Ok(&self.convert.as_ref().expect("loaded above").1)
    }

    /// Zeroes every slot's length and overlap flag and gives each slot its own pages (fresh
    /// engine).
    fn reset_state(&self, stream: BorrowedStream) -> Result<()> {
        let slots = self.opts.max_num_seqs;
        for &(table, pages) in &self.model.block_tables {
            copy_to_device_sync(table, &static_block_table(slots, pages), stream)?;
        }
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

    /// Streams the values through the pinned staging pool (made on the first write) straight
    /// into the arena, and waits: the host may free its sources when this returns.
    fn write_weights(
        &mut self,
        table: &WeightTable,
        values: &dyn WeightValues,
        progress: &Progress,
        stream: StreamHandle,
    ) -> Result<()> {
        if self.staging.is_none() {
            let threads = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16);
            self.staging = Some(StagingPool::new(
                &self.ctx,
                self.staging_bytes as usize,
                2 * threads,
            )?);
        }
        let pool = self.staging.as_ref().expect("made above");
        pool.upload(
            table,
            &self.model.weights,
            values,
            progress,
            BorrowedStream::from_raw(stream),
        )
    }

    /// Confirms that every device source (and scale) lies inside a CUDA allocation, then runs
    /// the check kernels, [`WEIGHT_CHECKS`] entries a pass, each pass read back once.
    fn check_device(
        &mut self,
        checks: &[DeviceCheck],
        writes: &[DeviceWrite],
        stream: StreamHandle,
    ) -> Result<()> {
        let st = BorrowedStream::from_raw(stream);
        let ctx = self.ctx.clone();
        let _g = ctx.enter()?;
        // Each source once (a fused expert tensor is the source of many writes).
        let mut seen = std::collections::HashSet::new();
        let key = |w: &DeviceWrite| (w.src.addr, w.src.len, w.src.scale.map(|s| (s.addr, s.len)));
        for w in writes.iter().filter(|w| seen.insert(key(w))) {
            let name = format!("device data of {}", w.who);
            checked_device_range(w.src.addr, w.src.len, &name)?;
            if let Some(sc) = w.src.scale {
                checked_device_range(sc.addr, sc.len, &format!("{name} (its scale)"))?;
            }
        }
        let results = self.model.weight_check;
        let conv = self.converter()?;
        for batch in checks.chunks(WEIGHT_CHECKS) {
            for (k, c) in batch.iter().enumerate() {
                // SAFETY: every checked entry is the source of a write, whose range the driver
                // confirmed above; the check reads no more than that range.
                let src = unsafe { DevicePtr::from_raw(c.addr, c.n * c.enc.size()) };
                let bound = c.bound.unwrap_or(0);
                conv.scan(src, c.enc, c.n, bound, results.slice(8 * k, 8)?, st)?;
            }
            let mut first = vec![0u64; batch.len()];
            crate::cuda::arena::copy_to_host_sync(&mut first, results, st)?;
            if let Some((c, &i)) = batch.iter().zip(&first).find(|(_, i)| **i != u64::MAX) {
                return Err(c.error(i));
            }
        }
        Ok(())
    }

    /// Codes copied device to device with their scales converted, or values converted /
    /// quantized by weight_convert.cu (bit for bit as the host path); then waits.
    fn write_device(
        &mut self,
        table: &WeightTable,
        writes: &[DeviceWrite],
        stream: StreamHandle,
    ) -> Result<()> {
        let st = BorrowedStream::from_raw(stream);
        let ctx = self.ctx.clone();
        let _g = ctx.enter()?;
        let weights = self.model.weights.clone();
        let conv = self.converter()?;
        for w in writes {
            let dw = weights[w.dst];
            let g = Geometry::of(table.entry(w.dst));
            // SAFETY: check_device confirmed the ranges (the engine runs it first).
            let src = unsafe { DevicePtr::from_raw(w.src.addr, w.src.len) };
            let scale = w.src.scale.map(|sc| DeviceScale {
                // SAFETY: as above.
                ptr: unsafe { DevicePtr::from_raw(sc.addr, sc.len) },
                f32: sc.f32,
                block: w.src.block,
            });
            if w.as_is {
                let rb = g.row_bytes();
                let codes = src.slice(w.row0 * rb, w.rows * rb)?;
                memcpy_dtod_async(dw.data.slice(0, codes.bytes())?, codes, st)?;
                let (Some(scale), Some(dst)) = (scale, dw.scales) else {
                    return Err(Error::new(
                        Status::Internal,
                        format!(
                            "`{}`: a stored-format write without scales",
                            table.name(w.dst)
                        ),
                    ));
                };
                let n = g.scale_range(&(0..g.rows)).len();
                let offset = match w.src.enc {
                    // A whole matrix of the source: its scale grid.
                    DeviceEnc::Fp8 => {
                        let per_mat = w.src.mat_rows.div_ceil(w.src.block[0])
                            * w.src.cols.div_ceil(w.src.block[1]);
                        (w.row0 / w.src.mat_rows.max(1)) * per_mat
                    }
                    _ => w.row0 * w.src.cols.div_ceil(crate::weights::qmatrix::FP4_BLOCK),
                };
                conv.scales(scale, offset, n, dst, st)?;
            } else {
                let format = match table.entry(w.dst).layout.kind {
                    StorageKind::I32 => None,
                    _ => Some(dw.format),
                };
                let rows = SourceRows {
                    ptr: src,
                    enc: w.src.enc,
                    scale,
                    mat_rows: w.src.mat_rows,
                    cols: w.src.cols,
                    row0: w.row0,
                    rows: w.rows,
                };
                let dest = DestWeight {
                    data: dw.data,
                    scales: dw.scales,
                    format,
                    block: dw.block,
                };
                conv.convert(&rows, &dest, st)?;
            }
        }
        st.synchronize()
    }

    fn end_writes(&mut self) {
        self.staging = None;
    }

    fn transient_host_bytes(&self) -> u64 {
        self.staging.as_ref().map_or(0, |p| p.bytes() as u64)
    }

    fn finalize(&mut self, stream: StreamHandle) -> Result<()> {
        self.finalize_on(BorrowedStream::from_raw(stream))
    }

    fn rebuild_derived(&mut self, stream: StreamHandle) -> Result<()> {
        let st = BorrowedStream::from_raw(stream);
        let _g = self.ctx.enter()?;
        self.rebuild_derived_on(st)?;
        st.synchronize()
    }

    fn forward_host(&mut self, _batch: &mut Batch) -> Result<()> {
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

    fn memory(&self) -> MemoryFigures {
        let b = &self.buffers;
        MemoryFigures {
            weights: b.span(BufferKind::Weights).1,
            derived: b.span(BufferKind::Derived).1,
            state: b.span(BufferKind::State).1,
            state_per_slot: self.state_per_slot,
            workspace: b.span(BufferKind::Workspace).1,
            device: b.arena.total_bytes() as u64,
            host: self.staging_bytes,
        }
    }

    /// The device copy of the slot's length, once the work on `stream` has run (commit_slots
    /// writes it at the end of every forward).
    fn slot_length(&self, slot: usize, stream: StreamHandle) -> Result<usize> {
        let _g = self.ctx.enter()?;
        let mut len = [0i32; 1];
        crate::cuda::arena::copy_to_host_sync(
            &mut len,
            self.model.slot_len.slice(slot * 4, 4)?,
            BorrowedStream::from_raw(stream),
        )?;
        Ok(len[0].max(0) as usize)
    }

    fn take_device_error(&mut self, stream: StreamHandle) -> Result<Option<BatchFault>> {
        let rec = self.take_device_record(BorrowedStream::from_raw(stream))?;
        BatchFault::from_record(&rec)
    }

    /// The device copy (the table's storage layout).
    fn weight_addr(&self, i: usize) -> WeightAddr {
        let w = self.model.weights[i];
        WeightAddr {
            data: w.data.addr(),
            scales: w.scales.map_or(0, |p| p.addr()),
        }
    }

    fn derived(&self) -> Vec<DerivedTensor> {
        self.buffers.derived()
    }

    fn facts(&self) -> crate::load_report::BackendFacts {
        let info = self.ctx.info();
        crate::load_report::BackendFacts {
            device: Some(info.name.clone()),
            arch: Some(info.arch.clone()),
            kernel_set: Some(self.opts.kernel_set().name()),
            kernels: self.registry.as_ref().map(|r| {
                let s = r.stats();
                crate::load_report::KernelFacts {
                    families: s.compiled + s.cache_hits + s.cache_rejected,
                    compiled: s.compiled,
                    cached: s.cache_hits,
                    rejected: s.cache_rejected,
                    secs: s.cubin_time.as_secs_f64(),
                }
            }),
        }
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
