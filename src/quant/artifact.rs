//! Calibration artifacts: everything a quantizer needs besides the encoded
//! rows, in a safetensors file.
//!
//! Metadata (`__metadata__`, all strings): `format` = [`FORMAT`],
//! `version` = [`VERSION`], `method` (e.g. `turboquant-mse`), `checksum` (FNV-1a
//! 64 over method, configuration and every tensor's name, dtype, shape and
//! bytes, as 16 hex digits) and the configuration as `config.<key>`.
//! Tensors are little-endian `F32`, `U32` or `U8`. Loading checks the format,
//! version, method and checksum, then each quantizer validates shapes and
//! values, so a truncated, corrupt or mismatched file is an error.

use super::{QuantError, Quantizer, Result};
use crate::safetensors_io::TensorBytes;
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

pub const FORMAT: &str = "veloxquant-quantizer";
pub const VERSION: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32,
    U32,
    U8,
}

impl ElemType {
    fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "F32",
            ElemType::U32 => "U32",
            ElemType::U8 => "U8",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    pub elem: ElemType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Artifact {
    pub method: String,
    pub config: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, Tensor>,
}

fn bad(msg: impl Into<String>) -> QuantError {
    QuantError::Artifact(msg.into())
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
    // Length separator so that concatenations cannot collide trivially.
    for b in (bytes.len() as u64).to_le_bytes() {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

impl Artifact {
    pub fn new(method: &str) -> Self {
        Artifact { method: method.into(), config: BTreeMap::new(), tensors: BTreeMap::new() }
    }

    pub fn set(&mut self, key: &str, value: impl ToString) {
        self.config.insert(key.into(), value.to_string());
    }

    /// The configuration value `key`, parsed.
    pub fn get<T: FromStr>(&self, key: &str) -> Result<T> {
        let s = self.config.get(key).ok_or_else(|| bad(format!("config key {key} is missing")))?;
        s.parse().map_err(|_| bad(format!("config key {key} has invalid value {s:?}")))
    }

    pub fn put_f32(&mut self, name: &str, shape: &[usize], v: &[f32]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.insert(name.into(), Tensor { elem: ElemType::F32, shape: shape.to_vec(), data });
    }

    pub fn put_u32(&mut self, name: &str, shape: &[usize], v: &[u32]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.insert(name.into(), Tensor { elem: ElemType::U32, shape: shape.to_vec(), data });
    }

    fn tensor(&self, name: &str, elem: ElemType, shape: &[usize]) -> Result<&Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| bad(format!("tensor {name} is missing")))?;
        if t.elem != elem || t.shape != shape {
            return Err(bad(format!(
                "tensor {name} is {} {:?}, expected {} {:?}",
                t.elem.name(),
                t.shape,
                elem.name(),
                shape
            )));
        }
        Ok(t)
    }

    /// Tensor `name` as f32 with exactly `shape`; values must be finite.
    pub fn f32s(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.tensor(name, ElemType::F32, shape)?;
        let v: Vec<f32> =
            t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if v.iter().any(|x| !x.is_finite()) {
            return Err(bad(format!("tensor {name} holds non-finite values")));
        }
        Ok(v)
    }

    pub fn u32s(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let t = self.tensor(name, ElemType::U32, shape)?;
        Ok(t.data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Shape of tensor `name` (to size the checks of variable-size tensors).
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.tensors.get(name).ok_or_else(|| bad(format!("tensor {name} is missing")))?.shape)
    }

    /// Copies `sub` into this artifact under `prefix` (composite quantizers).
    pub fn embed(&mut self, prefix: &str, sub: &Artifact) {
        self.set(&format!("{prefix}method"), &sub.method);
        for (k, v) in &sub.config {
            self.config.insert(format!("{prefix}{k}"), v.clone());
        }
        for (k, t) in &sub.tensors {
            self.tensors.insert(format!("{prefix}{k}"), t.clone());
        }
    }

    /// The artifact stored under `prefix` by [`Artifact::embed`].
    pub fn extract(&self, prefix: &str) -> Result<Artifact> {
        let mut a = Artifact::new(&self.get::<String>(&format!("{prefix}method"))?);
        for (k, v) in &self.config {
            if let Some(rest) = k.strip_prefix(prefix) {
                if rest != "method" {
                    a.config.insert(rest.into(), v.clone());
                }
            }
        }
        for (k, t) in &self.tensors {
            if let Some(rest) = k.strip_prefix(prefix) {
                a.tensors.insert(rest.into(), t.clone());
            }
        }
        Ok(a)
    }

    /// Checks that this artifact is for `method`.
    pub fn expect_method(&self, method: &str) -> Result<()> {
        if self.method != method {
            return Err(bad(format!("method is {}, expected {method}", self.method)));
        }
        Ok(())
    }

    fn checksum(&self) -> String {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        fnv(&mut h, self.method.as_bytes());
        for (k, v) in &self.config {
            fnv(&mut h, k.as_bytes());
            fnv(&mut h, v.as_bytes());
        }
        for (k, t) in &self.tensors {
            fnv(&mut h, k.as_bytes());
            fnv(&mut h, t.elem.name().as_bytes());
            for &s in &t.shape {
                fnv(&mut h, &(s as u64).to_le_bytes());
            }
            fnv(&mut h, &t.data);
        }
        format!("{h:016x}")
    }

    /// The safetensors bytes. Written here rather than with
    /// `safetensors::serialize` so that the header lists metadata and
    /// tensors in sorted order and the same artifact always gives the same
    /// bytes; `from_bytes` parses it with the safetensors reader.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), FORMAT.to_string());
        meta.insert("version".to_string(), VERSION.to_string());
        meta.insert("method".to_string(), self.method.clone());
        meta.insert("checksum".to_string(), self.checksum());
        for (k, v) in &self.config {
            meta.insert(format!("config.{k}"), v.clone());
        }
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for (k, t) in &self.tensors {
            let n: usize = t.shape.iter().product();
            let size = n * if t.elem == ElemType::U8 { 1 } else { 4 };
            if size != t.data.len() {
                return Err(bad(format!("tensor {k}: {} bytes for shape {:?}", t.data.len(), t.shape)));
            }
            tensors.push(TensorBytes { name: k, dtype: t.elem.name(), shape: &t.shape, data: &t.data });
        }
        let out = crate::safetensors_io::write(&meta, &tensors);
        Ok(out)
    }

    /// Parses and checks an artifact; `method`, if given, must match.
    pub fn from_bytes(bytes: &[u8], method: Option<&str>) -> Result<Self> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let meta = header.metadata().clone().ok_or_else(|| bad("metadata is missing"))?;
        let field = |k: &str| meta.get(k).ok_or_else(|| bad(format!("metadata field {k} is missing")));
        let format = field("format")?;
        if format != FORMAT {
            return Err(bad(format!("format is {format:?}, expected {FORMAT:?}")));
        }
        let version = field("version")?;
        if version != &VERSION.to_string() {
            return Err(bad(format!("version {version} is not supported (this build reads {VERSION})")));
        }
        let mut a = Artifact::new(field("method")?);
        if let Some(m) = method {
            a.expect_method(m)?;
        }
        for (k, v) in &meta {
            if let Some(rest) = k.strip_prefix("config.") {
                a.config.insert(rest.into(), v.clone());
            } else if !["format", "version", "method", "checksum"].contains(&k.as_str()) {
                return Err(bad(format!("unknown metadata field {k}")));
            }
        }
        for (name, view) in st.tensors() {
            let elem = match view.dtype() {
                Dtype::F32 => ElemType::F32,
                Dtype::U32 => ElemType::U32,
                Dtype::U8 => ElemType::U8,
                d => return Err(bad(format!("tensor {name} has unsupported dtype {d:?}"))),
            };
            a.tensors.insert(
                name,
                Tensor { elem, shape: view.shape().to_vec(), data: view.data().to_vec() },
            );
        }
        let sum = field("checksum")?;
        if sum != &a.checksum() {
            return Err(bad("checksum mismatch: the file is corrupt"));
        }
        Ok(a)
    }

    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        std::fs::write(path, self.to_bytes()?)?;
        Ok(())
    }

    pub fn load(path: impl AsRef<Path>, method: Option<&str>) -> Result<Self> {
        Self::from_bytes(&std::fs::read(path)?, method)
    }
}

/// Rebuilds the quantizer an artifact describes, whatever its method.
pub fn quantizer_from_artifact(a: &Artifact) -> Result<Box<dyn Quantizer>> {
    use super::*;
    Ok(match a.method.as_str() {
        turboquant::MSE => Box::new(TurboQuantMse::from_artifact(a)?),
        turboquant::PROD => Box::new(TurboQuantProd::from_artifact(a)?),
        turboquant::RVQ => Box::new(TurboQuantRvq::from_artifact(a)?),
        outlier::METHOD => Box::new(OutlierSplit::from_artifact(a)?),
        kivi::KEYS => Box::new(KiviKeys::from_artifact(a)?),
        kivi::VALUES => Box::new(KiviValues::from_artifact(a)?),
        pq::METHOD => Box::new(ProductQuantizer::from_artifact(a)?),
        qjl::METHOD => Box::new(Qjl::from_artifact(a)?),
        m => return Err(bad(format!("unknown method {m:?}"))),
    })
}

/// Parses an artifact file's bytes and rebuilds its quantizer.
pub fn load_quantizer(bytes: &[u8]) -> Result<Box<dyn Quantizer>> {
    quantizer_from_artifact(&Artifact::from_bytes(bytes, None)?)
}

/// Helpers for the `rotation.*` entries shared by several methods.
pub(crate) fn put_rotation(a: &mut Artifact, prefix: &str, r: &super::Rotation) {
    use super::RotationKind;
    a.set(&format!("{prefix}rotation"), r.kind().name());
    let d = r.dim();
    match r.kind() {
        RotationKind::Hadamard => a.put_f32(&format!("{prefix}rotation.signs"), &[d], r.signs()),
        RotationKind::Dense => a.put_f32(&format!("{prefix}rotation.matrix"), &[d, d], r.matrix()),
    }
}

pub(crate) fn get_rotation(a: &Artifact, prefix: &str, d: usize) -> Result<super::Rotation> {
    use super::{Rotation, RotationKind};
    let kind = RotationKind::from_name(&a.get::<String>(&format!("{prefix}rotation"))?)
        .map_err(|e| bad(e.to_string()))?;
    let r = match kind {
        RotationKind::Hadamard => Rotation::from_signs(d, a.f32s(&format!("{prefix}rotation.signs"), &[d])?),
        RotationKind::Dense => Rotation::from_matrix(d, a.f32s(&format!("{prefix}rotation.matrix"), &[d, d])?),
    };
    r.map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::gaussian;
    use crate::quant::*;
    use safetensors::tensor::TensorView;
    use std::collections::HashMap;

    fn dtype(e: ElemType) -> Dtype {
        match e {
            ElemType::F32 => Dtype::F32,
            ElemType::U32 => Dtype::U32,
            ElemType::U8 => Dtype::U8,
        }
    }

    fn all() -> Vec<Box<dyn Quantizer>> {
        let d = 64;
        let calib = gaussian(300, d, 1);
        vec![
            Box::new(TurboQuantMse::new(d, 3, RotationKind::Hadamard, 1).unwrap()),
            Box::new(TurboQuantMse::new(80, 2, RotationKind::Dense, 1).unwrap()),
            Box::new(TurboQuantProd::new(d, 2, RotationKind::Hadamard, 2).unwrap()),
            Box::new(TurboQuantProd::with_sketch(d, 1, RotationKind::Hadamard, 2, false).unwrap()),
            Box::new(TurboQuantRvq::new(d, 2, 1, RotationKind::Hadamard, 3).unwrap()),
            Box::new(OutlierSplit::calibrate(&calib, d, 16, 3, 2, RotationKind::Hadamard, 4).unwrap()),
            Box::new(Qjl::new(d, 96, true, 5).unwrap()),
            Box::new(ProductQuantizer::train(&calib, d, PqConfig { max_iters: 3, ..PqConfig::keys(4, 6) }).unwrap().0),
            Box::new(KiviKeys::new(d, 2, 32).unwrap()),
            Box::new(KiviValues::new(d, 4, 32).unwrap()),
        ]
    }

    #[test]
    fn round_trip_is_bit_identical() {
        let dir = std::env::temp_dir().join(format!("vq-artifact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for q in all() {
            let a = q.to_artifact();
            let bytes = a.to_bytes().unwrap();
            let path = dir.join(format!("{}.safetensors", q.method()));
            a.save(&path).unwrap();
            let back = Artifact::load(&path, Some(q.method())).unwrap();
            assert_eq!(back, a, "{}", q.method());
            assert_eq!(back.to_bytes().unwrap(), bytes, "{}", q.method());
            let q2 = load_quantizer(&bytes).unwrap();
            assert_eq!(q2.method(), q.method());
            assert_eq!(q2.to_artifact(), a);
            let xs = &gaussian(50, q.dim(), 9);
            let (e1, e2) = (q.encode(xs).unwrap(), q2.encode(xs).unwrap());
            assert_eq!(e1, e2, "{}", q.method());
            let (y1, y2) = (q.decode(&e1).unwrap(), q2.decode(&e2).unwrap());
            assert_eq!(
                y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_or_corrupt_files_are_errors() {
        for q in all() {
            let bytes = q.to_artifact().to_bytes().unwrap();
            let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            for cut in [0, 4, 8, header / 2, header, bytes.len() - 1] {
                if cut >= bytes.len() {
                    continue;
                }
                let e = load_quantizer(&bytes[..cut]).err().unwrap();
                assert!(matches!(e, QuantError::Artifact(_)), "cut {cut}: {e}");
            }
            // Every single-byte change in the header, and a spread of them in
            // the data, is caught (by the parser, the metadata checks or the
            // checksum).
            let data_step = ((bytes.len() - header) / 64).max(1);
            for i in (0..header).chain((header..bytes.len()).step_by(data_step)) {
                let mut b = bytes.clone();
                b[i] ^= 0x01;
                assert!(load_quantizer(&b).is_err(), "{}: flip at {i} accepted", q.method());
            }
        }
    }

    #[test]
    fn wrong_version_format_or_method() {
        let q = TurboQuantMse::new(64, 2, RotationKind::Hadamard, 1).unwrap();
        let a = q.to_artifact();
        let rewrite = |key: &str, value: &str| {
            let mut meta = HashMap::new();
            meta.insert("format".to_string(), FORMAT.to_string());
            meta.insert("version".to_string(), VERSION.to_string());
            meta.insert("method".to_string(), a.method.clone());
            meta.insert("checksum".to_string(), a.checksum());
            for (k, v) in &a.config {
                meta.insert(format!("config.{k}"), v.clone());
            }
            meta.insert(key.to_string(), value.to_string());
            let views: Vec<(String, TensorView<'_>)> = a
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), TensorView::new(dtype(t.elem), t.shape.clone(), &t.data).unwrap()))
                .collect();
            safetensors::serialize(views, Some(meta)).unwrap()
        };
        let e = Artifact::from_bytes(&rewrite("version", "2"), None).unwrap_err().to_string();
        assert!(e.contains("version 2 is not supported"), "{e}");
        let e = Artifact::from_bytes(&rewrite("format", "other"), None).unwrap_err().to_string();
        assert!(e.contains("format"), "{e}");
        // A method name changed without updating the checksum.
        let e = load_quantizer(&rewrite("method", "turboquant-prod")).err().unwrap().to_string();
        assert!(e.contains("checksum"), "{e}");
        // A valid file for another method.
        let bytes = a.to_bytes().unwrap();
        let e = Artifact::from_bytes(&bytes, Some("pq")).unwrap_err().to_string();
        assert_eq!(e, "artifact: method is turboquant-mse, expected pq");
        assert!(ProductQuantizer::from_artifact(&a).is_err());
        // Consistent file, inconsistent content: a codebook of the wrong size.
        let mut bad = a.clone();
        bad.put_f32("codebook", &[3], &[0.0, 1.0, 2.0]);
        let e = load_quantizer(&bad.to_bytes().unwrap()).err().unwrap().to_string();
        assert!(e.contains("codebook"), "{e}");
        let mut bad = a.clone();
        bad.put_f32("codebook", &[4], &[0.0, 1.0, 0.5, 2.0]);
        assert!(load_quantizer(&bad.to_bytes().unwrap()).is_err());
        let mut bad = a.clone();
        bad.set("bits", 5);
        let e = load_quantizer(&bad.to_bytes().unwrap()).err().unwrap().to_string();
        assert!(e.starts_with("bits: 5"), "{e}");
        assert!(matches!(Artifact::load("/nonexistent/x.safetensors", None), Err(QuantError::Io(_))));
    }
}
