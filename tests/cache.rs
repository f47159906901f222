//! The compressed layer cache on the CPU stream: fused attention against the
//! reference graph and against decode-then-SDPA, windows, memory, trim, state.

mod common;

use common::{attention_masks, f32s, normal};
use half::f16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cache::{CacheConfig, LayerCache, Method};
use veloxquant::{ops, Array, Dtype, Policy, Stream};

fn rel_err(a: &Array, b: &Array) -> f64 {
    common::rel_err(&f32s(a), &f32s(b))
}

fn config(d: usize, hkv: usize, method: Method, policy: Policy) -> CacheConfig {
    let mut c = CacheConfig::new(d, hkv);
    c.key_method = method;
    c.value_method = method;
    c.window = 16;
    c.sinks = 4;
    c.policy = policy;
    c
}

/// A cache filled with a prefill chunk and then single tokens, so that sinks,
/// compressed tokens and the recent window all hold something.
fn filled(cfg: CacheConfig, b: i32, prefill: i32, decode: i32, dtype: Dtype, seed: u64) -> (LayerCache, Vec<(Array, Array)>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut cache = LayerCache::new(cfg.clone(), Some(Stream::cpu())).unwrap();
    let (h, d) = (cfg.kv_heads as i32, cfg.head_dim as i32);
    let mut chunks = Vec::new();
    let k = normal(&mut rng, &[b, h, prefill, d], dtype);
    let v = normal(&mut rng, &[b, h, prefill, d], dtype);
    cache.append(&k, &v).unwrap();
    chunks.push((k, v));
    for _ in 0..decode {
        let k = normal(&mut rng, &[b, h, 1, d], dtype);
        let v = normal(&mut rng, &[b, h, 1, d], dtype);
        cache.append(&k, &v).unwrap();
        chunks.push((k, v));
    }
    (cache, chunks)
}

fn concat_tokens(chunks: &[(Array, Array)]) -> (Array, Array) {
    let s = Stream::cpu();
    let ks: Vec<Array> = chunks.iter().map(|c| c.0.clone()).collect();
    let vs: Vec<Array> = chunks.iter().map(|c| c.1.clone()).collect();
    (ops::concatenate(&ks, 2, &s).unwrap(), ops::concatenate(&vs, 2, &s).unwrap())
}

#[test]
fn fp16_method_equals_plain_sdpa() {
    let (cache, chunks) = filled(config(64, 2, Method::Fp16, Policy::Auto), 2, 40, 5, Dtype::F16, 1);
    let (k, v) = concat_tokens(&chunks);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let q = normal(&mut rng, &[2, 6, 1, 64], Dtype::F16);
    let got = cache.attention(&q, 0.125, false).unwrap();
    let want = ops::scaled_dot_product_attention(&q, &k, &v, 0.125, false, &Stream::cpu()).unwrap();
    assert_eq!(f32s(&got), f32s(&want));
    assert_eq!(cache.offset(), 45);
}

#[test]
fn fused_attention_matches_reference_and_decoded_sdpa() {
    for &(d, dtype, tol) in &[(128usize, Dtype::F32, 1e-5), (64, Dtype::F16, 1e-2), (96, Dtype::BF16, 2e-2), (80, Dtype::F32, 1e-5), (256, Dtype::F16, 1e-2)] {
        let (cache, _) = filled(config(d, 2, Method::TurboQuantMse, Policy::Require), 2, 70, 3, dtype, d as u64);
        assert!(cache.compressed_tokens() > 0, "some tokens are compressed");
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let q = normal(&mut rng, &[2, 8, 1, d as i32], dtype);
        let scale = 1.0 / (d as f32).sqrt();
        let fused = cache.attention(&q, scale, false).unwrap();
        let mut off_cfg = cache.config().clone();
        off_cfg.policy = Policy::Off;
        let bytes = cache.to_bytes().unwrap();
        let reference_cache = LayerCache::from_bytes(&bytes, Some(Stream::cpu())).unwrap();
        let _ = off_cfg;
        let (k, v) = cache.dequantize().unwrap();
        let sdpa = ops::scaled_dot_product_attention(&q, &k, &v, scale, false, &Stream::cpu()).unwrap();
        let e = rel_err(&fused, &sdpa);
        assert!(e <= tol, "d={d} {dtype}: fused vs decode+SDPA relative error {e}");
        let again = reference_cache.attention(&q, scale, false).unwrap();
        assert_eq!(f32s(&again), f32s(&fused), "a reloaded cache attends identically");
    }
}

#[test]
fn causal_multi_token_queries_match_decoded_sdpa() {
    let (cache, _) = filled(config(64, 1, Method::TurboQuantMse, Policy::Require), 1, 90, 0, Dtype::F32, 4);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let q = normal(&mut rng, &[1, 4, 20, 64], Dtype::F32);
    let fused = cache.attention(&q, 0.125, true).unwrap();
    let (k, v) = cache.dequantize().unwrap();
    let sdpa = ops::scaled_dot_product_attention(&q, &k, &v, 0.125, true, &Stream::cpu()).unwrap();
    let e = rel_err(&fused, &sdpa);
    assert!(e <= 1e-5, "causal: relative error {e}");
}

#[test]
fn compression_error_is_turboquant_s() {
    // 4-bit TurboQuant-MSE keeps about 0.9% of the energy as error.
    let mut cfg = config(128, 2, Method::TurboQuantMse, Policy::Auto);
    cfg.window = 1;
    cfg.sinks = 0;
    let (cache, chunks) = filled(cfg, 1, 600, 0, Dtype::F32, 6);
    let (k, _) = concat_tokens(&chunks);
    let (kd, _) = cache.dequantize().unwrap();
    let e = rel_err(&kd, &k).powi(2);
    assert!((0.007..0.012).contains(&e), "relative MSE {e}");
}

#[test]
fn windows_sinks_and_counts() {
    let cfg = config(64, 2, Method::TurboQuantMse, Policy::Auto);
    let (mut cache, _) = filled(cfg, 1, 3, 0, Dtype::F16, 7);
    assert_eq!((cache.offset(), cache.compressed_tokens()), (3, 0));
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    // Sinks fill first, then the window grows to 2 * window before compressing.
    for t in 4..=(4 + 32) {
        let k = normal(&mut rng, &[1, 2, 1, 64], Dtype::F16);
        cache.append(&k, &k).unwrap();
        assert_eq!(cache.offset(), t);
    }
    assert_eq!(cache.compressed_tokens(), 0, "4 sinks + 32 recent fit the windows");
    let k = normal(&mut rng, &[1, 2, 1, 64], Dtype::F16);
    cache.append(&k, &k).unwrap();
    assert_eq!(cache.compressed_tokens(), 17, "33 pending: the oldest 17 are compressed, 16 stay");
    assert_eq!(cache.trim(20), 20);
    assert_eq!((cache.offset(), cache.compressed_tokens()), (17, 13));
    assert_eq!(cache.trim(1000), 17);
    assert_eq!(cache.offset(), 0);
}

/// `data_nbytes` counts what is stored for the tokens held, row by row:
/// TurboQuant-MSE keys at 4 bits and values at 3 (D / 2 and 3 D / 8 code
/// bytes and a float16 norm per token and head), float16 window rows and the
/// keys' float32 mean; the rest of `nbytes` is capacity.
#[test]
fn data_bytes_are_the_rows_of_the_tokens_held() {
    let mut cfg = config(64, 2, Method::TurboQuantMse, Policy::Auto);
    (cfg.key_bits, cfg.value_bits) = (4, 3);
    let (b, h, d) = (2usize, 2usize, 64usize);
    for (prefill, decode) in [(3, 0), (40, 5), (300, 17)] {
        let (cache, _) = filled(cfg.clone(), b as i32, prefill, decode, Dtype::F16, 5);
        let held = cache.offset();
        let comp = cache.compressed_tokens();
        let window = held - comp;
        let codes = comp * (d / 2 + 3 * d / 8 + 2 * 2);
        let want = b * h * (codes + window * d * 2 * 2) + b * h * d * 4;
        assert_eq!(cache.data_nbytes(), want, "prefill {prefill}, decode {decode}: {comp} compressed, {window} in windows");
        assert!(cache.data_nbytes() <= cache.nbytes());
    }
    let dense = filled(config(64, 2, Method::Fp16, Policy::Auto), 1, 37, 2, Dtype::F16, 5).0;
    assert_eq!(dense.data_nbytes(), 39 * 2 * 64 * 2 * 2);
}

#[test]
fn state_round_trips_and_rejects_corruption() {
    let (cache, _) = filled(config(64, 2, Method::TurboQuantMse, Policy::Auto), 1, 50, 2, Dtype::F16, 11);
    let bytes = cache.to_bytes().unwrap();
    let back = LayerCache::from_bytes(&bytes, Some(Stream::cpu())).unwrap();
    assert_eq!(back.to_bytes().unwrap(), bytes, "round trip is bit-identical");
    assert_eq!((back.offset(), back.compressed_tokens()), (cache.offset(), cache.compressed_tokens()));
    let e = LayerCache::from_bytes(&bytes[..bytes.len() / 2], None).err().unwrap().to_string();
    assert!(e.starts_with("state:"), "{e}");
    let e = LayerCache::from_bytes(b"not a state at all", None).err().unwrap().to_string();
    assert!(e.starts_with("state:"), "{e}");
    // A state of another version (here the last one with unscaled rotated
    // frames) is refused, naming the version.
    let old = replace_bytes(&bytes, b"\"version\":\"7\"", b"\"version\":\"4\"");
    let e = LayerCache::from_bytes(&old, None).err().unwrap().to_string();
    assert!(e.starts_with("state: version \"4\" is not supported"), "{e}");
    // Version 5's 3-bit TurboQuant-MSE values are Lloyd–Max codes, which
    // this version's uniform grid would decode wrongly: refused too.
    let v5 = replace_bytes(&bytes, b"\"version\":\"7\"", b"\"version\":\"5\"");
    let e = LayerCache::from_bytes(&v5, None).err().unwrap().to_string();
    assert!(e.starts_with("state: version \"5\" is not supported"), "{e}");
}

/// `bytes` with the one occurrence of `from` replaced by `to` (same length).
fn replace_bytes(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at: Vec<usize> = (0..=bytes.len() - from.len()).filter(|&i| &bytes[i..i + from.len()] == from).collect();
    assert_eq!(at.len(), 1, "{:?} occurs {} times", String::from_utf8_lossy(from), at.len());
    let mut out = bytes.to_vec();
    out[at[0]..at[0] + to.len()].copy_from_slice(to);
    out
}

#[test]
fn saved_states_refuse_flipped_bits_and_truncation() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for m in [(Method::TurboQuantMse, 4, Method::TurboQuantMse, 3), (Method::Kivi, 4, Method::Pq, 2), (Method::Fp16, 16, Method::Fp16, 16)] {
        let (cache, _) = filled(mixed_config(64, 2, m, Policy::Auto), 1, 90, 3, Dtype::F16, 17);
        let bytes = cache.to_bytes().unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert!(LayerCache::from_bytes(&bytes, None).is_ok());
        // Single flipped bits, in the header and throughout the tensors' data:
        // every one refused (CRC-32 catches every single-bit error).
        let bits = 8 * bytes.len();
        let mut positions: Vec<usize> = (0..600).map(|_| rand::RngExt::random_range(&mut rng, 0..bits)).collect();
        positions.extend((0..200).map(|_| rand::RngExt::random_range(&mut rng, 8 * header..bits)));
        positions.extend([0, 63, 8 * header, bits - 1]);
        for bit in positions {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            match LayerCache::from_bytes(&bad, Some(Stream::cpu())) {
                Ok(_) => panic!("{m:?}: bit {bit} of {bits} flipped (header ends at byte {header}) and the state loaded"),
                Err(e) => assert!(e.to_string().starts_with("state:"), "{m:?}: bit {bit}: {e}"),
            }
        }
        // Truncated, or with bytes added: refused.
        for len in [0, 1, 7, 8, header - 1, header, header + 1, bytes.len() / 2, bytes.len() - 1] {
            let e = LayerCache::from_bytes(&bytes[..len], None).err().unwrap_or_else(|| panic!("{m:?}: {len} bytes loaded"));
            assert!(e.to_string().starts_with("state:"), "{m:?}: {len} bytes: {e}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(LayerCache::from_bytes(&longer, None).err().unwrap().to_string().starts_with("state:"));
        // A tensor's data changed with its checksum left as it was names the tensor.
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x10;
        let e = LayerCache::from_bytes(&bad, None).err().unwrap().to_string();
        assert!(e.contains("checksum does not match"), "{e}");
    }
}

#[test]
fn bad_input_names_the_argument() {
    let cfg = config(64, 2, Method::TurboQuantMse, Policy::Auto);
    let mut cache = LayerCache::new(cfg.clone(), Some(Stream::cpu())).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let good = normal(&mut rng, &[1, 2, 3, 64], Dtype::F16);
    let bad_heads = normal(&mut rng, &[1, 3, 3, 64], Dtype::F16);
    let ints = Array::from_slice(&[0i32; 384], &[1, 2, 3, 64]).unwrap();
    assert!(cache.append(&bad_heads, &bad_heads).unwrap_err().to_string().starts_with("keys: shape"));
    assert!(cache.append(&ints, &ints).unwrap_err().to_string().starts_with("keys: dtype int32"));
    assert!(cache.attention(&good, 0.1, false).unwrap_err().to_string().contains("empty"));
    cache.append(&good, &good).unwrap();
    let f32k = normal(&mut rng, &[1, 2, 3, 64], Dtype::F32);
    assert!(cache.append(&f32k, &f32k).unwrap_err().to_string().starts_with("keys: dtype float32"));
    let q5 = normal(&mut rng, &[1, 5, 1, 64], Dtype::F16);
    assert!(cache.attention(&q5, 0.1, false).unwrap_err().to_string().starts_with("queries: 5 heads"));
    let q4 = normal(&mut rng, &[1, 4, 1, 64], Dtype::F16);
    for scale in [f32::NAN, f32::INFINITY] {
        let e = cache.attention(&q4, scale, false).unwrap_err().to_string();
        assert!(e.starts_with("scale: ") && e.contains("not a finite number"), "{e}");
    }
    assert!(cache.attention(&q4, 0.1, false).is_ok());
    let mut c = cfg.clone();
    c.key_bits = 5;
    assert!(LayerCache::new(c, None).err().unwrap().to_string().starts_with("key_bits: 5"));
    let mut c = cfg.clone();
    c.head_dim = 100;
    assert!(LayerCache::new(c, None).err().unwrap().to_string().starts_with("head_dim: head dimension 100"));
    let mut c = cfg;
    c.key_method = Method::Kivi;
    c.key_bits = 6;
    let e = LayerCache::new(c, None).err().unwrap().to_string();
    assert!(e.starts_with("key_bits: 6 is not supported by kivi"), "{e}");
    let _ = f16::ONE;
}

#[test]
fn channel_offsets_of_keys_do_not_cost_precision() {
    // Real keys carry large per-channel offsets. The cache subtracts the
    // channel mean of the first append, so the codes only hold what varies:
    // the error relative to the keys' varying part stays TurboQuant's 4-bit
    // ~0.9%, instead of growing with the offsets' energy (here ~14x).
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let (h, d, t) = (2i32, 64i32, 600i32);
    let mut cfg = config(d as usize, h as usize, Method::TurboQuantMse, Policy::Auto);
    cfg.window = 1;
    cfg.sinks = 0;
    let mut cache = LayerCache::new(cfg, Some(Stream::cpu())).unwrap();
    let noise = f32s(&normal(&mut rng, &[1, h, t, d], Dtype::F32));
    let keys: Vec<f32> = noise.iter().enumerate().map(|(i, v)| v + if (i % d as usize) % 5 == 0 { 8.0 } else { 0.0 }).collect();
    let k = Array::from_slice(&keys, &[1, h, t, d]).unwrap();
    cache.append(&k, &k).unwrap();
    let (kd, _) = cache.dequantize().unwrap();
    let err: f64 = f32s(&kd).iter().zip(&keys).map(|(a, b)| f64::from(a - b).powi(2)).sum();
    let varying: f64 = noise.iter().map(|v| f64::from(*v).powi(2)).sum();
    assert!(err / varying < 0.012, "error / varying energy = {}", err / varying);
}

/// Key and value methods with their bits, mixed: every method on both sides
/// and in combination with the others.
const MIXED: [(Method, u32, Method, u32); 14] = [
    (Method::Kivi, 4, Method::Kivi, 2),
    (Method::Pq, 2, Method::Pq, 4),
    (Method::Pq, 1, Method::Kivi, 4),
    (Method::TurboQuantMse, 4, Method::Kivi, 3),
    (Method::Kivi, 2, Method::TurboQuantMse, 3),
    (Method::Kivi, 8, Method::Fp16, 16),
    (Method::Fp16, 16, Method::Kivi, 4),
    (Method::TurboQuantMse, 3, Method::Fp16, 16),
    (Method::Qjl, 1, Method::Kivi, 4),
    (Method::Qjl, 2, Method::Fp16, 16),
    (Method::TurboQuantProd, 4, Method::TurboQuantRvq, 3),
    (Method::TurboQuantProd, 2, Method::Pq, 2),
    (Method::TurboQuantRvq, 5, Method::TurboQuantRvq, 2),
    (Method::Kivi, 4, Method::TurboQuantRvq, 4),
];

fn mixed_config(d: usize, hkv: usize, m: (Method, u32, Method, u32), policy: Policy) -> CacheConfig {
    let mut c = config(d, hkv, m.0, policy);
    c.key_bits = m.1;
    c.value_method = m.2;
    c.value_bits = m.3;
    c
}

#[test]
fn mixed_methods_fused_attention_matches_decoded_sdpa() {
    let dims = [(64usize, Dtype::F32, 1e-5), (128, Dtype::F32, 1e-5), (80, Dtype::F16, 1e-2), (80, Dtype::F16, 1e-2), (96, Dtype::F32, 1e-5), (128, Dtype::BF16, 2e-2), (256, Dtype::F16, 1e-2), (128, Dtype::F32, 1e-5),
                (64, Dtype::F32, 1e-5), (128, Dtype::F16, 1e-2), (128, Dtype::F32, 1e-5), (64, Dtype::F16, 1e-2), (96, Dtype::F32, 1e-5), (80, Dtype::BF16, 2e-2)];
    for (i, &m) in MIXED.iter().enumerate() {
        let (d, dtype, tol) = dims[i];
        // Batch 2, GQA 4:1, a prefill chunk and single tokens.
        let (cache, _) = filled(mixed_config(d, 2, m, Policy::Require), 2, 70, 3, dtype, 40 + i as u64);
        assert!(cache.compressed_tokens() > 0, "{m:?}: some tokens are compressed");
        let (k, v) = cache.dequantize().unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let mut rng = ChaCha8Rng::seed_from_u64(i as u64);
        for (l, causal) in [(1, false), (1, true), (6, true), (6, false)] {
            let q = normal(&mut rng, &[2, 8, l, d as i32], dtype);
            let fused = cache.attention(&q, scale, causal).unwrap();
            let sdpa = ops::scaled_dot_product_attention(&q, &k, &v, scale, causal && l > 1, &Stream::cpu()).unwrap();
            let e = rel_err(&fused, &sdpa);
            assert!(e <= tol, "{m:?} d={d} {dtype} L={l} causal={causal}: fused vs decode+SDPA relative error {e}");
        }
        // A reloaded cache attends identically; the reference graph (policy
        // off) over the same tokens agrees with the fused kernel.
        let back = LayerCache::from_bytes(&cache.to_bytes().unwrap(), Some(Stream::cpu())).unwrap();
        let q = normal(&mut rng, &[2, 8, 1, d as i32], dtype);
        let fused = cache.attention(&q, scale, false).unwrap();
        assert_eq!(f32s(&back.attention(&q, scale, false).unwrap()), f32s(&fused), "{m:?}: reloaded");
        let (reference, _) = filled(mixed_config(d, 2, m, Policy::Off), 2, 70, 3, dtype, 40 + i as u64);
        let e = rel_err(&reference.attention(&q, scale, false).unwrap(), &fused);
        assert!(e <= tol.max(1e-4), "{m:?}: reference graph vs fused kernel relative error {e}");
    }
}

#[test]
fn kivi_compression_error_and_groups() {
    // KIVI 4 bits: keys per channel over 32-token groups (the window, 16, is
    // smaller: the recent slots hold window + 32), values per token over 32
    // channels; both well under a few percent of energy, and 2 bits clearly
    // worse than 4.
    let mut errs = Vec::new();
    for bits in [2u32, 4] {
        let mut cfg = config(128, 2, Method::Kivi, Policy::Auto);
        cfg.key_bits = bits;
        cfg.value_bits = bits;
        cfg.sinks = 0;
        let (cache, chunks) = filled(cfg, 1, 600, 0, Dtype::F32, 6);
        assert_eq!(cache.compressed_tokens() % 32, 0, "whole key groups are compressed");
        let recent = 600 - cache.compressed_tokens();
        assert!((16..16 + 32).contains(&recent), "{recent} recent tokens: the window and less than one group");
        let (k, v) = concat_tokens(&chunks);
        let (kd, vd) = cache.dequantize().unwrap();
        errs.push((rel_err(&kd, &k).powi(2), rel_err(&vd, &v).powi(2)));
    }
    let ((k2, v2), (k4, v4)) = (errs[0], errs[1]);
    assert!(k4 > 1e-4 && k4 < 0.01 && v4 > 1e-4 && v4 < 0.01, "4-bit relative MSE keys {k4} values {v4}");
    assert!(k2 > 4.0 * k4 && v2 > 4.0 * v4, "2 bits {k2}/{v2} vs 4 bits {k4}/{v4}");
}

#[test]
fn kivi_key_groups_stay_32_tokens_under_a_small_window() {
    // Window 1: the recent slots hold 1 + 32 tokens, so that every flush
    // compresses whole 32-token key groups (one float16 scale and zero per
    // channel per group), and the cache stays far below float16.
    for decode in [0, 70] {
        let mut cfg = config(128, 2, Method::Kivi, Policy::Auto);
        cfg.window = 1;
        cfg.sinks = 0;
        let (cache, _) = filled(cfg.clone(), 1, 130, decode, Dtype::F16, 21);
        let (n, c) = (cache.offset(), cache.compressed_tokens());
        assert_eq!(c % 32, 0, "whole key groups: {c} of {n}");
        assert!(n - c >= 1 && n - c <= 33, "{} recent tokens", n - c);
        let mut dense = cfg;
        dense.key_method = Method::Fp16;
        dense.value_method = Method::Fp16;
        let (fp16, _) = filled(dense, 1, 130, decode, Dtype::F16, 21);
        assert!(cache.nbytes() * 2 < fp16.nbytes(), "KIVI {} bytes vs float16 {}", cache.nbytes(), fp16.nbytes());
    }
}

#[test]
fn trim_inside_a_kivi_key_group_keeps_groups_aligned() {
    let mut cfg = config(64, 2, Method::Kivi, Policy::Require);
    cfg.value_method = Method::TurboQuantMse;
    let (mut cache, chunks) = filled(cfg, 1, 100, 0, Dtype::F32, 13);
    // 4 sinks, whole 32-token key groups compressed, the rest recent.
    let c0 = cache.compressed_tokens();
    assert_eq!(cache.offset(), 100);
    assert!(c0 >= 32 && c0 % 32 == 0, "{c0} compressed");
    let recent = 100 - 4 - c0;
    let (k_before, _) = cache.dequantize().unwrap();
    assert_eq!(cache.trim(recent + 7), recent + 7);
    assert_eq!(cache.compressed_tokens(), c0 - 7, "the last key group is partial now");
    // Enough new tokens to flush: the partial group is compressed again,
    // starting on its group boundary.
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let k = normal(&mut rng, &[1, 2, 60, 64], Dtype::F32);
    cache.append(&k, &k).unwrap();
    assert_eq!(cache.offset(), 100 - recent - 7 + 60);
    assert!(cache.compressed_tokens() >= c0, "the reopened group was compressed again");
    assert_eq!(cache.compressed_tokens() % 32, 0, "groups aligned again: {}", cache.compressed_tokens());
    let (k_after, v_after) = cache.dequantize().unwrap();
    // Tokens before the reopened group decode as before.
    let s = Stream::cpu();
    let keep = (4 + c0 - 32) as i32;
    let head = |a: &Array, n: i32| ops::slice(a, &[0, 0, 0, 0], &[1, 2, n, 64], &s).unwrap();
    assert_eq!(f32s(&head(&k_after, keep)), f32s(&head(&k_before, keep)));
    // The reopened tokens were compressed twice: still close to the originals.
    let (orig, _) = concat_tokens(&chunks);
    let part = |a: &Array| ops::slice(a, &[0, 0, keep, 0], &[1, 2, (4 + c0 - 7) as i32, 64], &s).unwrap();
    let e = rel_err(&part(&k_after), &part(&orig));
    assert!(e < 0.15, "reopened keys relative error {e}");
    let q = normal(&mut rng, &[1, 4, 3, 64], Dtype::F32);
    let fused = cache.attention(&q, 0.125, true).unwrap();
    let sdpa = ops::scaled_dot_product_attention(&q, &k_after, &v_after, 0.125, true, &s).unwrap();
    assert!(rel_err(&fused, &sdpa) <= 1e-5);
}

#[test]
fn every_method_state_round_trips_bit_identically() {
    for (i, &m) in MIXED.iter().enumerate() {
        let (cache, _) = filled(mixed_config(64, 2, m, Policy::Auto), 2, 50, 2, Dtype::F16, 60 + i as u64);
        let bytes = cache.to_bytes().unwrap();
        let back = LayerCache::from_bytes(&bytes, Some(Stream::cpu())).unwrap();
        assert_eq!(back.to_bytes().unwrap(), bytes, "{m:?}: round trip is bit-identical");
        assert_eq!(back.config(), cache.config());
        assert_eq!((back.offset(), back.compressed_tokens()), (cache.offset(), cache.compressed_tokens()));
        let (k0, v0) = cache.dequantize().unwrap();
        let (k1, v1) = back.dequantize().unwrap();
        assert_eq!((f32s(&k0), f32s(&v0)), (f32s(&k1), f32s(&v1)), "{m:?}: same tokens");
        // A saved state with a tensor renamed fails its header's checksum; a
        // state missing a tensor, or with one of the wrong shape, names
        // `state` and the tensor.
        let (tensors, meta) = cache.state_parts().unwrap();
        let meta: std::collections::HashMap<String, String> = meta.into_iter().collect();
        for name in ["k_codes", "v_codes", "win_k"] {
            let mut broken = bytes.clone();
            let pat = format!("\"{name}\"").into_bytes();
            let at = broken.windows(pat.len()).position(|w| w == pat.as_slice()).expect("tensor name in the header");
            *broken.get_mut(at + pat.len() - 2).unwrap() = b'#';
            let e = LayerCache::from_bytes(&broken, None).err().unwrap().to_string();
            assert!(e.starts_with("state:") && e.contains("checksum"), "{m:?}: {e}");
            let mut parts: std::collections::HashMap<String, Array> = tensors.iter().cloned().collect();
            parts.remove(name);
            let e = LayerCache::from_state_parts(&parts, &meta, None).err().unwrap().to_string();
            assert!(e.starts_with("state:") && e.contains(name), "{m:?}: {e}");
            let first = ops::slice(&tensors.iter().find(|t| t.0 == name).unwrap().1, &[0, 0, 0, 0], &[1, 1, 1, 1], &Stream::cpu()).unwrap();
            parts.insert(name.to_string(), first);
            let e = LayerCache::from_state_parts(&parts, &meta, None).err().unwrap().to_string();
            assert!(e.starts_with("state:") && e.contains(name), "{m:?}: {e}");
        }
        let e = LayerCache::from_bytes(&bytes[..bytes.len() - 3], None).err().unwrap().to_string();
        assert!(e.starts_with("state:"), "{e}");
    }
}

#[test]
fn wrong_bits_and_methods_name_the_argument() {
    for (method, bits, arg) in [(Method::Kivi, 5u32, "key_bits"), (Method::TurboQuantMse, 6, "key_bits")] {
        let mut c = config(64, 2, method, Policy::Auto);
        c.key_bits = bits;
        let e = LayerCache::new(c, None).err().unwrap().to_string();
        assert!(e.starts_with(&format!("{arg}: {bits} is not supported by {method}")), "{e}");
    }
    let mut c = config(64, 2, Method::Fp16, Policy::Auto);
    c.value_method = Method::Kivi;
    c.value_bits = 7;
    let e = LayerCache::new(c, None).err().unwrap().to_string();
    assert!(e.starts_with("value_bits: 7 is not supported by kivi"), "{e}");
    for (method, bits) in [(Method::Qjl, 5u32), (Method::TurboQuantProd, 1), (Method::TurboQuantProd, 6), (Method::TurboQuantRvq, 1)] {
        let mut c = config(64, 2, Method::Fp16, Policy::Auto);
        (c.key_method, c.key_bits) = (method, bits);
        let e = LayerCache::new(c, None).err().unwrap().to_string();
        assert!(e.starts_with(&format!("key_bits: {bits} is not supported by {method}")), "{e}");
    }
    let mut c = config(64, 2, Method::TurboQuantRvq, Policy::Auto);
    c.value_bits = 8;
    let e = LayerCache::new(c, None).err().unwrap().to_string();
    assert!(e.starts_with("value_bits: 8 is not supported by turboquant-rvq"), "{e}");
    // The estimators hold keys only.
    for method in [Method::Qjl, Method::TurboQuantProd] {
        let mut c = config(64, 2, Method::TurboQuantMse, Policy::Auto);
        (c.value_method, c.value_bits) = (method, 2);
        let e = LayerCache::new(c, None).err().unwrap().to_string();
        assert!(e.starts_with(&format!("value_method: {method} estimates attention scores and stores keys only")), "{e}");
    }
    let e = "nope".parse::<Method>().unwrap_err().to_string();
    assert!(e.starts_with("method: \"nope\" is not one of") && e.contains("\"kivi\""), "{e}");
    let e = Method::parse_arg("value_method", "nope").unwrap_err().to_string();
    assert!(e.starts_with("value_method: \"nope\" is not one of") && e.contains("\"kivi\""), "{e}");
    assert_eq!(Method::Kivi.supported_bits(), Some(&[1, 2, 3, 4, 8][..]));
    assert_eq!(Method::Fp16.supported_bits(), None);
    // A state's metadata problems name the field and value, never `Some(..)`.
    let (cache, _) = filled(config(64, 2, Method::TurboQuantMse, Policy::Auto), 1, 30, 0, Dtype::F16, 3);
    let (tensors, meta) = cache.state_parts().unwrap();
    let tensors: std::collections::HashMap<String, Array> = tensors.into_iter().collect();
    for (key, value, want) in [
        ("version", "2", "state: version \"2\" is not supported: this veloxquant reads versions 7 and 8"),
        ("format", "zip", "state: format \"zip\" is not \"veloxquant-layer-cache\""),
        ("dtype", "float64", "state: dtype \"float64\" is not one of"),
        ("window", "-1", "state: field \"window\": \"-1\" is not a valid value"),
    ] {
        let mut m: std::collections::HashMap<String, String> = meta.clone().into_iter().collect();
        m.insert(key.into(), value.into());
        let e = LayerCache::from_state_parts(&tensors, &m, None).err().unwrap().to_string();
        assert!(e.starts_with(want) && !e.contains("Some("), "{e}");
    }
}

#[test]
fn pq_compression_error_falls_with_bits() {
    let mut errs = Vec::new();
    for bits in [1u32, 2, 4] {
        let mut cfg = config(128, 2, Method::Pq, Policy::Auto);
        cfg.key_bits = bits;
        cfg.value_bits = bits;
        (cfg.window, cfg.sinks) = (1, 0);
        let (cache, chunks) = filled(cfg, 1, 400, 0, Dtype::F32, 8);
        let (_, v) = concat_tokens(&chunks);
        let (_, vd) = cache.dequantize().unwrap();
        errs.push(rel_err(&vd, &v).powi(2));
    }
    // Relative MSE: far from useless at 1 bit, and each doubling helps.
    assert!(errs[0] < 0.5 && errs[1] < 0.7 * errs[0] && errs[2] < 0.7 * errs[1], "relative MSE by bits 1, 2, 4: {errs:?}");
}

/// Errors of the keys' inner products with queries aligned with them (`q =
/// 0.6 k + z`, so that a wrong scale of the estimate shows as a bias), as the
/// cache's decoded keys give them (the fused kernel scores the same
/// estimate). Unbiasedness is over the sketch's randomness as well as the
/// data, so the pairs are spread over 10 cache seeds: (relative bias, its
/// 99.9% interval from the spread of the seeds' biases, rms error / d ≈
/// ‖q‖ ‖k‖).
fn score_stats(method: Method, bits: u32) -> (f64, f64, f64) {
    let (d, t, seeds) = (64usize, 600i32, 10u64);
    let (mut biases, mut sq, mut n) = (Vec::new(), 0.0f64, 0usize);
    for seed in 0..seeds {
        let mut cfg = config(d, 1, method, Policy::Auto);
        (cfg.key_bits, cfg.value_method, cfg.value_bits, cfg.seed) = (bits, Method::Fp16, 16, seed);
        (cfg.window, cfg.sinks) = (1, 0);
        let (cache, chunks) = filled(cfg, 1, t, 0, Dtype::F32, 31 + seed);
        assert_eq!(cache.compressed_tokens(), t as usize - 1);
        let (k, _) = concat_tokens(&chunks);
        let (kd, _) = cache.dequantize().unwrap();
        let (k, kd) = (f32s(&k), f32s(&kd));
        let z = f32s(&normal(&mut ChaCha8Rng::seed_from_u64(100 + seed), &[t, d as i32], Dtype::F32));
        let (mut err, mut truth) = (0.0f64, 0.0f64);
        for ((exact, est), z) in k.chunks(d).zip(kd.chunks(d)).zip(z.chunks(d)).take(t as usize - 1) {
            let q: Vec<f32> = exact.iter().zip(z).map(|(a, b)| 0.6 * a + b).collect();
            let dot = |x: &[f32]| x.iter().zip(&q).map(|(a, b)| f64::from(a * b)).sum::<f64>();
            let e = dot(est) - dot(exact);
            (err, truth, sq, n) = (err + e, truth + dot(exact), sq + e * e, n + 1);
        }
        biases.push(err / truth);
    }
    let k = seeds as f64;
    let rel = biases.iter().sum::<f64>() / k;
    let sd = (biases.iter().map(|b| (b - rel).powi(2)).sum::<f64>() / (k - 1.0)).sqrt();
    // Student t with 9 degrees of freedom: 4.78 for 99.9%.
    (rel, 4.78 * sd / k.sqrt(), (sq / n as f64).sqrt() / d as f64)
}

#[test]
fn estimated_scores_are_unbiased_and_tighten_with_bits() {
    let mut last = (Method::Fp16, f64::INFINITY);
    for (method, bits, bound) in [
        (Method::Qjl, 1, 0.12),
        (Method::Qjl, 4, 0.06),
        (Method::TurboQuantProd, 2, 0.08),
        (Method::TurboQuantProd, 5, 0.02),
    ] {
        let (rel, ci, rms) = score_stats(method, bits);
        eprintln!("{method}/{bits}: relative bias {rel:.4} ± {ci:.4}, rms {rms:.4} of ‖q‖‖k‖");
        assert!(rel.abs() < ci && rel.abs() < 0.02, "{method}/{bits}: relative bias {rel} ± {ci}");
        assert!(rms < bound, "{method}/{bits}: rms error {rms} of ‖q‖‖k‖");
        if last.0 == method {
            assert!(rms < 0.7 * last.1, "{method}/{bits}: more bits, smaller error ({rms} vs {})", last.1);
        }
        last = (method, rms);
    }
    // TurboQuant-MSE at 1 bit shrinks inner products by about 2/π: the
    // statistics above can tell a biased method.
    let (rel, ci, _) = score_stats(Method::TurboQuantMse, 1);
    assert!(rel.abs() > ci && (rel + 1.0 - 2.0 / std::f64::consts::PI).abs() < 0.05, "turboquant-mse/1: {rel} ± {ci}");
}

#[test]
fn prod_and_rvq_store_what_the_reference_quantizers_do() {
    use veloxquant::quant::{Quantizer, RotationKind, TurboQuantProd, TurboQuantRvq};
    let (d, t, seed) = (64usize, 400i32, 5u64);
    for bits in [2u32, 4] {
        let mut cfg = config(d, 2, Method::TurboQuantProd, Policy::Auto);
        (cfg.key_bits, cfg.value_method, cfg.value_bits, cfg.seed) = (bits, Method::TurboQuantRvq, bits + 1, seed);
        (cfg.window, cfg.sinks) = (1, 0);
        let (cache, chunks) = filled(cfg, 1, t, 0, Dtype::F32, 33);
        let (k, v) = concat_tokens(&chunks);
        let (kd, vd) = cache.dequantize().unwrap();
        let (k, v, kd, vd) = (f32s(&k), f32s(&v), f32s(&kd), f32s(&vd));
        // Keys are stored minus their channel mean (of the one append).
        let mut mean = vec![0.0f32; 2 * d];
        for (i, x) in k.iter().enumerate() {
            mean[(i / (t as usize * d)) * d + i % d] += x / t as f32;
        }
        let centred: Vec<f32> = k.iter().enumerate().map(|(i, x)| x - mean[(i / (t as usize * d)) * d + i % d]).collect();
        let prod = TurboQuantProd::new(d, bits, RotationKind::Hadamard, seed).unwrap();
        let rvq = TurboQuantRvq::new(d, bits, 1, RotationKind::Hadamard, seed).unwrap();
        let want_k = prod.decode(&prod.encode(&centred).unwrap()).unwrap();
        let want_v = rvq.decode(&rvq.encode(&v).unwrap()).unwrap();
        let got_k: Vec<f32> = kd.iter().enumerate().map(|(i, x)| x - mean[(i / (t as usize * d)) * d + i % d]).collect();
        // Compressed tokens only (the last one is in the window).
        let rel = |a: &[f32], b: &[f32]| {
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for h in 0..2 {
                let r = h * t as usize * d..(h * t as usize + t as usize - 1) * d;
                num += a[r.clone()].iter().zip(&b[r.clone()]).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>();
                den += b[r].iter().map(|y| f64::from(*y).powi(2)).sum::<f64>();
            }
            (num / den).sqrt()
        };
        let (ek, ev) = (rel(&got_k, &want_k), rel(&vd, &want_v));
        assert!(ek < 1e-2 && ev < 1e-2, "bits {bits}: cache vs reference quantizer, keys {ek}, values {ev}");
        // And both are real approximations of the input.
        assert!(rel(&vd, &v) < 0.5 && rel(&got_k, &centred) < 1.0, "bits {bits}");
    }
}

#[test]
fn rvq_residual_bit_lowers_the_error() {
    // Values' relative MSE: TurboQuant-RVQ at `bits` (bits − 1, then 1 on the
    // residual) against TurboQuant-MSE at bits − 1.
    let err = |method: Method, bits: u32| {
        let mut cfg = config(128, 2, method, Policy::Auto);
        (cfg.key_bits, cfg.value_bits, cfg.window, cfg.sinks) = (bits, bits, 1, 0);
        let (cache, chunks) = filled(cfg, 1, 400, 0, Dtype::F32, 9);
        let (_, v) = concat_tokens(&chunks);
        rel_err(&cache.dequantize().unwrap().1, &v).powi(2)
    };
    for bits in [2u32, 3, 4, 5] {
        let (rvq, mse) = (err(Method::TurboQuantRvq, bits), err(Method::TurboQuantMse, bits - 1));
        assert!(rvq < 0.8 * mse, "bits {bits}: rvq {rvq} vs turboquant-mse at {} bits {mse}", bits - 1);
    }
}

/// Kernels pending on the cache's arrays after each single-token append
/// (evaluating in between), split into steady appends and window flushes;
/// the few appends that grow a window (it doubles up to its capacity) are
/// left out of both.
fn append_launches(cfg: CacheConfig, tokens: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut cache, _) = filled(cfg.clone(), 1, 40, 0, Dtype::F16, 9);
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let (h, d) = (cfg.kv_heads as i32, cfg.head_dim as i32);
    let (mut steady, mut flush) = (Vec::new(), Vec::new());
    veloxquant::array::eval(&cache.arrays()).unwrap();
    for _ in 0..tokens {
        let k = normal(&mut rng, &[1, h, 1, d], Dtype::F16);
        let v = normal(&mut rng, &[1, h, 1, d], Dtype::F16);
        veloxquant::array::eval(&[&k, &v]).unwrap();
        let (before, bytes) = (cache.compressed_tokens(), cache.nbytes());
        cache.append(&k, &v).unwrap();
        let n = veloxquant::graph::pending_kernels(&cache.arrays()).unwrap().len();
        if cache.compressed_tokens() != before {
            flush.push(n)
        } else if cache.nbytes() == bytes {
            steady.push(n)
        }
        veloxquant::array::eval(&cache.arrays()).unwrap();
    }
    (steady, flush)
}

#[test]
fn appending_a_token_launches_one_kernel() {
    for m in [
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 3),
        (Method::Kivi, 4, Method::Kivi, 2),
        (Method::Pq, 2, Method::Pq, 2),
        (Method::Qjl, 1, Method::TurboQuantRvq, 3),
        (Method::TurboQuantProd, 4, Method::Fp16, 16),
        (Method::Fp16, 16, Method::Fp16, 16),
    ] {
        let cfg = mixed_config(64, 2, m, Policy::Auto);
        let window = cfg.window;
        let (steady, flush) = append_launches(cfg, 40);
        assert!(!steady.is_empty(), "{m:?}: no steady append");
        let most = *steady.iter().max().unwrap();
        // A compressed layer: one `window_append` (both sides, into their
        // frames); the dense control: one slice update per side.
        let bound = if m.0 == Method::Fp16 && m.2 == Method::Fp16 { 2 } else { 1 };
        assert!(most <= bound, "{m:?}: {most} kernels for one appended token (K + V)");
        let flush_most = flush.iter().copied().max().unwrap_or(0);
        eprintln!("{m:?}: steady {most} kernels per token (K + V), window flush {flush_most} (once per {window} tokens)");
    }
}

#[test]
fn array_masks_match_decoded_sdpa_for_every_method() {
    use veloxquant::cache::AttentionMask;
    let pairs = [
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 3),
        (Method::Kivi, 4, Method::Pq, 2),
        (Method::Qjl, 1, Method::TurboQuantRvq, 3),
        (Method::TurboQuantProd, 4, Method::Fp16, 16),
        (Method::Fp16, 16, Method::Fp16, 16),
    ];
    let s = Stream::cpu();
    for (i, &m) in pairs.iter().enumerate() {
        for (d, dtype, tol) in [(64usize, Dtype::F32, 1e-5), (128, Dtype::F16, 1e-2)] {
            let (cache, _) = filled(mixed_config(d, 2, m, Policy::Require), 2, 70, 3, dtype, 90 + i as u64);
            let (k, v) = cache.dequantize().unwrap();
            let t = cache.offset() as i32;
            let scale = 1.0 / (d as f32).sqrt();
            let mut rng = ChaCha8Rng::seed_from_u64(i as u64);
            for l in [1, 5] {
                let q = normal(&mut rng, &[2, 8, l, d as i32], dtype);
                let (boolean, additive) = attention_masks(&mut rng, 2, 8, l, t);
                for (name, mask) in [("boolean [B,1,L,T]", &boolean), ("additive [B,Hq,L,T]", &additive)] {
                    let fused = cache.attention_with_mask(&q, scale, AttentionMask::Array(mask)).unwrap();
                    let mask_q = if mask.dtype() == Dtype::Bool { mask.clone() } else { ops::astype(mask, dtype, &s).unwrap() };
                    let sdpa = ops::scaled_dot_product_attention_masked(&q, &k, &v, scale, &mask_q, &s).unwrap();
                    let e = rel_err(&fused, &sdpa);
                    assert!(e <= tol, "{m:?} d={d} {dtype} L={l} {name}: fused vs decode+SDPA relative error {e}");
                }
                // The mask matters: it changes the output.
                let unmasked = cache.attention(&q, scale, false).unwrap();
                let masked = cache.attention_with_mask(&q, scale, AttentionMask::Array(&boolean)).unwrap();
                assert!(rel_err(&masked, &unmasked) > 1e-2, "{m:?}: the mask had no effect");
            }
        }
    }
}

#[test]
fn bad_masks_name_the_argument() {
    use veloxquant::cache::AttentionMask;
    let (cache, _) = filled(mixed_config(64, 2, (Method::Kivi, 4, Method::Kivi, 2), Policy::Auto), 1, 40, 1, Dtype::F32, 7);
    let t = cache.offset() as i32;
    let q = normal(&mut ChaCha8Rng::seed_from_u64(1), &[1, 4, 1, 64], Dtype::F32);
    let wrong_len = ops::zeros(&[1, 1, 1, t + 1], Dtype::F32, &Stream::cpu()).unwrap();
    let wrong_heads = ops::zeros(&[1, 3, 1, t], Dtype::F32, &Stream::cpu()).unwrap();
    let integer = ops::zeros(&[1, 1, 1, t], Dtype::I32, &Stream::cpu()).unwrap();
    for bad in [&wrong_len, &wrong_heads, &integer] {
        let e = cache.attention_with_mask(&q, 0.125, AttentionMask::Array(bad)).unwrap_err().to_string();
        assert!(e.contains("mask"), "{e}");
    }
}

#[test]
fn layers_of_one_config_hold_one_set_of_shared_arrays() {
    use veloxquant::cache::total_nbytes;
    let s = Stream::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let fill = |cfg: CacheConfig, rng: &mut ChaCha8Rng| {
        let mut c = LayerCache::new(cfg, Some(s.clone())).unwrap();
        assert_eq!(c.shared_id(), None, "nothing is shared before the first append");
        let k = normal(rng, &[1, 2, 40, 64], Dtype::F16);
        c.append(&k, &k).unwrap();
        c
    };
    let layers: Vec<LayerCache> = (0..4).map(|_| fill(config(64, 2, Method::TurboQuantMse, Policy::Auto), &mut rng)).collect();
    let id = layers[0].shared_id().expect("an appended layer holds its shared arrays");
    assert!(layers.iter().all(|l| l.shared_id() == Some(id)), "one config, one set of shared arrays");
    let shared = layers[0].shared_nbytes();
    assert!(shared > 0);
    let own: usize = layers.iter().map(LayerCache::nbytes).sum();
    assert_eq!(total_nbytes(&layers), own + shared, "the shared arrays count once");
    // Another bit width or seed has its own codebook or rotation; a copy
    // rebuilt from the state joins the set of its configuration.
    let mut other = config(64, 2, Method::TurboQuantMse, Policy::Auto);
    other.key_bits = 3;
    let other = fill(other, &mut rng);
    assert_ne!(other.shared_id(), Some(id));
    let back = LayerCache::from_bytes(&layers[1].to_bytes().unwrap(), Some(s.clone())).unwrap();
    assert_eq!(back.shared_id(), Some(id));
    let all: Vec<&LayerCache> = layers.iter().chain([&other, &back]).collect();
    assert_eq!(
        total_nbytes(all.iter().copied()),
        own + other.nbytes() + back.nbytes() + shared + other.shared_nbytes()
    );
}

/// Bytes of a float16 cache holding `tokens` keys and values `[b, h, ·, d]`
/// as mlx_lm's `KVCache` allocates them (steps of 256 tokens).
fn fp16_cache_bytes(b: usize, h: usize, d: usize, tokens: usize) -> usize {
    2 * b * h * d * 2 * tokens.div_ceil(256) * 256
}

#[test]
fn compressed_caches_allocate_by_need_and_never_hold_more_than_float16() {
    let (b, h, d) = (1usize, 8usize, 128usize);
    let configs = [
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 4, 128, 4),
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 4, 16, 4),
        (Method::Kivi, 4, Method::Kivi, 2, 128, 4),
        (Method::Kivi, 8, Method::Kivi, 8, 16, 0),
        (Method::Pq, 2, Method::Pq, 2, 128, 4),
        (Method::Qjl, 1, Method::TurboQuantRvq, 3, 64, 4),
        (Method::TurboQuantMse, 4, Method::Fp16, 16, 128, 4),
        (Method::Fp16, 16, Method::Fp16, 16, 128, 4),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for (km, kb, vm, vb, window, sinks) in configs {
        let mut cfg = mixed_config(d, h, (km, kb, vm, vb), Policy::Auto);
        cfg.window = window;
        cfg.sinks = sinks;
        let tag = format!("{km}/{kb} {vm}/{vb} window {window}");
        // One prefill chunk of each size: at most float16's bytes.
        for t in [1usize, 3, 77, 200, 300, 1000, 2500] {
            let mut cache = LayerCache::new(cfg.clone(), Some(Stream::cpu())).unwrap();
            let k = normal(&mut rng, &[b as i32, h as i32, t as i32, d as i32], Dtype::F16);
            cache.append(&k, &k).unwrap();
            let fp16 = fp16_cache_bytes(b, h, d, t);
            assert!(cache.nbytes() <= fp16, "{tag}, {t} tokens: {} bytes, float16 {fp16}", cache.nbytes());
        }
        // A prefill of 77 tokens, then single tokens: at most float16's bytes
        // at every step, but for the key mean and its offset (6 bytes per
        // channel and KV head) and the one slot of a store with no token yet
        // when the windows hold as many tokens as float16 allocates (under
        // three tokens of float16 keys and values).
        let mut cache = LayerCache::new(cfg.clone(), Some(Stream::cpu())).unwrap();
        let k = normal(&mut rng, &[b as i32, h as i32, 77, d as i32], Dtype::F16);
        cache.append(&k, &k).unwrap();
        let mean = if cfg.compressed() { 3 * (2 * b * h * d * 2) } else { 0 };
        for t in 78..=700usize {
            let k = normal(&mut rng, &[b as i32, h as i32, 1, d as i32], Dtype::F16);
            cache.append(&k, &k).unwrap();
            let fp16 = fp16_cache_bytes(b, h, d, t);
            let slack = if t % 256 == 0 || t % 256 > 256 - 8 { mean } else { 0 };
            assert!(cache.nbytes() <= fp16 + slack, "{tag}, {t} tokens: {} bytes, float16 {fp16}", cache.nbytes());
        }
    }
}

/// `x` `[1, H, T, D]` float16 with `value` at (head, token, channel).
fn with_value(x: &Array, head: usize, token: usize, channel: usize, value: f32) -> Array {
    let shape = x.shape();
    let (t, d) = (shape[2] as usize, shape[3] as usize);
    let mut v = f32s(x);
    v[(head * t + token) * d + channel] = value;
    ops::astype(&Array::from_slice(&v, &shape).unwrap(), Dtype::F16, &Stream::cpu()).unwrap()
}

#[test]
fn non_finite_keys_and_values_stay_non_finite_for_every_method() {
    let (h, d, total) = (2usize, 64usize, 100usize);
    let s = Stream::cpu();
    let pairs = [
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 4),
        (Method::Kivi, 4, Method::Kivi, 2),
        (Method::Pq, 2, Method::Pq, 4),
        (Method::Qjl, 2, Method::TurboQuantMse, 3),
        (Method::TurboQuantProd, 4, Method::TurboQuantRvq, 3),
        (Method::TurboQuantMse, 4, Method::Fp16, 16),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(51);
    let clean_k = normal(&mut rng, &[1, h as i32, total as i32, d as i32], Dtype::F16);
    let clean_v = normal(&mut rng, &[1, h as i32, total as i32, d as i32], Dtype::F16);
    let q = normal(&mut rng, &[1, 2 * h as i32, 1, d as i32], Dtype::F16);
    for m in pairs {
        // A bad token in the first chunk (its mean must not shift the other
        // keys) and one appended later; a NaN or an infinity; in the keys or
        // the values; always in KV head 1, channel 7.
        for (bad, value, keys) in [(10, f32::NAN, true), (50, f32::NAN, true), (50, f32::INFINITY, true), (50, f32::NEG_INFINITY, false), (10, f32::NAN, false)] {
            let tag = format!("{m:?}, {} {value} at token {bad}", if keys { "key" } else { "value" });
            let (k, v) = if keys {
                (with_value(&clean_k, 1, bad, 7, value), clean_v.clone())
            } else {
                (clean_k.clone(), with_value(&clean_v, 1, bad, 7, value))
            };
            let mut cache = LayerCache::new(mixed_config(d, h, m, Policy::Auto), Some(s.clone())).unwrap();
            let chunk = |x: &Array, lo: usize, hi: usize| ops::slice(x, &[0, 0, lo as i32, 0], &[1, h as i32, hi as i32, d as i32], &s).unwrap();
            cache.append(&chunk(&k, 0, 40), &chunk(&v, 0, 40)).unwrap();
            for t in 40..total {
                cache.append(&chunk(&k, t, t + 1), &chunk(&v, t, t + 1)).unwrap();
            }
            assert!(cache.compressed_tokens() > bad, "{tag}: the bad token is compressed");
            // dequantize: the bad token is non-finite, KV head 0 and the
            // other tokens of head 1 are not (but for KIVI keys, whose
            // scales the 32 tokens of a group share per channel).
            let (kd, vd) = cache.dequantize().unwrap();
            let side = f32s(if keys { &kd } else { &vd });
            let other = f32s(if keys { &vd } else { &kd });
            let row = |x: &[f32], head: usize, t: usize| x[(head * total + t) * d..(head * total + t + 1) * d].to_vec();
            assert!(row(&side, 1, bad).iter().any(|x| !x.is_finite()), "{tag}: decoded finite");
            let shared_group = keys && m.0 == Method::Kivi;
            for t in 0..total {
                assert!(row(&side, 0, t).iter().all(|x| x.is_finite()), "{tag}: head 0 token {t}");
                assert!(row(&other, 1, t).iter().all(|x| x.is_finite()), "{tag}: other side, token {t}");
                // (Compressed slots start after the 4 sinks.)
                if t != bad && !(shared_group && t >= 4 && (t - 4) / 32 == (bad - 4) / 32) {
                    assert!(row(&side, 1, t).iter().all(|x| x.is_finite()), "{tag}: token {t} became non-finite");
                }
            }
            // Attention: the query heads of KV head 1 see the bad token and
            // get non-finite outputs (NaN), the others stay finite; for a NaN
            // key as float16 attention over the inputs gives.
            let out = f32s(&cache.attention(&q, 0.125, false).unwrap());
            let want = f32s(&ops::scaled_dot_product_attention(&q, &k, &v, 0.125, false, &s).unwrap());
            assert!(out[..2 * d].iter().all(|x| x.is_finite()), "{tag}: KV head 0's queries");
            let dense = if keys { m.0 } else { m.2 } == Method::Fp16;
            if dense {
                // Kept as given: float16 attention's own result.
                let finite = |x: &[f32]| x.iter().map(|v| v.is_finite()).collect::<Vec<_>>();
                assert_eq!(finite(&out), finite(&want), "{tag}: non-finite where float16 attention has them");
            } else {
                assert!(out[2 * d..].iter().all(|x| x.is_nan()), "{tag}: KV head 1's queries are not NaN");
            }
            if value.is_nan() && keys {
                let nan = |x: &[f32]| x.iter().map(|v| v.is_nan()).collect::<Vec<_>>();
                assert_eq!(nan(&out), nan(&want), "{tag}: NaN where float16 attention has NaN");
            }
        }
    }
}

/// `[1, h, t, d]` uniform in `[-scale, scale]` in `dtype` (float16 keeps
/// every value finite below 65504).
fn uniform(rng: &mut ChaCha8Rng, shape: &[i32], scale: f32, dtype: Dtype) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| scale * (2.0 * rand::RngExt::random::<f32>(rng) - 1.0)).collect();
    ops::astype(&Array::from_slice(&v, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
}

#[test]
fn norms_beyond_float16_are_held_or_refused_never_wrong() {
    let (h, d, t) = (2i32, 128i32, 96i32);
    let s = Stream::cpu();
    let pairs = [
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 4),
        (Method::Pq, 2, Method::TurboQuantRvq, 3),
        (Method::TurboQuantProd, 4, Method::Pq, 4),
        (Method::Qjl, 2, Method::TurboQuantMse, 3),
        (Method::Kivi, 4, Method::TurboQuantMse, 4),
    ];
    for m in pairs {
        // The relative error at unit scale, then at scales whose norms are
        // far beyond float16's 65504: float32 and bfloat16 at 1e5 (norms
        // about 6.5e5), float16 up to 3e4 (every float16 value is held).
        let err_at = |scale: f32, dtype: Dtype| -> (f64, f64, f64) {
            let mut rng = ChaCha8Rng::seed_from_u64(61);
            let k = uniform(&mut rng, &[1, h, t, d], scale, dtype);
            let v = uniform(&mut rng, &[1, h, t, d], scale, dtype);
            let q = uniform(&mut rng, &[1, 2 * h, 1, d], 2.0 / scale, dtype);
            let mut cfg = mixed_config(d as usize, h as usize, m, Policy::Auto);
            cfg.window = 8;
            let mut cache = LayerCache::new(cfg, Some(s.clone())).unwrap();
            cache.append(&k, &v).unwrap();
            assert!(cache.compressed_tokens() >= 64);
            let (kd, vd) = cache.dequantize().unwrap();
            let (kdf, vdf) = (f32s(&kd), f32s(&vd));
            assert!(kdf.iter().chain(&vdf).all(|x| x.is_finite()), "{m:?} {dtype} at {scale}: non-finite decoded values");
            let fused = cache.attention(&q, 0.1, false).unwrap();
            let f32_ = |a: &Array| ops::astype(a, Dtype::F32, &s).unwrap();
            let want = ops::scaled_dot_product_attention(&f32_(&q), &f32_(&kd), &f32_(&vd), 0.1, false, &s).unwrap();
            (rel_err(&kd, &k), rel_err(&vd, &v), rel_err(&f32_(&fused), &want))
        };
        let (k1, v1, _) = err_at(1.0, Dtype::F32);
        for (scale, dtype, attention_tol) in [(1e5, Dtype::F32, 1e-4), (1e5, Dtype::BF16, 2e-2), (3e4, Dtype::F16, 1e-2), (1e-2, Dtype::F16, 1e-2)] {
            let (ke, ve, ae) = err_at(scale, dtype);
            let tag = format!("{m:?} {dtype} at scale {scale}");
            assert!(ke < 1.2 * k1 + 0.02 && ve < 1.2 * v1 + 0.02, "{tag}: relative errors {ke:.3} {ve:.3}, at unit scale {k1:.3} {v1:.3}");
            assert!(ae < attention_tol, "{tag}: fused attention against decoded SDPA {ae:.2e}");
        }
    }
    // Norms beyond what the scaled frame holds (65504 · F) are refused: such
    // a token decodes to NaN, never to a wrong finite value.
    let mut rng = ChaCha8Rng::seed_from_u64(62);
    let k = uniform(&mut rng, &[1, h, t, d], 1e7, Dtype::F32);
    let mut cache = LayerCache::new(config(d as usize, h as usize, Method::TurboQuantMse, Policy::Auto), Some(s.clone())).unwrap();
    cache.append(&k, &k).unwrap();
    let (kd, _) = cache.dequantize().unwrap();
    let kd = f32s(&kd);
    let n = cache.compressed_tokens();
    assert!(n > 0);
    for head in 0..h as usize {
        for tok in 0..t as usize {
            let row = &kd[(head * t as usize + tok) * d as usize..][..d as usize];
            let compressed = tok >= 4 && tok < 4 + n;
            assert_eq!(row.iter().all(|x| x.is_nan()), compressed, "token {tok}");
        }
    }
}

/// KIVI keys of 3 bits on average over channels of 1 to 8 bits (the first
/// channels weighed most), TurboQuant values: widths a head's channels share
/// in every group and batch row.
fn kivi_widths_config() -> CacheConfig {
    let (d, h) = (64usize, 2usize);
    let mut cfg = config(d, h, Method::Kivi, Policy::Auto);
    cfg.value_method = Method::TurboQuantMse;
    cfg.key_bits = 3;
    cfg.key_group = 32;
    let weights: Vec<f32> = (0..h * d).map(|i| 4.0f32.powi(6 - (i % d) as i32 / 8)).collect();
    cfg.key_widths = Some(veloxquant::cache::channel_widths(&weights, d, 3).unwrap());
    cfg
}

#[test]
fn channel_widths_keep_the_bits_and_follow_the_weights() {
    let cfg = kivi_widths_config();
    let w = cfg.key_widths.as_ref().unwrap();
    for head in w.chunks(64) {
        assert_eq!(head.iter().map(|&v| v as usize).sum::<usize>(), 64 * 3);
        // Weights fall by 4x every 8 channels: one more bit per step of 4x,
        // so widths never rise along the channels.
        assert!(head.windows(2).all(|p| p[0] >= p[1]), "{head:?}");
        assert!(head[0] > 3 && head[63] < 3, "{head:?}");
    }
    assert_eq!(veloxquant::cache::channel_widths(&[1.0; 64], 64, 4).unwrap(), vec![4u8; 64], "equal weights: equal widths");
    for (weights, dim, bits) in [(vec![1.0f32; 60], 64, 3), (vec![f32::NAN; 64], 64, 3), (vec![1.0; 64], 64, 9)] {
        assert!(veloxquant::cache::channel_widths(&weights, dim, bits).is_err());
    }
}

#[test]
fn kivi_keys_with_bits_per_channel_decode_attend_and_round_trip() {
    let cfg = kivi_widths_config();
    let (cache, chunks) = filled(cfg.clone(), 2, 200, 40, Dtype::F32, 71);
    assert!(cache.compressed_tokens() >= 160 && cache.compressed_tokens() % 32 == 0);
    let (k, v) = cache.dequantize().unwrap();
    let (orig, _) = concat_tokens(&chunks);
    // Per channel, the error falls with its width: the widest channels'
    // error is far below the 1-bit ones'.
    let (got, want) = (f32s(&k), f32s(&orig));
    let widths = cfg.key_widths.as_ref().unwrap();
    let channel_err = |c: usize| -> f64 {
        let n = got.len() / 64;
        (0..n).map(|i| f64::from((got[i * 64 + c] - want[i * 64 + c]).abs())).sum::<f64>() / n as f64
    };
    let (wide, narrow) = (channel_err(0), channel_err(63));
    assert!(widths[0] >= 5 && widths[63] == 1 && wide * 8.0 < narrow, "error {wide} at {} bits vs {narrow} at 1", widths[0]);
    // The fused kernel reads the codes at the same offsets as the decode.
    let s = Stream::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(72);
    for (l, causal) in [(1, false), (5, true)] {
        let q = normal(&mut rng, &[2, 4, l, 64], Dtype::F32);
        let fused = cache.attention(&q, 0.125, causal).unwrap();
        let sdpa = ops::scaled_dot_product_attention(&q, &k, &v, 0.125, causal, &s).unwrap();
        assert!(rel_err(&fused, &sdpa) <= 1e-5, "L={l}: {}", rel_err(&fused, &sdpa));
    }
    // State: the widths travel with it (version 8), bit-identically.
    let (_, meta) = cache.state_parts().unwrap();
    assert_eq!(meta.get("version").map(String::as_str), Some("8"));
    let bytes = cache.to_bytes().unwrap();
    let back = LayerCache::from_bytes(&bytes, Some(Stream::cpu())).unwrap();
    assert_eq!(back.config(), cache.config());
    assert_eq!(back.to_bytes().unwrap(), bytes);
    // The widths' offsets are data; the bytes held stay below the dense
    // float32 tokens' (windows of 52 slots are most of them at 240 tokens).
    assert!(cache.data_nbytes() < cache.nbytes());
    assert!(cache.nbytes() < 2 * 2 * 240 * 64 * 4, "{} bytes", cache.nbytes());
}

#[test]
fn uniform_widths_quantize_as_kivi_does() {
    // Every channel at `bits`: the graph with widths gives KIVI's own codes,
    // scales and zeros (its reference graph, which rounds the same way).
    let s = Stream::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(73);
    let x = normal(&mut rng, &[1, 2, 64, 64], Dtype::F16);
    for bits in [2u32, 3, 4] {
        let widths = vec![bits as u8; 2 * 64];
        let (c, sc, z) = veloxquant::kernels::kivi_quantize_widths(&x, &widths, bits, 32, &s).unwrap();
        let flat = ops::reshape(&x, &[128, 64], &s).unwrap();
        let off = veloxquant::Options::on(s.clone(), Policy::Off);
        let (c0, sc0, z0) = veloxquant::kernels::kivi_quantize(&flat, bits, 32, veloxquant::kernels::KiviMode::Keys, &off).unwrap();
        let flat_of = |a: &Array| f32s(&ops::astype(a, Dtype::F32, &s).unwrap());
        assert_eq!(flat_of(&c), flat_of(&c0), "{bits} bits: codes");
        assert_eq!((flat_of(&sc), flat_of(&z)), (flat_of(&sc0), flat_of(&z0)), "{bits} bits: scales and zeros");
    }
}

#[test]
fn wrong_key_widths_name_the_argument() {
    let good = kivi_widths_config();
    let mut bad = Vec::new();
    let mut c = good.clone();
    c.key_widths.as_mut().unwrap()[0] += 1; // one head's sum off by one
    bad.push(c);
    let mut c = good.clone();
    c.key_widths.as_mut().unwrap().pop(); // not kv_heads * head_dim
    bad.push(c);
    let mut c = good.clone();
    let w = c.key_widths.as_mut().unwrap();
    (w[0], w[1]) = (9, w[1] + w[0] - 9); // a width past 8 bits
    bad.push(c);
    let mut c = good.clone();
    c.key_method = Method::TurboQuantMse; // not KIVI keys
    bad.push(c);
    for cfg in bad {
        let e = LayerCache::new(cfg, Some(Stream::cpu())).err().expect("refused").to_string();
        assert!(e.contains("key_widths"), "{e}");
    }
}

#[test]
fn zero_weights_share_the_bits_evenly() {
    assert_eq!(veloxquant::cache::channel_widths(&[0.0; 128], 64, 3).unwrap(), vec![3u8; 128]);
}

#[test]
fn a_prefill_chunk_joins_no_store_and_its_state_copies_only_the_windows() {
    // The first chunk of a compressed layer creates its stores as fresh
    // zeros (no join of a placeholder slot), and the state mlx_lm evaluates
    // after every chunk copies nothing but the two windows (their sinks and
    // recent tokens joined): the codes and side data are views.
    let mut cfg = CacheConfig::new(64, 2);
    cfg.key_bits = 4;
    cfg.value_bits = 3;
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let mut cache = LayerCache::new(cfg, Some(Stream::cpu())).unwrap();
    for chunk in 0..2 {
        let k = normal(&mut rng, &[1, 2, 300, 64], Dtype::F16);
        let v = normal(&mut rng, &[1, 2, 300, 64], Dtype::F16);
        veloxquant::array::eval(&[&k, &v]).unwrap();
        cache.append(&k, &v).unwrap();
        let launched = veloxquant::graph::pending_kernels(&cache.arrays()).unwrap();
        if chunk == 0 {
            assert!(cache.compressed_tokens() > 0, "the first chunk compressed nothing");
            assert!(!launched.iter().any(|n| n == "Concatenate"), "first chunk joins arrays: {launched:?}");
        }
        veloxquant::array::eval(&cache.arrays()).unwrap();
        let (parts, _) = cache.state_parts().unwrap();
        let state: Vec<&Array> = parts.iter().map(|(_, a)| a).collect();
        let extra = veloxquant::graph::pending_kernels(&state).unwrap();
        assert!(extra.iter().all(|n| n == "Concatenate"), "chunk {chunk}: evaluating the state launches {extra:?}");
        assert_eq!(extra.len(), 2, "chunk {chunk}: evaluating the state launches {extra:?}");
    }
}

#[test]
fn a_chunk_that_grows_turboquant_stores_writes_both_in_one_launch() {
    // The stores grow and take the chunk's codes and marked norms in one
    // `store_write` for both sides: no zeros, joins, slice updates or mark of their own.
    let mut cfg = CacheConfig::new(64, 2);
    cfg.key_bits = 4;
    cfg.value_bits = 3;
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let mut cache = LayerCache::new(cfg, Some(Stream::cpu())).unwrap();
    for chunk in 0..3 {
        let k = normal(&mut rng, &[1, 2, 300, 64], Dtype::F16);
        let v = normal(&mut rng, &[1, 2, 300, 64], Dtype::F16);
        veloxquant::array::eval(&[&k, &v]).unwrap();
        let before = cache.compressed_tokens();
        cache.append(&k, &v).unwrap();
        assert!(cache.compressed_tokens() > before, "chunk {chunk} compressed nothing");
        let launched = veloxquant::graph::pending_kernels(&cache.arrays()).unwrap();
        let count = |name: &str| launched.iter().filter(|n| n.as_str() == name).count();
        assert_eq!(count("veloxquant_store_write"), 1, "chunk {chunk}: {launched:?}");
        // The first chunk's key mean and its offset: one `key_mean`, none of
        // the ops it stands for (the mask's select, the sum, the division).
        assert_eq!(count("veloxquant_key_mean"), usize::from(chunk == 0), "chunk {chunk}: {launched:?}");
        for op in ["Select", "Sum", "Divide"] {
            assert_eq!(count(op), 0, "chunk {chunk}: {op} in {launched:?}");
        }
        // The first chunk also makes the stores and windows (zeros) and the keys' mean.
        for op in ["Full", "SliceUpdate", "GreaterEqual", "Select"].into_iter().filter(|_| chunk > 0) {
            // The windows' own writes are slice updates: two a chunk.
            let allowed = if op == "SliceUpdate" { 2 } else { 0 };
            assert!(count(op) <= allowed, "chunk {chunk}: {} {op} in {launched:?}", count(op));
        }
        veloxquant::array::eval(&cache.arrays()).unwrap();
    }
}

#[test]
fn every_method_is_defined_once_and_parses_from_its_names() {
    use veloxquant::cache::{Method, METHODS};
    for (i, m) in METHODS.into_iter().enumerate() {
        let def = m.def();
        assert_eq!(def.method, m, "definition {i} is for another method");
        for name in std::iter::once(def.name).chain(def.aliases.iter().copied()) {
            assert_eq!(name.parse::<Method>().unwrap(), m, "{name:?}");
        }
        // The codec a side gets is one the method's bits are checked for,
        // and a keys-only method is refused for values.
        let mut cfg = CacheConfig::new(64, 2);
        cfg.key_method = m;
        cfg.key_bits = def.bits.map_or(16, |b| b[b.len() - 1]);
        cfg.validate().unwrap_or_else(|e| panic!("{m} keys at {} bits: {e}", cfg.key_bits));
        assert_eq!(cfg.key_codec().codec == veloxquant::codec::Codec::Dense, m == Method::Fp16);
        cfg.value_method = m;
        cfg.value_bits = cfg.key_bits;
        assert_eq!(cfg.validate().is_err(), def.keys_only, "{m} values");
    }
    let err = "turboquant-msee".parse::<Method>().unwrap_err().to_string();
    assert!(err.contains("turboquant-mse") && err.contains("kivi"), "{err}");
}

#[test]
fn turboquant_values_at_three_bits_sit_on_a_uniform_grid() {
    use veloxquant::codec::Codec;
    let cfg = mixed_config(128, 2, (Method::TurboQuantMse, 4, Method::TurboQuantMse, 3), Policy::Auto);
    assert_eq!(cfg.key_codec().codec, Codec::TurboQuantMse, "keys keep the Lloyd–Max table");
    assert_eq!(cfg.value_codec().codec, Codec::TurboQuantUniform);
    // Values of other widths, and 3-bit keys, keep the table.
    let k3 = mixed_config(128, 2, (Method::TurboQuantMse, 3, Method::TurboQuantMse, 4), Policy::Auto);
    assert_eq!((k3.key_codec().codec, k3.value_codec().codec), (Codec::TurboQuantMse, Codec::TurboQuantMse));
    // The grid: symmetric, evenly spaced, the Gaussian's step over √d.
    let grid = cfg.value_codec().table(128, 0).unwrap().unwrap();
    assert_eq!(grid.len(), 8);
    let step = grid[1] - grid[0];
    for (i, g) in grid.iter().enumerate() {
        assert!((g - (i as f32 - 3.5) * step).abs() < 1e-6, "{grid:?}");
    }
    assert!((step * (128f32).sqrt() - 0.586).abs() < 1e-3, "step {step}");
    // Gaussian values decode with about the uniform quantizer's error
    // (relative MSE 0.0374 for a Gaussian; the table's 0.0345).
    let (cache, chunks) = filled(cfg, 1, 300, 0, Dtype::F32, 21);
    let (_, v) = cache.dequantize().unwrap();
    let (_, want) = &chunks[0];
    let e = rel_err(&v, want);
    assert!((0.12..0.21).contains(&e), "relative error {e}");
}
