//! A cache's configuration: the methods (each defined once, in
//! [`METHOD_DEFS`]), their bits and windows, and how KIVI keys' channels
//! share their bits.

use std::fmt;
use std::str::FromStr;

use crate::array::Array;
use crate::codec::{Codec, SideCodec, PQ_CODE_BITS};
use crate::error::{Error, Result};
use crate::kernels::Policy;

/// Which cached tokens each query attends to.
#[derive(Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every cached token.
    None,
    /// Query `l` of `L` sits at position `offset - L + l` and sees tokens up to it.
    Causal,
    /// Boolean (true attends) or additive (a float dtype), broadcastable to
    /// `[batch, q_heads, queries, offset]`, as MLX's attention takes it.
    /// Compressed caches attend through the generic fused kernel, which adds
    /// it to the scores; a query that sees no token gets zeros.
    Array(&'a Array),
}

/// How the keys or values of a layer are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    /// Uncompressed (the cache's dtype): the control.
    Fp16,
    /// TurboQuant-MSE: norm + rotated Lloyd–Max codes.
    TurboQuantMse,
    /// KIVI: asymmetric min/max codes; keys per channel over groups of
    /// tokens, values per token over groups of channels.
    Kivi,
    /// Product quantization (VecInfer-style): norm + one 8-bit code per
    /// sub-vector of the rotated unit vector; `bits` per element sets the
    /// sub-vector size (`8 / bits` channels).
    Pq,
    /// QJL (keys only): signs of a `bits * D`-row Gaussian sketch of the key
    /// and its norm; scores are the unbiased QJL estimate.
    Qjl,
    /// TurboQuant-Prod (keys only): `bits − 1` MSE bits plus one QJL sign
    /// bit of the residual per channel; scores are unbiased.
    TurboQuantProd,
    /// TurboQuant-RVQ: `bits − 1` bits, then 1 bit on the residual.
    TurboQuantRvq,
    /// Affine codes per token, keys and values alike: a float16 scale and
    /// zero per group of up to 64 channels, the layout of mlx_lm's
    /// `QuantizedKVCache` (`group_size` 64), here with the cache's windows
    /// and fused attention: the like-for-like baseline at equal bits.
    Affine,
    /// FP8: float8 e4m3 codes per element and a float16 scale per token,
    /// keys and values alike (the FP8 KV caches of serving engines).
    Fp8,
}

/// Every method, in the order the documentation lists them (and of
/// [`Method::def`]'s table).
pub const METHODS: [Method; 9] = [
    Method::Fp16,
    Method::TurboQuantMse,
    Method::Kivi,
    Method::Pq,
    Method::Qjl,
    Method::TurboQuantProd,
    Method::TurboQuantRvq,
    Method::Affine,
    Method::Fp8,
];

/// One method's definition: the names arguments and saved states use, the
/// bits it takes, whether it can hold values, and the codec each side of a
/// layer stores its tokens with ([`crate::codec`] defines those).
pub struct MethodDef {
    pub method: Method,
    /// The name arguments, configurations and saved states use.
    pub name: &'static str,
    /// Other names an argument may use.
    pub aliases: &'static [&'static str],
    /// The bits per element it supports (`None`: bits are ignored).
    pub bits: Option<&'static [u32]>,
    /// Whether it only estimates attention scores, so that it can hold keys
    /// but not values.
    pub keys_only: bool,
    /// The codec of its keys (`true`) or values at `bits` in a layer of `cfg`.
    pub codec: fn(cfg: &CacheConfig, bits: u32, keys: bool) -> SideCodec,
}

/// The definitions, in the order of [`METHODS`].
static METHOD_DEFS: [MethodDef; 9] = [
    MethodDef {
        method: Method::Fp16,
        name: "fp16",
        aliases: &["float16"],
        bits: None,
        keys_only: false,
        codec: |_, bits, _| SideCodec { codec: Codec::Dense, bits, group: 1 },
    },
    MethodDef {
        method: Method::TurboQuantMse,
        name: "turboquant-mse",
        aliases: &["turboquant", "mse"],
        bits: Some(&crate::kernels::turboquant::TQ_BITS),
        keys_only: false,
        // 3-bit values on a uniform grid: as good as the Lloyd–Max table on
        // real values (SmolLM2 K4/V3: KL 0.0201 against 0.0214), and read by
        // CUDA's decode without a table. Keys keep the table (3-bit keys on
        // the grid: +8.7% perplexity against +6.0%).
        codec: |_, bits, keys| SideCodec {
            codec: if !keys && bits == 3 { Codec::TurboQuantUniform } else { Codec::TurboQuantMse },
            bits,
            group: 1,
        },
    },
    MethodDef {
        method: Method::Kivi,
        name: "kivi",
        aliases: &[],
        bits: Some(&crate::cpu::SUPPORTED_BITS),
        keys_only: false,
        codec: |cfg, bits, keys| {
            if keys {
                // KIVI's groups of `key_group` tokens; the recent slots hold
                // at least one group beyond the window (`recent_capacity`).
                SideCodec { codec: Codec::KiviPerChannel, bits, group: cfg.key_group }
            } else {
                SideCodec { codec: Codec::KiviPerToken, bits, group: channel_group(cfg.head_dim, KIVI_GROUP) }
            }
        },
    },
    MethodDef {
        method: Method::Pq,
        name: "pq",
        aliases: &[],
        // 8-bit codes of 8, 4 or 2 channels.
        bits: Some(&[1, 2, 4]),
        keys_only: false,
        codec: |_, bits, _| SideCodec { codec: Codec::ProductQuantized, bits: PQ_CODE_BITS, group: (8 / bits.max(1)) as usize },
    },
    MethodDef {
        method: Method::Qjl,
        name: "qjl",
        aliases: &[],
        // Sketch rows per channel (m = bits * D).
        bits: Some(&[1, 2, 3, 4]),
        keys_only: true,
        codec: |_, bits, _| SideCodec { codec: Codec::Qjl, bits, group: 1 },
    },
    MethodDef {
        method: Method::TurboQuantProd,
        name: "turboquant-prod",
        aliases: &["prod"],
        // bits - 1 MSE bits (1 to 4) + 1 sign bit.
        bits: Some(&[2, 3, 4, 5]),
        keys_only: true,
        codec: |_, bits, _| SideCodec { codec: Codec::TurboQuantProd, bits, group: 1 },
    },
    MethodDef {
        method: Method::TurboQuantRvq,
        name: "turboquant-rvq",
        aliases: &["rvq"],
        // bits - 1 first-stage bits + 1 residual bit.
        bits: Some(&[2, 3, 4, 5]),
        keys_only: false,
        codec: |_, bits, _| SideCodec { codec: Codec::TurboQuantRvq, bits, group: 1 },
    },
    MethodDef {
        method: Method::Affine,
        name: "affine",
        aliases: &["mlx-affine"],
        bits: Some(&crate::cpu::SUPPORTED_BITS),
        keys_only: false,
        // KIVI's per-token codec on both sides.
        codec: |cfg, bits, _| SideCodec { codec: Codec::KiviPerToken, bits, group: channel_group(cfg.head_dim, AFFINE_GROUP) },
    },
    MethodDef {
        method: Method::Fp8,
        name: "fp8",
        aliases: &["e4m3"],
        bits: Some(&[8]),
        keys_only: false,
        codec: |_, bits, _| SideCodec { codec: Codec::Fp8, bits, group: 1 },
    },
];

/// Channels per scale and zero of the `affine` method: mlx_lm's
/// `QuantizedKVCache` default `group_size`.
pub const AFFINE_GROUP: usize = 64;

/// Channels per scale and zero of a per-token codec: the largest multiple of
/// 8 up to `max` that divides the head (8 when none does).
fn channel_group(head_dim: usize, max: usize) -> usize {
    (1..=max / 8).rev().map(|k| 8 * k).find(|g| head_dim % g == 0).unwrap_or(8)
}

impl Method {
    /// The method's definition.
    pub fn def(self) -> &'static MethodDef {
        &METHOD_DEFS[self as usize]
    }

    /// Parses `s` as the method an argument names (`key_method`,
    /// `value_method`): an unknown name is an error naming that argument and
    /// listing the methods.
    pub fn parse_arg(argument: &'static str, s: &str) -> Result<Method> {
        s.parse().map_err(|_| unknown_method(argument, s))
    }

    /// The bits per element this method supports (`None`: bits are ignored).
    pub fn supported_bits(self) -> Option<&'static [u32]> {
        self.def().bits
    }

    /// Whether the method only estimates attention scores, so it can hold
    /// keys but not values.
    pub fn keys_only(self) -> bool {
        self.def().keys_only
    }

    pub fn name(self) -> &'static str {
        self.def().name
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
        METHOD_DEFS
            .iter()
            .find(|d| d.name == s || d.aliases.contains(&s))
            .map(|d| d.method)
            .ok_or_else(|| unknown_method("method", s))
    }
}

fn unknown_method(argument: &'static str, name: &str) -> Error {
    let names: Vec<String> = METHODS.iter().map(|m| format!("{:?}", m.name())).collect();
    Error::invalid(argument, format!("{name:?} is not one of {}", names.join(", ")))
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
    /// Tokens of a KIVI key group: one float16 scale and zero per channel
    /// and group, `32 / key_group` bits per element.
    pub key_group: usize,
    /// Seed of the random rotation.
    pub seed: u64,
    pub policy: Policy,
    /// KIVI keys' bits per channel, `[kv_heads, head_dim]` row-major: each
    /// head's widths (1 to 8) add up to `head_dim * key_bits`, so a code row
    /// keeps its size; `None` gives every channel `key_bits`. Unequal widths
    /// put the bits where the queries weigh a channel's error most
    /// ([`channel_widths`]).
    pub key_widths: Option<Vec<u8>>,
}

impl CacheConfig {
    /// The default recipe ([`DEFAULT_KEY_BITS`], [`DEFAULT_VALUE_BITS`]), a
    /// window of 128 recent tokens and 4 sinks in float16.
    pub fn new(head_dim: usize, kv_heads: usize) -> Self {
        CacheConfig {
            head_dim,
            kv_heads,
            key_method: Method::TurboQuantMse,
            key_bits: DEFAULT_KEY_BITS,
            value_method: Method::TurboQuantMse,
            value_bits: DEFAULT_VALUE_BITS,
            window: 128,
            sinks: 4,
            key_group: KIVI_GROUP,
            seed: 0,
            policy: Policy::Auto,
            key_widths: None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        crate::kernels::turboquant::check_head_dim("head_dim", self.head_dim)?;
        if self.kv_heads == 0 {
            return Err(Error::invalid("kv_heads", "must be at least 1"));
        }
        for (arg, method, bits) in [("key_bits", self.key_method, self.key_bits), ("value_bits", self.value_method, self.value_bits)] {
            let Some(supported) = method.supported_bits() else { continue };
            if !supported.contains(&bits) {
                return Err(Error::invalid(arg, format!("{bits} is not supported by {method}; use one of {supported:?}")));
            }
        }
        if self.value_method.keys_only() {
            return Err(Error::invalid(
                "value_method",
                format!("{} estimates attention scores and stores keys only; choose another method for values", self.value_method),
            ));
        }
        if !(8..=MAX_KIVI_KEY_GROUP).contains(&self.key_group) || self.key_group % 8 != 0 {
            return Err(Error::invalid(
                "key_group",
                format!("{} is not a multiple of 8 from 8 to {MAX_KIVI_KEY_GROUP} tokens", self.key_group),
            ));
        }
        if let Some(w) = &self.key_widths {
            self.check_key_widths(w)?;
        }
        if self.compressed() && self.window == 0 {
            return Err(Error::invalid("window", "must be at least 1 token for a compressed method"));
        }
        Ok(())
    }

    fn check_key_widths(&self, widths: &[u8]) -> Result<()> {
        let arg = "key_widths";
        if self.key_method != Method::Kivi {
            return Err(Error::invalid(arg, format!("bits per channel need KIVI keys, not {}", self.key_method)));
        }
        let (h, d) = (self.kv_heads, self.head_dim);
        if widths.len() != h * d {
            return Err(Error::invalid(arg, format!("{} widths, expected kv_heads * head_dim = {}", widths.len(), h * d)));
        }
        if let Some(w) = widths.iter().find(|w| !(1..=MAX_CHANNEL_BITS).contains(*w)) {
            return Err(Error::invalid(arg, format!("a width of {w} bits; each must be 1 to {MAX_CHANNEL_BITS}")));
        }
        for (head, row) in widths.chunks(d).enumerate() {
            let sum: usize = row.iter().map(|&w| w as usize).sum();
            if sum != d * self.key_bits as usize {
                return Err(Error::invalid(
                    arg,
                    format!("head {head}'s widths add up to {sum} bits, expected head_dim * key_bits = {}", d * self.key_bits as usize),
                ));
            }
        }
        Ok(())
    }

    /// Whether either side is compressed (else the dense control).
    pub fn compressed(&self) -> bool {
        self.key_method != Method::Fp16 || self.value_method != Method::Fp16
    }

    /// Float16 slots for recent tokens: the window plus room to gather a
    /// flush. A flush compresses whole token groups of the keys' codec (KIVI:
    /// `key_group` tokens), so the room is at least one group: `window +
    /// max(window, group)`.
    pub fn recent_capacity(&self) -> usize {
        let key = self.key_codec();
        let group = key.codec.def().tokens_per_param_row(&key);
        self.window + if group > 1 { self.window.max(group) } else { self.window }
    }

    /// Float16 window slots per side: the sinks, then the recent tokens.
    pub fn window_capacity(&self) -> usize {
        self.sinks + self.recent_capacity()
    }

    /// How the keys' compressed tokens are stored.
    pub fn key_codec(&self) -> SideCodec {
        self.codec(self.key_method, self.key_bits, true)
    }

    /// How the values' compressed tokens are stored.
    pub fn value_codec(&self) -> SideCodec {
        self.codec(self.value_method, self.value_bits, false)
    }

    fn codec(&self, method: Method, bits: u32, keys: bool) -> SideCodec {
        (method.def().codec)(self, bits, keys)
    }
}

/// The widest channel of KIVI keys with bits per channel.
pub const MAX_CHANNEL_BITS: u8 = 8;

/// Bits per channel for KIVI keys, `bits` on average, from `weights`
/// `[heads, dim]` (row-major): what a unit of error in each channel costs the
/// attention scores, e.g. `E[q_c²]·range(k_c)²` over the queries and keys of
/// a calibration chunk. Every channel gets 1 bit, then each further bit goes
/// where it removes the most weighted error of a uniform quantizer
/// (`weight · 4^-width`), up to [`MAX_CHANNEL_BITS`]. At equal bits this
/// halves the attention KL of KIVI keys on SmolLM2-135M
/// (`docs/results/key-error-smollm2.md`).
pub fn channel_widths(weights: &[f32], dim: usize, bits: u32) -> Result<Vec<u8>> {
    if dim == 0 || weights.len() % dim != 0 {
        return Err(Error::invalid("weights", format!("{} values is not a whole number of heads of {dim} channels", weights.len())));
    }
    if !(1..=u32::from(MAX_CHANNEL_BITS)).contains(&bits) {
        return Err(Error::invalid("bits", format!("{bits}; expected 1 to {MAX_CHANNEL_BITS}")));
    }
    if let Some(w) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return Err(Error::invalid("weights", format!("{w}; each must be finite and >= 0")));
    }
    let mut widths = vec![1u8; weights.len()];
    for (row, out) in weights.chunks(dim).zip(widths.chunks_mut(dim)) {
        // A floor far below the largest weight, so that channels of equal
        // (even zero) weight share their bits in turn.
        let floor = row.iter().fold(0.0f64, |m, &w| m.max(f64::from(w))) * 1e-12 + f64::MIN_POSITIVE * 1e60;
        for _ in 0..dim * (bits as usize - 1) {
            // The gain of one more bit: weight · (4^-w − 4^-(w+1)) = weight · ¾ · 4^-w.
            let best = (0..dim)
                .filter(|&c| out[c] < MAX_CHANNEL_BITS)
                .max_by(|&a, &b| {
                    let gain = |c: usize| (f64::from(row[c]) + floor) * 0.25f64.powi(i32::from(out[c]));
                    gain(a).total_cmp(&gain(b)).then(b.cmp(&a))
                })
                .expect("bits <= MAX_CHANNEL_BITS leaves a channel below it");
            out[best] += 1;
        }
    }
    Ok(widths)
}

/// KIVI's group size (tokens for keys by default, channels for values).
pub const KIVI_GROUP: usize = 32;
/// The default recipe's bits: TurboQuant-MSE keys at 4 and values at 3
/// (keys cause nearly all of the loss).
pub const DEFAULT_KEY_BITS: u32 = 4;
pub const DEFAULT_VALUE_BITS: u32 = 3;

/// The values' bits when a configuration gives none: the default recipe's
/// [`DEFAULT_VALUE_BITS`] where no key bits are given either and both sides
/// are TurboQuant-MSE; otherwise the keys' bits ([`DEFAULT_KEY_BITS`] where
/// not given).
pub fn default_value_bits(key_method: Method, value_method: Method, key_bits: Option<u32>) -> u32 {
    match key_bits {
        Some(bits) => bits,
        None if [key_method, value_method] == [Method::TurboQuantMse; 2] => DEFAULT_VALUE_BITS,
        None => DEFAULT_KEY_BITS,
    }
}

/// The longest KIVI key group a cache takes (tokens).
pub const MAX_KIVI_KEY_GROUP: usize = 1024;
