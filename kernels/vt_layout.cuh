// V^T for the fp8 per-token variant: the layout the e4m3 P V reads, shared by the pre-pass that
// writes it (transpose_v.cu) and the Hopper kernel that loads it (mla_prefill_sm90.cu).
//
// The e4m3 wgmma takes its B operand K-major, so P V needs V^T: keys contiguous. The pre-pass
// writes, once per call, vt[H][128 values][cols] (e4m3 bytes) from v[Tk, H, 128]:
//   * Sequence b's keys occupy columns [vt_col0(kv_begin[b], b), + Sk) (kv_begin = cache_row_offsets);
//     vt_col0 is a multiple of kVtAlign and the regions of consecutive sequences never overlap
//     (cache_row_offsets is non-decreasing); columns between regions are zeros.
//     cols = vt_cols(Tk, B) (a multiple of 16, as a TMA row pitch must be).
//   * The kernel starts each key tile at a multiple of kVtAlign keys of its sequence, so a tile's
//     first column is 16-byte aligned (TMA's innermost coordinate must be) and the key order below
//     is the same relative to every tile.
//   * Key order inside each aligned group of 16 columns (why: sm90/fp8.cuh, pack_p_e4m3): an e4m3 A
//     fragment holds k positions 4t .. 4t + 3 of a row in one register, while S = Q K^T leaves a
//     thread keys {2t, 2t + 1, 2t + 8, 2t + 9} of each 16; so column 4t + m of a group holds key
//         sigma(4t + m) = 2t + (m & 1) + 8 (m >> 1)
//     and the P registers pair with their own keys' values without any lane shuffle.
#pragma once
#include "common.cuh"

namespace mla {

constexpr int kVtAlign = 16;  // keys per aligned group: tile starts, region starts, the sigma order

// First column of sequence b's region (kv_begin: its first key's row in v).
__device__ __host__ __forceinline__ i64 vt_col0(u32 kv_begin, int b) {
  return ((static_cast<i64>(kv_begin) + kVtAlign - 1) / kVtAlign + b) * kVtAlign;
}

// Key (relative to its group) stored at column p (0..15) of a group.
__device__ __forceinline__ int vt_sigma(int p) { return 2 * ((p >> 2) & 3) + (p & 1) + 8 * ((p >> 1) & 1); }

// 4 x 4 byte transpose: out[e] = byte e of in[0], in[1], in[2], in[3] (in that byte order).
__device__ __forceinline__ void transpose4x4_bytes(const u32 (&in)[4], u32 (&out)[4]) {
  const u32 lo01 = __byte_perm(in[0], in[1], 0x5140), hi01 = __byte_perm(in[0], in[1], 0x7362);
  const u32 lo23 = __byte_perm(in[2], in[3], 0x5140), hi23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

}  // namespace mla
