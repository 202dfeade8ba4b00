//! [`WeightStore`]: the values of every weight in host memory, allocated once at create at
//! their final address and only ever written in place (load, refit). The CPU backend's
//! weights (and tests' host models); the CUDA backend holds none (DESIGN.md §2: no host
//! mirror), its values live in the device arena only.

use crate::config::ModelConfig;
use crate::error::{Result, Status};
use crate::weights::WeightFormat;
use crate::weights::qmatrix::QMatrix;
use crate::weights::spec::TensorSpec;
use crate::weights::table::storage_kind;
pub use crate::weights::table::{StorageKind, WeightLayout, WeightTable, weight_layout};

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

    /// The stored values as bytes (little-endian f32 / bf16 / i32 words, or the codes) and the
    /// f32 block scales (empty unless quantized), for writing in place.
    pub fn parts_mut(&mut self) -> (&mut [u8], &mut [f32]) {
        fn bytes_of<T: Copy>(v: &mut [T]) -> &mut [u8] {
            // SAFETY: the words are plain numbers (f32, u16, i32) with no invalid bit patterns,
            // u8 needs no alignment, and the byte slice borrows `v` mutably for its lifetime.
            unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v))
            }
        }
        match self {
            TensorData::F32(v) => (bytes_of(v), &mut []),
            TensorData::Bf16(v) => (bytes_of(v), &mut []),
            TensorData::I32(v) => (bytes_of(v), &mut []),
            TensorData::Quant(q) => (&mut q.codes, &mut q.scales),
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
    table: WeightTable,
    tensors: Vec<Tensor>,
}

impl WeightStore {
    /// Allocates every weight of `cfg` (zero-filled) at its final address, as stored in
    /// the checkpoint the config declares.
    pub fn allocate(cfg: &ModelConfig) -> Result<Self> {
        Self::allocate_with(cfg, WeightFormat::AsStored)
    }

    /// Allocates every weight with quantizable weights held per `format`.
    pub fn allocate_with(cfg: &ModelConfig, format: WeightFormat) -> Result<Self> {
        let table = WeightTable::new(cfg, format)?;
        let tensors = table
            .entries()
            .iter()
            .map(|e| {
                Ok(Tensor {
                    spec: e.spec.clone(),
                    data: storage_for(&e.spec, cfg, format)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(WeightStore { table, tensors })
    }

    /// A store of no weights (a placeholder while the real one is lent out).
    pub fn empty() -> Self {
        WeightStore {
            table: WeightTable::empty(),
            tensors: Vec::new(),
        }
    }

    /// The table these values follow (names, shapes, layouts).
    pub fn table(&self) -> &WeightTable {
        &self.table
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.table.index_of(name)
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

    /// The table and every weight's values, for writing them while reading the table.
    pub fn table_and_tensors_mut(&mut self) -> (&WeightTable, &mut [Tensor]) {
        (&self.table, &mut self.tensors)
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
        self.table.require(name)
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
