//! The TurboQuant cache kernels (metal/tq_encode.metal, tq_decode.metal,
//! tq_reduce.metal, and kv_attention.metal for several queries) on the
//! emulator, launched exactly as `src/kernels/turboquant.rs` launches them
//! (kernel names, input and output names and order, params layout, template
//! arguments, grid in threads, threadgroup sizes, the two-pass attention
//! whose partial outputs feed the reduction), against
//! `veloxquant::cpu::turboquant`:
//! - `tq_encode`: codes and norms bit for bit (same arithmetic order; f16 and
//!   bf16 inputs are converted to f32 first on both sides);
//! - `tq_decode` or `kv_attention`, then `tq_reduce`: relative error (max |gpu - cpu| over
//!   max |cpu|) at most 1e-5 in f32 and 1e-2 in f16 (sums run in different
//!   orders). The stored codes, norms and windows come from the CPU encoder
//!   and a real rotation, as the cache stores them; unused slots of the
//!   stores hold garbage (NaN norms and window rows) that must never be read.

mod metal_emulator;

use half::{bf16, f16};
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::turboquant::{self as tq, AttentionInputs, AttentionShape, FromF32};
use veloxquant::cpu::{Float, VqElement};
use veloxquant::codec::{Codec, SideCodec};
use veloxquant::cpu::kv_attention::KvShape;
use veloxquant::kernels::kv_attention::{gpu_plan, split_plan as kv_split_plan};
use veloxquant::kernels::turboquant::reduce_threads;
use veloxquant::kernels::Policy;
use veloxquant::stream::Backend;
use veloxquant::quant::ScalarCodebook;

/// Row-major `Π` as `src/cache/layer/tables.rs` builds it: Hadamard where the size
/// allows, else dense; column j is `forward(e_j)`.
fn rotation_matrix(dim: usize, seed: u64) -> Vec<f32> {
    veloxquant::cache::rotation_matrix(dim, seed).unwrap()
}

fn centroids(dim: usize, bits: u32) -> Vec<f32> {
    ScalarCodebook::sphere(dim, bits).unwrap().centroids().to_vec()
}

/// Roughly Gaussian values (sum of uniforms), standard deviation `scale`.
fn gaussian(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| ((0..4).map(|_| rng.random::<f32>()).sum::<f32>() - 2.0) * 1.73 * scale).collect()
}

fn conv<T: Float>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| <T as Float>::from_f32(v)).collect()
}

/// `y = Π x` for each row of `x` (what the windows hold), in f32.
fn rotate(rot: &[f32], x: &[f32], d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (src, dst) in x.chunks(d).zip(out.chunks_mut(d)) {
        for i in 0..d {
            dst[i] = (0..d).map(|j| rot[i * d + j] * src[j]).sum();
        }
    }
    out
}

// ---------------------------------------------------------------- tq_encode

/// The host's launch (`kernels::turboquant::tq_encode`): no launch for N = 0,
/// else grid N*D threads in threadgroups of D, params {N}; without a rotation
/// (vectors rotated already) a one-element placeholder and ROTATE = false.
fn gpu_encode<T: Element>(
    x: &[T],
    n: usize,
    d: usize,
    bits: u32,
    rot: Option<&[f32]>,
    cent: &[f32],
) -> Option<(Vec<u8>, Vec<f16>)> {
    if n == 0 {
        return None;
    }
    let row_bytes = d * bits as usize / 8;
    let hadamard = rot.is_some_and(|r| r.len() == d);
    let rotation = match rot {
        Some(r) if hadamard => HostArray::new(&[d], r),
        Some(r) => HostArray::new(&[d, d], r),
        // The host passes the codebook as the unread placeholder.
        None => HostArray::new(&[1 << bits], cent),
    };
    let out = metal_emulator::declared(Kernel::TqEncode)
        .launch()
        .input(HostArray::new(&[n, d], x))
        .input(rotation)
        .input(HostArray::new(&[1 << bits], cent))
        .output(&[n, row_bytes], Dtype::U8)
        .output(&[n], Dtype::F16)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .template("ROTATE", TemplateArg::Bool(rot.is_some()))
        .template("HADAMARD", TemplateArg::Bool(hadamard))
        .grid((n * d) as u32, 1, 1)
        .threadgroup(d as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_encode {:?} n={n} d={d} bits={bits} rotate={}: {e}", T::DTYPE, rot.is_some()));
    Some((out[0].to_vec(), out[1].to_vec()))
}

/// `n` vectors: random, one zero vector (norm 0, codes of y = 0), and in f32
/// one beyond float16's range (norm saturated at 65504).
fn encode_input(n: usize, d: usize, seed: u64, big: bool) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x = gaussian(&mut rng, n * d, 1.0);
    if n > 3 {
        x[3 * d..4 * d].iter_mut().for_each(|v| *v = 0.0);
    }
    if n > 7 && big {
        x[7 * d..8 * d].iter_mut().for_each(|v| *v *= 3.0e4);
    }
    x
}

fn check_encode<T: Float + Element>(n: usize, d: usize, bits: u32, rot: Option<&[f32]>, cent: &[f32]) {
    let x: Vec<T> = conv(&encode_input(n, d, (n * 1000 + d) as u64 + u64::from(bits), T::DTYPE == Dtype::F32));
    let row_bytes = d * bits as usize / 8;
    let (mut codes, mut norms) = (vec![0u8; n * row_bytes], vec![f16::ZERO; n]);
    tq::tq_encode(&x, rot, cent, d, bits, &mut codes, &mut norms);
    let tag = format!("{:?} n={n} d={d} bits={bits} rotate={}", T::DTYPE, rot.is_some());
    match gpu_encode(&x, n, d, bits, rot, cent) {
        None => assert!(n == 0 && codes.is_empty() && norms.is_empty(), "{tag}"),
        Some((gc, gn)) => {
            let (gn, norms): (Vec<u16>, Vec<u16>) =
                (gn.iter().map(|v| v.to_bits()).collect(), norms.iter().map(|v| v.to_bits()).collect());
            assert_eq!(gn, norms, "tq_encode norms {tag}");
            assert_eq!(gc, codes, "tq_encode codes {tag}");
            if n > 3 {
                assert_eq!(norms[3], 0, "zero vector {tag}");
            }
        }
    }
}

const DIMS: [usize; 5] = [64, 80, 96, 128, 256];
const BITS: [u32; 5] = [1, 2, 3, 4, 8];

#[test]
fn tq_encode_matches_cpu() {
    for (di, &d) in DIMS.iter().enumerate() {
        let rot = rotation_matrix(d, 7 + d as u64);
        for (bi, &bits) in BITS.iter().enumerate() {
            let cent = centroids(d, bits);
            for n in [0, 1, 37] {
                check_encode::<f32>(n, d, bits, Some(&rot), &cent);
            }
            // f16 and bf16 are converted to f32 first: every (D, bits) pair
            // once over the two, to keep the number of instantiations down.
            if (di + bi) % 2 == 0 {
                check_encode::<f16>(37, d, bits, Some(&rot), &cent);
            } else {
                check_encode::<bf16>(37, d, bits, Some(&rot), &cent);
            }
        }
        check_encode::<f16>(1, d, BITS[di], Some(&rot), &centroids(d, BITS[di]));
    }
}

/// A Hadamard rotation passed as its signs: the butterflies, bit for bit the
/// CPU kernel's (which applies `quant::Rotation::forward`), for every
/// power-of-two D and bit width.
#[test]
fn tq_encode_hadamard_matches_cpu() {
    for (i, d) in [64usize, 128, 256].into_iter().enumerate() {
        let rot = veloxquant::quant::Rotation::hadamard(d, 11 + d as u64).unwrap();
        let signs = rot.signs().to_vec();
        for (bi, &bits) in BITS.iter().enumerate() {
            let cent = centroids(d, bits);
            check_encode::<f32>(37, d, bits, Some(&signs), &cent);
            if (i + bi) % 2 == 0 {
                check_encode::<f16>(37, d, bits, Some(&signs), &cent);
            } else {
                check_encode::<bf16>(1, d, bits, Some(&signs), &cent);
            }
        }
    }
}

/// Without a rotation (the cache encodes its windows, rotated already): the
/// one-element placeholder rotation is never read. The packing is covered
/// above; here each D once, every bit width once.
#[test]
fn tq_encode_without_rotation_matches_cpu() {
    for (i, &d) in DIMS.iter().enumerate() {
        let bits = BITS[i];
        check_encode::<f32>(37, d, bits, None, &centroids(d, bits));
        check_encode::<f32>(1, d, bits, None, &centroids(d, bits));
    }
    check_encode::<f16>(37, 128, 4, None, &centroids(128, 4));
    check_encode::<bf16>(37, 64, 3, None, &centroids(64, 3));
    check_encode::<f32>(0, 64, 4, None, &centroids(64, 4));
}

#[test]
fn tq_encode_zero_vector_alone() {
    let d = 128;
    let rot = rotation_matrix(d, 3);
    for bits in [1, 3] {
        let cent = centroids(d, bits);
        let x = vec![0.0f32; d];
        let row_bytes = d * bits as usize / 8;
        let (mut codes, mut norms) = (vec![0u8; row_bytes], vec![f16::ONE; 1]);
        tq::tq_encode(&x, Some(&rot), &cent, d, bits, &mut codes, &mut norms);
        let (gc, gn) = gpu_encode(&x, 1, d, bits, Some(&rot), &cent).unwrap();
        assert_eq!(gn[0].to_bits(), 0, "norm of the zero vector, bits={bits}");
        assert_eq!(norms[0].to_bits(), 0);
        assert_eq!(gc, codes, "codes of the zero vector, bits={bits}");
    }
}

// ------------------------------- tq_decode / kv_attention + tq_reduce

const ATTENTION_THREADS: usize = 128;

/// One layer's stored data, laid out as the cache holds it.
struct Layer<T> {
    rot: Vec<f32>,
    k_codes: Vec<u8>,
    k_norms: Vec<f16>,
    k_cent: Vec<f32>,
    v_codes: Vec<u8>,
    v_norms: Vec<f16>,
    v_cent: Vec<f32>,
    win_k: Vec<T>,
    win_v: Vec<T>,
}

impl<T: VqElement> Layer<T> {
    fn inputs(&self) -> AttentionInputs<'_, T> {
        AttentionInputs {
            rot_k: &self.rot,
            rot_v: &self.rot,
            k_codes: &self.k_codes,
            k_norms: &self.k_norms,
            k_centroids: &self.k_cent,
            v_codes: &self.v_codes,
            v_norms: &self.v_norms,
            v_centroids: &self.v_cent,
            win_k: &self.win_k,
            win_v: &self.win_v,
        }
    }
}

/// Keys and values of every token rotated into `T` (the windows hold them so)
/// and, for the compressed part, encoded from there by the CPU encoder
/// without a rotation, as the cache does when tokens leave the window. Sinks
/// sit in window slots 0.., the recent tokens after them. Unused slots:
/// random code bytes, NaN norms, NaN window rows.
fn build_layer<T: Float>(sh: &AttentionShape, seed: u64) -> Layer<T> {
    let (d, heads, total) = (sh.dim, sh.batch * sh.kv_heads, sh.total());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let rot = rotation_matrix(d, seed);
    let (k_cent, v_cent) = (centroids(d, sh.key_bits), centroids(d, sh.value_bits));
    let (kb, vb) = (d * sh.key_bits as usize / 8, d * sh.value_bits as usize / 8);
    let mut layer = Layer {
        k_codes: (0..heads * sh.capacity * kb).map(|_| rng.random::<u8>()).collect(),
        k_norms: vec![f16::NAN; heads * sh.capacity],
        v_codes: (0..heads * sh.capacity * vb).map(|_| rng.random::<u8>()).collect(),
        v_norms: vec![f16::NAN; heads * sh.capacity],
        win_k: vec![<T as Float>::from_f32(f32::NAN); heads * sh.window_capacity * d],
        win_v: vec![<T as Float>::from_f32(f32::NAN); heads * sh.window_capacity * d],
        rot,
        k_cent,
        v_cent,
    };
    for h in 0..heads {
        // Keys with a per-token scale, so that the softmax is far from uniform.
        let mut keys = gaussian(&mut rng, total * d, 1.0);
        for (t, row) in keys.chunks_mut(d).enumerate() {
            let s = 0.5 + 2.0 * ((t * 7919 + h * 31) % 17) as f32 / 17.0;
            row.iter_mut().for_each(|v| *v *= s);
        }
        let values = gaussian(&mut rng, total * d, 1.0);
        let rk: Vec<T> = conv(&rotate(&layer.rot, &keys, d));
        let rv: Vec<T> = conv(&rotate(&layer.rot, &values, d));
        let (c0, c1) = (sh.sinks, sh.sinks + sh.compressed);
        let slots = h * sh.capacity..h * sh.capacity + sh.compressed;
        tq::tq_encode(
            &rk[c0 * d..c1 * d],
            None,
            &layer.k_cent,
            d,
            sh.key_bits,
            &mut layer.k_codes[slots.start * kb..slots.end * kb],
            &mut layer.k_norms[slots.clone()],
        );
        tq::tq_encode(
            &rv[c0 * d..c1 * d],
            None,
            &layer.v_cent,
            d,
            sh.value_bits,
            &mut layer.v_codes[slots.start * vb..slots.end * vb],
            &mut layer.v_norms[slots],
        );
        let w0 = h * sh.window_capacity * d;
        for (w, t) in (0..sh.sinks).chain(c1..total).enumerate() {
            let dst = w0 + w * d;
            layer.win_k[dst..dst + d].copy_from_slice(&rk[t * d..(t + 1) * d]);
            layer.win_v[dst..dst + d].copy_from_slice(&rv[t * d..(t + 1) * d]);
        }
    }
    layer
}

/// `kernels::turboquant::split_plan`.
fn split_plan(sh: &AttentionShape, units: usize, max_split: usize) -> (usize, usize, usize) {
    let wanted_splits = (1024 / units.max(1)).max(1);
    let split_tokens =
        (sh.compressed.div_ceil(wanted_splits).div_ceil(ATTENTION_THREADS).max(1) * ATTENTION_THREADS).min(max_split);
    let comp_splits = sh.compressed.div_ceil(split_tokens);
    (split_tokens, comp_splits, comp_splits + (sh.sinks + sh.recent).div_ceil(ATTENTION_THREADS))
}

/// A TurboQuant layer's attention on a GPU: the partials of `tq_decode` (one
/// query) or `kv_attention` (several), then the reduction into `[rows, D]`
/// of `T`. `q` is `[B, Hq, L, D]` row-contiguous, or with `q_transposed` laid
/// out `[B, L, Hq, D]` and handed over as a strided view (decode reads
/// strides). Returns the output and the number of splits.
fn gpu_attention<T: Element + VqElement>(q: &[T], layer: &Layer<T>, sh: &AttentionShape, scale: f32, q_transposed: bool) -> (Vec<T>, usize) {
    let d = sh.dim;
    let rows = sh.batch * sh.q_heads * sh.queries;
    let parts = if sh.queries == 1 { decode_partials(q, layer, sh, scale, q_transposed) } else { tile_partials(q, layer, sh, scale) };
    let num_splits = parts[0].shape[1];
    let tag = format!("{:?} {sh:?}", T::DTYPE);
    let out = metal_emulator::declared(Kernel::TqReduce)
        .launch()
        .input(parts[0].clone())
        .input(parts[1].clone())
        .input(parts[2].clone())
        .input(HostArray::new(&[d, d], &layer.rot))
        .output(&[rows, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("ROTATE", TemplateArg::Bool(true))
        .grid((rows * reduce_threads(d)) as u32, 1, 1)
        .threadgroup(reduce_threads(d) as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_reduce {tag}: {e}"));
    (out[0].to_vec(), num_splits)
}

/// `kernels::turboquant::decode`: the query as given, the stores,
/// leading-slice views of the key norms and the key window for the lengths,
/// no parameter buffer.
fn decode_partials<T: Element + VqElement>(q: &[T], layer: &Layer<T>, sh: &AttentionShape, scale: f32, q_transposed: bool) -> Vec<HostArray> {
    let d = sh.dim;
    let head_rows = sh.q_heads / sh.kv_heads * sh.queries;
    let qn = head_rows.min(4);
    let units = sh.batch * sh.kv_heads * head_rows.div_ceil(qn);
    let (_, _, num_splits) = split_plan(sh, units, 512);
    let (b, h, hq, l) = (sh.batch, sh.kv_heads, sh.q_heads, sh.queries);
    let (kb, vb) = (d * sh.key_bits as usize / 8, d * sh.value_bits as usize / 8);
    let (nc, nw) = (sh.compressed, sh.sinks + sh.recent);
    let q_arr = if q_transposed {
        HostArray::heads_transposed([b, hq, l, d], q)
    } else {
        HostArray::new(&[b, hq, l, d], q)
    };
    let view = |base: HostArray, len: usize| {
        let mut shape = base.shape.clone();
        shape[2] = len;
        HostArray::leading_slice(&base, &shape)
    };
    let rows = b * hq * l;
    let tag = format!("{:?} {sh:?}", T::DTYPE);
    metal_emulator::declared(Kernel::TqDecode)
        .launch()
        .input(q_arr)
        .input(HostArray::new(&[d, d], &layer.rot))
        .input(HostArray::new(&[b, h, sh.capacity, kb], &layer.k_codes))
        .input(view(HostArray::new(&[b, h, sh.capacity], &layer.k_norms), nc))
        .input(HostArray::new(&[1 << sh.key_bits], &layer.k_cent))
        .input(HostArray::new(&[b, h, sh.capacity, vb], &layer.v_codes))
        .input(HostArray::new(&[b, h, sh.capacity], &layer.v_norms))
        .input(HostArray::new(&[1 << sh.value_bits], &layer.v_cent))
        .input(view(HostArray::new(&[b, h, sh.window_capacity, d], &layer.win_k), nw))
        .input(HostArray::new(&[b, h, sh.window_capacity, d], &layer.win_v))
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits, d], Dtype::F32)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("KB", TemplateArg::Int(sh.key_bits as i32))
        .template("VB", TemplateArg::Int(sh.value_bits as i32))
        .template("QN", TemplateArg::Int(qn as i32))
        .template("TPT", TemplateArg::Int(veloxquant::kernels::turboquant::decode_lanes(d) as i32))
        .template("N_SINK", TemplateArg::Int(sh.sinks as i32))
        .template("CAUSAL", TemplateArg::Bool(sh.causal))
        .template("SCALE", TemplateArg::Int(scale.to_bits() as i32))
        .grid((units * num_splits * ATTENTION_THREADS) as u32, 1, 1)
        .threadgroup(ATTENTION_THREADS as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_decode {tag}: {e}"))
}

/// The layer's shape as the cache hands it to `kv_attention`.
fn kv_shape(sh: &AttentionShape) -> KvShape {
    let key = SideCodec { codec: Codec::TurboQuantMse, bits: sh.key_bits, group: 1 };
    let value = SideCodec { codec: Codec::TurboQuantMse, bits: sh.value_bits, group: 1 };
    KvShape {
        batch: sh.batch,
        q_heads: sh.q_heads,
        kv_heads: sh.kv_heads,
        queries: sh.queries,
        dim: sh.dim,
        key: key.layout(sh.dim),
        value: value.layout(sh.dim),
        query_features: key.query_features(sh.dim),
        sinks: sh.sinks,
        compressed: sh.compressed,
        recent: sh.recent,
        capacity: sh.capacity,
        window_capacity: sh.window_capacity,
        causal: sh.causal,
        mask_heads: 0,
    }
}

/// Several queries: the cache attends a TurboQuant layer with `kv_attention`
/// (the kernel of every codec; `LayerCache::kv_layer`), the queries rotated
/// and scaled by the host, the norms as scales, placeholders for the zeros
/// and the mask, tiles and staging as Metal's plan has them.
fn tile_partials<T: Element + VqElement>(q: &[T], layer: &Layer<T>, sh: &AttentionShape, scale: f32) -> Vec<HostArray> {
    let ks = kv_shape(sh);
    let plan = gpu_plan(&ks, Backend::Metal, Policy::Require).unwrap().expect("fits");
    let q_tiles = sh.queries.div_ceil(plan.per_tile);
    let units = sh.batch * sh.kv_heads * q_tiles;
    let (split_tokens, comp_splits, num_splits) = kv_split_plan(&ks, units);
    // The host rotates and scales the queries once: qr = scale * Π q.
    let d = sh.dim;
    let qr: Vec<f32> = (0..q.len())
        .map(|e| {
            let (row, i) = (e / d, e % d);
            scale * (0..d).map(|j| layer.rot[i * d + j] * q[row * d + j].to_f32()).sum::<f32>()
        })
        .collect();
    let rows = sh.batch * sh.q_heads * sh.queries;
    let params: Vec<u32> = [
        sh.batch, sh.q_heads, sh.kv_heads, sh.queries, sh.sinks, sh.compressed, sh.recent, sh.capacity,
        sh.window_capacity, split_tokens, num_splits, q_tiles, usize::from(sh.causal), comp_splits, 0,
    ]
    .iter()
    .map(|&v| v as u32)
    .collect();
    let (kb, vb) = (d * sh.key_bits as usize / 8, d * sh.value_bits as usize / 8);
    let blocks = units * num_splits;
    let tag = format!("{:?} {sh:?}", T::DTYPE);
    let unread_f16 = HostArray::new(&[8], &[f16::NAN; 8]);
    let id = Codec::TurboQuantMse.id();
    metal_emulator::declared(Kernel::KvAttention)
        .launch()
        .input(HostArray::new(&[sh.batch, sh.q_heads, sh.queries, d], &qr))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.capacity, kb], &layer.k_codes))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.capacity], &layer.k_norms))
        .input(unread_f16.clone())
        .input(HostArray::new(&[1 << sh.key_bits], &layer.k_cent))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.capacity, vb], &layer.v_codes))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.capacity], &layer.v_norms))
        .input(unread_f16)
        .input(HostArray::new(&[1 << sh.value_bits], &layer.v_cent))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.window_capacity, d], &layer.win_k))
        .input(HostArray::new(&[sh.batch, sh.kv_heads, sh.window_capacity, d], &layer.win_v))
        .input(HostArray::new(&[8], &[f32::NAN; 8]))
        .input(HostArray::new(&[params.len()], &params))
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits], Dtype::F32)
        .output(&[rows, num_splits, d], Dtype::F32)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("KM", TemplateArg::Int(id))
        .template("KB", TemplateArg::Int(sh.key_bits as i32))
        .template("KG", TemplateArg::Int(1))
        .template("VM", TemplateArg::Int(id))
        .template("VB", TemplateArg::Int(sh.value_bits as i32))
        .template("VG", TemplateArg::Int(1))
        .template("QN", TemplateArg::Int(plan.rows as i32))
        .template("QF", TemplateArg::Int(ks.query_features as i32))
        .template("STAGE", TemplateArg::Bool(plan.stage))
        .grid((blocks * ATTENTION_THREADS) as u32, 1, 1)
        .threadgroup(ATTENTION_THREADS as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("kv_attention {tag}: {e}"))
}

#[allow(clippy::too_many_arguments)]
fn shape(b: usize, hq: usize, hkv: usize, l: usize, d: usize, parts: (usize, usize, usize), causal: bool) -> AttentionShape {
    let (sinks, compressed, recent) = parts;
    AttentionShape {
        batch: b,
        q_heads: hq,
        kv_heads: hkv,
        queries: l,
        dim: d,
        key_bits: 4,
        value_bits: 3,
        sinks,
        compressed,
        recent,
        // Room left in both stores, as in the cache.
        capacity: compressed + 13,
        window_capacity: sinks + recent + 5,
        causal,
    }
}

/// Runs one case; returns the number of splits the host would use.
fn check_attention<T: Float + FromF32 + Element>(sh: AttentionShape, tol: f32, seed: u64) -> usize {
    check_attention_q::<T>(sh, tol, seed, false)
}

/// As `check_attention`; with `q_transposed` the decode kernel reads the
/// queries through transposed strides, as mlx_lm hands them over.
fn check_attention_q<T: Float + FromF32 + Element>(sh: AttentionShape, tol: f32, seed: u64, q_transposed: bool) -> usize {
    let layer = build_layer::<T>(&sh, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let q: Vec<T> = conv(&gaussian(&mut rng, sh.batch * sh.q_heads * sh.queries * sh.dim, 1.0));
    let scale = 1.0 / (sh.dim as f32).sqrt();
    let mut want = vec![<T as Float>::from_f32(0.0); q.len()];
    tq::tq_attention(&q, &layer.inputs(), &sh, scale, &mut want);
    let (got, splits) = gpu_attention(&q, &layer, &sh, scale, q_transposed);
    let (got, want): (Vec<f32>, Vec<f32>) =
        (got.iter().map(|v| v.to_f32()).collect(), want.iter().map(|v| v.to_f32()).collect());
    assert!(want.iter().all(|v| v.is_finite()), "CPU output not finite: {sh:?}");
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_ref > 0.0);
    let rel = max_err / max_ref;
    eprintln!("{:?} B={} Hq={} Hkv={} L={} D={} tokens={:?} splits={splits}: relative error {rel:.2e}",
        T::DTYPE, sh.batch, sh.q_heads, sh.kv_heads, sh.queries, sh.dim, (sh.sinks, sh.compressed, sh.recent));
    assert!(rel <= tol, "{:?} {sh:?}: relative error {rel:e} > {tol:e} (splits {splits})", T::DTYPE);
    splits
}

#[test]
fn tq_attention_decode_matches_cpu() {
    for d in [64, 128] {
        for (hq, hkv) in [(2, 2), (8, 2)] {
            // Sinks, compressed and recent non-empty; 3 splits of 128 tokens.
            let s = check_attention::<f32>(shape(1, hq, hkv, 1, d, (4, 300, 40), true), 1e-5, d as u64 + hq as u64);
            assert!(s > 1, "expected several splits, got {s}");
        }
    }
    // Batch 2, a single split, no sinks; and only windows, no compressed part.
    check_attention::<f32>(shape(2, 4, 1, 1, 64, (0, 50, 7), false), 1e-5, 11);
    check_attention::<f32>(shape(1, 4, 1, 1, 64, (3, 0, 9), true), 1e-5, 12);
}

#[test]
fn tq_attention_multi_token_causal_matches_cpu() {
    for d in [64, 128] {
        // G = 1: QN = 5, one tile; G = 4: QN = 16 (4 queries per tile), two
        // tiles, the second one partial.
        for (hq, hkv) in [(2, 2), (8, 2)] {
            let s = check_attention::<f32>(shape(1, hq, hkv, 5, d, (4, 300, 40), true), 1e-5, 100 + d as u64 + hq as u64);
            assert!(s > 1);
        }
    }
    // Causal with the queries inside the compressed part's reach: L larger
    // than the recent window, so early queries see no recent token.
    check_attention::<f32>(shape(1, 4, 2, 5, 64, (2, 140, 3), true), 1e-5, 21);
    // Non-causal multi-token.
    check_attention::<f32>(shape(1, 4, 2, 5, 64, (2, 140, 3), false), 1e-5, 22);
}

#[test]
fn tq_attention_f16_matches_cpu() {
    let s = check_attention::<f16>(shape(1, 8, 2, 1, 128, (4, 300, 40), true), 1e-2, 31);
    assert!(s > 1);
    check_attention::<f16>(shape(1, 8, 2, 5, 64, (4, 300, 40), true), 1e-2, 32);
}


#[test]
fn tq_decode_head_dims_bits_and_groups_match_cpu() {
    // Every supported head size (TPT 4, 8, 8, 8, 16 lanes per token, chunks
    // not dividing evenly at 80 and 96), queries through transposed strides.
    for (i, d) in [64, 80, 96, 128, 256].into_iter().enumerate() {
        let s = check_attention_q::<f32>(shape(1, 8, 2, 1, d, (4, 300, 40), true), 1e-5, 200 + i as u64, true);
        assert!(s > 2, "expected several splits, got {s}");
    }
    // Groups of 3 (one tile of 3 rows), 8 (two tiles of 4), 1; batch 2.
    check_attention_q::<f32>(shape(1, 9, 3, 1, 64, (4, 260, 9), true), 1e-5, 210, true);
    check_attention_q::<f32>(shape(2, 16, 2, 1, 128, (4, 200, 17), true), 1e-5, 211, false);
    check_attention_q::<f32>(shape(1, 2, 2, 1, 64, (1, 129, 128), false), 1e-5, 212, true);
    // Every key and value width.
    for (kb, vb) in [(1, 2), (2, 8), (3, 3), (8, 1)] {
        let sh = AttentionShape { key_bits: kb, value_bits: vb, ..shape(1, 4, 1, 1, 128, (2, 170, 30), true) };
        check_attention_q::<f32>(sh, 1e-5, 220 + kb as u64, true);
    }
    // Half types; no compressed token yet (empty store views).
    check_attention_q::<f16>(shape(1, 8, 2, 1, 128, (4, 300, 40), true), 1e-2, 230, true);
    check_attention_q::<bf16>(shape(1, 8, 2, 1, 64, (4, 300, 40), true), 1e-2, 231, true);
    check_attention_q::<f32>(shape(1, 4, 2, 1, 64, (3, 0, 2), true), 1e-5, 232, true);
}

/// `kernels::turboquant::rotate_queries`: blocks of 4 rows x 32 output
/// dimensions, 256 threads; out = scale * Π q per row, queries read through
/// transposed strides (rows that do not fill the last block, D not a
/// multiple of 32 on this backend).
#[test]
fn tq_rotate_matches_cpu() {
    for (i, (b, hq, d)) in [(1usize, 8usize, 128usize), (2, 3, 64), (1, 5, 80)].into_iter().enumerate() {
        let mut rng = ChaCha8Rng::seed_from_u64(300 + i as u64);
        let rot = rotation_matrix(d, 7 + i as u64);
        let q = gaussian(&mut rng, b * hq * d, 1.0);
        let scale = (d as f32).powf(-0.5);
        let rows = b * hq;
        let blocks = rows.div_ceil(4) * d.div_ceil(32);
        let out = metal_emulator::declared(Kernel::TqRotate)
            .launch()
            .input(HostArray::heads_transposed([b, hq, 1, d], &conv::<f16>(&q)))
            .input(HostArray::new(&[d, d], &rot))
            .output(&[b, hq, 1, d], Dtype::F32)
            .template("T", TemplateArg::Dtype(Dtype::F16))
            .template("D", TemplateArg::Int(d as i32))
            .template("QR", TemplateArg::Int(4))
            .template("SCALE", TemplateArg::Int(scale.to_bits() as i32))
            .grid((blocks * 256) as u32, 1, 1)
            .threadgroup(256, 1, 1)
            .run()
            .unwrap_or_else(|e| panic!("tq_rotate D={d}: {e}"));
        let q16: Vec<f32> = conv::<f16>(&q).iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = rotate(&rot, &q16, d).iter().map(|v| v * scale).collect();
        let got: Vec<f32> = out[0].to_vec();
        let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
        assert!(err <= 1e-5, "tq_rotate B={b} Hq={hq} D={d}: max error {err:e}");
    }
}
