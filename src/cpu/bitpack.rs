//! Dense b-bit packing along the last axis.
//!
//! Layout: within a row, code `i` occupies bits `[i*b, i*b + b)` of a
//! little-endian bit stream; byte `j` holds stream bits `[8j, 8j + 8)`, bit 0
//! being its least significant bit. A row of `n` codes takes
//! `ceil(n*b / 8)` bytes; the unused high bits of the last byte are zero.
//! Eight codes always fill exactly `b` bytes, which is how every
//! implementation (CPU, Metal, CUDA, reference graph) walks a row.

/// Bit widths that `bit_pack` / `bit_unpack` accept.
pub const SUPPORTED_BITS: [u32; 5] = [1, 2, 3, 4, 8];

/// Bytes that one row of `n` codes of `bits` bits occupies.
pub fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// Packs `rows` rows of `n` codes (only the low `bits` bits of each code are
/// kept) into `out`, which holds `rows * packed_len(n, bits)` bytes.
pub fn bit_pack(codes: &[u8], rows: usize, n: usize, bits: u32, out: &mut [u8]) {
    let nbytes = packed_len(n, bits);
    assert_eq!(codes.len(), rows * n, "codes length");
    assert_eq!(out.len(), rows * nbytes, "packed length");
    let b = bits as usize;
    let mask = (1u64 << bits) - 1;
    super::for_each_chunk(out, nbytes, 4096, |row0, chunk| {
        for (r, dst) in chunk.chunks_mut(nbytes).enumerate() {
            let src = &codes[(row0 + r) * n..(row0 + r + 1) * n];
            for (g, group) in src.chunks(8).enumerate() {
                let mut word = 0u64;
                for (j, &c) in group.iter().enumerate() {
                    word |= (u64::from(c) & mask) << (j * b);
                }
                let start = g * b;
                let end = (start + b).min(nbytes);
                for (k, byte) in dst[start..end].iter_mut().enumerate() {
                    *byte = (word >> (8 * k)) as u8;
                }
            }
        }
    });
}

/// Reads up to 8 codes of `b` bits from the group's bytes `src` (the bytes
/// that hold them: `b` for a whole group, fewer at the end of a row).
#[inline(always)]
pub(crate) fn get_group(src: &[u8], b: usize, codes: &mut [u8]) {
    let mut word = 0u64;
    for (k, &byte) in src.iter().enumerate() {
        word |= u64::from(byte) << (8 * k);
    }
    let mask = (1u64 << b) - 1;
    for (j, c) in codes.iter_mut().enumerate() {
        *c = ((word >> (j * b)) & mask) as u8;
    }
}

/// Unpacks `rows` rows of `packed_len(n, bits)` bytes into `n` codes each.
pub fn bit_unpack(packed: &[u8], rows: usize, n: usize, bits: u32, out: &mut [u8]) {
    let nbytes = packed_len(n, bits);
    assert_eq!(packed.len(), rows * nbytes, "packed length");
    assert_eq!(out.len(), rows * n, "codes length");
    let b = bits as usize;
    super::for_each_chunk(out, n, 4096, |row0, chunk| {
        for (r, dst) in chunk.chunks_mut(n).enumerate() {
            let src = &packed[(row0 + r) * nbytes..(row0 + r + 1) * nbytes];
            for (g, group) in dst.chunks_mut(8).enumerate() {
                get_group(&src[g * b..(g * b + b).min(nbytes)], b, group);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_bits_are_dense() {
        // 8 codes of 3 bits fill exactly 3 bytes.
        let codes = [1u8, 2, 3, 4, 5, 6, 7, 0];
        let mut out = [0u8; 3];
        bit_pack(&codes, 1, 8, 3, &mut out);
        let word = u32::from(out[0]) | u32::from(out[1]) << 8 | u32::from(out[2]) << 16;
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!((word >> (3 * i)) & 7, u32::from(c));
        }
    }

    #[test]
    fn round_trip_every_width_and_tail() {
        for &bits in &SUPPORTED_BITS {
            for n in [0usize, 1, 5, 8, 13, 64, 100] {
                let rows = 3;
                let codes: Vec<u8> = (0..rows * n)
                    .map(|i| ((i * 7 + 3) % (1 << bits)) as u8)
                    .collect();
                let mut packed = vec![0u8; rows * packed_len(n, bits)];
                bit_pack(&codes, rows, n, bits, &mut packed);
                let mut back = vec![0u8; rows * n];
                bit_unpack(&packed, rows, n, bits, &mut back);
                assert_eq!(codes, back, "bits={bits} n={n}");
                if n * bits as usize % 8 != 0 {
                    let last = packed[packed_len(n, bits) - 1];
                    let used = (n * bits as usize) % 8;
                    assert_eq!(last >> used, 0, "tail bits must be zero");
                }
            }
        }
    }
}

/// Bit planes for `c`-bit codes (product quantization's, up to 12 bits):
/// the (low, high) widths `bit_pack` takes.
pub fn code_planes(c: u32) -> (u32, u32) {
    match c {
        1 | 2 | 3 | 4 | 8 => (c, 0),
        5..=7 => (4, c - 4),
        _ => (8, c - 8),
    }
}
