//! The compressed key/value cache of one attention layer, and attention over it.
//!
//! Keys and values are kept only as packed codes and float16 norms in stores
//! that grow by doubling, plus two float16 windows: the first `sinks` tokens
//! (attention sinks) and the most recent `window` tokens (up to `window +
//! window` before the oldest `window` of them are compressed in one batch). No
//! float16 copy of a compressed token is kept. The `fp16` method is the
//! uncompressed control: dense buffers and MLX's fused attention.

mod state;

use std::fmt;
use std::str::FromStr;

pub use state::{rotation_matrix, LayerCache};

use crate::error::{Error, Result};
use crate::kernels::Policy;

/// How the keys or values of a layer are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    /// Uncompressed (the cache's dtype): the control.
    Fp16,
    /// TurboQuant-MSE: norm + rotated Lloyd–Max codes.
    TurboQuantMse,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Fp16 => "fp16",
            Method::TurboQuantMse => "turboquant-mse",
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Method {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp16" | "float16" => Ok(Method::Fp16),
            "turboquant-mse" | "turboquant" => Ok(Method::TurboQuantMse),
            other => Err(Error::invalid("method", format!("{other:?} is not one of \"fp16\", \"turboquant-mse\""))),
        }
    }
}

/// The configuration of one layer's cache.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    pub head_dim: usize,
    pub kv_heads: usize,
    pub key_method: Method,
    pub key_bits: u32,
    pub value_method: Method,
    pub value_bits: u32,
    /// Most recent tokens kept in float16.
    pub window: usize,
    /// First tokens kept in float16 (attention sinks).
    pub sinks: usize,
    /// Seed of the random rotation.
    pub seed: u64,
    pub policy: Policy,
}

impl CacheConfig {
    pub fn new(head_dim: usize, kv_heads: usize) -> Self {
        CacheConfig {
            head_dim,
            kv_heads,
            key_method: Method::TurboQuantMse,
            key_bits: 4,
            value_method: Method::TurboQuantMse,
            value_bits: 4,
            window: 128,
            sinks: 4,
            seed: 0,
            policy: Policy::Auto,
        }
    }

    pub fn validate(&self) -> Result<()> {
        crate::kernels::turboquant::check_head_dim("head_dim", self.head_dim)?;
        if self.kv_heads == 0 {
            return Err(Error::invalid("kv_heads", "must be at least 1"));
        }
        if self.key_method != self.value_method {
            return Err(Error::invalid(
                "value_method",
                format!("{} with keys in {} is not supported; use the same method for both", self.value_method, self.key_method),
            ));
        }
        if self.key_method == Method::TurboQuantMse {
            for (arg, bits) in [("key_bits", self.key_bits), ("value_bits", self.value_bits)] {
                if !crate::kernels::turboquant::TQ_BITS.contains(&bits) {
                    return Err(Error::invalid(
                        arg,
                        format!("{bits} is not supported by turboquant-mse; use one of {:?}", crate::kernels::turboquant::TQ_BITS),
                    ));
                }
            }
            if self.window == 0 {
                return Err(Error::invalid("window", "must be at least 1 token for turboquant-mse"));
            }
        }
        Ok(())
    }
}
