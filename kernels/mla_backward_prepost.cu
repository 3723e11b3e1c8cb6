// The backward's passes around its main kernel (backward.cuh says what the workspace holds):
//   pre_kernel        per query row and head: lse_log2 and D = dout . out (less dlse, the gradient of
//                     lse where the loss reads it: dS = P (dP - D + dlse)) into the workspace, and
//                     the row's dq chunk zeroed (and its semaphore, deterministic mode); and
//                     the words that the Hopper kernel adds into, zeroed: rope_part's one slot
//                     (and the key blocks' semaphores, deterministic mode);
//   dq_kernel         per dq chunk and head: dq = scale * dq_accum, un-permuted from the main
//                     kernel's layout (DqLayout), in q's dtype;
//   rope_kernel       per key row: dk_rope = the sum of the slots of rope_part; and zero
//                     gradients for the rows of k, v and k_rope that no sequence uses.
// All three are bandwidth-bound copies with 16-byte accesses where the layout allows.
#include "backward.cuh"
#include "common.cuh"
#include "params_abi.cuh"

namespace mla {
namespace bwd {

// How a main kernel lays out a chunk's 64 x 192 floats of dq_accum: row-major (the portable
// kernel's atomics), or in the order its two consumer warpgroups hold their 64 x 96 halves in wgmma
// accumulators (the Hopper kernel: float4 (n-tile nt, thread t) of half p at (p * 12 + nt) * 128 + t,
// so that the staging stores and the bulk reduction are contiguous; the post-pass inverts it).
enum DqLayout : int { kDqRowMajor = 0, kDqWgmma = 1 };

// Element (row, col) of a chunk in layout L, as a float index from the chunk's start.
template <int L>
__device__ __forceinline__ int dq_index(int row, int col) {
  if constexpr (L == kDqRowMajor) {
    return row * kDqk + col;
  } else {
    const int part = col / 96, c = col % 96;   // the warpgroup's half, its column
    const int nt = c / 8, t = (c % 8) / 2;     // n-tile, thread of the quad
    const int warp = row / 16, g = row % 8;    // the warp's 16 rows: g and g + 8
    const int e = 2 * ((row % 16) / 8) + (c % 2);
    return ((part * 12 + nt) * 128 + warp * 32 + g * 4 + t) * 4 + e;
  }
}

// ---------------------------------------------------------------------------------------------
// The pre-pass. Grid (query blocks of the longest sequence, or more for the words zeroed,
// sequences, head blocks of kHeads).
// ---------------------------------------------------------------------------------------------
namespace pre {
constexpr int kThreads = 256;
constexpr int kHeads = 8;  // heads per CTA
#define MLA_BWD_PRE_PARAMS(X)                                                                             \
  /* dout, out [Tq, H, 128] (element strides), lse [Tq, H] and, where the loss reads lse, its        */  \
  /* gradient dlse [Tq, H] or null (row strides)                                                      */  \
  X(const void*, dout) X(i64, do_st) X(i64, do_sh) X(const void*, out) X(i64, o_st) X(i64, o_sh)          \
  X(const float*, lse) X(i64, lse_st) X(const float*, dlse) X(i64, dlse_st)                               \
  /* the workspace (backward.cuh) */                                                                      \
  X(float*, lse_log2) X(float*, dpsum) X(float*, dq_accum) X(int*, dq_sem)                                \
  /* zeroed_f4 float4s from rope_part: rope_part's one slot and rope_sem after it (0: none) */            \
  X(float*, rope_part) X(i64, zeroed_f4)                                                                  \
  X(const u32*, q_offsets) X(int, num_heads) X(int, batch) X(int, num_chunks)
MLA_DEFINE_PARAMS(Params, MLA_BWD_PRE_PARAMS)
#define MLA_BWD_PRE_GEOMETRY(X) X(threads, kThreads) X(heads_per_cta, kHeads)
MLA_DEFINE_GEOMETRY(MLA_BWD_PRE_GEOMETRY)
}  // namespace pre

// T: dout's dtype; OutT: out's (T, or float32 when the forward wrote float32).
template <typename T, typename OutT>
__global__ void __launch_bounds__(pre::kThreads) pre_kernel(const __grid_constant__ pre::Params p) {
  const int m = blockIdx.x, b = blockIdx.y, h0 = blockIdx.z * pre::kHeads;
  {  // every CTA its share of the words zeroed, before any returns
    const i64 cta = blockIdx.x + static_cast<i64>(gridDim.x) * (blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z);
    const i64 stride = static_cast<i64>(gridDim.x) * gridDim.y * gridDim.z * pre::kThreads;
    float4* zeroed = reinterpret_cast<float4*>(p.rope_part);
    for (i64 i = cta * pre::kThreads + threadIdx.x; i < p.zeroed_f4; i += stride) zeroed[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const u32 q0 = p.q_offsets[b];
  const int sq = static_cast<int>(p.q_offsets[b + 1] - q0);
  if (m * kChunkRows >= sq) return;
  const i64 chunk = chunk_of(q0, b, m);
  const int heads = min(pre::kHeads, p.num_heads - h0);
  // D and lse_log2: 16 lanes per (row, head), 8 values each (one 16-byte load of 16-bit dout)
  const int lane16 = threadIdx.x % 16;
  for (int pair = threadIdx.x / 16; pair < kChunkRows * heads; pair += pre::kThreads / 16) {
    const int r = pair % kChunkRows, h = h0 + pair / kChunkRows;
    const int row = m * kChunkRows + r;
    float d = 0.f;
    if (row < sq) {
      const i64 qrow = static_cast<i64>(q0) + row;
      const T* dp = static_cast<const T*>(p.dout) + qrow * p.do_st + h * p.do_sh + 8 * lane16;
      const OutT* op = static_cast<const OutT*>(p.out) + qrow * p.o_st + h * p.o_sh + 8 * lane16;
      float x[4], y[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        load4(dp + 4 * half, x);
        load4(op + 4 * half, y);
#pragma unroll
        for (int i = 0; i < 4; ++i) d = fmaf(x[i], y[i], d);
      }
    }
#pragma unroll
    for (int off = 8; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
    if (lane16 == 0) {
      const i64 at = static_cast<i64>(h) * p.num_chunks * kChunkRows + chunk * kChunkRows + r;
      float l2 = cuda::std::numeric_limits<float>::infinity();  // past the sequence: P = 0
      if (row < sq) {
        const float l = p.lse[(static_cast<i64>(q0) + row) * p.lse_st + h];
        l2 = l == neg_inf() ? -neg_inf() : l * kLog2e;  // a row that sees no key: P = 0
        if (p.dlse != nullptr) d -= p.dlse[(static_cast<i64>(q0) + row) * p.dlse_st + h];
      }
      p.lse_log2[at] = l2;
      p.dpsum[at] = d;
    }
  }
  // the chunk's dq_accum, zeroed for every head of the block
  constexpr int kChunkF4 = kChunkRows * kDqk / 4;
  for (int i = threadIdx.x; i < kChunkF4 * heads; i += pre::kThreads) {
    const int h = h0 + i / kChunkF4;
    float4* dst = reinterpret_cast<float4*>(p.dq_accum + (static_cast<i64>(h) * p.num_chunks + chunk) * kChunkRows * kDqk);
    dst[i % kChunkF4] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq_sem != nullptr && threadIdx.x < heads) p.dq_sem[static_cast<i64>(h0 + threadIdx.x) * p.num_chunks + chunk] = 0;
}

// ---------------------------------------------------------------------------------------------
// dq. Grid (query blocks of the longest sequence, sequences, heads); the chunk goes through shared
// memory row-major, then out as 16-byte rows pieces.
// ---------------------------------------------------------------------------------------------
namespace post_dq {
constexpr int kThreads = 256;
constexpr int kSmemBytes = kChunkRows * kDqk * 4;  // 48 KiB
#define MLA_BWD_DQ_PARAMS(X)                                                                              \
  X(const float*, dq_accum) X(void*, dq) X(i64, dq_st) X(i64, dq_sh) X(float, scale)                      \
  X(const u32*, q_offsets) X(int, num_heads) X(int, batch) X(int, num_chunks)
MLA_DEFINE_PARAMS(Params, MLA_BWD_DQ_PARAMS)
#define MLA_BWD_DQ_GEOMETRY(X) X(threads, kThreads) X(smem, kSmemBytes)
MLA_DEFINE_GEOMETRY(MLA_BWD_DQ_GEOMETRY)
}  // namespace post_dq

template <typename T, int kLayout>
__global__ void __launch_bounds__(post_dq::kThreads) dq_kernel(const __grid_constant__ post_dq::Params p) {
  extern __shared__ __align__(16) float rows[];  // [64][192]
  const int m = blockIdx.x, b = blockIdx.y, h = blockIdx.z;
  const u32 q0 = p.q_offsets[b];
  const int sq = static_cast<int>(p.q_offsets[b + 1] - q0);
  if (m * kChunkRows >= sq) return;
  const float4* src = reinterpret_cast<const float4*>(
      p.dq_accum + (static_cast<i64>(h) * p.num_chunks + chunk_of(q0, b, m)) * kChunkRows * kDqk);
  constexpr int kF4 = kChunkRows * kDqk / 4;
  for (int i = threadIdx.x; i < kF4; i += post_dq::kThreads) {
    const float4 x = src[i];
    const float v[4] = {x.x, x.y, x.z, x.w};
    if constexpr (kLayout == kDqRowMajor) {
      reinterpret_cast<float4*>(rows)[i] = x;
    } else {  // float4 i of the wgmma order: (half, n-tile, thread); its elements e = 0..3 (dq_index)
      const int part = i / (12 * 128), nt = (i / 128) % 12, t = i % 128;
      const int warp = t / 32, g = (t % 32) / 4, c0 = part * 96 + nt * 8 + 2 * (t % 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) rows[(warp * 16 + g + 8 * (e / 2)) * kDqk + c0 + e % 2] = v[e];
    }
  }
  __syncthreads();
  const int n_rows = min(kChunkRows, sq - m * kChunkRows);
  constexpr int kPieces = kDqk / 8;  // 8 values (16 bytes of a 16-bit dq) per piece
  for (int i = threadIdx.x; i < n_rows * kPieces; i += post_dq::kThreads) {
    const int r = i / kPieces, c = (i % kPieces) * 8;
    float lo[4], hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo[e] = p.scale * rows[r * kDqk + c + e];
      hi[e] = p.scale * rows[r * kDqk + c + 4 + e];
    }
    T* dst = static_cast<T*>(p.dq) + (static_cast<i64>(q0) + m * kChunkRows + r) * p.dq_st + h * p.dq_sh + c;
    store4(dst, lo);
    store4(dst + 4, hi);
  }
}

// ---------------------------------------------------------------------------------------------
// dk_rope, and the rows of no sequence. Grid: key rows in blocks of kRows; 16 threads per row, 4
// rope values each.
// ---------------------------------------------------------------------------------------------
namespace post_rope {
constexpr int kThreads = 256;
constexpr int kRows = kThreads / 16;
#define MLA_BWD_ROPE_PARAMS(X)                                                                            \
  /* rope_part [slots][tk][64]; dk_rope [tk, 1, 64] (row stride); dk, dv [tk, H, 128] */                  \
  X(const float*, rope_part) X(int, slots) X(i64, tk) X(void*, dk_rope) X(i64, dkr_st)                   \
  X(void*, dk) X(i64, dk_st) X(i64, dk_sh) X(void*, dv) X(i64, dv_st) X(i64, dv_sh) X(int, num_heads)      \
  /* the sequences' last key row + 1 (kv_end[batch - 1]); batch 0: every row is of no sequence */         \
  X(const u32*, kv_end) X(int, batch)
MLA_DEFINE_PARAMS(Params, MLA_BWD_ROPE_PARAMS)
#define MLA_BWD_ROPE_GEOMETRY(X) X(threads, kThreads) X(rows_per_cta, kRows)
MLA_DEFINE_GEOMETRY(MLA_BWD_ROPE_GEOMETRY)
}  // namespace post_rope

template <typename T>
__global__ void __launch_bounds__(post_rope::kThreads) rope_kernel(const __grid_constant__ post_rope::Params p) {
  const i64 row = static_cast<i64>(blockIdx.x) * post_rope::kRows + threadIdx.x / 16;
  if (row >= p.tk) return;
  const int q = threadIdx.x % 16;  // rope values 4q .. 4q + 3
  const i64 used_end = p.batch > 0 ? static_cast<i64>(p.kv_end[p.batch - 1]) : 0;
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
  if (row < used_end) {
    for (int g = 0; g < p.slots; ++g) {
      float x[4];
      load4(p.rope_part + (static_cast<i64>(g) * p.tk + row) * kDr + 4 * q, x);
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[i] += x[i];
    }
  }
  store4(static_cast<T*>(p.dk_rope) + row * p.dkr_st + 4 * q, sum);
  if (row >= used_end) {  // a row of no sequence: zero dk and dv too (8 values a store)
    const float z[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = q; i < p.num_heads * (kDv / 8); i += 16) {
      const int h = i / (kDv / 8), c = (i % (kDv / 8)) * 8;
      T* dk = static_cast<T*>(p.dk) + row * p.dk_st + h * p.dk_sh + c;
      T* dv = static_cast<T*>(p.dv) + row * p.dv_st + h * p.dv_sh + c;
      store4(dk, z);
      store4(dk + 4, z);
      store4(dv, z);
      store4(dv + 4, z);
    }
  }
}

}  // namespace bwd
}  // namespace mla
