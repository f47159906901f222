//! The mixed-method attention kernels (metal/kv_attention.metal,
//! tq_reduce.metal) on the emulator, launched exactly as
//! `src/kernels/kv_attention.rs` launches them (kernel names, input and
//! output names and order, params layout, template arguments, the split plan
//! and tile rows, grid in threads), against `veloxquant::cpu::kv_attention`:
//! relative error (max |gpu - cpu| over max |cpu|) at most 1e-5 in f32 and
//! 1e-2 in f16. The stores are filled by the CPU encoders, laid out as the
//! cache holds them; unused slots hold garbage (NaN parameters and window
//! rows, random codes) that must never be read.

mod metal_emulator;

use half::f16;
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::codec::{kivi_bit_offsets, Codec, SideCodec, SideLayout};
use veloxquant::cpu::kv_attention::{self as kv, KvShape, KvSide};
use veloxquant::cpu::turboquant::{self as tq, FromF32};
use veloxquant::cpu::{Float, VqElement};
use veloxquant::kernels::kv_attention::{gpu_plan, split_plan};
use veloxquant::kernels::Policy;
use veloxquant::stream::Backend;
use veloxquant::kernels::turboquant::reduce_threads;

/// Roughly Gaussian values (sum of uniforms), standard deviation `scale`.
fn gaussian(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| ((0..4).map(|_| rng.random::<f32>()).sum::<f32>() - 2.0) * 1.73 * scale).collect()
}

fn conv<T: Float>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| <T as Float>::from_f32(v)).collect()
}

/// `y = Π x` for each row of `x`.
fn rotate(rot: &[f32], x: &[f32], d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (src, dst) in x.chunks(d).zip(out.chunks_mut(d)) {
        for i in 0..d {
            dst[i] = (0..d).map(|j| rot[i * d + j] * src[j]).sum();
        }
    }
    out
}

/// One side's stored data, laid out as the cache holds it.
struct SideData<T> {
    sc: SideCodec,
    codes: Vec<u8>,
    dense: Vec<T>,
    scales: Vec<f16>,
    zeros: Vec<f16>,
    table: Vec<f32>,
    window: Vec<T>,
}

impl<T: VqElement + Element> SideData<T> {
    fn view(&self) -> KvSide<'_, T> {
        KvSide { codes: &self.codes, dense: &self.dense, scales: &self.scales, zeros: &self.zeros, table: &self.table, window: &self.window }
    }

    /// The arrays the host passes (8-element placeholders for the unused ones).
    fn inputs(&self, sh: &KvShape) -> [HostArray; 4] {
        let (b, h, cap, d) = (sh.batch, sh.kv_heads, sh.capacity, sh.dim);
        let codes = if self.sc.codec == Codec::Dense {
            HostArray::new(&[b, h, cap, d], &self.dense)
        } else {
            HostArray::new(&[b, h, cap, self.sc.row_len(d)], &self.codes)
        };
        let params = |v: &[f16]| {
            if v.is_empty() {
                HostArray::new(&[8], &[f16::ZERO; 8])
            } else {
                HostArray::new(&[v.len()], v)
            }
        };
        let table = if self.table.is_empty() { HostArray::new(&[8], &[0.0f32; 8]) } else { HostArray::new(&[self.table.len()], &self.table) };
        [codes, params(&self.scales), params(&self.zeros), table]
    }
}

/// Tokens of every head, in the side's frame, encoded into the compressed
/// slots (sinks and recent tokens in the window), garbage elsewhere.
/// KIVI keys' widths `[kv_heads, dim]` (`None`: `bits` each) apply to a
/// per-channel side.
fn build_side<T: Float + Element>(
    sc: SideCodec,
    sh: &KvShape,
    rot: &[f32],
    tokens: &[Vec<f32>],
    widths: Option<&[u8]>,
    rng: &mut ChaCha8Rng,
) -> SideData<T> {
    let (d, heads, cap) = (sh.dim, sh.batch * sh.kv_heads, sh.capacity);
    let (pr, pc) = (sc.param_rows(cap), sc.param_cols(d));
    let mut side = SideData {
        sc,
        codes: (0..heads * cap * sc.row_len(d)).map(|_| rng.random::<u8>()).collect(),
        dense: if sc.codec == Codec::Dense { vec![<T as Float>::from_f32(f32::NAN); heads * cap * d] } else { Vec::new() },
        scales: if pc > 0 { vec![f16::NAN; heads * pr * pc] } else { Vec::new() },
        zeros: if sc.has_zeros() { vec![f16::NAN; heads * pr * pc] } else { Vec::new() },
        table: if sc.codec == Codec::KiviPerChannel {
            kivi_bit_offsets(widths, d, sc.bits)
        } else {
            sc.table(d, 0).unwrap().unwrap_or_default()
        },
        window: vec![<T as Float>::from_f32(f32::NAN); heads * sh.window_capacity * d],
    };
    let (c0, c1, total, n) = (sh.sinks, sh.sinks + sh.compressed, sh.total(), sh.compressed);
    for (hd, x) in tokens.iter().enumerate() {
        let framed: Vec<T> = conv(&if sc.codec.rotated() { rotate(rot, x, d) } else { x.clone() });
        let comp = &framed[c0 * d..c1 * d];
        let row = sc.row_len(d);
        let slots = hd * cap..hd * cap + n;
        match sc.codec {
            Codec::Dense => side.dense[slots.start * d..slots.end * d].copy_from_slice(comp),
            // Any grid index is a valid code: random codes, each token's scale.
            Codec::Fp8 => slots.for_each(|i| side.scales[i] = f16::from_f32(rng.random_range(0.001f32..0.05))),
            Codec::TurboQuantMse | Codec::TurboQuantUniform => tq::tq_encode(
                comp,
                None,
                &side.table,
                d,
                sc.bits,
                &mut side.codes[slots.start * row..slots.end * row],
                &mut side.scales[slots],
            ),
            Codec::ProductQuantized => {
                // Norms, then the unit vectors' sub-vectors into the codebook.
                let mut unit = Vec::with_capacity(n * d);
                for (i, tok) in comp.chunks(d).enumerate() {
                    let norm = tok.iter().map(|v| v.to_f32() * v.to_f32()).sum::<f32>().sqrt();
                    side.scales[slots.start + i] = f16::from_f32(norm);
                    unit.extend(tok.iter().map(|v| v.to_f32() / norm));
                }
                veloxquant::cpu::pq_encode(&unit, n, d, &side.table, sc.group, sc.bits, &mut side.codes[slots.start * row..slots.end * row], &mut []);
            }
            Codec::Qjl => {
                let m = sc.sketch_rows(d);
                veloxquant::cpu::qjl_encode(comp, n, d, &side.table, m, &mut side.codes[slots.start * row..slots.end * row], &mut side.scales[slots]);
            }
            Codec::TurboQuantProd | Codec::TurboQuantRvq => {
                // Norms and unit vectors, the first stage's codes, then the
                // residual's signs and norm (Prod) or 1-bit codes (RVQ);
                // each row is the first codes followed by the second.
                let (b1, first) = (sc.bits - 1, 1usize << (sc.bits - 1));
                let mut unit = Vec::with_capacity(n * d);
                let mut norms = Vec::with_capacity(n);
                for tok in comp.chunks(d) {
                    let norm = tok.iter().map(|v| v.to_f32() * v.to_f32()).sum::<f32>().sqrt();
                    norms.push(f16::from_f32(norm));
                    unit.extend(tok.iter().map(|v| v.to_f32() / norm));
                }
                let (l1, l2) = (sc.first_len(d), row - sc.first_len(d));
                let mut c1 = vec![0u8; n * l1];
                veloxquant::cpu::scalar_quantize(&unit, n, d, &side.table[..first], b1, &mut c1);
                let mut approx = vec![0.0f32; n * d];
                veloxquant::cpu::scalar_dequantize(&c1, n, d, &side.table[..first], b1, &mut approx);
                let residual: Vec<f32> = unit.iter().zip(&approx).map(|(u, a)| u - a).collect();
                let mut c2 = vec![0u8; n * l2];
                let mut rnorms = vec![f16::ZERO; n];
                if sc.codec == Codec::TurboQuantProd {
                    veloxquant::cpu::qjl_encode(&residual, n, d, &side.table[first..], d, &mut c2, &mut rnorms);
                } else {
                    veloxquant::cpu::scalar_quantize(&residual, n, d, &side.table[first..], 1, &mut c2);
                }
                for i in 0..n {
                    let dst = &mut side.codes[(slots.start + i) * row..(slots.start + i + 1) * row];
                    dst[..l1].copy_from_slice(&c1[i * l1..(i + 1) * l1]);
                    dst[l1..].copy_from_slice(&c2[i * l2..(i + 1) * l2]);
                    if sc.codec == Codec::TurboQuantProd {
                        side.scales[2 * (slots.start + i)] = norms[i];
                        side.scales[2 * (slots.start + i) + 1] = rnorms[i];
                    } else {
                        side.scales[slots.start + i] = norms[i];
                    }
                }
            }
            Codec::KiviPerChannel => {
                // Channel c of each group of tokens with its own width,
                // packed at the head's bit offsets (the side's table).
                let at = 1 + (hd % sh.kv_heads) * side.table[0] as usize;
                let offsets = side.table[at..at + d + 1].to_vec();
                side.codes[slots.start * row..slots.end * row].fill(0);
                for g in 0..n.div_ceil(sc.group) {
                    let toks = g * sc.group..((g + 1) * sc.group).min(n);
                    for c in 0..d {
                        let (o, w) = (offsets[c] as usize, (offsets[c + 1] - offsets[c]) as u32);
                        let vals = toks.clone().map(|t| comp[t * d + c].to_f32());
                        let (lo, hi) = vals.clone().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
                        let (scale, zero) = veloxquant::cpu::kivi_params(lo, hi, w);
                        side.scales[(hd * pr + g) * pc + c] = scale;
                        side.zeros[(hd * pr + g) * pc + c] = zero;
                        for (t, v) in toks.clone().zip(vals) {
                            let code = u32::from(veloxquant::cpu::kivi_code(v, scale.to_f32(), zero.to_f32(), w)) << (o & 7);
                            let at = (slots.start + t) * row + o / 8;
                            side.codes[at] |= code as u8;
                            if code > 0xff {
                                side.codes[at + 1] |= (code >> 8) as u8;
                            }
                        }
                    }
                }
            }
            Codec::KiviPerToken => {
                veloxquant::cpu::kivi_quantize(
                    comp,
                    n,
                    d,
                    sc.bits,
                    sc.group,
                    false,
                    &mut side.codes[slots.start * row..slots.end * row],
                    &mut side.scales[hd * cap * pc..(hd * cap + n) * pc],
                    &mut side.zeros[hd * cap * pc..(hd * cap + n) * pc],
                );
            }
        }
        let w0 = hd * sh.window_capacity * d;
        for (w, t) in (0..sh.sinks).chain(c1..total).enumerate() {
            side.window[w0 + w * d..w0 + (w + 1) * d].copy_from_slice(&framed[t * d..(t + 1) * d]);
        }
    }
    side
}

#[allow(clippy::too_many_arguments)]
fn shape(b: usize, hq: usize, hkv: usize, l: usize, d: usize, key: SideCodec, value: SideCodec, parts: (usize, usize, usize), causal: bool) -> KvShape {
    let (sinks, compressed, recent) = parts;
    KvShape {
        batch: b,
        q_heads: hq,
        kv_heads: hkv,
        queries: l,
        dim: d,
        key: key.layout(d),
        value: value.layout(d),
        query_features: key.query_features(d),
        sinks,
        compressed,
        recent,
        // Room left in both stores, as in the cache.
        capacity: compressed + 37,
        window_capacity: sinks + recent + 5,
        causal,
        mask_heads: 0,
    }
}

/// `kernels::kv_attention::attention_gpu`: the split plan, the attention pass
/// into float32 partials, the reduction into `[rows, D]` of `T`; with
/// `stage`, the staged sides as Metal's plan has them.
fn gpu_attention<T: Element + VqElement>(qf: &[f32], k: &SideData<T>, v: &SideData<T>, rot: &[f32], mask: &[f32], sh: &KvShape, stage: bool) -> (Vec<T>, usize) {
    let plan = gpu_plan(sh, Backend::Metal, Policy::Require).unwrap().expect("fits");
    let (per_tile, qn, stage) = (plan.per_tile, plan.rows, plan.stage && stage);
    let q_tiles = sh.queries.div_ceil(per_tile);
    let units = sh.batch * sh.kv_heads * q_tiles;
    let (split_tokens, comp_splits, num_splits) = split_plan(sh, units);
    let d = sh.dim;
    let rows = sh.batch * sh.q_heads * sh.queries;
    let params: Vec<u32> = [
        sh.batch, sh.q_heads, sh.kv_heads, sh.queries, sh.sinks, sh.compressed, sh.recent, sh.capacity,
        sh.window_capacity, split_tokens, num_splits, q_tiles, usize::from(sh.causal), comp_splits, sh.mask_heads,
    ]
    .iter()
    .map(|&x| x as u32)
    .collect();
    let tag = format!("{:?} {sh:?}", T::DTYPE);
    let kernel = metal_emulator::declared(Kernel::KvAttention);
    let mut launch = kernel.launch().input(HostArray::new(&[sh.batch, sh.q_heads, sh.queries, sh.query_features], qf));
    for a in k.inputs(sh).into_iter().chain(v.inputs(sh)) {
        launch = launch.input(a);
    }
    let win = [sh.batch, sh.kv_heads, sh.window_capacity, d];
    // Without a mask the host hands over a placeholder the kernel never reads.
    let mask = if mask.is_empty() { HostArray::new(&[8], &[f32::NAN; 8]) } else {
        HostArray::new(&[sh.batch, sh.mask_heads, sh.queries, sh.total()], mask)
    };
    let parts = launch
        .input(HostArray::new(&win, &k.window))
        .input(HostArray::new(&win, &v.window))
        .input(mask)
        .input(HostArray::new(&[params.len()], &params))
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits, d], Dtype::F32)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("KM", TemplateArg::Int(sh.key.codec.id()))
        .template("KB", TemplateArg::Int(sh.key.bits as i32))
        .template("KG", TemplateArg::Int(sh.key.group as i32))
        .template("VM", TemplateArg::Int(sh.value.codec.id()))
        .template("VB", TemplateArg::Int(sh.value.bits as i32))
        .template("VG", TemplateArg::Int(sh.value.group as i32))
        .template("QN", TemplateArg::Int(qn as i32))
        .template("QF", TemplateArg::Int(sh.query_features as i32))
        .template("STAGE", TemplateArg::Bool(stage))
        .grid((units * num_splits * 128) as u32, 1, 1)
        .threadgroup(128, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("kv_attention {tag}: {e}"));
    let rotate_back = sh.value.codec.rotated();
    // Without a rotation the host hands over the maxima as the unread `rot_v`.
    let rot_v = if rotate_back { HostArray::new(&[d, d], rot) } else { parts[0].clone() };
    let out = metal_emulator::declared(Kernel::TqReduce)
        .launch()
        .input(parts[0].clone())
        .input(parts[1].clone())
        .input(parts[2].clone())
        .input(rot_v)
        .output(&[rows, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("ROTATE", TemplateArg::Bool(rotate_back))
        .grid((rows * reduce_threads(d)) as u32, 1, 1)
        .threadgroup(reduce_threads(d) as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_reduce {tag}: {e}"));
    (out[0].to_vec(), num_splits)
}

fn check<T: Float + FromF32 + Element>(sh: KvShape, tol: f32, seed: u64) -> usize {
    check_widths::<T>(sh, None, tol, seed, true)
}

fn check_widths<T: Float + FromF32 + Element>(sh: KvShape, key_widths: Option<&[u8]>, tol: f32, seed: u64, stage: bool) -> usize {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let d = sh.dim;
    let rot = veloxquant::cache::rotation_matrix(d, seed).unwrap();
    let heads = sh.batch * sh.kv_heads;
    // Keys with per-token scales and a few outlier channels, so that the
    // softmax is far from uniform and KIVI's per-channel groups matter.
    let keys: Vec<Vec<f32>> = (0..heads)
        .map(|h| {
            let mut k = gaussian(&mut rng, sh.total() * d, 1.0);
            for (t, row) in k.chunks_mut(d).enumerate() {
                let s = 0.5 + 2.0 * ((t * 7919 + h * 31) % 17) as f32 / 17.0;
                row.iter_mut().for_each(|v| *v *= s);
                row[3] += 4.0;
            }
            k
        })
        .collect();
    let values: Vec<Vec<f32>> = (0..heads).map(|_| gaussian(&mut rng, sh.total() * d, 1.0)).collect();
    let k = build_side::<T>(side_codec(&sh.key), &sh, &rot, &keys, key_widths, &mut rng);
    let v = build_side::<T>(side_codec(&sh.value), &sh, &rot, &values, None, &mut rng);
    // The host's prepared queries: scale * (Π q or q).
    let scale = 1.0 / (d as f32).sqrt();
    let q = gaussian(&mut rng, sh.batch * sh.q_heads * sh.queries * d, 1.0);
    let q: Vec<f32> = q.iter().map(|&x| <T as Float>::from_f32(x).to_f32()).collect();
    let framed = if sh.key.codec.rotated() { rotate(&rot, &q, d) } else { q };
    let mut qf: Vec<f32> = framed.iter().map(|x| x * scale).collect();
    if sh.key.codec == Codec::ProductQuantized {
        // Each row followed by its lookup table ⟨q_p, codebook[c]⟩.
        let (sub, entries) = (sh.key.group, 1usize << sh.key.bits);
        qf = qf
            .chunks(d)
            .flat_map(|row| {
                let lut: Vec<f32> = (0..d / sub)
                    .flat_map(|p| (0..entries).map(move |c| (p, c)))
                    .map(|(p, c)| (0..sub).map(|i| row[p * sub + i] * k.table[c * sub + i]).sum::<f32>())
                    .collect();
                row.iter().copied().chain(lut).collect::<Vec<f32>>()
            })
            .collect();
    }
    if matches!(sh.key.codec, Codec::Qjl | Codec::TurboQuantProd) {
        // Each row followed by its sketched query c S q (the sketch after
        // Prod's centroids).
        let m = sh.key.sketch_rows;
        let sketch = &k.table[k.table.len() - m * d..];
        let c = kv::sketch_scale(m);
        qf = qf
            .chunks(d)
            .flat_map(|row| {
                let sq: Vec<f32> = sketch.chunks(d).map(|s| c * s.iter().zip(row).map(|(a, b)| a * b).sum::<f32>()).collect();
                row.iter().copied().chain(sq).collect::<Vec<f32>>()
            })
            .collect();
    }
    let rot_v: &[f32] = if sh.value.codec.rotated() { &rot } else { &[] };
    // An additive mask: a bias on every score and about a third of the
    // tokens hidden, the newest always seen.
    let total = sh.total();
    let mask: Vec<f32> = (0..sh.batch * sh.mask_heads * sh.queries * total)
        .map(|i| match (i % total == total - 1, rng.random::<f32>()) {
            (false, u) if u < 0.35 => f32::NEG_INFINITY,
            (_, u) => -2.0 * u,
        })
        .collect();
    let mut want = vec![<T as Float>::from_f32(0.0); sh.batch * sh.q_heads * sh.queries * d];
    kv::kv_attention(&qf, &k.view(), &v.view(), rot_v, &mask, &sh, &mut want);
    let (got, splits) = gpu_attention(&qf, &k, &v, &rot, &mask, &sh, stage);
    let (got, want): (Vec<f32>, Vec<f32>) = (got.iter().map(|x| x.to_f32()).collect(), want.iter().map(|x| x.to_f32()).collect());
    assert!(want.iter().all(|x| x.is_finite()), "CPU output not finite: {sh:?}");
    let max_ref = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let max_err = got.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let rel = max_err / max_ref;
    eprintln!("{:?} key {:?} value {:?} D={} L={} splits={splits}: relative error {rel:.2e}", T::DTYPE, sh.key, sh.value, d, sh.queries);
    assert!(max_ref > 0.0 && rel <= tol, "{:?} {sh:?}: relative error {rel:e} > {tol:e}", T::DTYPE);
    splits
}

/// The codec a layout was computed from.
fn side_codec(l: &SideLayout) -> SideCodec {
    SideCodec { codec: l.codec, bits: l.bits, group: l.group }
}

fn codec(codec: Codec, bits: u32, group: usize) -> SideCodec {
    SideCodec { codec, bits, group }
}

#[test]
fn kivi_keys_and_values_decode_matches_cpu() {
    let (k, v) = (codec(Codec::KiviPerChannel, 4, 16), codec(Codec::KiviPerToken, 2, 32));
    // Several compressed splits, a partial last key group, GQA 4:2, batch 2.
    let s = check::<f32>(shape(2, 4, 2, 1, 64, k, v, (4, 300, 21), true), 1e-5, 1);
    assert!(s > 2, "expected several splits, got {s}");
}

#[test]
fn mixed_codecs_multi_token_causal_match_cpu() {
    // TurboQuant keys (rotated frame) with KIVI values (model frame): QN = 16.
    let (k, v) = (codec(Codec::TurboQuantMse, 4, 1), codec(Codec::KiviPerToken, 3, 32));
    check::<f32>(shape(1, 8, 2, 5, 128, k, v, (4, 200, 40), true), 1e-5, 2);
    // KIVI keys with TurboQuant values (rotated back by the reduction).
    let (k, v) = (codec(Codec::KiviPerChannel, 2, 32), codec(Codec::TurboQuantMse, 3, 1));
    check::<f32>(shape(1, 2, 1, 3, 96, k, v, (2, 150, 9), false), 1e-5, 3);
}

#[test]
fn dense_sides_and_f16_match_cpu() {
    let (k, v) = (codec(Codec::KiviPerChannel, 8, 16), codec(Codec::Dense, 16, 1));
    check::<f16>(shape(1, 4, 2, 1, 80, k, v, (4, 140, 7), true), 1e-2, 4);
    let (k, v) = (codec(Codec::Dense, 16, 1), codec(Codec::KiviPerToken, 4, 16));
    check::<f32>(shape(1, 2, 2, 1, 256, k, v, (0, 60, 3), true), 1e-5, 5);
}

#[test]
fn turboquant_sides_match_cpu_staged_and_read_in_place() {
    // The cache's default (TurboQuant-MSE 4/3) over a causal tile of 4
    // queries, 8:2 heads, f16: the staged tile (the plan's choice here) and
    // the same codes read from device memory.
    let (k, v) = (codec(Codec::TurboQuantMse, 4, 1), codec(Codec::TurboQuantMse, 3, 1));
    let sh = shape(1, 8, 2, 4, 128, k, v, (4, 300, 21), true);
    assert!(gpu_plan(&sh, Backend::Metal, Policy::Require).unwrap().expect("fits").stage);
    for stage in [true, false] {
        check_widths::<f16>(sh, None, 1e-2, 50, stage);
    }
    // Uniform-table keys of 2 bits and 4-bit values at head size 64, float32,
    // two sequences, not causal.
    let (k, v) = (codec(Codec::TurboQuantUniform, 2, 1), codec(Codec::TurboQuantMse, 4, 1));
    for stage in [true, false] {
        check_widths::<f32>(shape(2, 4, 1, 3, 64, k, v, (2, 200, 9), false), None, 1e-5, 51, stage);
    }
}

#[test]
fn tiles_are_staged_where_they_fit_and_read_in_place_where_not() {
    let (k, v) = (codec(Codec::TurboQuantMse, 4, 1), codec(Codec::TurboQuantMse, 3, 1));
    // The default recipe at llama-8b's heads, 4 queries: 16 rows, staged on both back-ends.
    let sh = shape(1, 32, 8, 4, 128, k, v, (4, 4096, 100), true);
    for backend in [Backend::Cuda, Backend::Metal] {
        let plan = gpu_plan(&sh, backend, Policy::Require).unwrap().unwrap();
        assert_eq!((plan.per_tile, plan.rows, plan.stage), (4, 16, true), "{backend:?}");
    }
    // 8-bit keys and 4-bit values at head size 256: the staged tiles alone
    // pass 32 KiB (Metal's threadgroup memory) and leave CUDA's 48 KiB no
    // room for the rows, so both read the codes in place.
    let wide = shape(1, 32, 8, 4, 256, codec(Codec::Fp8, 8, 1), codec(Codec::TurboQuantMse, 4, 1), (4, 4096, 100), true);
    for backend in [Backend::Cuda, Backend::Metal] {
        assert!(!gpu_plan(&wide, backend, Policy::Require).unwrap().unwrap().stage, "{backend:?}");
    }
    // 32 query heads a KV head exceed a tile's 16 rows: the reference graph,
    // or the reason under "require".
    let one_kv = shape(1, 32, 1, 1, 128, k, v, (4, 4096, 100), true);
    assert_eq!(gpu_plan(&one_kv, Backend::Cuda, Policy::Auto).unwrap(), None);
    match gpu_plan(&one_kv, Backend::Cuda, Policy::Require) {
        Err(veloxquant::Error::Unsupported(why)) => assert!(why.contains("32 query heads"), "{why}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn fp8_keys_and_values_match_cpu() {
    let (k, v) = (codec(Codec::Fp8, 8, 1), codec(Codec::Fp8, 8, 1));
    check::<f16>(shape(1, 8, 2, 1, 128, k, v, (4, 200, 9), true), 1e-2, 43);
    // Beside TurboQuant values (rotated back by the reduction), float32.
    let (k, v) = (codec(Codec::Fp8, 8, 1), codec(Codec::TurboQuantUniform, 3, 1));
    check::<f32>(shape(1, 4, 2, 3, 64, k, v, (2, 130, 11), false), 1e-5, 44);
}

#[test]
fn per_token_keys_match_cpu() {
    // The affine method: per-token codes on both sides, 64 channels a group.
    let (k, v) = (codec(Codec::KiviPerToken, 4, 64), codec(Codec::KiviPerToken, 8, 64));
    check::<f16>(shape(1, 8, 2, 1, 128, k, v, (4, 200, 9), true), 1e-2, 41);
}

#[test]
fn product_quantized_keys_and_values_match_cpu() {
    // Keys scored through each query's lookup table (read from device
    // memory), values decoded from the codebook; 2 and 4 bits per element.
    let (k, v) = (codec(Codec::ProductQuantized, 8, 4), codec(Codec::ProductQuantized, 8, 2));
    check::<f32>(shape(1, 4, 2, 3, 64, k, v, (4, 150, 9), true), 1e-5, 6);
    let (k, v) = (codec(Codec::ProductQuantized, 8, 8), codec(Codec::KiviPerToken, 4, 32));
    check::<f16>(shape(2, 2, 1, 1, 128, k, v, (0, 200, 5), false), 1e-2, 7);
}

#[test]
fn sketched_keys_match_cpu() {
    // QJL keys (1 and 2 sketch rows per channel) and TurboQuant-Prod keys,
    // scored from the sketched query read from device memory.
    let (k, v) = (codec(Codec::Qjl, 1, 1), codec(Codec::KiviPerToken, 4, 32));
    check::<f32>(shape(1, 4, 2, 3, 64, k, v, (4, 150, 9), true), 1e-5, 8);
    let (k, v) = (codec(Codec::Qjl, 2, 1), codec(Codec::TurboQuantMse, 4, 1));
    check::<f16>(shape(2, 2, 1, 1, 128, k, v, (0, 200, 5), false), 1e-2, 9);
    let (k, v) = (codec(Codec::TurboQuantProd, 4, 1), codec(Codec::Dense, 16, 1));
    check::<f32>(shape(1, 8, 2, 2, 96, k, v, (4, 160, 7), true), 1e-5, 10);
    let (k, v) = (codec(Codec::TurboQuantProd, 2, 1), codec(Codec::KiviPerToken, 2, 32));
    check::<f16>(shape(1, 2, 2, 1, 64, k, v, (2, 140, 3), false), 1e-2, 11);
}

#[test]
fn array_masks_match_cpu() {
    // One mask for every head, decoding, with TurboQuant on both sides (the
    // cache sends masked attention here for every method).
    let (k, v) = (codec(Codec::TurboQuantMse, 4, 1), codec(Codec::TurboQuantUniform, 3, 1));
    let mut sh = shape(2, 4, 2, 1, 64, k, v, (4, 300, 21), false);
    sh.mask_heads = 1;
    check::<f32>(sh, 1e-5, 20);
    // A mask per head over a multi-token tile, f16, KIVI keys and PQ values.
    let (k, v) = (codec(Codec::KiviPerChannel, 4, 32), codec(Codec::ProductQuantized, 8, 4));
    let mut sh = shape(1, 8, 2, 3, 128, k, v, (4, 200, 40), false);
    sh.mask_heads = 8;
    check::<f16>(sh, 1e-2, 21);
}

#[test]
fn residual_quantized_keys_and_values_match_cpu() {
    let (k, v) = (codec(Codec::TurboQuantRvq, 3, 1), codec(Codec::TurboQuantRvq, 5, 1));
    check::<f32>(shape(1, 4, 2, 3, 64, k, v, (4, 150, 9), true), 1e-5, 12);
    let (k, v) = (codec(Codec::KiviPerChannel, 4, 16), codec(Codec::TurboQuantRvq, 2, 1));
    check::<f16>(shape(1, 2, 1, 1, 128, k, v, (4, 170, 5), false), 1e-2, 13);
}

#[test]
fn kivi_keys_with_bits_per_channel_match_cpu() {
    // Each head's channels of 1 to 8 bits, 3 on average (codes straddling
    // bytes), decoding and a causal tile, f32 and f16.
    let weights: Vec<f32> = (0..2 * 64).map(|i| ((i * 37 % 101) as f32 / 10.0).powi(3)).collect();
    let widths = veloxquant::cache::channel_widths(&weights, 64, 3).unwrap();
    assert!(widths.iter().any(|&w| w == 1) && widths.iter().any(|&w| w >= 5), "{widths:?}");
    let (k, v) = (codec(Codec::KiviPerChannel, 3, 32), codec(Codec::TurboQuantMse, 3, 1));
    check_widths::<f32>(shape(2, 4, 2, 1, 64, k, v, (4, 300, 21), true), Some(&widths), 1e-5, 30, true);
    check_widths::<f16>(shape(1, 8, 2, 3, 64, k, v, (2, 150, 9), true), Some(&widths), 1e-2, 31, true);
}
