//! The one error type of the quantizers. Every message names the argument
//! that is wrong, so a caller can tell what to fix without reading the code.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum QuantError {
    /// A bit width the method has no codebook or packing for.
    #[error("bits: {bits} is not supported by {method} ({supported})")]
    UnsupportedBits { method: &'static str, bits: u32, supported: &'static str },

    /// A vector length the method (usually its rotation) cannot handle.
    #[error("dim: {dim} is not supported by {method} ({reason})")]
    UnsupportedDim { method: &'static str, dim: usize, reason: String },

    /// Any other argument outside its domain.
    #[error("{arg}: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },

    /// NaN or infinity in an input vector.
    #[error("{arg}: element {index} is not finite ({value})")]
    NonFinite { arg: &'static str, index: usize, value: f32 },

    /// A norm, scale or zero point that does not fit in float16.
    #[error("{arg}: {value} of row {row} does not fit in float16")]
    F16Overflow { arg: &'static str, row: usize, value: f32 },

    /// Calibration needs at least one sample.
    #[error("calibration: {0}")]
    Calibration(String),

    /// An `Encoded` whose buffers do not match the quantizer that reads it.
    #[error("encoded: {0}")]
    Encoded(String),

    /// A calibration artifact that is truncated, corrupt or for another method.
    #[error("artifact: {0}")]
    Artifact(String),

    #[error("artifact: io error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, QuantError>;

impl QuantError {
    pub(crate) fn arg(arg: &'static str, reason: impl Into<String>) -> Self {
        QuantError::InvalidArgument { arg, reason: reason.into() }
    }
}
