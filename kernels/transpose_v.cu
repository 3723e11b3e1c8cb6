// The fp8 per-token variant's pre-pass: v[Tk, H, 128] (e4m3 bytes) -> vt[H][128][cols] in the layout
// of vt_layout.cuh (per-sequence regions of aligned columns, the sigma key order in each group of
// 16, zeros elsewhere). A bandwidth-bound copy: every byte of v read once, every byte of vt written
// once.
//
// Grid (cols / kVtColsPerCta, H), kVtThreads threads. Warp w of a CTA writes two 16-column groups;
// lane l covers values 4l .. 4l + 3: for each key it loads one 4-byte word (the warp reads a key's
// 128 values as one 128-byte line) and, after a 4x4 byte transpose per quad of keys, stores 16
// columns of each of its 4 values as one 16-byte word.
#include "common.cuh"
#include "vt_layout.cuh"

namespace mla {

constexpr int kVtThreads = 128;
constexpr int kVtGroupsPerWarp = 2;
constexpr int kVtColsPerCta = (kVtThreads / 32) * kVtGroupsPerWarp * kVtAlign;  // 128

// The sequence whose region may hold column `col` (the last b with vt_col0 <= col), by bisection.
__device__ __forceinline__ int vt_sequence_of(i64 col, const u32* __restrict__ kv_begin, int batch) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (vt_col0(kv_begin[mid], mid) <= col) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kVtThreads) transpose_v_e4m3_kernel(
    const unsigned char* __restrict__ v, i64 v_st, i64 v_sh, const u32* __restrict__ kv_begin,
    const u32* __restrict__ kv_end, int batch, unsigned char* __restrict__ vt, i64 cols) {
  const int h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned char* vh = v + h * v_sh + 4 * lane;
#pragma unroll
  for (int g = 0; g < kVtGroupsPerWarp; ++g) {
    const i64 col = static_cast<i64>(blockIdx.x) * kVtColsPerCta + (warp * kVtGroupsPerWarp + g) * kVtAlign;
    if (col >= cols) return;
    const int b = vt_sequence_of(col, kv_begin, batch);
    const i64 j0 = col - vt_col0(kv_begin[b], b);          // the group's first key in sequence b
    const i64 sk = static_cast<i64>(kv_end[b]) - kv_begin[b];
    u32 w[kVtAlign];                                        // w[key]: values 4l .. 4l + 3 of the key
#pragma unroll
    for (int q = 0; q < kVtAlign; ++q) {
      const i64 j = j0 + q;
      w[q] = j >= 0 && j < sk ? *reinterpret_cast<const u32*>(vh + (kv_begin[b] + j) * v_st) : 0u;
    }
    u32 out[4][4];  // out[e][t]: value 4l + e, columns 4t .. 4t + 3 = keys sigma(4t + m)
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const u32 keys[4] = {w[2 * t], w[2 * t + 1], w[2 * t + 8], w[2 * t + 9]};
      u32 tr[4];
      transpose4x4_bytes(keys, tr);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e][t] = tr[e];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      *reinterpret_cast<uint4*>(vt + (static_cast<i64>(h) * 128 + 4 * lane + e) * cols + col) =
          make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]);
  }
}

}  // namespace mla
