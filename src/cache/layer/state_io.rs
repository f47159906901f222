//! The versioned byte form of a layer cache.

use safetensors::tensor::Dtype as StDtype;
use safetensors::SafeTensors;

use super::*;

const STATE_FORMAT: &str = "veloxquant-layer-cache";
/// Version 4: `to_bytes` adds a CRC-32 of every tensor and of the header.
/// Version 5: rotated frames are scaled by `1/F` (`frame_scale`).
/// Version 7: TurboQuant-MSE's 3-bit values on a uniform grid
/// (`Codec::TurboQuantUniform`), whose codes the Lloyd–Max table of
/// versions 5 and 6 would decode wrongly.
const STATE_VERSION: &str = "7";
/// Version 6, now 8: with KIVI keys of unequal bits per channel
/// (`key_widths`), which a reader of version 5 (7) would decode wrongly.
const STATE_VERSION_WIDTHS: &str = "8";

fn st_name(d: Dtype) -> &'static str {
    match d {
        Dtype::U8 => "U8",
        Dtype::F16 => "F16",
        Dtype::BF16 => "BF16",
        _ => "F32",
    }
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::invalid("state", msg)
}

/// The first `rows` rows (axis 2) of `a`.
fn head_rows(a: &Array, rows: usize, s: &Stream) -> Result<Array> {
    let mut stop = a.shape();
    stop[2] = rows as i32;
    ops::slice(a, &vec![0; stop.len()], &stop, s)
}

/// The state tensors of one side: its used codes, scales and zeros.
fn side_tensors(side: &Side, prefix: &str, len: usize, s: &Stream) -> Result<Vec<(String, Array)>> {
    let mut out = vec![(format!("{prefix}_codes"), head_rows(&side.codes, len, s)?)];
    let rows = side.codec.param_rows(len);
    if let Some(a) = &side.scales {
        out.push((format!("{prefix}_{}", side.scales_name()), head_rows(a, rows, s)?));
    }
    if let Some(a) = &side.zeros {
        out.push((format!("{prefix}_zeros"), head_rows(a, rows, s)?));
    }
    Ok(out)
}

/// The state as named arrays (lazy views of the used slots, nothing
/// copied to the host) and string metadata.
pub(super) fn parts(cache: &LayerCache) -> Result<(Vec<(String, Array)>, BTreeMap<String, String>)> {
    let c = &cache.cfg;
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in [
        ("format", STATE_FORMAT.to_string()),
        ("version", if c.key_widths.is_some() { STATE_VERSION_WIDTHS } else { STATE_VERSION }.to_string()),
        ("head_dim", c.head_dim.to_string()),
        ("kv_heads", c.kv_heads.to_string()),
        ("key_method", c.key_method.to_string()),
        ("key_bits", c.key_bits.to_string()),
        ("value_method", c.value_method.to_string()),
        ("value_bits", c.value_bits.to_string()),
        ("window", c.window.to_string()),
        ("sinks", c.sinks.to_string()),
        ("key_group", c.key_group.to_string()),
        ("seed", c.seed.to_string()),
        ("batch", cache.batch.to_string()),
        ("dtype", cache.dtype.to_string()),
    ] {
        meta.insert(k.to_string(), v);
    }
    if let Some(w) = &c.key_widths {
        meta.insert("key_widths".to_string(), w.iter().map(u8::to_string).collect::<Vec<_>>().join(","));
    }
    let s = &cache.stream()?;
    let (b, h, d) = (cache.batch as i32, c.kv_heads as i32, c.head_dim as i32);
    let mut tensors: Vec<(String, Array)> = Vec::new();
    match &cache.store {
        None => {}
        Some(Store::Dense(x)) => {
            let n = x.len as i32;
            tensors.push(("keys".into(), ops::slice(&x.keys, &[0, 0, 0, 0], &[b, h, n, d], s)?));
            tensors.push(("values".into(), ops::slice(&x.values, &[0, 0, 0, 0], &[b, h, n, d], s)?));
        }
        Some(Store::Compressed(x)) => {
            if let Some(mean) = &x.k_mean {
                tensors.push(("k_mean".into(), mean.clone()));
            }
            tensors.extend(side_tensors(&x.keys, "k", x.len, s)?);
            tensors.extend(side_tensors(&x.values, "v", x.len, s)?);
            // Sinks then recent tokens, as stored.
            let (ns, nr, w0) = (x.n_sink as i32, x.n_recent as i32, c.sinks as i32);
            // Joined even where the slots are one run (the sinks full): on
            // the CUDA back-end a view of the window here made the next
            // prefill chunk's evaluation 16 ms slower at llama-8b 4K (H100,
            // scripts/gpu/prefill_chunks.py, 62.9 against 78.8 ms), more than
            // the copy of two windows costs.
            let take = |w: &Array| -> Result<Array> {
                let sink = ops::slice(w, &[0, 0, 0, 0], &[b, h, ns, d], s)?;
                let recent = ops::slice(w, &[0, 0, w0, 0], &[b, h, w0 + nr, d], s)?;
                ops::concatenate(&[sink, recent], 2, s)
            };
            tensors.push(("win_k".into(), take(&x.keys.window)?));
            tensors.push(("win_v".into(), take(&x.values.window)?));
            meta.insert("n_sink".into(), x.n_sink.to_string());
            meta.insert("n_recent".into(), x.n_recent.to_string());
            meta.insert("compressed".into(), x.len.to_string());
        }
    }
    Ok((tensors, meta))
}

/// Metadata key of a tensor's CRC-32 (lowercase hex of its bytes).
fn crc_key(name: &str) -> String {
    format!("crc32:{name}")
}

/// Metadata key of the header's CRC-32.
const HEADER_CRC: &str = "crc32";

/// CRC-32 of the header: every metadata entry but this checksum, then
/// each tensor's name, dtype and shape, in name order.
fn header_crc<'a>(meta: impl Iterator<Item = (&'a String, &'a String)>, tensors: &mut [(String, &'static str, Vec<usize>)]) -> String {
    let mut meta: Vec<_> = meta.filter(|(k, _)| k.as_str() != HEADER_CRC).collect();
    meta.sort();
    tensors.sort();
    let mut h = crc32fast::Hasher::new();
    for (k, v) in meta {
        h.update(format!("{}={}\n", k.len(), k).as_bytes());
        h.update(format!("{}={}\n", v.len(), v).as_bytes());
    }
    for (name, dtype, shape) in tensors.iter() {
        h.update(format!("{}:{name} {dtype} {shape:?}\n", name.len()).as_bytes());
    }
    format!("{:08x}", h.finalize())
}

pub(super) fn save(cache: &LayerCache) -> Result<Vec<u8>> {
    let (tensors, mut meta) = parts(cache)?;
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, a)| {
            let shape = a.shape().iter().map(|&v| v as usize).collect();
            Ok((name, a.dtype(), shape, a.to_bytes()?))
        })
        .collect::<Result<_>>()?;
    for (name, _, _, bytes) in &data {
        meta.insert(crc_key(name), format!("{:08x}", crc32fast::hash(bytes)));
    }
    let mut layout: Vec<_> = data.iter().map(|(n, dt, shape, _)| (n.clone(), st_name(*dt), shape.clone())).collect();
    let crc = header_crc(meta.iter(), &mut layout);
    meta.insert(HEADER_CRC.to_string(), crc);
    let views: Vec<crate::safetensors_io::TensorBytes<'_>> = data
        .iter()
        .map(|(n, dt, shape, bytes)| crate::safetensors_io::TensorBytes { name: n, dtype: st_name(*dt), shape, data: bytes })
        .collect();
    Ok(crate::safetensors_io::write(&meta, &views))
}

fn field<T: std::str::FromStr>(meta: &HashMap<String, String>, key: &str) -> Result<T> {
    let v = meta.get(key).ok_or_else(|| corrupt(format!("missing field {key:?}")))?;
    v.parse().map_err(|_| corrupt(format!("field {key:?}: {v:?} is not a valid value (a non-negative integer)")))
}

fn dtype_of(d: StDtype) -> Option<Dtype> {
    match d {
        StDtype::U8 => Some(Dtype::U8),
        StDtype::F16 => Some(Dtype::F16),
        StDtype::BF16 => Some(Dtype::BF16),
        StDtype::F32 => Some(Dtype::F32),
        _ => None,
    }
}

/// Reads [`save`]'s bytes: the header's and every tensor's CRC-32 are
/// checked before anything is built, so a corrupt or truncated state is
/// refused.
pub(super) fn load(bytes: &[u8], stream: Option<Stream>) -> Result<LayerCache> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
    let meta = header.metadata().clone().ok_or_else(|| corrupt("no metadata"))?;
    check_format(&meta)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
    let mut layout: Vec<_> = st
        .tensors()
        .iter()
        .map(|(name, t)| Ok((name.clone(), dtype_of(t.dtype()).map(st_name).ok_or_else(|| corrupt(format!("{name}: dtype {:?} is not a cache dtype", t.dtype())))?, t.shape().to_vec())))
        .collect::<Result<_>>()?;
    let want = meta.get(HEADER_CRC).ok_or_else(|| corrupt("no checksum of the header"))?;
    if header_crc(meta.iter(), &mut layout) != *want {
        return Err(corrupt("the header's checksum does not match: the state is corrupt"));
    }
    let mut tensors = HashMap::new();
    for (name, t) in st.tensors() {
        let want = meta.get(&crc_key(&name)).ok_or_else(|| corrupt(format!("{name}: no checksum")))?;
        if format!("{:08x}", crc32fast::hash(t.data())) != *want {
            return Err(corrupt(format!("{name}: the data's checksum does not match: the state is corrupt")));
        }
        let dt = dtype_of(t.dtype()).ok_or_else(|| corrupt(format!("{name}: dtype {:?} is not a cache dtype", t.dtype())))?;
        let shape = t.shape().iter().map(|&v| i32::try_from(v).map_err(|_| corrupt(format!("{name}: shape {:?}", t.shape())))).collect::<Result<Vec<_>>>()?;
        tensors.insert(name, Array::from_bytes(t.data(), &shape, dt)?);
    }
    let checked = meta.keys().filter(|k| k.starts_with("crc32:")).count();
    if checked != tensors.len() {
        return Err(corrupt(format!("{checked} tensor checksums for {} tensors", tensors.len())));
    }
    from_parts(&tensors, &meta, stream)
}

fn check_format(meta: &HashMap<String, String>) -> Result<()> {
    match meta.get("format") {
        Some(f) if f == STATE_FORMAT => {}
        Some(f) => return Err(corrupt(format!("format {f:?} is not {STATE_FORMAT:?}: not a layer cache state"))),
        None => return Err(corrupt(format!("no format field (expected {STATE_FORMAT:?}): not a layer cache state"))),
    }
    match meta.get("version") {
        Some(v) if v == STATE_VERSION || v == STATE_VERSION_WIDTHS => {}
        Some(v) => {
            return Err(corrupt(format!(
                "version {v:?} is not supported: this veloxquant reads versions {STATE_VERSION} and {STATE_VERSION_WIDTHS} (states of other \
                 versions are refused; rebuild the cache from its tokens)"
            )))
        }
        None => return Err(corrupt(format!("no version (expected {STATE_VERSION})"))),
    }
    Ok(())
}

/// A cache rebuilt from [`parts`]' arrays and metadata (each array's dtype
/// and shape checked against the metadata).
pub(super) fn from_parts(tensors: &HashMap<String, Array>, meta: &HashMap<String, String>, stream: Option<Stream>) -> Result<LayerCache> {
    check_format(meta)?;
    let mut cfg = CacheConfig::new(field(&meta, "head_dim")?, field(&meta, "kv_heads")?);
    let method = |key: &str| -> Result<crate::cache::config::Method> {
        meta.get(key).ok_or_else(|| corrupt(format!("missing field {key:?}")))?.parse().map_err(|e: Error| corrupt(e.to_string()))
    };
    cfg.key_method = method("key_method")?;
    cfg.value_method = method("value_method")?;
    cfg.key_bits = field(&meta, "key_bits")?;
    cfg.value_bits = field(&meta, "value_bits")?;
    cfg.window = field(&meta, "window")?;
    cfg.sinks = field(&meta, "sinks")?;
    // States written before the key group was a setting held KIVI's 32.
    if meta.contains_key("key_group") {
        cfg.key_group = field(&meta, "key_group")?;
    }
    cfg.seed = field(&meta, "seed")?;
    if let Some(w) = meta.get("key_widths") {
        let widths = w.split(',').map(|v| v.trim().parse::<u8>()).collect::<std::result::Result<Vec<_>, _>>();
        cfg.key_widths = Some(widths.map_err(|_| corrupt(format!("key_widths {w:?} is not a list of bit widths")))?);
    }
    let mut cache = LayerCache::new(cfg, stream).map_err(|e| corrupt(e.to_string()))?;
    let batch: usize = field(meta, "batch")?;
    if tensors.is_empty() {
        return Ok(cache);
    }
    let dtype = match meta.get("dtype").map(String::as_str) {
        Some("float16") => Dtype::F16,
        Some("bfloat16") => Dtype::BF16,
        Some("float32") => Dtype::F32,
        Some(other) => return Err(corrupt(format!("dtype {other:?} is not one of \"float16\", \"bfloat16\", \"float32\""))),
        None => return Err(corrupt("missing field \"dtype\"")),
    };
    let (b, h, d) = (batch as i32, cache.cfg.kv_heads as i32, cache.cfg.head_dim as i32);
    let tensor = |name: &str, dt: Dtype, shape: &[i32]| -> Result<Array> {
        let t = tensors.get(name).ok_or_else(|| corrupt(format!("{name}: missing")))?;
        if t.dtype() != dt || t.shape() != shape {
            return Err(corrupt(format!("{name}: {} {:?}, expected {dt} {shape:?}", t.dtype(), t.shape())));
        }
        Ok(t.clone())
    };
    cache.init(batch, dtype, 0)?;
    let s = cache.stream()?;
    if !cache.cfg.compressed() {
        let n = tensors.get("keys").ok_or_else(|| corrupt("keys: missing"))?.shape().get(2).copied().unwrap_or(0);
        let k = tensor("keys", dtype, &[b, h, n as i32, d])?;
        let v = tensor("values", dtype, &[b, h, n as i32, d])?;
        cache.append(&k, &v)?;
        return Ok(cache);
    }
    let n: usize = field(&meta, "compressed")?;
    let ns: usize = field(&meta, "n_sink")?;
    let nr: usize = field(&meta, "n_recent")?;
    if ns > cache.cfg.sinks || nr > cache.cfg.recent_capacity() || (ns < cache.cfg.sinks && n + nr > 0) {
        return Err(corrupt(format!("inconsistent counts: {ns} sinks, {n} compressed, {nr} recent")));
    }
    let wk = tensor("win_k", dtype, &[b, h, (ns + nr) as i32, d])?;
    let wv = tensor("win_v", dtype, &[b, h, (ns + nr) as i32, d])?;
    let mean = match tensors.get("k_mean") {
        Some(_) => Some(tensor("k_mean", Dtype::F32, &[b, h, 1, d])?),
        None if n + ns + nr == 0 => None,
        None => return Err(corrupt("k_mean: missing")),
    };
    let key_rotation = cache.shared.as_ref().and_then(|sh| sh.rotation.clone());
    let Some(Store::Compressed(c)) = &mut cache.store else { unreachable!() };
    let rotation = key_rotation.as_ref().filter(|_| c.keys.codec.codec.rotated());
    c.k_offset = mean.as_ref().map(|m| key_offset(m, rotation, dtype, &s)).transpose()?;
    c.k_mean = mean;
    let cap = store_capacity(c.capacity, n);
    c.reserve_window(if nr > 0 { cache.cfg.sinks + nr } else { ns }, n + ns + nr, cache.cfg.window_capacity(), &s)?;
    let w0 = cache.cfg.sinks as i32;
    for (side, prefix, win) in [(&mut c.keys, "k", &wk), (&mut c.values, "v", &wv)] {
        side.grow(cap, false, &s)?;
        let sc = side.codec;
        let codes_dtype = side.codes.dtype();
        let codes = tensor(&format!("{prefix}_codes"), codes_dtype, &[b, h, n as i32, sc.row_len(d as usize) as i32])?;
        let params_shape = side.param_shape(b, h, sc.param_rows(n), d as usize);
        let scales = match side.scales {
            Some(_) => Some(tensor(&format!("{prefix}_{}", side.scales_name()), Dtype::F16, &params_shape)?),
            None => None,
        };
        let zeros = match side.zeros {
            Some(_) => Some(tensor(&format!("{prefix}_zeros"), Dtype::F16, &params_shape)?),
            None => None,
        };
        side.write(Encoded { codes, scales, zeros }, 0, &s)?;
        let sink = ops::slice(win, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
        let recent = ops::slice(win, &[0, 0, ns as i32, 0], &[b, h, (ns + nr) as i32, d], &s)?;
        let w = ops::slice_update(&side.window, &sink, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
        side.window = ops::slice_update(&w, &recent, &[0, 0, w0, 0], &[b, h, w0 + nr as i32, d], &s)?;
    }
    c.capacity = cap;
    c.len = n;
    c.n_sink = ns;
    c.n_recent = nr;
    Ok(cache)
}
