// Portable MLA backward main kernel (sm_80 and newer): FlashAttention-2 style, mma.sync m16n8k16
// with float32 accumulation, cp.async, ldmatrix. The same work, workspace and outputs as the Hopper
// kernel (kernels/mla_backward_sm90.cu; backward.cuh states the math and the workspace); the pre-pass
// and post-passes of kernels/mla_backward_prepost.cu run around it, the dq post-pass with
// bwd::kDqRowMajor (a chunk's element (row, col) at row * 192 + col).
//
// Work. One CTA per work-tile index (backward.cuh: decode_key_tile): 64 keys of one sequence and a
// group of heads. It loads the keys' rope rows once, then per head of the group that head's k and v
// rows, and loops over the query blocks of 64 rows that see the keys (bwd::query_blocks): the q and
// dout rows with their lse_log2 and D stream through a ring of kStages stages (cp.async; the next
// block's copies overlap this block's math). Per query block, 8 warps:
//   S  = Q K^T    [64 x 64]   warp (wm, wn) = (warp % 4, warp / 4): 16 query rows x 32 keys
//   dP = dO V^T   [64 x 64]   the same split
//   P = exp2(scale_log2 S - lse_log2), dS = P (dP - D), selected to 0 where a pair is invisible;
//       both to shared memory (16-bit, [query][key])
//   dV += P^T dO  [64 x 128]  warp (wk, wd): 16 keys x 64 dims        (P^T by ldmatrix.trans)
//   dK += dS^T Q  [64 x 192]  warp (wk, wd): 16 keys x 96 dims: nope dims 64 wd .. 64 wd + 63 and
//                             rope dims 128 + 32 wd .. + 31, so every warp holds rope columns
//   dQ  = dS K    [64 x 192]  warp (wq, wd): 16 query rows x 96 dims, in two halves of 48, each
//                             added to dq_accum as soon as it is done
// dK and dV stay in registers across the head's query blocks and are stored per head (dk times
// scale, dv unscaled); dK's rope columns are never reset between heads, so they end the tile
// holding the group's sum over heads, stored once (times scale) into rope_part's slot of the group.
//
// Tile sizes and registers. With 192-wide q and k the accumulators decide: dK (64 x 192) and dV
// (64 x 128) over 256 threads are 48 + 32 = 80 floats per thread, held for a whole head; S and dP
// add 16 each, then (not live with them) dQ's half 24. Its whole 48 measured spills with ptxas'
// hoisted addresses (sm_90a, 255 registers); in halves the kernel compiles to 235-249 registers, no
// local memory, for every mask at sm_80 / sm_86 / sm_89 / sm_90a (one CTA of 8 warps per SM). 128 keys
// per CTA would double dK and dV (160 per thread): no room for the rest. 64 x 64 is also
// FlashAttention-2's tile for large head dims on sm_80.
//
// Shared memory: k (64 x 192, its rope columns loaded once per tile) 24 KiB, v 16 KiB, P and dS
// 8 KiB each, and per stage q 24 KiB, dout 16 KiB, lse_log2 and D 512 B: 137 KiB with two stages
// (A100, Hopper: up to 163 / 227 KiB). GPUs with 99 KiB per CTA (sm_86, sm_89 such as the L40,
// sm_120) get one stage (96.5 KiB): the next block's copies then start once this block's dK and dV
// GEMMs are done, overlapping its dQ GEMM and atomics. kGeometry exports the size compiled for the
// module's arch. Copies: thread t copies row t / 4 of a tile, 16-byte chunks t % 4 + 4 i (one row
// address per thread and tensor).
//
// Masks and bounds, as the Hopper kernel: a warp's 16 x 32 sub-tile that is not wholly visible and
// inside its sequence takes the per-element predicate, and invisible pairs get P = dS = 0 by a
// select, never by arithmetic. Rows of q / dout past the sequence and rows of k / rope / v past it
// are zero-filled by cp.async (src-size 0) before any GEMM sums over them; a chunk's rows past the
// sequence have lse_log2 = +inf (pre-pass), so their P is 0 even before the select.
//
// dq. Each CTA adds its 64 x 192 dq block (unscaled) into the chunk with float32 reductions:
// red.global.add.f32 (4 per n-tile and thread) on sm_80; on sm_90+ lanes t and t ^ 1 of a quad swap
// half their pairs so that each holds 4 adjacent columns of one row, then one red.global.add.v4.f32
// per n-tile. A last chunk's rows past the sequence receive exact zeros (no predicate).
//
// Deterministic mode (p.deterministic): the additions to each (head, chunk) in a fixed order of the
// key blocks (backward.cuh: dq_turn; from the last that processes it down under a mask). The chunk's
// semaphore dq_sem counts the key blocks that have added to it; block n waits until it equals its
// turn, adds, and increments it (release) once every thread's additions are done. Forward progress:
// a CTA only ever waits on key blocks of its own (sequence, group) whose turns come first, and
// decode_key_tile hands those out at lower work-tile indices in this mode. With p.tile_counter set,
// a CTA takes its index as a ticket from the counter when it starts (not blockIdx.x), so every lower
// index belongs to a CTA that is already running (resident) or done: the CTA holding the lowest
// unfinished index waits on nothing unfinished, and by induction every CTA finishes, whatever order
// the hardware dispatches CTAs in and however few fit at once. (A non-persistent grid keyed on blockIdx.x would rely on in-order dispatch,
// which CUDA does not promise; a persistent grid would need every CTA resident.) The CTA that takes
// the last ticket (gridDim.x - 1) resets the counter to 0 for the next launch (word 0 only; word 1,
// the Hopper protocol's, is left at its 0). Without a counter the index is blockIdx.x: fine when not
// deterministic; the host passes the counter in deterministic mode.
//
// Launch: grid num_n_blocks * batch * groups (num_n_blocks counted in kGeometry's block_n keys; a
// smaller grid faults, a larger one is fine), 256 threads, kGeometry[0] bytes of dynamic shared
// memory. Rows of q, k, v, k_rope and dout must start on 16 bytes (cp.async: 16-byte aligned bases,
// element strides multiples of 8); dk and dv are stored two values at a time (even element strides),
// rope_part as float2.
#include "backward.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "params_abi.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace mla {
namespace sm80_bwd {

using bwd::kDqk;
using bwd::kDr;
using bwd::kDv;

constexpr int kBlockM = 64;  // query rows of a query block (a dq chunk)
constexpr int kBlockN = 64;  // keys of a work tile
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
static_assert(kBlockM == bwd::kChunkRows, "a query block is one dq chunk");

// Stages of the q / dout ring: two where a CTA may have 137 KiB of shared memory (sm_80, sm_87,
// sm_90, sm_100, sm_103), one elsewhere (99 KiB: sm_86, sm_89, sm_120, and archs not listed here).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 800 && __CUDA_ARCH__ != 870 && __CUDA_ARCH__ != 900 && \
    __CUDA_ARCH__ != 1000 && __CUDA_ARCH__ != 1030
constexpr int kStages = 1;
#else
constexpr int kStages = 2;
#endif

// Shared tiles of 16-bit rows, swizzled (common.cuh: SwizzledTile): q and k rows of 192 values, v and
// dout rows of 128, P and dS rows (one per query) of the 64 keys.
using QkTile = SwizzledTile<kDqk * 2 / 16>;   // 24 chunks of 16 bytes
using VTile = SwizzledTile<kDv * 2 / 16>;     // 16
using PTile = SwizzledTile<kBlockN * 2 / 16>; // 8
constexpr int kNopeChunks = kDv * 2 / 16;     // k's chunks 0-15 come from k, 16-23 from the rope
constexpr int kRopeChunks = kDr * 2 / 16;

constexpr int kKBytes = kBlockN * QkTile::kRowBytes;   // 24 KiB
constexpr int kVBytes = kBlockN * VTile::kRowBytes;    // 16 KiB
constexpr int kPBytes = kBlockM * PTile::kRowBytes;    // 8 KiB (P, and dS)
constexpr int kQBytes = kBlockM * QkTile::kRowBytes;   // 24 KiB
constexpr int kDoBytes = kBlockM * VTile::kRowBytes;   // 16 KiB
constexpr int kStatBytes = kBlockM * 4;                // lse_log2 or D of a query block
constexpr int kStageBytes = kQBytes + kDoBytes + 2 * kStatBytes;
constexpr int kKOffset = 0;
constexpr int kVOffset = kKOffset + kKBytes;
constexpr int kPOffset = kVOffset + kVBytes;
constexpr int kDsOffset = kPOffset + kPBytes;
constexpr int kStageOffset = kDsOffset + kPBytes;
constexpr int kTicketOffset = kStageOffset + kStages * kStageBytes;  // the CTA's work-tile index
constexpr int kSmemBytes = kTicketOffset + 16;
static_assert(kStageOffset % 128 == 0 && kStageBytes % 128 == 0, "tiles start on 128 bytes (the swizzle's rows)");
static_assert(kStages == 1 ? kSmemBytes <= 99 * 1024 : kSmemBytes <= 163 * 1024, "shared memory per CTA");

static_assert(kBlockM * 4 == kThreads && kBlockN * 4 == kThreads, "copies: four threads per row");
static_assert(kNopeChunks % 4 == 0 && kRopeChunks % 4 == 0 && (kDqk * 2 / 16) % 4 == 0, "copies: chunks in fours");

// The arguments: exactly the common list (backward.cuh), so the host packs both main kernels from it.
MLA_DEFINE_PARAMS(Params, MLA_BWD_COMMON_PARAMS)

// What the launch code reads from the module besides the parameter layout: dynamic shared memory in
// bytes, threads per CTA, query rows per block (a dq chunk), keys per work tile.
#define MLA_BWD_SM80_GEOMETRY(X) X(smem, kSmemBytes) X(threads, kThreads) X(block_m, kBlockM) X(block_n, kBlockN)
MLA_DEFINE_GEOMETRY(MLA_BWD_SM80_GEOMETRY)

// dq's float32 reductions: one value, or (sm_90+) four adjacent values at a 16-byte aligned address.
__device__ __forceinline__ void red_add(float* p, float x) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void red_add_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
#endif

template <int N>
__device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
}

template <typename T, typename Mask>
struct Cta {
  const Params& p;
  const Mask mask;
  const bwd::KeyTile& t;
  u32 smem;             // shared address of the dynamic shared memory
  int tid, warp, lane;
  int w4, w2;           // warp % 4 (a 16-row slice of a GEMM's M), warp / 4 (its column half)

  // Accumulator element e of n-tile j: row g + 8 (e / 2) of the warp's 16, column 8 j + 2 (lane % 4) + e % 2.
  __device__ __forceinline__ int col_of(int j, int e) const { return 8 * j + 2 * (lane % 4) + (e & 1); }
  __device__ __forceinline__ u32 stage(int s) const { return smem + kStageOffset + s * kStageBytes; }

  // ---- copies: thread tid copies row tid / 4, 16-byte chunks tid % 4 + 4 i (a warp: 8 rows x 64 bytes
  // an instruction), so that it forms one row address per tensor; rows past the sequence zero-filled --
  // Head h's k (nope) and v rows of the tile's keys, and the rope rows when `rope`.
  __device__ __forceinline__ void load_kv(int h, bool rope) const {
    const int r = tid / 4, c4 = tid % 4;
    const bool ok = t.n0 + r < t.w.sk;
    const i64 row = t.w.kv_row0 + t.n0 + r;
    const T* k = static_cast<const T*>(p.k) + (ok ? row * p.k_st + h * p.k_sh : 0);
    const T* v = static_cast<const T*>(p.v) + (ok ? row * p.v_st + h * p.v_sh : 0);
    const u32 sk = smem + kKOffset, sv = smem + kVOffset;
#pragma unroll
    for (int i = 0; i < kNopeChunks / 4; ++i) {
      const int c = c4 + 4 * i;
      cp_async_16(sk + QkTile::offset(r, c), k + c * 8, ok);
      cp_async_16(sv + VTile::offset(r, c), v + c * 8, ok);
    }
    if (rope) {
      const T* kr = static_cast<const T*>(p.k_rope) + (ok ? row * p.rope_st : 0);
#pragma unroll
      for (int i = 0; i < kRopeChunks / 4; ++i) {
        const int c = c4 + 4 * i;
        cp_async_16(sk + QkTile::offset(r, kNopeChunks + c), kr + c * 8, ok);
      }
    }
  }

  // Head h's q and dout rows of query block m, with the block's lse_log2 and D, into stage s.
  __device__ __forceinline__ void load_block(int h, int m, int s) const {
    const u32 sq = stage(s), sdo = sq + kQBytes, sstat = sdo + kDoBytes;
    const int r = tid / 4, c4 = tid % 4;
    const bool ok = m * kBlockM + r < t.w.sq;
    const i64 row = t.w.q_row0 + m * kBlockM + r;
    const T* q = static_cast<const T*>(p.q) + (ok ? row * p.q_st + h * p.q_sh : 0);
    const T* dout = static_cast<const T*>(p.dout) + (ok ? row * p.do_st + h * p.do_sh : 0);
#pragma unroll
    for (int i = 0; i < kDqk * 2 / 16 / 4; ++i) {
      const int c = c4 + 4 * i;
      cp_async_16(sq + QkTile::offset(r, c), q + c * 8, ok);
    }
#pragma unroll
    for (int i = 0; i < kDv * 2 / 16 / 4; ++i) {
      const int c = c4 + 4 * i;
      cp_async_16(sdo + VTile::offset(r, c), dout + c * 8, ok);
    }
    if (tid < 2 * kStatBytes / 16) {  // lse_log2 (threads 0-15), then D (16-31): the chunk's 64 rows
      const int which = tid / (kStatBytes / 16), piece = tid % (kStatBytes / 16);
      const i64 at = (static_cast<i64>(h) * p.num_chunks + bwd::chunk_of(static_cast<u32>(t.w.q_row0), t.w.b, m)) *
                         kBlockM + 4 * piece;
      cp_async_16(sstat + which * kStatBytes + 16 * piece, (which == 0 ? p.lse_log2 : p.dpsum) + at, true);
    }
  }

  // The visible-key interval [lo, hi) of each of the thread's two rows (block rows r0, r0 + 8 of query
  // block m), as columns of the 32 keys from key `key0` of the sequence; empty for rows past the sequence.
  __device__ __forceinline__ void row_intervals(int m, int r0, int key0, int (&lo)[2], int (&hi)[2]) const {
    const WorkTile& w = t.w;
    const i64 kpos0 = w.k_pos0 + key0;
    const int last = min(32, w.sk - key0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = m * kBlockM + r0 + 8 * r;
      lo[r] = hi[r] = 0;
      if (row < w.sq) {
        const i64 qp = w.q_pos0 + row;
        i64 k_lo, k_hi;
        mask.key_range(qp, qp, k_lo, k_hi);
        const i64 c_lo = k_lo - kpos0, c_hi = k_hi - kpos0;  // |positions| < 2^62: no overflow
        lo[r] = static_cast<int>(c_lo < 0 ? 0 : (c_lo > 32 ? 32 : c_lo));
        hi[r] = static_cast<int>(c_hi < 0 ? 0 : (c_hi > last ? last : c_hi));
      }
    }
  }

  // One query block m of head h from stage s: the five GEMMs; dq added to the chunk.
  __device__ __forceinline__ void step(int h, int m, int s, float (&dk)[12][4], float (&dv)[8][4]) const {
    const WorkTile& w = t.w;
    u32 sq = stage(s);
    // opaque to the compiler: with one stage the address is the same every block, and the compiler then
    // keeps every q / dout ldmatrix address in a register across the loop (spills, NullMask on sm_86/89)
    asm volatile("" : "+r"(sq));
    const u32 sdo = sq + kQBytes, slse = sdo + kDoBytes, sd = slse + kStatBytes;
    const u32 sk = smem + kKOffset, sv = smem + kVOffset, sp = smem + kPOffset, sds = smem + kDsOffset;

    // 1. S = Q K^T (12 k-steps of 16 over 192) and dP = dO V^T (8 over 128): rows 16 w4, keys 32 w2
    {
      float sc[4][4], dp[4][4];
      zero(sc);
      zero(dp);
#pragma unroll
      for (int kk = 0; kk < kDqk / 16; ++kk) {
        u32 a[4];
        ldmatrix_x4(a, sq + QkTile::offset(16 * w4 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
        for (int np = 0; np < 2; ++np) {  // matrices: keys +{0..7, 0..7, 8..15, 8..15} x chunks 2 kk + {0, 1, 0, 1}
          u32 b[4];
          ldmatrix_x4(b, sk + QkTile::offset(32 * w2 + 16 * np + (lane >> 4) * 8 + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
          Elem<T>::mma(sc[2 * np], a, b[0], b[1]);
          Elem<T>::mma(sc[2 * np + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < kDv / 16; ++kk) {
        u32 a[4];
        ldmatrix_x4(a, sdo + VTile::offset(16 * w4 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          u32 b[4];
          ldmatrix_x4(b, sv + VTile::offset(32 * w2 + 16 * np + (lane >> 4) * 8 + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
          Elem<T>::mma(dp[2 * np], a, b[0], b[1]);
          Elem<T>::mma(dp[2 * np + 1], a, b[2], b[3]);
        }
      }

      // 2. P = exp2(scale_log2 S - lse_log2), dS = P (dP - D); invisible pairs 0 by a select
      const int r0 = 16 * w4 + lane / 4;  // the thread's block rows r0, r0 + 8
      const int qrow0 = m * kBlockM + 16 * w4;  // the warp's first row in the sequence
      const int key0 = t.n0 + 32 * w2;          // the warp's first key in the sequence
      const bool full = qrow0 + 16 <= w.sq && key0 + 32 <= w.sk &&
                        mask.all_visible(w.q_pos0 + qrow0, w.q_pos0 + qrow0 + 15, w.k_pos0 + key0, w.k_pos0 + key0 + 31);
      int lo[2] = {0, 0}, hi[2] = {32, 32};
      if (!full) row_intervals(m, r0, key0, lo, hi);
      float lse[2], d[2];
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(lse[0]) : "r"(slse + 4 * r0));
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(lse[1]) : "r"(slse + 4 * (r0 + 8)));
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(d[0]) : "r"(sd + 4 * r0));
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(d[1]) : "r"(sd + 4 * (r0 + 8)));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = col_of(j, e);
          const bool vis = full || (col >= lo[e / 2] && col < hi[e / 2]);
          const float pv = fast_exp2(fmaf(sc[j][e], p.scale_log2, -lse[e / 2]));  // then selected: no branch
          sc[j][e] = vis ? pv : 0.f;
          dp[j][e] = vis ? pv * (dp[j][e] - d[e / 2]) : 0.f;
        }
        // (row, key) pairs at [query][key]: chunk 4 w2 + j of rows r0 and r0 + 8, word lane % 4
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const u32 off = PTile::offset(r0 + 8 * r, 4 * w2 + j) + 4 * (lane % 4);
          sts32(sp + off, Elem<T>::pack(sc[j][2 * r], sc[j][2 * r + 1]));
          sts32(sds + off, Elem<T>::pack(dp[j][2 * r], dp[j][2 * r + 1]));
        }
      }
    }
    __syncthreads();  // P and dS whole

    // 3. dV += P^T dO (keys 16 w4 x dims 64 w2), dK += dS^T Q (keys 16 w4 x dK's 96 columns of w2):
    //    4 k-steps of 16 queries; P^T and dS^T by ldmatrix.trans of the [query][key] tiles, dO and Q
    //    (k = queries, n = dims, stored [k][n]) by ldmatrix.trans as well.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      // A: matrix j = lane / 8 is (keys +8 (j & 1), queries +8 (j >> 1)), read from stored rows (queries)
      const u32 a_off = PTile::offset(16 * kk + 8 * (lane >> 4) + (lane & 7), 2 * w4 + ((lane >> 3) & 1));
      // B: matrices (queries +{0, 8, 0, 8}) x (dims chunk +{0, 0, 1, 1})
      const int brow = 16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7);
      {
        u32 a[4];
        ldmatrix_x4_trans(a, sp + a_off);
#pragma unroll
        for (int dp = 0; dp < 4; ++dp) {
          u32 b[4];
          ldmatrix_x4_trans(b, sdo + VTile::offset(brow, 8 * w2 + 2 * dp + (lane >> 4)));
          Elem<T>::mma(dv[2 * dp], a, b[0], b[1]);
          Elem<T>::mma(dv[2 * dp + 1], a, b[2], b[3]);
        }
      }
      {
        u32 a[4];
        ldmatrix_x4_trans(a, sds + a_off);
#pragma unroll
        for (int dp = 0; dp < 6; ++dp) {  // dK's n-tiles 2 dp, 2 dp + 1: nope (dp < 4) or rope chunks
          const int c = dp < 4 ? 8 * w2 + 2 * dp : kNopeChunks + 4 * w2 + 2 * (dp - 4);
          u32 b[4];
          ldmatrix_x4_trans(b, sq + QkTile::offset(brow, c + (lane >> 4)));
          Elem<T>::mma(dk[2 * dp], a, b[0], b[1]);
          Elem<T>::mma(dk[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }

    if constexpr (kStages == 1) {  // the stage is free once every warp's dK / dV GEMMs are done: the next block's copies
      __syncthreads();
      if (m + 1 < t.m_end) load_block(h, m + 1, 0);
      cp_async_commit();
    }

    // 4. dQ = dS K, rows 16 w4 x dims 96 w2, in two halves of 48 dims (24 accumulator registers each,
    //    not 48: dK and dV hold 80 across the loop); each half added to the chunk (row-major) at once.
    //    Deterministic mode: the additions after those of the key blocks whose turn comes first (dq_turn).
    const i64 chunk = bwd::chunk_of(static_cast<u32>(w.q_row0), w.b, m);
    int* sem = p.deterministic ? p.dq_sem + static_cast<i64>(h) * p.num_chunks + chunk : nullptr;
    if (sem != nullptr) {
      if (tid == 0) {
        const int turn = bwd::dq_turn(mask, w, m, t.n_block, kBlockN);
        while (bwd::load_acquire(sem) != turn) {
        }
      }
      __syncthreads();
    }
    float* acc = p.dq_accum + (static_cast<i64>(h) * p.num_chunks + chunk) * (kBlockM * kDqk);
    // The thread's chunk rows row, row + 8. A chunk's rows past the sequence get exact zeros (their dS
    // rows are selected to 0): rows of the workspace that the pre-pass zeroed and nothing reads, so the
    // reductions need no predicate (ptxas branches around each predicated one on sm_80).
    const int row = 16 * w4 + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c0 = 12 * w2 + 6 * half;  // the half's first chunk (8 dims) of K's rows
      float dq[6][4];
      zero(dq);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {  // 16 keys a k-step; K (k = keys, n = dims) by ldmatrix.trans
        u32 a[4];
        ldmatrix_x4(a, sds + PTile::offset(16 * w4 + (lane & 15), 2 * kk + (lane >> 4)));
        const int brow = 16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int dp = 0; dp < 3; ++dp) {
          u32 b[4];
          ldmatrix_x4_trans(b, sk + QkTile::offset(brow, c0 + 2 * dp + (lane >> 4)));
          Elem<T>::mma(dq[2 * dp], a, b[0], b[1]);
          Elem<T>::mma(dq[2 * dp + 1], a, b[2], b[3]);
        }
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // lanes t, t ^ 1 of the quad swap pairs: an even t then holds row `row`, columns 2t .. 2t + 3 of
      // the n-tile, an odd t row + 8, columns 2 (t - 1) .. 2 (t - 1) + 3: one 16-byte reduction each
      const bool odd = lane & 1;
      const int my_row = row + (odd ? 8 : 0);
      const int my_col = 2 * (lane % 4) - (odd ? 2 : 0);
      float* dst = acc + my_row * kDqk + 8 * c0 + my_col;  // the n-tiles at constant offsets from it
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        const float s0 = odd ? dq[j][0] : dq[j][2], s1 = odd ? dq[j][1] : dq[j][3];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        const float x0 = odd ? r0 : dq[j][0], x1 = odd ? r1 : dq[j][1];
        const float x2 = odd ? dq[j][2] : r0, x3 = odd ? dq[j][3] : r1;
        red_add_v4(dst + 8 * j, x0, x1, x2, x3);
      }
#else
      float* dst = acc + row * kDqk + 8 * c0 + 2 * (lane % 4);  // every element at a constant offset from it
#pragma unroll
      for (int j = 0; j < 6; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red_add(dst + 8 * (e / 2) * kDqk + 8 * j + (e & 1), dq[j][e]);
#endif
    }
    if (sem != nullptr) {
      __syncthreads();  // every thread's additions issued before the release
      if (tid == 0) {
        __threadfence();
        bwd::add_release(sem, 1);
      }
    }
  }

  // dv (unscaled) and dk's nope columns (times scale) of head h, for the tile's keys that exist:
  // dK / dV element (key 16 w4 + g + 8 (e / 2), n-tile j's column).
  __device__ __forceinline__ void store_head(int h, const float (&dk)[12][4], const float (&dv)[8][4]) const {
    T* dkp = static_cast<T*>(p.dk) + h * p.dk_sh;
    T* dvp = static_cast<T*>(p.dv) + h * p.dv_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = t.n0 + 16 * w4 + lane / 4 + 8 * r;
      if (key >= t.w.sk) continue;
      const i64 row = t.w.kv_row0 + key;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int dim = 64 * w2 + col_of(j, 0);
        store2<T>(dvp + row * p.dv_st + dim, dv[j][2 * r], dv[j][2 * r + 1]);
        store2<T>(dkp + row * p.dk_st + dim, p.scale * dk[j][2 * r], p.scale * dk[j][2 * r + 1]);
      }
    }
  }

  // dK's rope columns (n-tiles 8-11: rope values 32 w2 + 8 (j - 8) + ..), the group's sum over its
  // heads, times scale into the group's slot of rope_part.
  __device__ __forceinline__ void store_rope(const float (&dk)[12][4]) const {
    float* part = p.rope_part + static_cast<i64>(t.h0 / p.heads_per_group) * p.tk * kDr;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = t.n0 + 16 * w4 + lane / 4 + 8 * r;
      if (key >= t.w.sk) continue;
      float* dst = part + (t.w.kv_row0 + key) * kDr + 32 * w2;
#pragma unroll
      for (int j = 8; j < 12; ++j) store2<float>(dst + col_of(j - 8, 0), p.scale * dk[j][2 * r], p.scale * dk[j][2 * r + 1]);
    }
  }

  __device__ __forceinline__ void run() const {
    float dk[12][4], dv[8][4];
    zero(dk);  // the rope columns (n-tiles 8-11) sum over the group's heads: never reset
    const bool any = t.m_begin < t.m_end;
    for (int hh = 0; hh < t.heads; ++hh) {
      const int h = t.h0 + hh;
#pragma unroll
      for (int j = 0; j < 8; ++j) dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.f;
      zero(dv);
      if (any) {
        __syncthreads();  // every warp is done with the previous head's k, v and stages
        load_kv(h, hh == 0);
        load_block(h, t.m_begin, 0);
        cp_async_commit();
#pragma unroll 1
        for (int m = t.m_begin; m < t.m_end; ++m) {
          const int s = kStages == 1 ? 0 : (m - t.m_begin) & 1;
          cp_async_wait<0>();
          __syncthreads();  // block m landed; every warp is done with block m - 1 (its stage, P and dS)
          if constexpr (kStages == 2) {
            if (m + 1 < t.m_end) load_block(h, m + 1, s ^ 1);
            cp_async_commit();
          }
          step(h, m, s, dk, dv);
        }
      }
      store_head(h, dk, dv);
    }
    store_rope(dk);
  }
};

template <typename T, typename Mask>
__global__ void __launch_bounds__(kThreads, 1) mla_backward_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  int idx = blockIdx.x;
  if (p.tile_counter != nullptr) {  // the index is a ticket: lower ones belong to CTAs already running
    int* ticket = reinterpret_cast<int*>(smem + kTicketOffset);
    if (threadIdx.x == 0) {
      const u32 mine = atomicAdd(p.tile_counter, 1u);
      if (mine == gridDim.x - 1) *p.tile_counter = 0;  // the last ticket: every CTA has taken its own
      *ticket = static_cast<int>(mine);
    }
    __syncthreads();
    idx = *ticket;
  }
  const int groups = (p.num_heads + p.heads_per_group - 1) / p.heads_per_group;
  const int num_work = p.num_n_blocks * p.batch * groups;
  // One tile per CTA: a smaller grid would leave tiles undone (wrong gradients, silently), so it faults
  // instead. (A loop over tiles, for any grid, costs registers: ptxas then spills, whatever the order.)
  if (static_cast<int>(gridDim.x) < num_work) __trap();
  if (idx >= num_work) return;
  const SeqOffsets so{p.q_offsets, p.kv_begin, p.kv_end, p.cache_offsets, p.q_start_pos};
  const Mask mask{p.mask_arg};
  bwd::KeyTile t;
  if (!bwd::decode_key_tile(so, mask, idx, p.num_heads, p.heads_per_group, p.batch, p.num_n_blocks, kBlockN,
                            p.tail_groups, p.deterministic != 0, t))
    return;
  const int warp = threadIdx.x / 32;
  const Cta<T, Mask> cta{p, mask, t, smem_addr(smem), static_cast<int>(threadIdx.x), warp, static_cast<int>(threadIdx.x % 32),
                         warp % 4, warp / 4};
  cta.run();
}

}  // namespace sm80_bwd
}  // namespace mla
