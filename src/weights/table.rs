//! [`WeightTable`]: every weight of the model with its storage layout, known from the config
//! and the create options alone. The engine validates every load and refit against it; it
//! holds no values. Where the values live is the backend's business: the CPU backend's
//! [`crate::weights::store::WeightStore`], or the CUDA backend's device arena (no host copy).

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightFormat;
use crate::weights::qmatrix::QFormat;
use crate::weights::spec::{ElemKind, StoredAs, TensorSpec, tensor_specs};

/// How one weight is stored, decided from its spec, the config and the weight format alone
/// (no allocation): quantizable weights follow `weight_format`; everything else is f32 (or
/// i32 for index tables). Both backends hold this layout, the CUDA one byte for byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageKind {
    I32,
    F32,
    Bf16,
    Quant(QFormat),
}

/// One weight's storage: its kind and bytes (values or codes, and f32 scales).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightLayout {
    pub kind: StorageKind,
    pub data_bytes: usize,
    /// f32 block scales (quantized weights only).
    pub scales: usize,
}

impl WeightLayout {
    /// Bytes of values and scales.
    pub fn bytes(&self) -> usize {
        self.data_bytes + self.scales * 4
    }
}

pub(crate) fn storage_kind(
    spec: &TensorSpec,
    cfg: &ModelConfig,
    format: WeightFormat,
) -> Result<StorageKind> {
    if spec.kind == ElemKind::Index {
        return Ok(StorageKind::I32);
    }
    if spec.stored == StoredAs::Bf16Matrix {
        // Kept as the release stores it, whatever the format asks of quantizable weights.
        return Ok(StorageKind::Bf16);
    }
    let quantizable = spec.stored != StoredAs::Plain && spec.shape.len() == 2;
    let quantize = match format {
        WeightFormat::Quantize => true,
        WeightFormat::AsStored => cfg.quant.is_some(),
        WeightFormat::Bf16 => false,
    };
    if !quantizable {
        return Ok(StorageKind::F32);
    }
    if format == WeightFormat::Bf16 {
        return Ok(StorageKind::Bf16);
    }
    if !quantize {
        return Ok(StorageKind::F32);
    }
    let block = cfg.quant.as_ref().map_or([128, 128], |q| q.weight_block);
    let experts_fp8 = cfg.quant.as_ref().is_some_and(|q| q.expert_dtype == "fp8");
    let qf = match spec.stored {
        StoredAs::Fp4Expert if !experts_fp8 => QFormat::Fp4,
        _ => QFormat::Fp8 { block },
    };
    let cols = spec.shape[1];
    if qf == QFormat::Fp4 && !cols.is_multiple_of(2) {
        crate::bail!(
            Config,
            "weight `{}` has an odd input dimension {cols}: FP4 packs two values per byte",
            spec.name
        );
    }
    Ok(StorageKind::Quant(qf))
}

/// The storage of weight `spec` (see [`StorageKind`]), without allocating it.
pub fn weight_layout(
    spec: &TensorSpec,
    cfg: &ModelConfig,
    format: WeightFormat,
) -> Result<WeightLayout> {
    let kind = storage_kind(spec, cfg, format)?;
    let n = spec.numel();
    Ok(match kind {
        StorageKind::I32 | StorageKind::F32 => WeightLayout {
            kind,
            data_bytes: n * 4,
            scales: 0,
        },
        StorageKind::Bf16 => WeightLayout {
            kind,
            data_bytes: n * 2,
            scales: 0,
        },
        StorageKind::Quant(q) => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let f = crate::weights::format::StorageFormat::of_qformat(q);
            let block = match q {
                QFormat::Fp8 { block } => block,
                QFormat::Fp4 => [0, 0],
            };
            WeightLayout {
                kind,
                data_bytes: f.data_bytes(rows, cols),
                scales: f.scale_count(rows, cols, block),
            }
        }
    })
}

/// One weight: its spec (name, logical shape, kind) and how it is stored.
#[derive(Clone, Debug)]
pub struct TableEntry {
    pub spec: TensorSpec,
    pub layout: WeightLayout,
}

impl TableEntry {
    /// Columns of the weight's matrix view (its last dimension; 1 for a scalar).
    pub fn cols(&self) -> usize {
        self.spec.shape.last().copied().unwrap_or(1)
    }

    /// Rows of the weight's matrix view (every dimension but the last).
    pub fn rows(&self) -> usize {
        self.spec.numel().checked_div(self.cols()).unwrap_or(0)
    }
}

/// Every weight of a model, in [`tensor_specs`] order, with lookups by canonical name.
#[derive(Clone, Debug)]
pub struct WeightTable {
    entries: Vec<TableEntry>,
    by_name: HashMap<String, usize>,
}

impl WeightTable {
    /// The table of `cfg` with quantizable weights held per `format`.
    pub fn new(cfg: &ModelConfig, format: WeightFormat) -> Result<WeightTable> {
        let specs = tensor_specs(cfg);
        let mut entries = Vec::with_capacity(specs.len());
        let mut by_name = HashMap::with_capacity(specs.len());
        for spec in specs {
            let layout = weight_layout(&spec, cfg, format)?;
            by_name.insert(spec.name.clone(), entries.len());
            entries.push(TableEntry { spec, layout });
        }
        Ok(WeightTable { entries, by_name })
    }

    /// A table of no weights.
    pub fn empty() -> WeightTable {
        WeightTable {
            entries: Vec::new(),
            by_name: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn entry(&self, i: usize) -> &TableEntry {
        &self.entries[i]
    }

    pub fn entries(&self) -> &[TableEntry] {
        &self.entries
    }

    /// Canonical name of weight `i`.
    pub fn name(&self, i: usize) -> &str {
        &self.entries[i].spec.name
    }

    /// Whether weight `i` is held as FP8/FP4 codes with scales.
    pub fn is_quantized(&self, i: usize) -> bool {
        matches!(self.entries[i].layout.kind, StorageKind::Quant(_))
    }

    /// Bytes of every weight's values and scales.
    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.layout.bytes() as u64).sum()
    }

    /// Every weight's (name, shape, storage): what the memory plans lay out.
    pub fn layouts(&self) -> Vec<(String, Vec<usize>, WeightLayout)> {
        self.entries
            .iter()
            .map(|e| (e.spec.name.clone(), e.spec.shape.clone(), e.layout))
            .collect()
    }

    /// Index of a weight the model requires; a missing one is an internal error.
    pub fn require(&self, name: &str) -> Result<usize> {
        self.index_of(name)
            .ok_or_else(|| crate::err!(Internal, "weight table lacks `{name}`"))
    }
}
