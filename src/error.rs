//! The crate's one error type.

use std::panic::Location;

/// Everything that can go wrong in veloxquant. Messages name the argument at
/// fault, so that the Python layer can pass them on as they are.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument has the wrong element type.
    #[error("{argument}: dtype {found} is not supported; expected {expected}")]
    Dtype { argument: &'static str, found: String, expected: String },
    /// An argument has a wrong value or shape.
    #[error("{argument}: {message}")]
    InvalidArgument { argument: &'static str, message: String },
    /// The requested implementation is not available for this stream.
    #[error("{0}")]
    Unsupported(String),
    /// MLX reported an error (its own message).
    #[error("MLX: {message} (at {location})")]
    Mlx { message: String, location: &'static Location<'static> },
    /// A Rust callback invoked from C++ panicked or failed.
    #[error("kernel {kernel}: {message}")]
    Kernel { kernel: String, message: String },
    /// The MLX loaded at run time is not the one veloxquant was built against.
    #[error("MLX version mismatch: veloxquant was built against MLX {compiled} but MLX {loaded} is loaded; install mlx=={compiled}")]
    VersionMismatch { compiled: String, loaded: String },
    /// A quantizer rejected its arguments, data or artifact (`quant::QuantError`,
    /// whose message already names the argument).
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(argument: &'static str, message: impl Into<String>) -> Self {
        Error::InvalidArgument { argument, message: message.into() }
    }
}
