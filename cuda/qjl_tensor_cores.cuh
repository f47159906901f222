// qjl_encode on the tensor cores, for float16 keys (D a multiple of 16 up to
// 128; m a multiple of 16 from 64 to 256). Placed after mma_common.cuh.
//
// The projections S k are mma.sync products of the float16 keys and the
// split sketch (mma_common.cuh); the power-of-two scale of each sketch row
// changes no sign, so it is never undone. The sums run in the tensor cores'
// order, not crate::cpu's: a sign may differ from the CPU kernel's only where
// (S k)_r lies within float32 rounding of zero (the parity rule's near-ties). The norms keep crate::cpu's in-order float32 sum.
//
// A block of 2m threads (m/16 warps) holds the whole split sketch in
// registers as mma B fragments: warp w owns sketch rows 16w..16w+15. The
// block then walks tiles of 64 keys (grid-stride): the tile sits in
// shared memory as float16 rows padded so that fragment reads hit 32 banks,
// the next tile is loaded into registers while this one is multiplied, and
// the sign bytes gather in a shared tile that leaves as one contiguous block.

template <int D, int M>
__device__ void qjl_encode_tensor_cores(const __half* k, const float* sketch, uint8_t* signs, __half* norms,
                                        uint32_t n) {
  static_assert(D % 16 == 0 && D <= 128 && M % 16 == 0 && M >= 64 && M <= 256, "tensor-core shape");
  constexpr int ROWS = 64;            // keys per tile
  constexpr int KS = D / 16;          // k-steps of an mma
  constexpr int THREADS = 2 * M;      // M / 16 warps of 32
  constexpr int NBYTES = M / 8;       // sign bytes per key
  constexpr int PITCH = D + 8;        // float16 per staged row: row r starts at bank 4r (mod 32)
  __shared__ __align__(16) __half xs[ROWS * PITCH];
  __shared__ __align__(16) uint8_t sg[ROWS * NBYTES];
  const uint32_t tid = threadIdx.x;
  const uint32_t warp = tid / 32;
  const uint32_t g = (tid % 32) / 4;  // fragment row group
  const uint32_t q = tid % 4;         // lane in the group

  // B fragments: column g of n-tile nt is sketch row 16 warp + 8 nt + g; a
  // register pair holds its entries ks*16 + 2q (+1) and ks*16 + 8 + 2q (+1).
  uint32_t bh[2][KS][2];
  uint32_t bl[2][KS][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float* row = sketch + uint64_t(16 * warp + 8 * nt + g) * D;
    vq_split_b<KS>([&](int j) { return row[j]; }, bh[nt], bl[nt]);
  }

  const uint32_t tiles = (n + ROWS - 1) / ROWS;
  const bool wide = vq_aligned(k, 16);
  VqRowTile<D, ROWS, THREADS> rows_in;

  if (blockIdx.x < tiles) {
    rows_in.fetch(k, blockIdx.x, n, wide, tid);
    rows_in.template stage<PITCH>(xs, tid);
  }
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    __syncthreads();  // xs holds this tile; sg is free
    if (tile + gridDim.x < tiles) {
      rows_in.fetch(k, tile + gridDim.x, n, wide, tid);
    }
#pragma unroll 1
    for (int mt = 0; mt < ROWS / 16; ++mt) {
      float acc[2][4] = {};
      const __half* a_row = xs + (mt * 16 + g) * PITCH + 2 * q;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[4];
        a[0] = *reinterpret_cast<const uint32_t*>(a_row + ks * 16);
        a[1] = *reinterpret_cast<const uint32_t*>(a_row + 8 * PITCH + ks * 16);
        a[2] = *reinterpret_cast<const uint32_t*>(a_row + ks * 16 + 8);
        a[3] = *reinterpret_cast<const uint32_t*>(a_row + 8 * PITCH + ks * 16 + 8);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          vq_mma_split(acc[nt], a, bh[nt][ks], bl[nt][ks]);
        }
      }
      // Bits 2q, 2q + 1 of byte (2 warp + nt) for rows g and g + 8; the
      // group's four lanes OR them into whole bytes.
      uint32_t bytes[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          uint32_t v = ((acc[nt][2 * half_row] >= 0.0f ? 1u : 0u) | (acc[nt][2 * half_row + 1] >= 0.0f ? 2u : 0u)) << (2 * q);
          v |= __shfl_xor_sync(0xffffffffu, v, 1);
          v |= __shfl_xor_sync(0xffffffffu, v, 2);
          bytes[nt][half_row] = v;
        }
      }
      if (q < 2) {
        const uint32_t r = mt * 16 + g + 8 * q;
        *reinterpret_cast<uint16_t*>(&sg[r * NBYTES + 2 * warp]) = uint16_t(bytes[0][q] | (bytes[1][q] << 8));
      }
    }
    // Norms: thread r sums key r's squares in order, 8 elements per read.
    const uint32_t key = tile * ROWS + tid;
    if (tid < ROWS && key < n) {
      float sum = 0.0f;
#pragma unroll 4
      for (int c = 0; c < D / 8; ++c) {
        float v[8];
        vq_load8(&xs[tid * PITCH + c * 8], v);
#pragma unroll
        for (int y = 0; y < 8; ++y) sum = __fadd_rn(sum, __fmul_rn(v[y], v[y]));
      }
      norms[key] = __float2half_rn(__fsqrt_rn(sum));
    }
    __syncthreads();  // sg complete; xs read by every warp
    // The tile's sign rows are contiguous in the output.
    const uint32_t rows = min(uint32_t(ROWS), n - tile * ROWS);
    vq_copy_tile_rows<ROWS, NBYTES>(sg, signs + uint64_t(tile) * ROWS * NBYTES, rows, tid, THREADS);
    if (tile + gridDim.x < tiles) {
      rows_in.template stage<PITCH>(xs, tid);
    }
  }
}
