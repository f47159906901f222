// scalar_quantize: x T [N, D], codebook float [2^B_BITS] (sorted) -> packed
// uint8 [N, nbytes], bit_pack's layout. sizes = {N, D, nbytes}; template T,
// B_BITS, ITEMS. A work item is a (row, group of 8 codes), as in bit_pack;
// each thread takes ITEMS of them, blockDim apart (each request coalesced),
// and requests all its elements before it computes, so that more bytes are
// in flight and the block's set-up is paid once per 8 * ITEMS codes. The
// code of v is the number of boundaries 0.5 * (c[i] + c[i+1]) strictly below
// v, found by a binary search of B_BITS steps, which the block computes once
// into shared memory. When D is a multiple of 8 a thread reads 8 elements and
// writes B_BITS bytes with one wide access each.
//
// 16-bit inputs at up to 4 bits search two elements at once: b < v holds for
// a 16-bit v exactly when v >= h, h the smallest T value above b, so each
// step is one paired comparison (a 0xFFFF mask per half) of the pair with
// the step's two thresholds, which logic ops select from registers by the
// earlier steps' masks. Float32 inputs and wider codes search each element
// over the boundaries in shared memory.
//
// TABLE (16-bit T; the host sets it for inputs large enough to pay for the
// table): the code of each of T's 65536 bit patterns, built once per block
// into 64 KB of dynamic shared memory by the same search, then one byte load
// per element and no search: the block walks chunks of ITEMS * blockDim
// items grid-stride. (The paired search is bound by the integer pipe; the
// loads are not.) The table is built by runs of 64 patterns, a run whose two
// ends have one code taking it throughout (vq_build_pair_code_table, as
// tq_encode's tensor-core path builds its own).
__shared__ float bounds[256];
__shared__ uint32_t pair_bounds[16];
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
constexpr uint32_t K = 1u << B_BITS;
constexpr bool PAIRED = sizeof(T) == 2 && B_BITS <= 4;
// Raw 16-byte words per group of 8 elements.
constexpr int WORDS = sizeof(T) / 2;
const uint32_t groups = (d + 7) / 8;
const uint64_t total = uint64_t(n) * groups;
const uint64_t first = uint64_t(blockIdx.x) * ITEMS * blockDim.x + threadIdx.x;
const bool fast = d % 8 == 0 && vq_aligned(x, 16) && vq_aligned(packed, vq_bytes_align<B_BITS>());
static_assert(!TABLE || sizeof(T) == 2, "a code table is for 16-bit inputs");
// The elements are requested before the block waits for its boundaries, so
// that the two latencies overlap.
uint4 raw[ITEMS][WORDS];
// The wide path's requests: this thread's ITEMS groups from `start`, a block apart.
auto request = [&](uint64_t start) {
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const uint64_t item = start + uint64_t(k) * blockDim.x;
    if (item < total) {
      vq_read_raw8(x + item * 8, raw[k], true);
    }
  }
};
if (fast) {
  request(first);
}
for (uint32_t i = threadIdx.x; i + 1 < K; i += blockDim.x) {
  const float b = __fmul_rn(0.5f, __fadd_rn(codebook[i], codebook[i + 1]));
  bounds[i] = b;
  if constexpr (PAIRED) {
    const uint32_t h = vq_bits_above(static_cast<const T*>(nullptr), b);
    pair_bounds[i] = h | (h << 16);
  }
}
__syncthreads();
// The per-element search walks a shared-window byte address, so that each
// step is a load at a constant offset, a compare and a predicated add.
const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(bounds));
auto code_of = [&](float e) {
  uint32_t at = base;
#pragma unroll
  for (uint32_t step = K / 2; step > 0; step /= 2) {
    float b;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(b) : "r"(at + (step - 1) * 4));
    if (b < e) {
      at += step * 4;
    }
  }
  return (at - base) / 4;
};
if constexpr (TABLE) {
  extern __shared__ __align__(16) uint8_t code_table[];
  const T* tag = nullptr;
  vq_build_pair_code_table<B_BITS>(code_table, [&](uint32_t v) {
    return code_of(vq_word_elem(tag, v, 0)) | (code_of(vq_word_elem(tag, v, 1)) << B_BITS);
  });
  __syncthreads();  // the whole table
  const uint64_t chunk_items = uint64_t(ITEMS) * blockDim.x;
  for (uint64_t chunk = blockIdx.x; chunk * chunk_items < total; chunk += gridDim.x) {
    const uint64_t start = chunk * chunk_items + threadIdx.x;
    if (fast) {
      if (chunk != blockIdx.x) {  // the first chunk's were requested before the boundaries
        request(start);
      }
      vq_store_pair_codes<B_BITS, uint64_t>(packed, raw, start, total, [&](uint32_t v) {
        const uint32_t lo = code_table[v & 0xFFFFu];
        const uint32_t hi = code_table[v >> 16];
        return lo | (hi << B_BITS);
      });
    } else {
      vq_store_codes_by_element<B_BITS, ITEMS>(packed, start, total, d, nbytes, [&](uint64_t i) {
        return uint32_t(code_table[*reinterpret_cast<const uint16_t*>(x + i)]);
      });
    }
  }
  return;
}
if (first >= total) {
  return;
}
if (fast) {
  if constexpr (PAIRED) {
    uint32_t thr[K - 1];
#pragma unroll
    for (uint32_t i = 0; i + 1 < K; ++i) {
      thr[i] = pair_bounds[i];
    }
    vq_store_pair_codes<B_BITS, uint32_t>(packed, raw, first, total, [&](uint32_t v) {
      return vq_pair_code<B_BITS>(static_cast<const T*>(nullptr), v, thr);
    });
  } else {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const uint64_t item = first + uint64_t(k) * blockDim.x;
      if (item < total) {
        float v[8];
        vq_load8(reinterpret_cast<const T*>(raw[k]), v);
        uint64_t word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          word |= uint64_t(code_of(v[j])) << (j * B_BITS);
        }
        vq_store_bytes<B_BITS>(packed + item * B_BITS, word);
      }
    }
  }
  return;
}
vq_store_codes_by_element<B_BITS, ITEMS>(packed, first, total, d, nbytes,
                                          [&](uint64_t i) { return code_of(static_cast<float>(x[i])); });
