// Writing V^T (vt_layout.cuh) a tile of columns at a time: the walk shared by the pre-pass
// (transpose_v.cu: e4m3 bytes of v in) and V's quantizer (quantize.cu: 16- or 32-bit values in,
// their e4m3 bytes written on the way). Every byte of vt is written once and every key of every
// sequence loaded once (columns in the gaps between regions load nothing and are zeros), both as
// whole 128-byte lines.
//
// A CTA of kVtThreads makes kVtCols = 128 columns of one head (8 groups of 16 keys), through shared
// memory:
//   1. warp w takes groups 2w and 2w + 1; lane (c = lane % 8, t = lane / 8) loads values
//      16c .. 16c + 15 of the group's keys 2t, 2t + 1, 2t + 8, 2t + 9 (the 16 e4m3 bytes that
//      load(row, c) returns for the key at row `row` of v: 8 lanes load one key's 128 values),
//      transposes 4 x 4 bytes in registers and stores, for each of its 16 values, the 4 bytes of
//      columns 4t .. 4t + 3 (keys in the sigma order) into the tile;
//   2. the 128 x 128-byte tile is written out row by row (8 lanes per 128-byte row).
#pragma once
#include "common.cuh"
#include "vt_layout.cuh"

namespace mla {

constexpr int kVtThreads = 128;
constexpr int kVtCols = 128;                    // columns (keys) per CTA
constexpr int kVtGroups = kVtCols / kVtAlign;   // 8
constexpr int kVtPitch = kVtCols + 16;          // shared tile row pitch in bytes (16-byte aligned rows)

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

// Columns c0 .. c0 + kVtCols - 1 (those below `cols`) of head h of vt[H][128][cols], for `batch`
// >= 1 sequences of key rows [kv_begin[b], kv_end[b]). `load(row, c)` gives the e4m3 bytes of
// values 16c .. 16c + 15 of head h of the key at row `row` (i64) of v, as a uint4.
template <typename Load>
__device__ __forceinline__ void write_vt_tile(const Load& load, const u32* __restrict__ kv_begin,
                                              const u32* __restrict__ kv_end, int batch,
                                              unsigned char* __restrict__ vt, i64 cols, int h, i64 c0) {
  __shared__ __align__(16) unsigned char tile[128 * kVtPitch];  // [value][column]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = lane % 8, t = lane / 8;
#pragma unroll
  for (int gi = 0; gi < kVtGroups / 4; ++gi) {
    const int g = warp * (kVtGroups / 4) + gi;
    const i64 col = c0 + g * kVtAlign;
    if (col >= cols) break;
    const int b = vt_sequence_of(col, kv_begin, batch);
    const i64 j0 = col - vt_col0(kv_begin[b], b);  // the group's first key in sequence b (< 0: a gap)
    const i64 sk = static_cast<i64>(kv_end[b]) - kv_begin[b];
    uint4 key[4];                                  // keys sigma(4t + m), values 16c .. 16c + 15
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const i64 j = j0 + 2 * t + (m & 1) + 8 * (m >> 1);
      key[m] = j >= 0 && j < sk ? load(static_cast<i64>(kv_begin[b]) + j, c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // values 16c + 4q .. 16c + 4q + 3
      const u32 in[4] = {(&key[0].x)[q], (&key[1].x)[q], (&key[2].x)[q], (&key[3].x)[q]};
      u32 out[4];
      transpose4x4_bytes(in, out);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        *reinterpret_cast<u32*>(tile + (16 * c + 4 * q + e) * kVtPitch + g * kVtAlign + 4 * t) = out[e];
    }
  }
  __syncthreads();
  // 128 rows x 8 chunks of 16 bytes; a warp writes 4 whole rows per instruction.
#pragma unroll
  for (int i = threadIdx.x; i < 128 * kVtGroups; i += kVtThreads) {
    const int row = i / kVtGroups, chunk = i % kVtGroups;
    const i64 col = c0 + chunk * kVtAlign;
    if (col < cols)
      *reinterpret_cast<uint4*>(vt + (static_cast<i64>(h) * 128 + row) * cols + col) =
          *reinterpret_cast<const uint4*>(tile + row * kVtPitch + chunk * kVtAlign);
  }
}

}  // namespace mla
