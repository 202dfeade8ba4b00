//! The storage format of a weight matrix, shared by the host store, the C ABI's weight
//! listing and the CUDA kernels (one enum: the kernels' `fmt` codes are its values).

use crate::weights::qmatrix::{FP4_BLOCK, QFormat};

/// How a weight matrix's values are stored: in the host store (`TensorData`) and, byte for
/// byte, in device memory, where the value is the kernels' `fmt` code (kernels/SPEC.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum StorageFormat {
    /// `float[rows * cols]`.
    F32 = 0,
    /// `unsigned short[rows * cols]` (bfloat16 bit patterns).
    Bf16 = 1,
    /// e4m3fn codes `u8[rows * cols]`, scales `f32[ceil(rows/br) * ceil(cols/bc)]`.
    Fp8 = 2,
    /// e2m1 codes `u8[rows * ceil(cols/2)]` (low nibble = even column), scales
    /// `f32[rows * ceil(cols/32)]`.
    Fp4 = 3,
}

impl StorageFormat {
    /// The `fmt` argument of the kernels.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The device format of a quantized CPU matrix.
    pub fn of_qformat(q: QFormat) -> StorageFormat {
        match q {
            QFormat::Fp8 { .. } => StorageFormat::Fp8,
            QFormat::Fp4 => StorageFormat::Fp4,
        }
    }

    /// Bytes of the values (codes) of a `rows x cols` matrix.
    pub fn data_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            StorageFormat::F32 => rows * cols * 4,
            StorageFormat::Bf16 => rows * cols * 2,
            StorageFormat::Fp8 => rows * cols,
            StorageFormat::Fp4 => rows * cols.div_ceil(2),
        }
    }

    /// Number of f32 scales of a `rows x cols` matrix (`block` = FP8 [br, bc]).
    pub fn scale_count(self, rows: usize, cols: usize, block: [usize; 2]) -> usize {
        match self {
            StorageFormat::F32 | StorageFormat::Bf16 => 0,
            StorageFormat::Fp8 => rows.div_ceil(block[0].max(1)) * cols.div_ceil(block[1].max(1)),
            StorageFormat::Fp4 => rows * cols.div_ceil(FP4_BLOCK),
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, StorageFormat::Fp8 | StorageFormat::Fp4)
    }
}
