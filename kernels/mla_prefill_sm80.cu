// Portable MLA prefill kernel (sm_80 and newer): FlashAttention-2 style.
//
//   * One CTA = 128 query rows of one head of one sequence; 8 warps, 16 rows each.
//   * Key tiles of 64 keys stream through a 2-stage cp.async ring. A K tile row is 192 values:
//     the head's 128 "nope" values from k, then the 64 rope values that every head shares,
//     read from k_rope (or the paged cache) once per key tile. Nothing materializes [Tk, H, 192].
//   * S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16/fp16 in, float32 accumulate);
//     the online softmax works in the log2 domain with the scale folded in.
//   * Key tiles a mask removes entirely are never loaded (visible_key_span); tiles fully visible
//     skip the per-element predicate; a warp whose 16 rows see nothing of a tile skips its MMAs.
#include "common.cuh"
#include "mask.cuh"
#include "params_abi.cuh"
#include "prefill_params.cuh"
#include "rope_source.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace mla {
namespace sm80 {

constexpr int kBlockM = 128;                 // query rows per CTA
constexpr int kBlockN = 64;                  // keys per tile
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockM / kWarps;  // 16 = one mma M
constexpr int kStages = 2;

constexpr int kQkChunks = kDqk * 2 / 16;     // 24 16-byte chunks per Q/K row
constexpr int kNopeChunks = kDv * 2 / 16;    // 16 of them from k
constexpr int kRopeChunks = kDr * 2 / 16;    // 8 of them from the rope source
constexpr int kVChunks = kDv * 2 / 16;       // 16 per V row
using QKTile = SwizzledTile<kQkChunks>;
using VTile = SwizzledTile<kVChunks>;

constexpr int kQBytes = kBlockM * QKTile::kRowBytes;  // 48 KiB
constexpr int kKBytes = kBlockN * QKTile::kRowBytes;  // 24 KiB
constexpr int kVBytes = kBlockN * VTile::kRowBytes;   // 16 KiB
constexpr int kStageBytes = kKBytes + kVBytes;
constexpr int kKeyOkOffset = kQBytes + kStages * kStageBytes;
constexpr int kSmemBytes = kKeyOkOffset + kStages * kBlockN;  // + per-key "readable" flags (paged)

constexpr int kQkSteps = kDqk / 16;          // 12 k-steps of 16 for S = Q K^T
constexpr int kSTiles = kBlockN / 8;         // 8 n-tiles of 8 keys in S
constexpr int kOTiles = kDv / 8;             // 16 n-tiles of 8 values in O
constexpr int kPvSteps = kBlockN / 16;       // 4 k-steps of 16 keys for O += P V

static_assert(kBlockM * kQkChunks % kThreads == 0, "Q tile copy must divide evenly");
static_assert(kBlockN * kNopeChunks % kThreads == 0, "K/V tile copy must divide evenly");
static_assert(kBlockN * kRopeChunks == 2 * kThreads, "rope copy: two chunks per thread");

// The arguments: one struct passed by value, its layout exported to the launch code (params_abi.cuh).
#define MLA_SM80_PARAMS(X)                                                                          \
  /* q [Tq, H, 192], k / v [Tk, H, 128] (element strides), out [Tq, H, 128], lse [Tq, H] or null */   \
  X(const void*, q) X(const void*, k) X(const void*, v) X(void*, out) X(float*, lse)                \
  X(i64, q_st) X(i64, q_sh) X(i64, k_st) X(i64, k_sh) X(i64, v_st) X(i64, v_sh) X(i64, o_st) X(i64, o_sh)    \
  X(i64, lse_st)                                                                                    \
  /* the batch, the rope source, the work (one CTA per query block, sequence and head in */         \
  /* tile_scheduler.cuh's order), the scores (prefill_params.cuh) */                               \
  MLA_SEQ_OFFSET_PARAMS(X) MLA_ROPE_PARAMS(X) MLA_WORK_PARAMS(X) MLA_SCORE_PARAMS(X)

MLA_DEFINE_PARAMS(Params, MLA_SM80_PARAMS)

// What the launch code reads from the module besides the parameter layout (params_abi.cuh): dynamic
// shared memory in bytes, threads per CTA, query rows per CTA.
#define MLA_SM80_GEOMETRY(X) X(smem, kSmemBytes) X(threads, kThreads) X(block_m, kBlockM)
MLA_DEFINE_GEOMETRY(MLA_SM80_GEOMETRY)

template <typename T, typename OutT, typename Mask, bool kPaged>
__global__ void __launch_bounds__(kThreads, 1) mla_prefill_kernel(const __grid_constant__ Params p) {
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  const i64 q_st = p.q_st, q_sh = p.q_sh, k_st = p.k_st, k_sh = p.k_sh, v_st = p.v_st, v_sh = p.v_sh;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  const SeqOffsets so{p.q_offsets, p.kv_begin, p.kv_end, p.cache_offsets, p.q_start_pos};
  WorkTile w;
  if (!decode_work_tile(so, blockIdx.x, p.num_heads, p.heads_per_section, p.batch, p.num_m_blocks, kBlockM, w)) return;
  const RopeArgs ra{p.rope_base, p.rope_row_stride, p.rope_block_stride, p.lookup, p.lookup_stride,
                    p.log2_page_size, p.num_blocks, p.max_pages};
  const Mask mask{p.mask_arg};

  const int m0 = w.m_block * kBlockM;             // first row of this CTA within the sequence
  const int rows = min(kBlockM, w.sq - m0);
  int n_begin, n_end;                             // keys any row of this CTA may see
  visible_key_span(mask, w, w.q_pos0 + m0, w.q_pos0 + m0 + rows - 1, n_begin, n_end);
  const int num_tiles = (n_end - n_begin + kBlockN - 1) / kBlockN;

  const u32 sQ = smem_addr(smem);
  unsigned char* key_ok = smem + kKeyOkOffset;    // [kStages][kBlockN]

  // ---- loaders: consecutive threads copy consecutive 16-byte chunks of one row (coalesced) ----
  auto load_q = [&]() {
#pragma unroll
    for (int i = 0; i < kBlockM * kQkChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kQkChunks, c = idx % kQkChunks;
      const bool ok = m0 + r < w.sq;
      const T* src = ok ? q + (w.q_row0 + m0 + r) * q_st + w.h * q_sh + c * 8 : q;
      cp_async_16(sQ + QKTile::offset(r, c), src, ok);
    }
  };
  // Returns true when some key of the tile could not be read (paged cache: bad block id).
  auto load_kv = [&](int tile, int stage) -> bool {
    const int n0 = n_begin + tile * kBlockN;
    const u32 sK = sQ + kQBytes + stage * kStageBytes;
    const u32 sV = sK + kKBytes;
#pragma unroll
    for (int i = 0; i < kBlockN * kNopeChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kNopeChunks, c = idx % kNopeChunks;
      const bool ok = n0 + r < n_end;
      const i64 row = w.kv_row0 + n0 + r;
      cp_async_16(sK + QKTile::offset(r, c), ok ? k + row * k_st + w.h * k_sh + c * 8 : k, ok);
      cp_async_16(sV + VTile::offset(r, c), ok ? v + row * v_st + w.h * v_sh + c * 8 : v, ok);
    }
    // Rope: key r = tid / 4, chunks 2 * (tid % 4) + {0, 1}; one source lookup per thread.
    const int r = tid / 4;
    const int j = n0 + r;
    const T* rp = j < n_end ? RopeSource<kPaged>::template row<T>(ra, w.b, w.kv_row0 + j, w.k_pos0 + j) : nullptr;
    const bool ok = rp != nullptr;
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int c = (tid % 4) * 2 + cc;
      cp_async_16(sK + QKTile::offset(r, kNopeChunks + c), ok ? rp + c * 8 : k, ok);
    }
    if (kPaged && (tid % 4) == 0) key_ok[stage * kBlockN + r] = ok;
    return kPaged && j < n_end && !ok;
  };

  // ---- per-warp state: rows wr0 .. wr0+15 of the sequence ----
  const int wr0 = m0 + warp * kWarpRows;
  const bool warp_active = wr0 < w.sq;
  const i64 wq_lo = w.q_pos0 + wr0;
  const i64 wq_hi = w.q_pos0 + min(wr0 + kWarpRows - 1, w.sq - 1);
  int wn_begin = 0, wn_end = 0;  // keys these rows may see
  if (warp_active) visible_key_span(mask, w, wq_lo, wq_hi, wn_begin, wn_end);

  float o[kOTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  OnlineSoftmax sm;                           // rows g and g + 8 of the warp
  sm.init();
  u32 qf[kQkSteps][4];                        // Q fragments, loaded once

  bool bad_cur = false, bad_next = false;
  if (num_tiles > 0) {
    load_q();
    bad_cur = load_kv(0, 0);
  }
  cp_async_commit();

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % kStages;
    if (t + 1 < num_tiles) {
      bad_next = load_kv(t + 1, (t + 1) % kStages);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    int tile_bad = 0;
    if (kPaged) tile_bad = __syncthreads_or(bad_cur);
    else __syncthreads();
    bad_cur = bad_next;

    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk)
        ldmatrix_x4(qf[kk], sQ + QKTile::offset(warp * kWarpRows + (lane & 15), kk * 2 + (lane >> 4)));
    }

    const int n0 = n_begin + t * kBlockN;
    const bool warp_skip = !warp_active || n0 >= wn_end || n0 + kBlockN <= wn_begin;
    if (!warp_skip) {
      const u32 sK = sQ + kQBytes + stage * kStageBytes;
      const u32 sV = sK + kKBytes;

      // S = Q K^T: 16 rows x 64 keys per warp.
      float s[kSTiles][4];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < kSTiles / 2; ++np) {
          // matrices: keys np*16+{0..7, 0..7, 8..15, 8..15} x chunks kk*2+{0,1,0,1}
          u32 kb[4];
          ldmatrix_x4(kb, sK + QKTile::offset(np * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
          Elem<T>::mma(s[2 * np], qf[kk], kb[0], kb[1]);
          Elem<T>::mma(s[2 * np + 1], qf[kk], kb[2], kb[3]);
        }
      }

      const bool full = !tile_bad && n0 + kBlockN <= n_end &&
                        mask.all_visible(wq_lo, wq_hi, w.k_pos0 + n0, w.k_pos0 + n0 + kBlockN - 1);
      if (!full)
        apply_mask(s, mask, w, wr0 + (lane >> 2), n0, n_end, kPaged && tile_bad ? key_ok + stage * kBlockN : nullptr);
      sm.update(s, o, p.scale_log2);

      // O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        u32 pa[4];
        pack_p<T>(s, kk, pa);
#pragma unroll
        for (int dp = 0; dp < kOTiles / 2; ++dp) {
          // matrices (transposed): keys kk*16+{0..7, 8..15, 0..7, 8..15} x chunks dp*2+{0,0,1,1}
          u32 vb[4];
          ldmatrix_x4_trans(vb, sV + VTile::offset(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dp * 2 + (lane >> 4)));
          Elem<T>::mma(o[2 * dp], pa, vb[0], vb[1]);
          Elem<T>::mma(o[2 * dp + 1], pa, vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }

  // ---- epilogue: normalize, write rows that exist; rows with no visible key get 0 and lse -inf ----
  store_rows<OutT>(o, sm, w, wr0 + (lane >> 2), static_cast<OutT*>(p.out), p.o_st, p.o_sh, p.lse, p.lse_st,
                   p.accumulate != 0);
}

}  // namespace sm80
}  // namespace mla
