//! Writing safetensors files with a deterministic header.
//!
//! `safetensors::serialize` takes its metadata as a `HashMap`, so the same
//! content can give different bytes from run to run. Files written here list
//! metadata in sorted order and tensors in the order given, so that a round
//! trip is bit-identical; the `safetensors` crate reads them.

use std::collections::BTreeMap;

/// One tensor: name, safetensors dtype name ("F32", "U8", "F16", ...), shape, bytes.
pub(crate) struct TensorBytes<'a> {
    pub name: &'a str,
    pub dtype: &'static str,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

pub(crate) fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The bytes of a safetensors file holding `meta` and `tensors`.
pub(crate) fn write(meta: &BTreeMap<String, String>, tensors: &[TensorBytes<'_>]) -> Vec<u8> {
    let mut h = String::from("{\"__metadata__\":{");
    let fields: Vec<String> = meta.iter().map(|(k, v)| format!("{}:{}", json_str(k), json_str(v))).collect();
    h.push_str(&fields.join(","));
    h.push('}');
    let mut offset = 0usize;
    for t in tensors {
        let shape: Vec<String> = t.shape.iter().map(|s| s.to_string()).collect();
        h.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            json_str(t.name),
            t.dtype,
            shape.join(","),
            offset,
            offset + t.data.len()
        ));
        offset += t.data.len();
    }
    h.push('}');
    // Pad the header with spaces to a multiple of 8, as safetensors does.
    while h.len() % 8 != 0 {
        h.push(' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend((h.len() as u64).to_le_bytes());
    out.extend(h.as_bytes());
    for t in tensors {
        out.extend(t.data);
    }
    out
}
