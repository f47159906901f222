//! Element types of MLX arrays.

use std::fmt;

use half::{bf16, f16};

use crate::ffi::mlx_dtype_ as raw;

/// An MLX element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
    F16,
    F32,
    F64,
    BF16,
    C64,
}

impl Dtype {
    pub(crate) fn to_raw(self) -> raw {
        match self {
            Dtype::Bool => raw::MLX_BOOL,
            Dtype::U8 => raw::MLX_UINT8,
            Dtype::U16 => raw::MLX_UINT16,
            Dtype::U32 => raw::MLX_UINT32,
            Dtype::U64 => raw::MLX_UINT64,
            Dtype::I8 => raw::MLX_INT8,
            Dtype::I16 => raw::MLX_INT16,
            Dtype::I32 => raw::MLX_INT32,
            Dtype::I64 => raw::MLX_INT64,
            Dtype::F16 => raw::MLX_FLOAT16,
            Dtype::F32 => raw::MLX_FLOAT32,
            Dtype::F64 => raw::MLX_FLOAT64,
            Dtype::BF16 => raw::MLX_BFLOAT16,
            Dtype::C64 => raw::MLX_COMPLEX64,
        }
    }

    pub(crate) fn from_raw(d: raw) -> Self {
        match d {
            raw::MLX_BOOL => Dtype::Bool,
            raw::MLX_UINT8 => Dtype::U8,
            raw::MLX_UINT16 => Dtype::U16,
            raw::MLX_UINT32 => Dtype::U32,
            raw::MLX_UINT64 => Dtype::U64,
            raw::MLX_INT8 => Dtype::I8,
            raw::MLX_INT16 => Dtype::I16,
            raw::MLX_INT32 => Dtype::I32,
            raw::MLX_INT64 => Dtype::I64,
            raw::MLX_FLOAT16 => Dtype::F16,
            raw::MLX_FLOAT32 => Dtype::F32,
            raw::MLX_FLOAT64 => Dtype::F64,
            raw::MLX_BFLOAT16 => Dtype::BF16,
            raw::MLX_COMPLEX64 => Dtype::C64,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 8,
        }
    }

    /// MLX's name for the type (as `mlx.core` prints it).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::U16 => "uint16",
            Dtype::U32 => "uint32",
            Dtype::U64 => "uint64",
            Dtype::I8 => "int8",
            Dtype::I16 => "int16",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::BF16 => "bfloat16",
            Dtype::C64 => "complex64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::F32 | Dtype::F64 | Dtype::BF16)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element of an MLX array of one dtype.
pub trait Element: Copy + Send + Sync + 'static + bytemuck::Pod {
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: Dtype = Dtype::$d; })* };
}
element!(u8 => U8, u16 => U16, u32 => U32, u64 => U64, i8 => I8, i16 => I16, i32 => I32, i64 => I64,
         f16 => F16, f32 => F32, f64 => F64, bf16 => BF16);
