//! [`WeightStore`]: every weight of the model in one place, allocated once at create at its
//! final address and only ever written in place (load, refit). Lookups by canonical name.

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::{Result, Status};
use crate::weights::WeightFormat;
use crate::weights::qmatrix::{QFormat, QMatrix};
use crate::weights::spec::{ElemKind, StoredAs, TensorSpec, tensor_specs};

/// Engine-side storage of one weight.
pub enum TensorData {
    F32(Vec<f32>),
    /// bfloat16 bit patterns (quantizable weights under `weight_format = bf16`).
    Bf16(Vec<u16>),
    /// FP8/FP4 codes with scales (quantizable weights under `as_stored` of a quantized
    /// checkpoint, or `quantize`).
    Quant(QMatrix),
    I32(Vec<i32>),
}

impl TensorData {
    /// The storage as allocated (equals [`weight_layout`] of its spec).
    pub fn layout(&self) -> WeightLayout {
        match self {
            TensorData::F32(v) => WeightLayout {
                kind: StorageKind::F32,
                data_bytes: v.len() * 4,
                scales: 0,
            },
            TensorData::I32(v) => WeightLayout {
                kind: StorageKind::I32,
                data_bytes: v.len() * 4,
                scales: 0,
            },
            TensorData::Bf16(v) => WeightLayout {
                kind: StorageKind::Bf16,
                data_bytes: v.len() * 2,
                scales: 0,
            },
            TensorData::Quant(q) => WeightLayout {
                kind: StorageKind::Quant(q.format),
                data_bytes: q.codes.len(),
                scales: q.scales.len(),
            },
        }
    }

    /// Address of the stored values (the codes, for quantized weights).
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            TensorData::F32(v) => v.as_ptr().cast(),
            TensorData::Bf16(v) => v.as_ptr().cast(),
            TensorData::Quant(q) => q.codes.as_ptr(),
            TensorData::I32(v) => v.as_ptr().cast(),
        }
    }
}

impl TensorData {
    /// Overwrites a float weight with `values` (rounded to BF16 or quantized as its
    /// storage requires; quantized storage needs finite values). Index tables are untouched.
    pub fn set_from_f32(&mut self, values: &[f32]) {
        match self {
            TensorData::F32(v) => v.copy_from_slice(values),
            TensorData::Bf16(v) => v
                .iter_mut()
                .zip(values)
                .for_each(|(o, x)| *o = half::bf16::from_f32(*x).to_bits()),
            TensorData::Quant(q) => q.quantize_from(values),
            TensorData::I32(_) => {}
        }
    }
}

/// A read view of a 2-D weight matrix in whatever format it is stored.
#[derive(Clone, Copy)]
pub enum MatRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Quant(&'a QMatrix),
}

impl MatRef<'_> {
    /// Row `r` of a matrix with `cols` columns as f32 (exact dequantization).
    pub fn row_into(&self, r: usize, cols: usize, out: &mut [f32]) {
        match self {
            MatRef::F32(v) => out.copy_from_slice(&v[r * cols..(r + 1) * cols]),
            MatRef::Bf16(v) => out
                .iter_mut()
                .zip(&v[r * cols..(r + 1) * cols])
                .for_each(|(o, &b)| *o = half::bf16::from_bits(b).to_f32()),
            MatRef::Quant(q) => q.row(r, out),
        }
    }

    /// The f32 slice, when the matrix is stored as f32 (lets hot loops skip the copy).
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            MatRef::F32(v) => Some(v),
            _ => None,
        }
    }
}

/// The storage chosen for a weight: quantizable weights follow `weight_format`; everything
/// else is f32 (or i32 for index tables) on the CPU backend.
/// How one weight is stored, decided from its spec, the config and the weight format alone
/// (no allocation): what [`WeightStore::allocate_with`] allocates and what the memory plan
/// counts.
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

fn storage_kind(spec: &TensorSpec, cfg: &ModelConfig, format: WeightFormat) -> Result<StorageKind> {
    if spec.kind == ElemKind::Index {
        return Ok(StorageKind::I32);
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

fn storage_for(spec: &TensorSpec, cfg: &ModelConfig, format: WeightFormat) -> Result<TensorData> {
    let n = spec.numel();
    Ok(match storage_kind(spec, cfg, format)? {
        StorageKind::I32 => TensorData::I32(try_zeroed(n, &spec.name)?),
        StorageKind::F32 => TensorData::F32(try_zeroed(n, &spec.name)?),
        StorageKind::Bf16 => TensorData::Bf16(try_zeroed(n, &spec.name)?),
        StorageKind::Quant(qf) => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            // Reserve first so a huge config fails cleanly instead of aborting.
            let _probe: Vec<u8> = try_zeroed(rows * cols, &spec.name)?;
            drop(_probe);
            TensorData::Quant(QMatrix::zeros(qf, rows, cols))
        }
    })
}

pub struct Tensor {
    pub spec: TensorSpec,
    pub data: TensorData,
}

pub struct WeightStore {
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
}

impl WeightStore {
    /// Allocates every weight of `cfg` (zero-filled) at its final address, as stored in
    /// the checkpoint the config declares.
    pub fn allocate(cfg: &ModelConfig) -> Result<Self> {
        Self::allocate_with(cfg, WeightFormat::AsStored)
    }

    /// Every weight's (name, shape, storage) as [`WeightStore::allocate_with`] would allocate
    /// it, allocating nothing (the memory plan).
    pub fn layouts(
        cfg: &ModelConfig,
        format: WeightFormat,
    ) -> Result<Vec<(String, Vec<usize>, WeightLayout)>> {
        tensor_specs(cfg)
            .into_iter()
            .map(|spec| {
                let l = weight_layout(&spec, cfg, format)?;
                Ok((spec.name, spec.shape, l))
            })
            .collect()
    }

    /// The allocated weights' (name, shape, storage), in [`WeightStore::layouts`] order.
    pub fn allocated_layouts(&self) -> Vec<(String, Vec<usize>, WeightLayout)> {
        self.tensors
            .iter()
            .map(|t| (t.spec.name.clone(), t.spec.shape.clone(), t.data.layout()))
            .collect()
    }

    /// Allocates every weight with quantizable weights held per `format`.
    pub fn allocate_with(cfg: &ModelConfig, format: WeightFormat) -> Result<Self> {
        let specs = tensor_specs(cfg);
        let mut tensors = Vec::with_capacity(specs.len());
        let mut by_name = HashMap::with_capacity(specs.len());
        for spec in specs {
            let data = storage_for(&spec, cfg, format)?;
            by_name.insert(spec.name.clone(), tensors.len());
            tensors.push(Tensor { spec, data });
        }
        Ok(WeightStore { tensors, by_name })
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn tensor(&self, i: usize) -> &Tensor {
        &self.tensors[i]
    }

    pub fn tensor_mut(&mut self, i: usize) -> &mut Tensor {
        &mut self.tensors[i]
    }

    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    pub fn tensors_mut(&mut self) -> &mut [Tensor] {
        &mut self.tensors
    }

    /// f32 data of tensor `i`. Panics unless it is stored f32 (a programming error: only
    /// non-quantizable weights are read this way; linears go through [`WeightStore::matrix`]).
    pub fn f32(&self, i: usize) -> &[f32] {
        match &self.tensors[i].data {
            TensorData::F32(v) => v,
            _ => self.misuse(i, "is not stored as f32"),
        }
    }

    /// i32 data of tensor `i`. Panics if it is not an index table (a programming error).
    pub fn i32(&self, i: usize) -> &[i32] {
        match &self.tensors[i].data {
            TensorData::I32(v) => v,
            _ => self.misuse(i, "is not an index tensor"),
        }
    }

    /// Panics naming weight `i`: it was read as what it is not (a programming error).
    fn misuse(&self, i: usize, what: &str) -> ! {
        panic!("weight `{}` {what}", self.tensors[i].spec.name)
    }

    /// Read view of weight matrix `i` in its stored format.
    pub fn matrix(&self, i: usize) -> MatRef<'_> {
        match &self.tensors[i].data {
            TensorData::F32(v) => MatRef::F32(v),
            TensorData::Bf16(v) => MatRef::Bf16(v),
            TensorData::Quant(q) => MatRef::Quant(q),
            TensorData::I32(_) => self.misuse(i, "is an index table, not a matrix"),
        }
    }

    /// Whether weight `i` holds FP8/FP4-quantized values (its GEMMs quantize activations in
    /// the official numerics).
    pub fn is_quantized(&self, i: usize) -> bool {
        matches!(self.tensors[i].data, TensorData::Quant(_))
    }

    /// Index of a weight the model requires; a missing one is an internal error.
    pub fn require(&self, name: &str) -> Result<usize> {
        self.index_of(name)
            .ok_or_else(|| crate::err!(Internal, "weight table lacks `{name}`"))
    }
}

/// Allocates `n` zeroed elements, turning allocation failure into an error instead of an abort.
fn try_zeroed<T: Default + Clone>(n: usize, name: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        crate::error::Error::new(
            Status::OutOfMemory,
            format!("cannot allocate {n} elements for weight `{name}`"),
        )
    })?;
    v.resize(n, T::default());
    Ok(v)
}
