//! Weights: the name/shape table (`spec`), the engine-side store (`store`), checkpoint
//! reading (`safetensors_io`, `names`, `dtype`, `load`) and dummy fill (`dummy`).

pub mod dtype;
pub mod dummy;
pub mod load;
pub mod names;
pub mod qmatrix;
pub mod quant;
pub mod safetensors_io;
pub mod spec;
pub mod store;

/// `weight_format` create option (DESIGN.md §4): how quantizable weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// As the config declares: FP8/FP4 when it has a `quantization_config`, else f32.
    AsStored,
    /// BF16 (FP8/FP4 sources are dequantized, exactly).
    Bf16,
    /// FP8 dense / FP4 experts with UE8M0 scales, quantizing float sources on write.
    Quantize,
}

/// Element type of host data handed to `load_tensor` / `refit` (mirrors `dsv4_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum HostDtype {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    I32 = 3,
    I64 = 4,
}

impl HostDtype {
    pub fn size(self) -> usize {
        match self {
            HostDtype::F32 | HostDtype::I32 => 4,
            HostDtype::Bf16 | HostDtype::F16 => 2,
            HostDtype::I64 => 8,
        }
    }

    pub fn from_i32(v: i32) -> Option<Self> {
        Some(match v {
            0 => HostDtype::F32,
            1 => HostDtype::Bf16,
            2 => HostDtype::F16,
            3 => HostDtype::I32,
            4 => HostDtype::I64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            HostDtype::F32 => "F32",
            HostDtype::Bf16 => "BF16",
            HostDtype::F16 => "F16",
            HostDtype::I32 => "I32",
            HostDtype::I64 => "I64",
        }
    }
}
