//! Weights: the name/shape table (`spec`), the engine-side store (`store`), checkpoint
//! reading (`safetensors_io`, `names`, `dtype`, `load`) and dummy fill (`dummy`).

pub mod dtype;
pub mod dummy;
pub mod format;
pub mod load;
pub mod names;
pub mod qmatrix;
pub mod quant;
pub mod rows;
pub mod safetensors_io;
pub mod spec;
pub mod store;
pub mod table;
pub mod values;

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
    /// FP8 e4m3fn codes, one per byte (a stored-format weight: its scale comes as a separate
    /// entry of the same refit).
    F8E4M3 = 5,
    /// Packed FP4 e2m1 codes, two per byte (low nibble = even column); the shape is the
    /// logical one, so the data holds numel / 2 bytes.
    Fp4E2M1 = 6,
    /// UE8M0 block-scale bytes (2^(b - 127)).
    E8M0 = 7,
}

impl HostDtype {
    pub fn from_i32(v: i32) -> Option<Self> {
        Some(match v {
            0 => HostDtype::F32,
            1 => HostDtype::Bf16,
            2 => HostDtype::F16,
            3 => HostDtype::I32,
            4 => HostDtype::I64,
            5 => HostDtype::F8E4M3,
            6 => HostDtype::Fp4E2M1,
            7 => HostDtype::E8M0,
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
            HostDtype::F8E4M3 => "F8_E4M3",
            HostDtype::Fp4E2M1 => "FP4_E2M1",
            HostDtype::E8M0 => "E8M0",
        }
    }

    /// Bytes of a tensor of this dtype and `shape`; None on overflow, or for packed FP4 with
    /// an odd last dimension (two codes share a byte within a row).
    pub fn nbytes(self, shape: &[usize]) -> Option<usize> {
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        match self {
            HostDtype::F32 | HostDtype::I32 => numel.checked_mul(4),
            HostDtype::Bf16 | HostDtype::F16 => numel.checked_mul(2),
            HostDtype::I64 => numel.checked_mul(8),
            HostDtype::F8E4M3 | HostDtype::E8M0 => Some(numel),
            HostDtype::Fp4E2M1 => {
                (shape.last().copied().unwrap_or(1) % 2 == 0).then_some(numel / 2)
            }
        }
    }
}

/// Where an update's bytes live.
#[derive(Clone, Copy, Debug)]
pub enum Bytes<'a> {
    Host(&'a [u8]),
    /// Device memory of the engine's CUDA device: address and byte count (written on the
    /// device, never copied to the host).
    Device {
        addr: u64,
        len: usize,
    },
}

impl<'a> Bytes<'a> {
    pub fn len(&self) -> usize {
        match self {
            Bytes::Host(b) => b.len(),
            Bytes::Device { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes when they are in host memory.
    pub fn host(&self) -> Option<&'a [u8]> {
        match self {
            Bytes::Host(b) => Some(b),
            Bytes::Device { .. } => None,
        }
    }

    /// The host bytes, or nothing for device memory (host-only code paths, which the plan
    /// never gives a device source).
    pub fn host_or_empty(&self) -> &'a [u8] {
        self.host().unwrap_or(&[])
    }
}

impl<'a> From<&'a [u8]> for Bytes<'a> {
    fn from(b: &'a [u8]) -> Self {
        Bytes::Host(b)
    }
}

impl<'a> From<&'a Vec<u8>> for Bytes<'a> {
    fn from(b: &'a Vec<u8>) -> Self {
        Bytes::Host(b)
    }
}

/// One named tensor as `load_tensor` / `refit` receive it, in host or device memory.
#[derive(Clone, Copy, Debug)]
pub struct UpdateTensor<'a> {
    pub name: &'a str,
    pub dtype: HostDtype,
    pub shape: &'a [usize],
    pub data: Bytes<'a>,
}
