//! KIVI (Liu et al., ICML 2024) baseline: asymmetric min/max quantization.
//!
//! - [`KiviKeys`]: per channel over groups of `G` consecutive tokens (rows);
//!   a last group of fewer than `G` rows gets its own scales. Each
//!   (group, channel) stores `scale = (max − min)/(2^b − 1)` and
//!   `zero = min`.
//! - [`KiviValues`]: per token over groups of `G` consecutive channels
//!   (`G` divides `dim`; `G = dim` is one group per token).
//!
//! Scale and zero are rounded to float16 first and the codes
//! `round((x − zero)/scale)` (clamped to `[0, 2^b − 1]`, 0 when the group is
//! constant) are computed with the rounded values, so decode
//! `zero + scale · code` sees exactly what is stored. Codes are packed along
//! each token row. The window of recent tokens that KIVI keeps in float16 is
//! the cache's job; these are the group quantizers it uses.

use super::*;
use half::f16;

pub const KEYS: &str = "kivi-keys";
pub const VALUES: &str = "kivi-values";

fn check(method: &'static str, dim: usize, bits: u32, group: usize) -> Result<()> {
    if ![1, 2, 3, 4, 8].contains(&bits) {
        return Err(QuantError::UnsupportedBits { method, bits, supported: "1, 2, 3, 4, 8" });
    }
    if dim == 0 {
        return Err(QuantError::UnsupportedDim { method, dim, reason: "must be positive".into() });
    }
    if group == 0 {
        return Err(QuantError::arg("group", "must be positive"));
    }
    Ok(())
}

/// f16 (scale, zero) for values in `[lo, hi]`.
fn params(lo: f32, hi: f32, bits: u32, row: usize) -> Result<(f16, f16)> {
    let levels = ((1u32 << bits) - 1) as f32;
    Ok((to_f16("scale", row, (hi - lo) / levels)?, to_f16("zero", row, lo)?))
}

#[inline]
fn code(x: f32, scale: f32, zero: f32, bits: u32) -> u8 {
    if scale <= 0.0 {
        return 0;
    }
    ((x - zero) / scale).round().clamp(0.0, ((1u32 << bits) - 1) as f32) as u8
}

#[derive(Clone, Debug)]
pub struct KiviKeys {
    dim: usize,
    bits: u32,
    group: usize,
}

impl KiviKeys {
    pub fn new(dim: usize, bits: u32, group_tokens: usize) -> Result<Self> {
        check(KEYS, dim, bits, group_tokens)?;
        Ok(KiviKeys { dim, bits, group: group_tokens })
    }

    pub fn from_artifact(a: &Artifact) -> Result<Self> {
        a.expect_method(KEYS)?;
        Self::new(a.get("dim")?, a.get("bits")?, a.get("group")?)
    }
}

impl Quantizer for KiviKeys {
    fn method(&self) -> &'static str {
        KEYS
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn encode(&self, x: &[f32]) -> Result<Encoded> {
        let (d, b) = (self.dim, self.bits);
        let n = check_rows(x, d)?;
        let groups = n.div_ceil(self.group);
        let mut scales = Vec::with_capacity(groups * d);
        let mut zeros = Vec::with_capacity(groups * d);
        let mut codes = vec![0u8; n * d];
        for g in 0..groups {
            let (r0, r1) = (g * self.group, ((g + 1) * self.group).min(n));
            for j in 0..d {
                let col = (r0..r1).map(|r| x[r * d + j]);
                let lo = col.clone().fold(f32::INFINITY, f32::min);
                let hi = col.fold(f32::NEG_INFINITY, f32::max);
                let (s, z) = params(lo, hi, b, g)?;
                for r in r0..r1 {
                    codes[r * d + j] = code(x[r * d + j], s.to_f32(), z.to_f32(), b);
                }
                scales.push(s);
                zeros.push(z);
            }
        }
        let mut e = Encoded::new(KEYS, n, d);
        e.push("codes", pack(&codes, n, d, b));
        e.push("scales", f16_bytes(&scales));
        e.push("zeros", f16_bytes(&zeros));
        Ok(e)
    }

    fn decode(&self, enc: &Encoded) -> Result<Vec<f32>> {
        enc.check(KEYS, self.dim)?;
        let (n, d, b) = (enc.rows, self.dim, self.bits);
        let groups = n.div_ceil(self.group);
        let codes = unpack(enc.buffer("codes", packed_bytes(n, d, b))?, n, d, b);
        let scales = f16_from_bytes(enc.buffer("scales", groups * d * 2)?);
        let zeros = f16_from_bytes(enc.buffer("zeros", groups * d * 2)?);
        Ok((0..n * d)
            .map(|i| {
                let p = (i / d / self.group) * d + i % d;
                zeros[p] + scales[p] * codes[i] as f32
            })
            .collect())
    }

    fn shared_bytes(&self) -> usize {
        0
    }

    fn to_artifact(&self) -> Artifact {
        let mut a = Artifact::new(KEYS);
        a.set("dim", self.dim);
        a.set("bits", self.bits);
        a.set("group", self.group);
        a
    }
}

#[derive(Clone, Debug)]
pub struct KiviValues {
    dim: usize,
    bits: u32,
    group: usize,
}

impl KiviValues {
    pub fn new(dim: usize, bits: u32, group_channels: usize) -> Result<Self> {
        check(VALUES, dim, bits, group_channels)?;
        if dim % group_channels != 0 {
            return Err(QuantError::arg("group", format!("{group_channels} does not divide dim {dim}")));
        }
        Ok(KiviValues { dim, bits, group: group_channels })
    }

    pub fn from_artifact(a: &Artifact) -> Result<Self> {
        a.expect_method(VALUES)?;
        Self::new(a.get("dim")?, a.get("bits")?, a.get("group")?)
    }
}

impl Quantizer for KiviValues {
    fn method(&self) -> &'static str {
        VALUES
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn encode(&self, x: &[f32]) -> Result<Encoded> {
        let (d, b) = (self.dim, self.bits);
        let n = check_rows(x, d)?;
        let mut scales = Vec::with_capacity(x.len() / self.group);
        let mut zeros = Vec::with_capacity(x.len() / self.group);
        let mut codes = vec![0u8; n * d];
        for (gi, (grp, out)) in x.chunks(self.group).zip(codes.chunks_mut(self.group)).enumerate() {
            let lo = grp.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (s, z) = params(lo, hi, b, gi * self.group / d)?;
            for (o, &v) in out.iter_mut().zip(grp) {
                *o = code(v, s.to_f32(), z.to_f32(), b);
            }
            scales.push(s);
            zeros.push(z);
        }
        let mut e = Encoded::new(VALUES, n, d);
        e.push("codes", pack(&codes, n, d, b));
        e.push("scales", f16_bytes(&scales));
        e.push("zeros", f16_bytes(&zeros));
        Ok(e)
    }

    fn decode(&self, enc: &Encoded) -> Result<Vec<f32>> {
        enc.check(VALUES, self.dim)?;
        let (n, d, b) = (enc.rows, self.dim, self.bits);
        let ng = n * d / self.group;
        let codes = unpack(enc.buffer("codes", packed_bytes(n, d, b))?, n, d, b);
        let scales = f16_from_bytes(enc.buffer("scales", ng * 2)?);
        let zeros = f16_from_bytes(enc.buffer("zeros", ng * 2)?);
        Ok(codes
            .iter()
            .enumerate()
            .map(|(i, &c)| zeros[i / self.group] + scales[i / self.group] * c as f32)
            .collect())
    }

    fn shared_bytes(&self) -> usize {
        0
    }

    fn to_artifact(&self) -> Artifact {
        let mut a = Artifact::new(VALUES);
        a.set("dim", self.dim);
        a.set("bits", self.bits);
        a.set("group", self.group);
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::gaussian;

    #[test]
    fn error_within_half_step_and_exact_bytes() {
        let d = 64;
        let n = 70; // two full groups of 32 and one of 6
        let x = gaussian(n, d, 3);
        for b in [2u32, 4, 8] {
            let k = KiviKeys::new(d, b, 32).unwrap();
            let e = k.encode(&x).unwrap();
            let y = k.decode(&e).unwrap();
            let scales = f16_from_bytes(e.buffer("scales", 3 * d * 2).unwrap());
            for i in 0..n * d {
                let s = scales[(i / d / 32) * d + i % d];
                // Half a step, plus the f16 rounding of min and scale.
                assert!((x[i] - y[i]).abs() <= 0.5 * s + 4e-3 * (1 << b) as f32 * s + 2e-3, "b={b} i={i}");
            }
            // codes + (scale, zero) in f16 per 32 tokens per channel (3
            // groups for 70 rows).
            assert_eq!(e.stored_bytes(), n * d * b as usize / 8 + 3 * d * 4);
            let bpe = k.bits_per_element(&KiviKeys::new(d, b, 32).unwrap().encode(&x[..64 * d]).unwrap(), 1);
            assert!((bpe - (b as f64 + 32.0 / 32.0)).abs() < 1e-12, "{bpe}");

            let v = KiviValues::new(d, b, 32).unwrap();
            let e = v.encode(&x).unwrap();
            let y = v.decode(&e).unwrap();
            let scales = f16_from_bytes(e.buffer("scales", n * 2 * 2).unwrap());
            for i in 0..n * d {
                let s = scales[i / 32];
                assert!((x[i] - y[i]).abs() <= 0.5 * s + 4e-3 * (1 << b) as f32 * s + 2e-3, "b={b} i={i}");
            }
            assert!((v.bits_per_element(&e, 1) - (b as f64 + 1.0)).abs() < 1e-12);
        }
    }

    #[test]
    fn keys_per_channel_beat_per_token_on_outlier_channels() {
        // KIVI's observation: keys have outlier channels, so grouping along
        // tokens (per channel) is far more accurate than per token.
        let d = 64;
        let mut x = gaussian(256, d, 5);
        for row in x.chunks_mut(d) {
            row[3] = row[3] * 0.1 + 20.0;
            row[40] = row[40] * 0.1 - 15.0;
        }
        let k = KiviKeys::new(d, 2, 32).unwrap();
        let v = KiviValues::new(d, 2, d / 2).unwrap();
        let ek = crate::quant::testutil::mse(&x, &k.decode(&k.encode(&x).unwrap()).unwrap(), d);
        let ev = crate::quant::testutil::mse(&x, &v.decode(&v.encode(&x).unwrap()).unwrap(), d);
        assert!(ek * 3.0 < ev, "per-channel {ek} vs per-token {ev}");
    }

    #[test]
    fn constant_groups_zero_rows_and_errors() {
        let d = 8;
        let x = vec![0.0f32; 5 * d];
        for q in [&KiviKeys::new(d, 2, 4).unwrap() as &dyn Quantizer, &KiviValues::new(d, 2, 4).unwrap()] {
            assert_eq!(q.decode(&q.encode(&x).unwrap()).unwrap(), x);
            let c = vec![3.25f32; 2 * d];
            assert_eq!(q.decode(&q.encode(&c).unwrap()).unwrap(), c);
            let mut bad = x.clone();
            bad[7] = f32::NAN;
            assert!(q.encode(&bad).is_err());
            assert!(q.encode(&[1e6; 8]).is_err());
        }
        assert_eq!(
            KiviKeys::new(d, 5, 4).unwrap_err().to_string(),
            "bits: 5 is not supported by kivi-keys (1, 2, 3, 4, 8)"
        );
        assert!(KiviKeys::new(d, 2, 0).is_err());
        assert!(KiviValues::new(d, 2, 3).is_err());
    }
}
