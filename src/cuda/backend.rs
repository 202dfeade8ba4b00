//! The CUDA backend's memory: every device buffer of the engine — weights in their stored
//! format, derived tables, per-slot decode state, activation workspace — planned from the
//! config and capacities and carved from ONE arena at create. Nothing is allocated later;
//! finalize uploads weights and builds derived tables in place; forward (forward.rs) only
//! launches kernels on the host's stream.

use crate::config::{AttnKind, ModelConfig};
use crate::cuda::arena::{
    Arena, ArenaPlan, DevicePtr, RegionId, copy_to_device_sync, memset_async,
};
use crate::cuda::context::Context;
use crate::cuda::registry::Registry;
use crate::cuda::stream::BorrowedStream;
use crate::engine::{DerivedDtype, DerivedTensor, EngineOptions};
use crate::error::{Error, Result, Status};
use crate::model::{ModelWeights, rope};
use crate::reference::HC0_FOLD_NAME;
use crate::weights::qmatrix::{FP4_BLOCK, QFormat};
use crate::weights::store::{TensorData, WeightStore};

use crate::cuda::kernels::batch::CheckedBatch;
pub use crate::cuda::kernels::linear::{DevWeight, WFormat};
use crate::model::batch::FAULT_RECORD_INTS;

/// Arena name of the device error record (dsv4_get_info reports its address).
pub const DEVICE_ERROR_NAME: &str = "state:device_error";

/// Per-layer device tables of expert weight addresses (derived: rebuilt at finalize).
#[derive(Clone, Copy, Debug)]
pub struct ExpertTables {
    /// u64[E] each: code pointers of w1, w2, w3 and their scale pointers.
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

/// Activation workspace for `max_num_tokens` tokens (names follow reference/mod.rs).
#[derive(Clone, Copy, Debug)]
pub struct Workspace {
    pub x: DevicePtr,
    pub u: DevicePtr,
    pub post: DevicePtr,
    pub comb: DevicePtr,
    pub a: DevicePtr,
    pub xq: DevicePtr,
    pub qr: DevicePtr,
    pub q: DevicePtr,
    pub kv: DevicePtr,
    pub o: DevicePtr,
    pub z: DevicePtr,
    pub comp_a: DevicePtr,
    pub comp_z: DevicePtr,
    pub icomp_a: DevicePtr,
    pub icomp_z: DevicePtr,
    pub qi: DevicePtr,
    pub iw: DevicePtr,
    pub iscores: DevicePtr,
    pub selected: DevicePtr,
    pub nsel: DevicePtr,
    pub seq_of: DevicePtr,
    pub ids: DevicePtr,
    pub rw: DevicePtr,
    pub offsets: DevicePtr,
    pub rows: DevicePtr,
    pub tiles: DevicePtr,
    pub ntiles: DevicePtr,
    pub h: DevicePtr,
    pub hq: DevicePtr,
    pub ya: DevicePtr,
    pub sg: DevicePtr,
    pub sv: DevicePtr,
    pub sh: DevicePtr,
    pub ys: DevicePtr,
    pub f: DevicePtr,
    pub xr: DevicePtr,
    pub y: DevicePtr,
    pub logits_f32: DevicePtr,
    pub rows_all: DevicePtr,
}

/// Tile height of the grouped expert GEMMs (kernels/SPEC.md `moe_plan_kernel`).
pub const MOE_TILE_ROWS: usize = crate::cuda::kernels::moe::TILE_ROWS;

pub struct CudaBackend {
    pub ctx: Context,
    pub cfg: ModelConfig,
    pub opts: EngineOptions,
    pub arena: Arena,
    pub registry: Option<Registry>,
    pub handles: ModelWeights,
    /// Device copy of every weight, indexed like the host store.
    pub weights: Vec<DevWeight>,
    pub experts: Vec<ExpertTables>,
    pub layers: Vec<LayerStateDev>,
    pub slot_len: DevicePtr,
    /// Derived f64 [(2+N)*N, D]: layer 0's stream-folded hc_attn projection
    /// (`reference::mhc::fold_projection`).
    pub hc0_fold: DevicePtr,
    pub ws: Workspace,
    /// The sanitized batch of the current forward and the device error record.
    pub batch: CheckedBatch,
    /// Max visible indexer entries per token (workspace width of `iscores`).
    pub max_index_entries: usize,
    /// Kernel families, resolved at finalize.
    pub kernels: Option<crate::cuda::forward::Kernels>,
}

const ALIGN: usize = 256;

fn f32s(n: usize) -> usize {
    n.max(1) * 4
}

/// Format, bytes, scale bytes and scale block of a weight's device copy (the host layout).
fn weight_layout(data: &TensorData) -> (WFormat, usize, Option<usize>, [usize; 2]) {
    match data {
        TensorData::F32(v) => (WFormat::F32, v.len() * 4, None, [0, 0]),
        // Index tables are raw int32 words; only their address is used.
        TensorData::I32(v) => (WFormat::F32, v.len() * 4, None, [0, 0]),
        TensorData::Bf16(v) => (WFormat::Bf16, v.len() * 2, None, [0, 0]),
        TensorData::Quant(q) => match q.format {
            QFormat::Fp8 { block } => {
                (WFormat::Fp8, q.codes.len(), Some(q.scales.len() * 4), block)
            }
            QFormat::Fp4 => (
                WFormat::Fp4,
                q.codes.len(),
                Some(q.scales.len() * 4),
                [1, FP4_BLOCK],
            ),
        },
    }
}

impl CudaBackend {
    /// Plans and allocates every device buffer for `cfg` and `opts` (create time).
    pub fn new(
        cfg: &ModelConfig,
        opts: &EngineOptions,
        store: &WeightStore,
    ) -> Result<CudaBackend> {
        let ctx = Context::retain(opts.device)?;
        let _g = ctx.enter()?;
        let mut plan = ArenaPlan::new();
        let t = opts.max_num_tokens;
        let slots = opts.max_num_seqs;
        let (n, d, hd, h) = (cfg.hc_mult, cfg.hidden_size, cfg.head_dim, cfg.num_heads);
        let (e, k, i) = (cfg.n_routed_experts, cfg.experts_per_tok, cfg.moe_inter);
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);

        // Weights.
        let mut wids = Vec::with_capacity(store.len());
        for tns in store.tensors() {
            let (fmt, bytes, sbytes, block) = weight_layout(&tns.data);
            let r = plan.reserve(format!("weight:{}", tns.spec.name), bytes.max(1), ALIGN)?;
            let s = match sbytes {
                Some(b) => {
                    Some(plan.reserve(format!("scale:{}", tns.spec.name), b.max(1), ALIGN)?)
                }
                None => None,
            };
            let cols = *tns.spec.shape.last().unwrap_or(&1);
            let rows = tns.spec.numel() / cols.max(1);
            wids.push((r, s, fmt, block, rows, cols));
        }
        // Derived tensors (rebuilt by finalize / refit from the weights), then per-slot state,
        // then workspace: each kind is one contiguous span (dsv4_get_info reports the spans).
        let mut eids = vec![];
        for l in 0..cfg.num_layers {
            let mut ids = [RegionId(0); 6];
            for (j, nm) in ["w1", "w2", "w3", "s1", "s2", "s3"].iter().enumerate() {
                ids[j] = plan.reserve(
                    format!("derived:layers.{l}.experts.{nm}_ptrs"),
                    e * 8,
                    ALIGN,
                )?;
            }
            eids.push(ids);
        }
        let inv_ids = (0..cfg.num_layers)
            .map(|l| {
                plan.reserve(
                    format!("derived:layers.{l}.inv_freq"),
                    f32s(cfg.rope_dim / 2),
                    ALIGN,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mix = (2 + n) * n;
        let hc0_fold = plan.reserve(HC0_FOLD_NAME, mix * d * 8, ALIGN)?;
        // Per-slot state.
        let mut lids = vec![];
        let mut max_index_entries = 1;
        for (l, spec) in cfg.layers.iter().enumerate() {
            let p = |x: &str| format!("state:layers.{l}.{x}");
            let ring = plan.reserve(p("ring"), f32s(slots * cfg.sliding_window * hd), ALIGN)?;
            let inv = inv_ids[l];
            let comp = |plan: &mut ArenaPlan,
                        name: &str,
                        dc: usize,
                        overlap: bool|
             -> Result<[RegionId; 5]> {
                let c = if overlap { 2 } else { 1 };
                let r = spec.ratio;
                Ok([
                    plan.reserve(
                        p(&format!("{name}.pend_a")),
                        f32s(slots * r * c * dc),
                        ALIGN,
                    )?,
                    plan.reserve(
                        p(&format!("{name}.pend_z")),
                        f32s(slots * r * c * dc),
                        ALIGN,
                    )?,
                    plan.reserve(p(&format!("{name}.prev_a")), f32s(slots * r * dc), ALIGN)?,
                    plan.reserve(p(&format!("{name}.prev_z")), f32s(slots * r * dc), ALIGN)?,
                    plan.reserve(p(&format!("{name}.has_prev")), f32s(slots), ALIGN)?,
                ])
            };
            let maxe = if spec.ratio > 0 {
                opts.max_seq_len / spec.ratio
            } else {
                0
            };
            let (c, ic, ent, ik) = match spec.attn {
                AttnKind::Sliding => (None, None, None, None),
                AttnKind::Hca => (
                    Some(comp(&mut plan, "compressor", hd, false)?),
                    None,
                    Some(plan.reserve(p("entries"), f32s(slots * maxe * hd), ALIGN)?),
                    None,
                ),
                AttnKind::Csa => {
                    max_index_entries = max_index_entries.max(maxe);
                    (
                        Some(comp(&mut plan, "compressor", hd, true)?),
                        Some(comp(&mut plan, "index_compressor", di, true)?),
                        Some(plan.reserve(p("entries"), f32s(slots * maxe * hd), ALIGN)?),
                        Some(plan.reserve(p("index_keys"), f32s(slots * maxe * di), ALIGN)?),
                    )
                }
            };
            lids.push((ring, inv, c, ic, ent, ik, maxe));
        }
        let slot_len = plan.reserve("state:slot_len", f32s(slots), ALIGN)?;
        // The device error record of bad batches: sticky across forwards, so it is state.
        let record = plan.reserve(DEVICE_ERROR_NAME, FAULT_RECORD_INTS * 4, ALIGN)?;
        // Workspace.
        let qk_max = [
            d,
            cfg.q_lora_rank,
            cfg.o_groups * cfg.o_lora_rank,
            i,
            h * hd / cfg.o_groups,
        ]
        .into_iter()
        .max()
        .unwrap();
        let w = |plan: &mut ArenaPlan, name: &str, bytes: usize| {
            plan.reserve(format!("workspace:{name}"), bytes.max(4), ALIGN)
        };
        let tk = t * k;
        let max_tiles = crate::cuda::kernels::moe::max_tiles(tk, MOE_TILE_ROWS, e);
        let topk = cfg.index_topk.max(1);
        let ws_ids = [
            w(&mut plan, "x", f32s(t * n * d))?,
            w(&mut plan, "u", f32s(t * d))?,
            w(&mut plan, "post", f32s(t * n))?,
            w(&mut plan, "comb", f32s(t * n * n))?,
            w(&mut plan, "a", f32s(t * d))?,
            w(&mut plan, "xq", f32s(tk.max(t) * qk_max))?,
            w(&mut plan, "qr", f32s(t * cfg.q_lora_rank))?,
            w(&mut plan, "q", f32s(t * h * hd))?,
            w(&mut plan, "kv", f32s(t * hd))?,
            w(&mut plan, "o", f32s(t * h * hd))?,
            w(&mut plan, "z", f32s(t * cfg.o_groups * cfg.o_lora_rank))?,
            w(&mut plan, "comp_a", f32s(t * 2 * hd))?,
            w(&mut plan, "comp_z", f32s(t * 2 * hd))?,
            w(&mut plan, "icomp_a", f32s(t * 2 * di))?,
            w(&mut plan, "icomp_z", f32s(t * 2 * di))?,
            w(&mut plan, "qi", f32s(t * hi * di))?,
            w(&mut plan, "iw", f32s(t * hi))?,
            w(&mut plan, "iscores", f32s(t * max_index_entries))?,
            w(&mut plan, "selected", f32s(t * topk))?,
            w(&mut plan, "nsel", f32s(t))?,
            w(&mut plan, "seq_of", f32s(t))?,
            w(&mut plan, "ids", f32s(tk))?,
            w(&mut plan, "rw", f32s(tk))?,
            w(&mut plan, "offsets", f32s(e + 1))?,
            w(&mut plan, "rows", f32s(tk))?,
            w(&mut plan, "tiles", f32s(3 * max_tiles))?,
            w(&mut plan, "ntiles", f32s(1))?,
            w(&mut plan, "h", f32s(tk * i))?,
            w(&mut plan, "hq", f32s(tk * i))?,
            w(&mut plan, "ya", f32s(tk * d))?,
            w(&mut plan, "sg", f32s(t * i))?,
            w(&mut plan, "sv", f32s(t * i))?,
            w(&mut plan, "sh", f32s(t * i))?,
            w(&mut plan, "ys", f32s(t * d))?,
            w(&mut plan, "f", f32s(t * d))?,
            w(&mut plan, "xr", f32s(t * n * d))?,
            w(&mut plan, "y", f32s(t * d))?,
            w(&mut plan, "logits_f32", f32s(t * cfg.vocab_size))?,
            w(&mut plan, "rows_all", f32s(t))?,
            // batch_check_kernel's sanitized batch (kernels/batch.cu).
            w(&mut plan, "batch.tokens", f32s(t))?,
            w(&mut plan, "batch.positions", f32s(t))?,
            w(&mut plan, "batch.seq_slots", f32s(slots))?,
            w(&mut plan, "batch.query_start", f32s(slots + 1))?,
            w(&mut plan, "batch.rows", f32s(t))?,
            w(&mut plan, "batch.verdict", f32s(1))?,
            w(&mut plan, "batch.claim", f32s(slots))?,
        ];
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
        let arena = Arena::from_plan(&ctx, &plan)?;
        let weights = wids
            .iter()
            .map(|&(r, s, format, block, rows, cols)| DevWeight {
                format,
                data: arena.region(r),
                scales: s.map(|s| arena.region(s)),
                block,
                rows,
                cols,
            })
            .collect();
        let experts = eids
            .iter()
            .map(|ids| ExpertTables {
                w1: arena.region(ids[0]),
                w2: arena.region(ids[1]),
                w3: arena.region(ids[2]),
                s1: arena.region(ids[3]),
                s2: arena.region(ids[4]),
                s3: arena.region(ids[5]),
            })
            .collect();
        let cdev = |ids: Option<[RegionId; 5]>, ratio: usize, overlap: bool, dc: usize| {
            ids.map(|ids| CompressorDev {
                ratio,
                overlap,
                dc,
                pend_a: arena.region(ids[0]),
                pend_z: arena.region(ids[1]),
                prev_a: arena.region(ids[2]),
                prev_z: arena.region(ids[3]),
                has_prev: arena.region(ids[4]),
            })
        };
        let layers = lids
            .iter()
            .zip(&cfg.layers)
            .map(|(&(ring, inv, c, ic, ent, ik, maxe), spec)| LayerStateDev {
                ring: arena.region(ring),
                compressor: cdev(c, spec.ratio, spec.attn == AttnKind::Csa, hd),
                index_compressor: cdev(ic, spec.ratio, true, di),
                entries: ent.map(|r| arena.region(r)),
                index_keys: ik.map(|r| arena.region(r)),
                maxe,
                inv_freq: arena.region(inv),
            })
            .collect();
        let r = |j: usize| arena.region(ws_ids[j]);
        let ws = Workspace {
            x: r(0),
            u: r(1),
            post: r(2),
            comb: r(3),
            a: r(4),
            xq: r(5),
            qr: r(6),
            q: r(7),
            kv: r(8),
            o: r(9),
            z: r(10),
            comp_a: r(11),
            comp_z: r(12),
            icomp_a: r(13),
            icomp_z: r(14),
            qi: r(15),
            iw: r(16),
            iscores: r(17),
            selected: r(18),
            nsel: r(19),
            seq_of: r(20),
            ids: r(21),
            rw: r(22),
            offsets: r(23),
            rows: r(24),
            tiles: r(25),
            ntiles: r(26),
            h: r(27),
            hq: r(28),
            ya: r(29),
            sg: r(30),
            sv: r(31),
            sh: r(32),
            ys: r(33),
            f: r(34),
            xr: r(35),
            y: r(36),
            logits_f32: r(37),
            rows_all: r(38),
        };
        let batch = CheckedBatch {
            tokens: r(39),
            positions: r(40),
            seq_slots: r(41),
            query_start: r(42),
            rows: r(43),
            verdict: r(44),
            claim: r(45),
            seq_of: ws.seq_of,
            record: arena.region(record),
        };
        let slot_len = arena.region(slot_len);
        let hc0_fold = arena.region(hc0_fold);
        drop(_g);
        Ok(CudaBackend {
            handles: ModelWeights::resolve(cfg, store)?,
            ctx,
            cfg: cfg.clone(),
            opts: opts.clone(),
            arena,
            registry: None,
            weights,
            experts,
            layers,
            slot_len,
            hc0_fold,
            ws,
            batch,
            max_index_entries,
            kernels: None,
        })
    }

    /// Uploads weights, builds derived tables (expert pointer tables, RoPE frequencies),
    /// resets the decode state and loads every kernel. Idempotent; blocks the host (this is
    /// not forward). Pointers never change.
    pub fn finalize(&mut self, store: &WeightStore, stream: BorrowedStream) -> Result<()> {
        let _g = self.ctx.enter()?;
        if self.registry.is_none() {
            let reg = Registry::load(&self.ctx, self.opts.cache_dir.as_deref())?;
            self.kernels = Some(crate::cuda::forward::Kernels::new(&reg)?);
            self.registry = Some(reg);
        }
        for i in 0..store.len() {
            self.upload_weight(store, i, stream)?;
        }
        self.rebuild_derived(store, stream)?;
        self.reset_state(stream)?;
        stream.synchronize()
    }

    /// Copies weight `i` of the host store to its device buffers.
    pub fn upload_weight(
        &self,
        store: &WeightStore,
        i: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        let dw = self.weights[i];
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
    pub fn rebuild_derived(&self, store: &WeightStore, stream: BorrowedStream) -> Result<()> {
        if let Some(l0) = self.handles.layers.first() {
            let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
            let mut fold = vec![0.0f64; self.hc0_fold.bytes() / 8];
            crate::reference::mhc::fold_projection(store.f32(l0.hc_attn.proj), n, d, &mut fold);
            copy_to_device_sync(self.hc0_fold, &fold, stream)?;
        }
        for (l, lw) in self.handles.layers.iter().enumerate() {
            let t = self.experts[l];
            let addr =
                |f: &dyn Fn(&crate::model::ExpertWeights) -> usize, scale: bool| -> Vec<u64> {
                    lw.experts
                        .iter()
                        .map(|ew| {
                            let dw = self.weights[f(ew)];
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
            copy_to_device_sync(self.layers[l].inv_freq, &freqs, stream)?;
        }
        Ok(())
    }

    /// Zeroes every slot's length and overlap flag (fresh engine).
    pub fn reset_state(&self, stream: BorrowedStream) -> Result<()> {
        memset_async(self.slot_len, 0, stream)?;
        for l in &self.layers {
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
    pub fn release_slot(&self, slot: usize) -> Result<()> {
        let _g = self.ctx.enter()?;
        self.ctx.synchronize()?;
        let stream = BorrowedStream::from_raw(std::ptr::null_mut());
        let len = self.slot_len.slice(slot * 4, 4)?;
        memset_async(len, 0, stream)?;
        for l in &self.layers {
            for c in [l.compressor, l.index_compressor].into_iter().flatten() {
                memset_async(c.has_prev.slice(slot * 4, 4)?, 0, stream)?;
            }
        }
        stream.synchronize()
    }

    /// Reads the device error record once all work enqueued on `stream` has run, and clears
    /// it (blocks the host: not for use inside a graph capture).
    pub fn take_device_error(&self, stream: BorrowedStream) -> Result<[i32; FAULT_RECORD_INTS]> {
        let _g = self.ctx.enter()?;
        let mut rec = [0i32; FAULT_RECORD_INTS];
        crate::cuda::arena::copy_to_host_sync(&mut rec, self.batch.record, stream)?;
        if rec[0] != 0 {
            memset_async(self.batch.record, 0, stream)?;
            stream.synchronize()?;
        }
        Ok(rec)
    }

    /// Named device regions (weights, derived, state, workspace) for dsv4_get_info.
    pub fn regions(&self) -> &[crate::cuda::arena::Region] {
        self.arena.regions()
    }

    /// The derived tensors (device addresses) for dsv4_weight_info, in arena order.
    pub fn derived(&self) -> Vec<DerivedTensor> {
        let (n, d, e) = (
            self.cfg.hc_mult,
            self.cfg.hidden_size,
            self.cfg.n_routed_experts,
        );
        self.regions()
            .iter()
            .filter(|r| r.name.starts_with("derived:"))
            .map(|r| {
                let (dtype, shape) = if r.name == HC0_FOLD_NAME {
                    (DerivedDtype::F64, vec![(2 + n) * n, d])
                } else if r.name.ends_with("_ptrs") {
                    (DerivedDtype::U64, vec![e])
                } else {
                    (DerivedDtype::F32, vec![self.cfg.rope_dim / 2])
                };
                DerivedTensor {
                    name: r.name.clone(),
                    dtype,
                    nbytes: shape.iter().product::<usize>() * dtype.size(),
                    shape,
                    addr: r.ptr.addr(),
                }
            })
            .collect()
    }

    /// The device span `(base, bytes)` covering every region whose name starts with `prefix`
    /// ("weight:" also covers "scale:"), or (0, 0) if none.
    pub fn span(&self, prefixes: &[&str]) -> (u64, u64) {
        let mut lo = u64::MAX;
        let mut hi = 0u64;
        for r in self.regions() {
            if prefixes.iter().any(|p| r.name.starts_with(p)) {
                lo = lo.min(r.ptr.addr());
                hi = hi.max(r.ptr.addr() + r.ptr.bytes() as u64);
            }
        }
        if lo == u64::MAX {
            (0, 0)
        } else {
            (lo, hi - lo)
        }
    }
}
