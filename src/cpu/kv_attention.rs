//! Attention over a cache whose keys and values each have their own codec
//! (`kv_attention`): scores straight from the key codes, online softmax,
//! values decoded on the fly, float16 windows included.
//!
//! The host prepares every query once as a row of `query_features` floats,
//! already multiplied by the softmax scale: the query in the key frame (the
//! rotation for the rotating codecs, the identity for the others) followed by
//! what a codec scores against besides it: for product quantization the
//! lookup table `⟨q_p, codebook[c]⟩` of every sub-vector `p` and entry `c`;
//! for the sketched key codecs (QJL, TurboQuant-Prod) the sketched query
//! `c · S q'` (`q'` the framed query, `c` the estimator's constant `√(π/2)/m`).
//! Values are accumulated in the value frame; the output is brought back with
//! `Πᵀ` when the value frame is rotated.

use half::f16;

use super::split_attention;
use super::split_attention::FromF32;
use super::turboquant::{code_at, code_bits};
use super::vq::VqElement;
use crate::codec::layout::{Codec, SideLayout};

/// KV head `hk`'s `dim + 1` offsets in a KIVI keys' table (empty without one).
#[inline]
fn head_layout(table: &[f32], hk: usize, d: usize) -> &[f32] {
    if table.is_empty() {
        return &[];
    }
    let at = 1 + hk * table[0] as usize;
    &table[at..at + d + 1]
}

/// The estimator's constant `√(π/2) / m` for a sketch of `m` rows.
pub fn sketch_scale(m: usize) -> f32 {
    std::f32::consts::FRAC_PI_2.sqrt() / m as f32
}

/// Sizes of one `kv_attention` call.
#[derive(Clone, Copy, Debug)]
pub struct KvShape {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Queries per head (1 when decoding).
    pub queries: usize,
    pub dim: usize,
    pub key: SideLayout,
    pub value: SideLayout,
    /// Floats per prepared query row (`dim` plus what the key codec needs).
    pub query_features: usize,
    /// Tokens held: float16 sinks first, then compressed, then the recent window.
    pub sinks: usize,
    pub compressed: usize,
    pub recent: usize,
    /// Token slots per head of the compressed stores and of the windows.
    pub capacity: usize,
    pub window_capacity: usize,
    /// Query `l` sits at position `total - queries + l` and sees positions up to it.
    pub causal: bool,
    /// Heads of the additive mask `[batch, mask_heads, queries, total]`
    /// (float32, added to the scaled scores; `-inf` hides a token): 0 without
    /// one, 1 for a mask every head shares, else `q_heads`.
    pub mask_heads: usize,
}

impl KvShape {
    pub fn total(&self) -> usize {
        self.sinks + self.compressed + self.recent
    }
}

/// Read-only views of one side's stored tokens. Arrays a codec does not use
/// are empty.
pub struct KvSide<'a, T> {
    /// Packed codes `[B, Hkv, capacity, row_len]`.
    pub codes: &'a [u8],
    /// `Dense` tokens `[B, Hkv, capacity, dim]`.
    pub dense: &'a [T],
    /// Norms or scales `[B, Hkv, param_rows(capacity), param_cols]`.
    pub scales: &'a [f16],
    /// Zeros, shaped as the scales.
    pub zeros: &'a [f16],
    /// Codebook of the codec (float32): TurboQuant-MSE centroids, the
    /// product-quantization codebook, the QJL sketch `[m, dim]`, the
    /// TurboQuant-Prod centroids then its sketch `[dim, dim]`, the
    /// TurboQuant-RVQ first then second codebook.
    pub table: &'a [f32],
    /// Float16/bfloat16/float32 window `[B, Hkv, window_capacity, dim]` in the
    /// side's frame: sinks from slot 0, recent tokens after them.
    pub window: &'a [T],
}

/// `⟨q, k⟩` of the compressed key at slot `ct` of `head` for the key codecs
/// scored from features of the prepared row `q` rather than from a decoded
/// key (product quantization's lookup table, the sketched query).
#[inline]
fn key_score<T: VqElement>(k: &KvSide<'_, T>, sc: &SideLayout, sh: &KvShape, head: usize, ct: usize, q: &[f32]) -> f32 {
    let (d, row) = (sh.dim, sc.row_len);
    let slot = head * sh.capacity + ct;
    let codes = &k.codes[slot * row..(slot + 1) * row];
    match sc.codec {
        Codec::ProductQuantized => {
            // The query's lookup table follows its first `d` features.
            let entries = 1usize << sc.bits;
            let mut s = 0.0f32;
            for p in 0..d / sc.group {
                s += q[d + p * entries + code_at(codes, p, sc.bits)];
            }
            s * k.scales[slot].to_f32()
        }
        Codec::Qjl => {
            // The sketched query follows the first `d` features.
            let mut s = 0.0f32;
            for r in 0..sc.sketch_rows {
                let f = q[d + r];
                s += if code_at(codes, r, 1) != 0 { f } else { -f };
            }
            s * k.scales[slot].to_f32()
        }
        Codec::TurboQuantProd => {
            let (mse, signs) = codes.split_at(sc.first_len);
            let (mut s, mut z) = (0.0f32, 0.0f32);
            for j in 0..d {
                s += q[j] * k.table[code_at(mse, j, sc.bits - 1)];
                let f = q[d + j];
                z += if code_at(signs, j, 1) != 0 { f } else { -f };
            }
            k.scales[2 * slot].to_f32() * (s + k.scales[2 * slot + 1].to_f32() * z)
        }
        _ => unreachable!("{:?} keys are decoded, then scored", sc.codec),
    }
}

/// Element `j` of a TurboQuant-RVQ unit vector: first plus second stage.
#[inline]
fn rvq_element(table: &[f32], codes: &[u8], sc: &SideLayout, j: usize) -> f32 {
    let (first, second) = codes.split_at(sc.first_len);
    table[code_at(first, j, sc.bits - 1)] + table[(1 << (sc.bits - 1)) + code_at(second, j, 1)]
}

/// Codes as their own values (0 to 255), to unpack a row of codes with
/// `decode_row`.
const CODE_VALUES: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = i as f32;
        i += 1;
    }
    t
};

/// Decodes one KV head's compressed tokens of one side, in its frame, for
/// the codecs a token can be decoded by (all but the score-only key codecs:
/// product-quantized keys, QJL, TurboQuant-Prod). It keeps what every token
/// of the head shares: the codebook padded for `decode_row`, KIVI keys'
/// channel offsets, and the float32 scales and zeros of the last KIVI token
/// group read.
struct SideReader<'a, 'b, T> {
    side: &'b KvSide<'a, T>,
    sc: SideLayout,
    dim: usize,
    head: usize,
    capacity: usize,
    table: [f32; 256],
    /// KIVI per channel with unequal widths: each channel's (bit offset, width).
    channels: Vec<(usize, u32)>,
    /// KIVI per channel: the token group whose float32 scales and zeros
    /// `scales` and `zeros` hold.
    group: usize,
    scales: Vec<f32>,
    zeros: Vec<f32>,
    codes: Vec<f32>,
}

impl<'a, 'b, T: VqElement> SideReader<'a, 'b, T> {
    fn new(side: &'b KvSide<'a, T>, sc: SideLayout, sh: &KvShape, head: usize) -> Self {
        let d = sh.dim;
        let mut table = [0.0f32; 256];
        if matches!(sc.codec, Codec::TurboQuantMse | Codec::TurboQuantUniform | Codec::Fp8) {
            table = super::turboquant::padded_table(side.table);
        }
        let mut channels = Vec::new();
        if sc.codec == Codec::KiviPerChannel && !side.table.is_empty() && side.table[0] != 0.0 {
            let layout = head_layout(side.table, head % sh.kv_heads, d);
            channels = (0..d).map(|j| (layout[j] as usize, (layout[j + 1] - layout[j]) as u32)).collect();
        }
        SideReader {
            side,
            sc,
            dim: d,
            head,
            capacity: sh.capacity,
            table,
            channels,
            group: usize::MAX,
            scales: vec![0.0; d],
            zeros: vec![0.0; d],
            codes: vec![0.0; d],
        }
    }

    /// The compressed token at slot `ct` into `out`, up to the factor it
    /// returns (its norm, for the codecs that store one, so that a key's
    /// scores take it once per row rather than once per element). With
    /// `scaled` the factor is applied and 1 returned.
    #[inline]
    fn decode(&mut self, ct: usize, scaled: bool, out: &mut [f32]) -> f32 {
        let (d, sc) = (self.dim, self.sc);
        let side = self.side;
        let slot = self.head * self.capacity + ct;
        let row = sc.row_len;
        let codes = if sc.codec == Codec::Dense { &[][..] } else { &side.codes[slot * row..(slot + 1) * row] };
        match sc.codec {
            Codec::Dense => {
                T::row_to_f32(&side.dense[slot * d..(slot + 1) * d], out);
                1.0
            }
            Codec::TurboQuantMse | Codec::TurboQuantUniform | Codec::Fp8 => {
                let n = side.scales[slot].to_f32();
                super::turboquant::decode_row(codes, sc.bits, &self.table, if scaled { n } else { 1.0 }, out);
                if scaled { 1.0 } else { n }
            }
            Codec::TurboQuantRvq => {
                let n = side.scales[slot].to_f32();
                for (j, o) in out.iter_mut().enumerate() {
                    *o = rvq_element(side.table, codes, &sc, j);
                }
                if scaled {
                    out.iter_mut().for_each(|o| *o *= n);
                    1.0
                } else {
                    n
                }
            }
            Codec::ProductQuantized => {
                let n = side.scales[slot].to_f32();
                let s = sc.group;
                for (p, chunk) in out.chunks_mut(s).enumerate() {
                    let c = code_at(codes, p, sc.bits);
                    for (o, &e) in chunk.iter_mut().zip(&side.table[c * s..(c + 1) * s]) {
                        *o = e * n;
                    }
                }
                1.0
            }
            Codec::KiviPerChannel => {
                let group = ct / sc.group;
                if group != self.group {
                    let p0 = (self.head * sc.param_rows(self.capacity) + group) * d;
                    f16::row_to_f32(&side.scales[p0..p0 + d], &mut self.scales);
                    f16::row_to_f32(&side.zeros[p0..p0 + d], &mut self.zeros);
                    self.group = group;
                }
                if self.channels.is_empty() {
                    super::turboquant::decode_row(codes, sc.bits, &CODE_VALUES, 1.0, &mut self.codes);
                } else {
                    for (c, &(o, w)) in self.codes.iter_mut().zip(&self.channels) {
                        *c = code_bits(codes, o, w) as f32;
                    }
                }
                for (((o, &z), &s), &c) in out.iter_mut().zip(&self.zeros).zip(&self.scales).zip(&self.codes) {
                    *o = z + s * c;
                }
                1.0
            }
            Codec::KiviPerToken => {
                super::turboquant::decode_row(codes, sc.bits, &CODE_VALUES, 1.0, &mut self.codes);
                let p0 = slot * (d / sc.group);
                for (g, (o, c)) in out.chunks_mut(sc.group).zip(self.codes.chunks(sc.group)).enumerate() {
                    let (z, s) = (side.zeros[p0 + g].to_f32(), side.scales[p0 + g].to_f32());
                    o.iter_mut().zip(c).for_each(|(o, &c)| *o = z + s * c);
                }
                1.0
            }
            Codec::Qjl | Codec::TurboQuantProd => unreachable!("{:?} keys are only scored", sc.codec),
        }
    }
}

/// Attention of the prepared queries `qf` `[batch, q_heads, queries,
/// query_features]` over the layer, into `out` `[batch, q_heads, queries,
/// dim]`. `rot_v` is `Π` (`dim * dim`) when the value frame is rotated, else
/// empty; `mask` is the additive mask `sh.mask_heads` describes (empty
/// without one). A row that sees no token comes out as zeros.
///
/// Split over the cores and merged by `split_attention`; a compressed key is
/// decoded once for every query row of its KV head (the score-only codecs
/// score each row from its features), a value once for every row.
pub fn kv_attention<T: VqElement + FromF32>(
    qf: &[f32],
    keys: &KvSide<'_, T>,
    values: &KvSide<'_, T>,
    rot_v: &[f32],
    mask: &[f32],
    sh: &KvShape,
    out: &mut [T],
) {
    let d = sh.dim;
    let qn = sh.query_features;
    let g = sh.q_heads / sh.kv_heads;
    let rows = g * sh.queries;
    let total = sh.total();
    assert_eq!(qf.len(), sh.batch * sh.q_heads * sh.queries * qn, "qf length");
    assert!(rot_v.is_empty() || rot_v.len() == d * d, "rot_v size");
    assert_eq!(mask.len(), sh.batch * sh.mask_heads * sh.queries * total, "mask length");
    let compressed = |t: usize| t >= sh.sinks && t < sh.sinks + sh.compressed;
    let key_decodes = !sh.key.scored_from_query;
    // Bytes of a key's code row, once (the codec's definition is a dynamic call).
    super::split_attention::attend(sh.batch * sh.kv_heads, rows, d, total, rot_v, out, |unit, t0, t1| {
        let (b, hk) = (unit / sh.kv_heads, unit % sh.kv_heads);
        let head = b * sh.kv_heads + hk;
        let window_slot = |t: usize| head * sh.window_capacity + if t < sh.sinks { t } else { t - sh.compressed };
        // Rows of this unit: heads hk*g .. hk*g+g, each with `queries` queries.
        let q_row = |r: usize| {
            let (hq, ql) = (hk * g + r / sh.queries, r % sh.queries);
            &qf[((b * sh.q_heads + hq) * sh.queries + ql) * qn..][..qn]
        };
        let (mut key_reader, mut value_reader) = (SideReader::new(keys, sh.key, sh, head), SideReader::new(values, sh.value, sh, head));
        let mut x = vec![0.0f32; d];
        let scores = |t: usize, s: &mut [f32]| {
            if compressed(t) && !key_decodes {
                for (r, sr) in s.iter_mut().enumerate() {
                    *sr = key_score(keys, &sh.key, sh, head, t - sh.sinks, q_row(r));
                }
            } else {
                let factor = if compressed(t) {
                    key_reader.decode(t - sh.sinks, false, &mut x)
                } else {
                    let slot = window_slot(t);
                    T::row_to_f32(&keys.window[slot * d..(slot + 1) * d], &mut x);
                    1.0
                };
                for (r, sr) in s.iter_mut().enumerate() {
                    *sr = split_attention::dot(&q_row(r)[..d], &x) * factor;
                }
            }
            for (r, sr) in s.iter_mut().enumerate() {
                if sh.causal && t > total - sh.queries + r % sh.queries {
                    *sr = f32::NEG_INFINITY;
                } else if sh.mask_heads > 0 {
                    let hm = if sh.mask_heads == 1 { 0 } else { hk * g + r / sh.queries };
                    *sr += mask[((b * sh.mask_heads + hm) * sh.queries + r % sh.queries) * total + t];
                }
            }
        };
        let value = |t: usize, x: &mut [f32]| {
            if compressed(t) {
                value_reader.decode(t - sh.sinks, true, x);
            } else {
                let slot = window_slot(t);
                T::row_to_f32(&values.window[slot * d..(slot + 1) * d], x);
            }
        };
        split_attention::online_softmax(rows, d, t0, t1, scores, value)
    });
}
