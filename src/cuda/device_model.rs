//! The CUDA engine's device model — weights in their stored format, derived tables and the
//! per-slot state — and how it is declared in the memory plan (memory_plan.rs) and found
//! again in the arena. Every kernel set reads it; only finalize and refit write it.

use crate::config::ModelConfig;
use crate::cuda::arena::{DevicePtr, RegionId};
use crate::cuda::backend::DEVICE_ERROR_NAME;
use crate::cuda::kernels::batch::CheckedBatch;
use crate::cuda::kernels::{fast_moe, fast_moe_gemm};
use crate::cuda::kv_pages::{KvFormat, KvPagesDev, KvRows};
use crate::cuda::memory_plan::{BufferKind, Buffers, Elem, MemoryPlan};
use crate::error::Result;
use crate::model::ModelWeights;
use crate::model::batch::FAULT_RECORD_INTS;
use crate::model::hc_fold::HC0_FOLD_NAME;
use crate::options::{EngineOptions, KernelSetName};
use crate::state::layout::{CompressorLayout, LayerLayout};
use crate::weights::format::StorageFormat;
use crate::weights::qmatrix::{FP4_BLOCK, QFormat};
use crate::weights::table::{StorageKind, WeightLayout, WeightTable};

pub use crate::cuda::kernels::linear::WeightDev;

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
    /// The fast set's tensor maps of the experts and the shared expert
    /// ([`crate::cuda::kernels::fast_moe_gemm::tensor_maps`]); the reference set has none.
    pub maps: Option<DevicePtr>,
    /// The fast set's UE8M0 copy of the FP4 experts' scales
    /// ([`crate::cuda::kernels::fast_moe_gemm::scales8_bytes`]); None for the reference set.
    pub scales8: Option<DevicePtr>,
    /// The fast set's BF16 planes of the router's gate
    /// ([`crate::cuda::kernels::fast_moe::gate_planes_bytes`]); None for the reference set.
    pub gate_planes: Option<DevicePtr>,
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

/// One layer's per-slot state (the KV rows in kv_pages.rs's layout).
#[derive(Clone, Copy, Debug)]
pub struct LayerStateDev {
    /// The window ring: W KV rows per slot.
    pub ring: KvPagesDev,
    pub compressor: Option<CompressorDev>,
    pub index_compressor: Option<CompressorDev>,
    /// Compressed entries (maxe KV rows per slot) and indexer keys (maxe per slot).
    pub entries: Option<KvPagesDev>,
    pub index_keys: Option<KvPagesDev>,
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
    /// The paged state's block tables (one per compression ratio) with their pages per slot:
    /// written at finalize, and never again while slots own their pages statically.
    pub block_tables: Vec<(DevicePtr, usize)>,
    /// `int[num_slots]`: tokens each slot holds.
    pub slot_len: DevicePtr,
    /// Derived f64 [(2+N)*N, D]: layer 0's stream-folded hc_attn projection.
    pub hc0_fold: DevicePtr,
    /// Workspace u64 [WEIGHT_CHECKS]: results of the device check of device-memory writes.
    pub weight_check: DevicePtr,
}

/// Device-memory entries checked per pass (a refit with more runs several passes).
pub const WEIGHT_CHECKS: usize = 256;

/// The device form of a weight's storage: format, value bytes, scale count, FP8 block.
fn device_layout(l: &WeightLayout) -> (StorageFormat, usize, Option<usize>, [usize; 2]) {
    match l.kind {
        // Index tables are raw int32 words; only their address is used.
        StorageKind::F32 | StorageKind::I32 => (StorageFormat::F32, l.data_bytes, None, [0, 0]),
        StorageKind::Bf16 => (StorageFormat::Bf16, l.data_bytes, None, [0, 0]),
        StorageKind::Quant(QFormat::Fp8 { block }) => {
            (StorageFormat::Fp8, l.data_bytes, Some(l.scales), block)
        }
        StorageKind::Quant(QFormat::Fp4) => (
            StorageFormat::Fp4,
            l.data_bytes,
            Some(l.scales),
            [1, FP4_BLOCK],
        ),
    }
}

/// Region ids of one compressor's state: pend_a, pend_z, prev_a, prev_z, has_prev.
type CompressorIds = [RegionId; 5];

/// Region ids of one weight: its values and (quantized) scales, with its matrix shape.
struct WeightIds {
    data: RegionId,
    scales: Option<RegionId>,
    format: StorageFormat,
    block: [usize; 2],
    rows: usize,
    cols: usize,
}

/// A paged buffer of the plan: its pool, block table (None: the ring), pages per slot, rows.
#[derive(Clone, Copy)]
struct PagesIds {
    pool: RegionId,
    table: Option<RegionId>,
    pages_per_slot: usize,
    rows: KvRows,
}

/// Region ids of one layer's state.
struct LayerStateIds {
    /// The model layer it belongs to (the placement may hold a subset).
    layer: usize,
    ring: PagesIds,
    compressor: Option<CompressorIds>,
    index_compressor: Option<CompressorIds>,
    entries: Option<PagesIds>,
    index_keys: Option<PagesIds>,
}

/// Everything the plan declares, kind by kind (memory_plan.rs lays them out in this order).
pub(crate) struct PlannedBuffers {
    weights: Vec<WeightIds>,
    /// Per held layer: w1, w2, w3 code-pointer tables, then s1, s2, s3 scale-pointer tables.
    expert_tables: Vec<[RegionId; 6]>,
    /// Per held layer, the fast set's tensor map table and UE8M0 scale table.
    tensor_maps: Vec<Option<RegionId>>,
    scales8: Vec<Option<RegionId>>,
    gate_planes: Vec<Option<RegionId>>,
    inv_freq: Vec<RegionId>,
    hc0_fold: RegionId,
    layer_state: Vec<LayerStateIds>,
    /// Block tables by compression ratio: (ratio, table, pages per slot).
    block_tables: Vec<(usize, RegionId, usize)>,
    slot_len: RegionId,
    record: RegionId,
    /// The device check of device-memory weight writes: one u64 result per entry.
    weight_check: RegionId,
    /// tokens, positions, seq_of, seq_slots, query_start, rows, verdict, claim.
    batch: [RegionId; 8],
}

/// Weights, in their stored format.
fn plan_weights(
    plan: &mut MemoryPlan,
    layouts: &[(String, Vec<usize>, WeightLayout)],
) -> Result<Vec<WeightIds>> {
    layouts
        .iter()
        .map(|(name, shape, layout)| {
            let (format, bytes, scales, block) = device_layout(layout);
            let data = plan.declare(
                BufferKind::Weights,
                format!("weight:{name}"),
                Elem::U8,
                &[bytes],
            )?;
            let scales = scales
                .map(|k| {
                    plan.declare(
                        BufferKind::Weights,
                        format!("scale:{name}"),
                        Elem::F32,
                        &[k],
                    )
                })
                .transpose()?;
            let cols = *shape.last().unwrap_or(&1);
            let numel: usize = shape.iter().product();
            Ok(WeightIds {
                data,
                scales,
                format,
                block,
                rows: numel / cols.max(1),
                cols,
            })
        })
        .collect()
}

/// Per-slot state of one layer: the shared layout (state/layout.rs) with the slot leading,
/// the KV rows paged in `format` (kv_pages.rs). `tables` holds the block table of each
/// compression ratio (declared first).
fn plan_layer_state(
    plan: &mut MemoryPlan,
    l: usize,
    lay: &LayerLayout,
    slots: usize,
    rows: KvStateRows,
    tables: &[(usize, RegionId, usize)],
) -> Result<LayerStateIds> {
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
    let comp = |plan: &mut MemoryPlan, name: &str, c: CompressorLayout| -> Result<CompressorIds> {
        Ok([
            st(plan, &format!("{name}.pend_a"), Elem::F32, &c.pending())?,
            st(plan, &format!("{name}.pend_z"), Elem::F32, &c.pending())?,
            st(plan, &format!("{name}.prev_a"), Elem::F32, &c.prev())?,
            st(plan, &format!("{name}.prev_z"), Elem::F32, &c.prev())?,
            st(plan, &format!("{name}.has_prev"), Elem::I32, &[])?,
        ])
    };
    // A paged buffer of `count` rows per slot: pages of `rows`, through the table of `ratio`.
    let paged = |plan: &mut MemoryPlan, what: &str, count: usize, rows: KvRows, ratio: usize| {
        let pages_per_slot = KvRows::pages_for(count);
        let table = tables.iter().find(|t| t.0 == ratio).map(|t| t.1);
        let pool = st(plan, what, Elem::U8, &[pages_per_slot, rows.page_bytes()])?;
        Ok::<_, crate::error::Error>(PagesIds {
            pool,
            table,
            pages_per_slot,
            rows,
        })
    };
    let ratio = lay.compressor.map_or(0, |c| c.ratio);
    Ok(LayerStateIds {
        layer: l,
        ring: paged(plan, "ring", lay.window[0], rows.kv, 0)?,
        compressor: lay
            .compressor
            .map(|c| comp(plan, "compressor", c))
            .transpose()?,
        index_compressor: lay
            .index_compressor
            .map(|c| comp(plan, "index_compressor", c))
            .transpose()?,
        entries: lay
            .entries
            .map(|s| paged(plan, "entries", s[0], rows.kv, ratio))
            .transpose()?,
        index_keys: lay
            .index_keys
            .map(|s| paged(plan, "index_keys", s[0], rows.index_keys, ratio))
            .transpose()?,
    })
}

/// The row layouts of an engine's KV state.
#[derive(Clone, Copy, Debug)]
struct KvStateRows {
    kv: KvRows,
    index_keys: KvRows,
}

impl KvStateRows {
    fn new(cfg: &ModelConfig, opts: &EngineOptions) -> KvStateRows {
        let format = KvFormat::for_numerics(opts.numerics);
        KvStateRows {
            kv: KvRows::kv(format, cfg.head_dim, cfg.nope_dim()),
            index_keys: KvRows::index_keys(format, cfg.index_head_dim),
        }
    }
}

/// Declares every buffer of the engine but the kernel set's workspace.
pub(crate) fn plan_model(
    plan: &mut MemoryPlan,
    cfg: &ModelConfig,
    opts: &EngineOptions,
    weights: &[(String, Vec<usize>, WeightLayout)],
    placement: &Placement,
    layouts: &[LayerLayout],
) -> Result<PlannedBuffers> {
    let (n, d) = (cfg.hc_mult, cfg.hidden_size);
    let slots = opts.max_num_seqs;
    let weights = plan_weights(plan, weights)?;
    // Derived tensors (rebuilt by finalize / refit from the weights).
    let mut expert_tables = vec![];
    let mut tensor_maps = vec![];
    let mut scales8 = vec![];
    let mut gate_planes = vec![];
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
        expert_tables.push(ids);
        let maps = (opts.kernel_set() == KernelSetName::Fast)
            .then(|| {
                let (per, bytes) = (fast_moe_gemm::MAPS_PER_EXPERT, fast_moe_gemm::MAP_BYTES);
                plan.declare(
                    BufferKind::Derived,
                    format!("derived:layers.{l}.experts.tensor_maps"),
                    Elem::U8,
                    &[(placement.experts.len() + 1) * per * bytes],
                )
            })
            .transpose()?;
        tensor_maps.push(maps);
        // Every expert slot of the table, the shared expert's included (it is read only when
        // the experts are stored FP4).
        let scales8_table = (opts.kernel_set() == KernelSetName::Fast)
            .then(|| {
                let bytes = fast_moe_gemm::scales8_bytes(
                    cfg.hidden_size,
                    cfg.moe_inter,
                    placement.experts.len() + 1,
                );
                plan.declare(
                    BufferKind::Derived,
                    format!("derived:layers.{l}.experts.scales_ue8m0"),
                    Elem::U8,
                    &[bytes],
                )
            })
            .transpose()?;
        scales8.push(scales8_table);
        let planes = (opts.kernel_set() == KernelSetName::Fast)
            .then(|| {
                let bytes = fast_moe::gate_planes_bytes(cfg.n_routed_experts, cfg.hidden_size);
                plan.declare(
                    BufferKind::Derived,
                    format!("derived:layers.{l}.ffn.gate.bf16_planes"),
                    Elem::U8,
                    &[bytes],
                )
            })
            .transpose()?;
        gate_planes.push(planes);
    }
    let inv_freq = placement
        .layers
        .clone()
        .map(|l| {
            let name = format!("derived:layers.{l}.inv_freq");
            plan.declare(BufferKind::Derived, name, Elem::F32, &[cfg.rope_dim / 2])
        })
        .collect::<Result<Vec<_>>>()?;
    let hc0_fold = plan.declare(
        BufferKind::Derived,
        HC0_FOLD_NAME,
        Elem::F64,
        &[(2 + n) * n, d],
    )?;
    // Per-slot state: the block table of each compression ratio the held layers use, the
    // layers' buffers, then the slot lengths and the sticky device error record.
    let mut block_tables: Vec<(usize, RegionId, usize)> = vec![];
    for l in placement.layers.clone() {
        if let (Some(c), Some(e)) = (layouts[l].compressor, layouts[l].entries)
            && !block_tables.iter().any(|t| t.0 == c.ratio)
        {
            let pages = KvRows::pages_for(e[0]);
            let id = plan.declare(
                BufferKind::State,
                format!("state:block_table.ratio{}", c.ratio),
                Elem::I32,
                &[slots, pages],
            )?;
            block_tables.push((c.ratio, id, pages));
        }
    }
    let rows = KvStateRows::new(cfg, opts);
    let layer_state = placement
        .layers
        .clone()
        .map(|l| plan_layer_state(plan, l, &layouts[l], slots, rows, &block_tables))
        .collect::<Result<Vec<_>>>()?;
    let slot_len = plan.declare(BufferKind::State, "state:slot_len", Elem::I32, &[slots])?;
    let record = plan.declare(
        BufferKind::State,
        DEVICE_ERROR_NAME,
        Elem::I32,
        &[FAULT_RECORD_INTS],
    )?;
    let weight_check = plan.declare(
        BufferKind::Workspace,
        "workspace:weight_check",
        Elem::U64,
        &[WEIGHT_CHECKS],
    )?;
    // The batch check's sanitized batch (workspace every kernel set reads).
    let t = opts.max_num_tokens;
    let mut batch = [RegionId(0); 8];
    let extents = [
        ("tokens", t),
        ("positions", t),
        ("seq_of", t),
        ("seq_slots", slots),
        ("query_start", slots + 1),
        ("rows", t),
        ("verdict", 1),
        ("claim", slots),
    ];
    for (id, (name, len)) in batch.iter_mut().zip(extents) {
        *id = plan.declare(
            BufferKind::Workspace,
            format!("workspace:batch.{name}"),
            Elem::I32,
            &[len],
        )?;
    }
    Ok(PlannedBuffers {
        weights,
        expert_tables,
        tensor_maps,
        scales8,
        gate_planes,
        inv_freq,
        hc0_fold,
        layer_state,
        block_tables,
        slot_len,
        record,
        weight_check,
        batch,
    })
}

impl PlannedBuffers {
    /// The device model at its addresses in `buffers`.
    pub(crate) fn model(
        &self,
        buffers: &Buffers,
        cfg: &ModelConfig,
        table: &WeightTable,
        layouts: &[LayerLayout],
    ) -> Result<DeviceModel> {
        let p = |id: RegionId| buffers.ptr(id);
        let weights = self
            .weights
            .iter()
            .map(|w| WeightDev {
                format: w.format,
                data: p(w.data),
                scales: w.scales.map(p),
                block: w.block,
                rows: w.rows,
                cols: w.cols,
            })
            .collect();
        let experts = self
            .expert_tables
            .iter()
            .zip(self.tensor_maps.iter().zip(&self.scales8))
            .zip(&self.gate_planes)
            .map(|((ids, (maps, sc8)), planes)| ExpertTables {
                maps: maps.map(p),
                scales8: sc8.map(p),
                gate_planes: planes.map(p),
                w1: p(ids[0]),
                w2: p(ids[1]),
                w3: p(ids[2]),
                s1: p(ids[3]),
                s2: p(ids[4]),
                s3: p(ids[5]),
            })
            .collect();
        let compressor = |ids: Option<CompressorIds>, c: Option<CompressorLayout>| {
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
        let pages = |ids: PagesIds| KvPagesDev {
            pool: p(ids.pool),
            table: ids.table.map(p),
            pages_per_slot: ids.pages_per_slot,
            rows: ids.rows,
        };
        let layers = self
            .layer_state
            .iter()
            .zip(&self.inv_freq)
            .map(|(ids, &inv)| (ids, &layouts[ids.layer], inv))
            .map(|(ids, lay, inv)| LayerStateDev {
                ring: pages(ids.ring),
                compressor: compressor(ids.compressor, lay.compressor),
                index_compressor: compressor(ids.index_compressor, lay.index_compressor),
                entries: ids.entries.map(pages),
                index_keys: ids.index_keys.map(pages),
                maxe: lay.max_entries(),
                inv_freq: p(inv),
            })
            .collect();
        Ok(DeviceModel {
            handles: ModelWeights::resolve(cfg, table)?,
            weights,
            experts,
            layers,
            block_tables: self
                .block_tables
                .iter()
                .map(|&(_, id, pages)| (p(id), pages))
                .collect(),
            slot_len: p(self.slot_len),
            hc0_fold: p(self.hc0_fold),
            weight_check: p(self.weight_check),
        })
    }

    /// The batch check's buffers and the device error record.
    pub(crate) fn checked_batch(&self, buffers: &Buffers) -> CheckedBatch {
        let p = |k: usize| buffers.ptr(self.batch[k]);
        CheckedBatch {
            tokens: p(0),
            positions: p(1),
            seq_of: p(2),
            seq_slots: p(3),
            query_start: p(4),
            rows: p(5),
            verdict: p(6),
            claim: p(7),
            record: buffers.ptr(self.record),
        }
    }
}
