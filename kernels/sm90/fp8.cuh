// float8_e4m3fn pieces of the Hopper kernel's fp8 per-token variant (sm_90a): the e4m3 wgmma, P
// packed to e4m3 in registers, and the V^T stage clean-up. The e4m3 wgmma needs its B operand
// K-major, so P V reads V^T (keys contiguous), written once per call by a pre-pass
// (transpose_v.cu) in the layout of vt_layout.cuh.
//
// An e4m3 A fragment (k-step of 32 keys) holds, in each 32-bit register, 4 consecutive k positions
// of one row: register 0 row g, k 4t..4t+3; 1 row g+8; 2 row g, k 16+4t..; 3 row g+8 (t = lane % 4).
// The scores of a row come out of S = Q K^T in pairs (keys 2t, 2t+1 of each 8-key n-tile), so the 4
// bytes a thread can pack without shuffles are keys {2t, 2t+1, 8+2t, 9+2t} of a 16-key half. V^T
// stores its keys in that order (vt_layout.cuh: sigma), so the contraction pairs every P value
// with its own key's V row.
#pragma once
#include "../common.cuh"
#include "../e4m3.cuh"
#include "ptx.cuh"
#include "../vt_layout.cuh"
#include "config.cuh"

namespace mla {
namespace sm90 {

// D[64x128] (+)= A[64x32] * B[32x128], e4m3 inputs, f32 accumulate. Both operands K-major.
struct WgmmaE4m3 {
  static __device__ __forceinline__ void ss(float (&d)[16][4], unsigned long long da, unsigned long long db,
                                            int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MLA_D64 ", %64, %65, p, 1, 1;\n}\n"
                 : MLA_ACC16(d)
                 : "l"(da), "l"(db), "r"(accumulate));
  }
  // The same on a 96-key tile (D[64x96]; pipe_probe's Fp8K96, no kernel).
  static __device__ __forceinline__ void ss(float (&d)[12][4], unsigned long long da, unsigned long long db,
                                            int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 " MLA_D48 ", %48, %49, p, 1, 1;\n}\n"
                 : MLA_ACC12(d)
                 : "l"(da), "l"(db), "r"(accumulate));
  }
  // A from registers (see pack_p_e4m3), B from shared memory.
  static __device__ __forceinline__ void rs(float (&d)[16][4], const u32 (&a)[4], unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MLA_D64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : MLA_ACC16(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
  // m64n8k32, A from registers: P times 8 columns of B (kRowSumMma: ones, so every column of d
  // holds the rows' sums of P over the k-steps since the last with accumulate 0).
  static __device__ __forceinline__ void rs_n8(float (&d)[1][4], const u32 (&a)[4], unsigned long long db,
                                               int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  }
};

// P is computed as kPScale * P: probabilities in [0, 1] would leave most of a long row in e4m3's
// subnormal range (below 2^-6, steps of 2^-9); scaled by 256 they stay normal down to 2^-14
// (FlashAttention-3's max offset of 8). The factor costs nothing: the softmax subtracts
// kLog2PScale less from each exponent (softmax.cuh). O and the row sums carry it and are scaled
// back once per work tile. kPScale * P <= 256 stays below e4m3's largest value, 448.
constexpr int kLog2PScale = 8;
constexpr float kPScale = 1 << kLog2PScale;

// kPScale * P of k-step kk (keys 32 kk .. 32 kk + 31, n-tiles 4 kk .. 4 kk + 3 of the S
// accumulator) as the e4m3 A fragment, in the k order of the file comment.
// kBytes: s holds exp_byte carriers (softmax.cuh), their bytes gathered as they are.
template <bool kBytes = false, int kNT>
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[kNT][4], int kk, u32 (&a)[4]) {
  const int j = 4 * kk;
  auto four = [](float x0, float x1, float x2, float x3) {
    if constexpr (kBytes) return exp_bytes4(x0, x1, x2, x3);
    else return e4m3x4(x0, x1, x2, x3);
  };
  a[0] = four(s[j][0], s[j][1], s[j + 1][0], s[j + 1][1]);          // row g, keys 2t, 2t+1, 8+2t, 9+2t
  a[1] = four(s[j][2], s[j][3], s[j + 1][2], s[j + 1][3]);          // row g + 8
  a[2] = four(s[j + 2][0], s[j + 2][1], s[j + 3][0], s[j + 3][1]);  // row g, keys 16 + ...
  a[3] = four(s[j + 2][2], s[j + 2][3], s[j + 3][2], s[j + 3][3]);  // row g + 8, keys 16 + ...
}

// Byte offset of (row, byte) in a tile of 128-byte rows with the 128-byte swizzle (16-byte chunk c
// of row r stored at chunk c ^ (r % 8)), the layout TMA writes and wgmma reads.
__device__ __forceinline__ u32 swizzle128(int row, int byte) {
  return row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}

// Zeroes, in a V^T stage (128 value rows x 128 key columns of e4m3, swizzled, keys in the order of
// vt_layout.cuh), the bytes of keys >= `valid`: a neighbour's keys, zero columns or masked keys, whose
// P is 0 but whose bytes may be NaN (0 * NaN = NaN). Thread `tid` of `nthreads`; the caller makes the
// stores visible to wgmma (fence.proxy.async) and synchronizes.
__device__ __forceinline__ void zero_vt_keys_from(u32 vt, int valid, int tid, int nthreads) {
  const int w0 = (valid / kVtAlign) * (kVtAlign / 4);  // the row's first 4-byte word with a key >= valid
  const int nw = 128 / 4 - w0;
  for (int i = tid; i < 128 * nw; i += nthreads) {
    const int row = i / nw, wi = w0 + i % nw;
    const int key0 = kVtAlign * (wi / 4) + vt_sigma(4 * (wi % 4));  // the word's keys: key0 + {0, 1, 8, 9}
    u32 keep = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m)
      if (key0 + (m & 1) + 8 * (m >> 1) < valid) keep |= 0xffu << (8 * m);
    const u32 addr = vt + swizzle128(row, 4 * wi);
    sts32(addr, keep ? lds32(addr) & keep : 0u);
  }
}

// One key's 64 e4m3 rope values at `src` (16-byte aligned; nullptr: zeros) times `scale`, stored
// as a 128-byte row of T at `dst` (row x of a 128-byte-swizzled tile) with st.shared. The caller
// makes the stores visible to wgmma (fence.proxy.async) before signalling them.
template <typename T>
__device__ __forceinline__ void store_rope_row_e4m3(u32 dst, int x, const unsigned char* src, float scale) {
  uint4 in[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) in[q] = src ? *reinterpret_cast<const uint4*>(src + 16 * q) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int c = 0; c < 8; ++c) {  // output chunk c: 8 values from input bytes 8c .. 8c + 7
    const u32 w0 = c % 2 ? in[c / 2].z : in[c / 2].x, w1 = c % 2 ? in[c / 2].w : in[c / 2].y;
    const float2 a = e4m3x2_to_float2(w0 & 0xffffu, scale), b = e4m3x2_to_float2(w0 >> 16, scale);
    const float2 d = e4m3x2_to_float2(w1 & 0xffffu, scale), e = e4m3x2_to_float2(w1 >> 16, scale);
    sts128(dst + ((c ^ (x & 7)) << 4), Elem<T>::pack(a.x, a.y), Elem<T>::pack(b.x, b.y), Elem<T>::pack(d.x, d.y),
           Elem<T>::pack(e.x, e.y));
  }
}

}  // namespace sm90
}  // namespace mla
