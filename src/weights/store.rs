//! [`WeightStore`]: every weight of the model in one place, allocated once at create at its
//! final address and only ever written in place (load, refit). Lookups by canonical name.

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::{Result, Status};
use crate::weights::spec::{ElemKind, TensorSpec, tensor_specs};

/// Engine-side storage of one weight.
pub enum TensorData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl TensorData {
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            TensorData::F32(v) => v.as_ptr().cast(),
            TensorData::I32(v) => v.as_ptr().cast(),
        }
    }
}

pub struct Tensor {
    pub spec: TensorSpec,
    pub data: TensorData,
    /// The values came from an FP8/FP4 source (they are exactly its dequantization).
    pub quantized: bool,
}

pub struct WeightStore {
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
}

impl WeightStore {
    /// Allocates every weight of `cfg` (zero-filled) at its final address.
    pub fn allocate(cfg: &ModelConfig) -> Result<Self> {
        let specs = tensor_specs(cfg);
        let mut tensors = Vec::with_capacity(specs.len());
        let mut by_name = HashMap::with_capacity(specs.len());
        for spec in specs {
            let n = spec.numel();
            let data = match spec.kind {
                ElemKind::Float => TensorData::F32(try_zeroed(n, &spec.name)?),
                ElemKind::Index => TensorData::I32(try_zeroed(n, &spec.name)?),
            };
            by_name.insert(spec.name.clone(), tensors.len());
            tensors.push(Tensor { spec, data, quantized: false });
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

    /// f32 data of tensor `i`. Panics if it is an index table (a programming error).
    pub fn f32(&self, i: usize) -> &[f32] {
        match &self.tensors[i].data {
            TensorData::F32(v) => v,
            TensorData::I32(_) => panic!("weight `{}` is not a float tensor", self.tensors[i].spec.name),
        }
    }

    /// i32 data of tensor `i`. Panics if it is a float tensor (a programming error).
    pub fn i32(&self, i: usize) -> &[i32] {
        match &self.tensors[i].data {
            TensorData::I32(v) => v,
            TensorData::F32(_) => panic!("weight `{}` is not an index tensor", self.tensors[i].spec.name),
        }
    }

    /// Whether weight `i` holds FP8/FP4-quantized values (its GEMMs quantize activations in
    /// the official numerics).
    pub fn is_quantized(&self, i: usize) -> bool {
        self.tensors[i].quantized
    }

    /// Index of a weight the model requires; a missing one is an internal error.
    pub fn require(&self, name: &str) -> Result<usize> {
        self.index_of(name).ok_or_else(|| crate::err!(Internal, "weight table lacks `{name}`"))
    }
}

/// Allocates `n` zeroed elements, turning allocation failure into an error instead of an abort.
fn try_zeroed<T: Default + Clone>(n: usize, name: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        crate::error::Error::new(Status::Capacity, format!("cannot allocate {n} elements for weight `{name}`"))
    })?;
    v.resize(n, T::default());
    Ok(v)
}
