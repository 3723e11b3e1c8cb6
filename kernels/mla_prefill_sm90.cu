// Hopper MLA prefill kernel (sm_90a): warp-specialized, TMA + wgmma, FlashAttention-3 style.
//
//   * Persistent: one CTA per SM works through the work tiles (128 query rows of one head of one
//     sequence) in the order of tile_scheduler.cuh (heads in L2-sized sections, longest first),
//     taking each next tile from a global counter when it frees up (sm90_scheduler.cuh).
//     3 warpgroups:
//       WG0, the producers: one thread issues TMA copies of each work tile's Q (once the
//           consumers are done with the previous one) and of its K/V tiles into a shared-memory
//           ring (2 stages; 3 in the fp8 per-token variant) guarded by mbarriers, K and V with
//           their own "full" and "empty" barriers; with a paged or fp8 rope a second warp brings
//           the rope rows into the K stages
//           (setmaxnreg: 56 registers);
//       WG1, WG2, the consumers: 64 query rows each; S = Q K^T with wgmma (both operands in shared
//           memory), online softmax in registers, O += P V with wgmma (P from registers, V read
//           transposed from shared memory; fp8: e4m3 P and V^T) (setmaxnreg: 224 registers).
//   * Intra-warpgroup overlap: a consumer issues S_t = Q K_t^T and then O += P_{t-1} V_{t-1}, waits
//     for S_t only, and runs the softmax of tile t while the tensor cores still work on P V; only
//     then does it wait for O and rescale it.
//   * A K tile is 128 keys x 192: two 64-wide column blocks of the head's nope part from k, then
//     the 64 rope values every head shares, copied from k_rope by their own tensor map. Nothing
//     materializes [Tk, H, 192].
//   * Tiles are 64-element column blocks with the 128-byte swizzle (what TMA writes; see sm90.cuh).
//   * With a paged cache a second producer warp (the rope warp) writes the rope rows into the K
//     stage's rope block, in parallel with warp 0's TMA of the nope blocks, and both complete the
//     stage's "full" barrier: TMA boxes of whole page runs when a tile starts on a page (or 128-key)
//     boundary, otherwise a cp.async gather (one lookup per key, unreadable pages zero-filled and
//     flagged). The same warp dequantizes an fp8 rope on the way.
//   * Key tiles a mask removes entirely are never loaded; fully visible tiles skip the predicate.
//   * Keys past a sequence's end arrive from TMA (the neighbour's rows or zero-filled past Tk): their
//     scores are masked and, in the one partial tile, their V rows are zeroed in shared memory
//     before P V (fp8: their V^T columns), so a neighbour's NaN can never reach this sequence.
//   * Variants (kVariant, below): 16-bit; fp8 per token (e4m3 Q K^T nope and P V, bf16 rope, S
//     dequantized by k_scales[j] in registers and q_scale[i] in the row's softmax scale, V^T from
//     the pre-pass of transpose_v.cu, key tiles starting on multiples of 16 keys: vt_layout.cuh,
//     the two consumers in pingpong); fp8 rope (dequantized by the rope warp).
#include "common.cuh"
#include "fp8.cuh"
#include "mask.cuh"
#include "rope_source.cuh"
#include "sm90.cuh"
#include "sm90_scheduler.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace mla {
namespace sm90 {

constexpr int kDv = 128;
constexpr int kDqk = 192;
constexpr int kBlockM = 128;                       // query rows per CTA
constexpr int kBlockN = 128;                       // keys per tile
// K/V ring depth: 2 stages of 80 KiB (16-bit), 3 of 49 KiB (fp8 per token)
template <bool kFp8> constexpr int kStages = kFp8 ? 3 : 2;
constexpr int kMaxStages = 3;
constexpr int kConsumers = 2;                      // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);   // 384
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr int kWgRows = kBlockM / kConsumers;      // 64 = one wgmma M

constexpr int kColBlock = 64;                      // 16-bit elements per 128-byte swizzled column block
constexpr int kBlk = kBlockN * 128;                // one column block of a 128-row tile: 16 KiB
static_assert(kBlockM == kBlockN, "Q and K/V tiles share the column-block size");
// Named barriers (0 is __syncthreads): both consumers after zeroing V rows; the consumers' turns.
constexpr int kVZeroBar = 1;
constexpr int kTurnBar = 2;                        // kTurnBar + c: consumer c may issue its GEMMs
constexpr float kFloatMin = 1.17549435e-38f;       // FLT_MIN
// The 128 nope values of a row (of Q or K): two 16-bit column blocks, or one e4m3 block (fp8 variant).
template <bool kFp8> constexpr int kNopeBlocks = kFp8 ? 1 : 2;
// Shared memory, the base aligned to 1 KiB for the swizzle:
//   [Q][K0 V0][K1 V1](fp8: [K2 V2])[mbarriers][flags of K0, K1, K2 (rope warp)]
//   Q:  the nope block(s), then the rope block (q's last 64 values; q_rope in the fp8 variant);
//   K:  the nope block(s), then the rope block (from k_rope by TMA; with a paged cache or an fp8
//       rope, written by the rope warp), then (fp8) the key scales (kScaleBox floats, in a 1 KiB slot);
//   V:  bf16/fp16: two column blocks; fp8: one e4m3 block of V^T (128 values x 128 keys, vt_layout.cuh).
template <bool kFp8> constexpr int kQBytes = (kNopeBlocks<kFp8> + 1) * kBlk;
template <bool kFp8> constexpr int kKBytes = (kNopeBlocks<kFp8> + 1) * kBlk + (kFp8 ? 1024 : 0);
template <bool kFp8> constexpr int kVBytes = kNopeBlocks<kFp8> * kBlk;
// fp8: the key scales of a tile come in a TMA box of 132 floats starting at the 16-byte boundary at
// or before the tile's first key (a 1-D box must start 16-byte aligned); 528 bytes of the 1 KiB slot.
constexpr int kScaleBox = kBlockN + 4;
template <bool kFp8> constexpr int kStageBytes = kKBytes<kFp8> + kVBytes<kFp8>;
template <bool kFp8> constexpr int kBarOffset = kQBytes<kFp8> + kStages<kFp8> * kStageBytes<kFp8>;
constexpr int kBarBytes = 256;
constexpr int kFlagBytes = kBlockN + 16;           // per K stage: a flag per key, then two tile flags
template <bool kFp8> constexpr int kKeyOkOffset = kBarOffset<kFp8> + kBarBytes;
template <bool kFp8> constexpr int kSmemBytes = kKeyOkOffset<kFp8> + kMaxStages * kFlagBytes + 1024;
// after the ring's mbarriers: the tile hand-out's (sm90_scheduler.cuh), then its two index slots
constexpr int kHandoutOffset = 8 * (2 + 4 * kMaxStages);
static_assert(kHandoutOffset + TileHandout::kBarBytes + TileHandout::kSlotBytes <= kBarBytes,
              "the mbarriers and the hand-out slots must fit their bytes");
static_assert(kSmemBytes<false> <= 227 * 1024 && kSmemBytes<true> <= 227 * 1024, "shared memory per CTA");
// The layout's size for [kFp8], exported so a CPU test can check the launch code's mirror
// (mla_cupy/api.py: sm90_smem_bytes) against it in the PTX.
__device__ const int kSmemBytesOf[2] = {kSmemBytes<false>, kSmemBytes<true>};

// Registers per thread after setmaxnreg (128 * (producer + 2 * consumer) <= 64 K). The producer
// warps need more than a bare TMA issuer's 24: the rope warp keeps a tile's page lookups in
// registers, and warp 0 takes work tiles from the scheduler's counter (at 24, 40 or 48 ptxas
// spills in one variant or another); the consumers need no more than 224 (no spills).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register budget");

constexpr int kQkSteps = kDqk / 16;                // 12 wgmma k-steps for S (fp8: 4 e4m3 k32 + 4 rope k16)
template <bool kFp8> constexpr int kPvSteps = kFp8 ? kBlockN / 32 : kBlockN / 16;  // wgmma k-steps for O
constexpr int kSTiles = kBlockN / 8;               // 16
constexpr int kOTiles = kDv / 8;                   // 16

// O[64x128] += P[64x128] V[128x128]: P from registers (8 k-steps of 16 keys), V from the stage's
// shared memory read transposed. Keys 16kk .. 16kk+15 are rows of V: 16 rows x 128 bytes = 2048
// bytes per k-step; V's two 64-wide column blocks are one block (16 KiB) apart (the LBO).
template <typename T>
__device__ __forceinline__ void pv_mma(float (&o)[kOTiles][4], const u32 (&pa)[kPvSteps<false>][4], u32 v_stage) {
#pragma unroll
  const unsigned long long dv = make_desc(v_stage, kBlk, 1024);
#pragma unroll
  for (int kk = 0; kk < kPvSteps<false>; ++kk) Wgmma<T>::rs_tb(o, pa[kk], desc_add(dv, kk * 2048));
}
// fp8: O += P V with V^T (rows = values, 128 k positions of one byte) K-major: 4 k-steps of 32 bytes.
__device__ __forceinline__ void pv_mma_e4m3(float (&o)[kOTiles][4], const u32 (&pa)[kPvSteps<true>][4], u32 vt_stage) {
#pragma unroll
  const unsigned long long dv = make_desc(vt_stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kPvSteps<true>; ++kk) WgmmaE4m3::rs(o, pa[kk], desc_add(dv, kk * 32));
}

// Variants (kVariant):
//   kBf16: T (bf16 or fp16) everywhere;
//   kFp8PerToken: tm_q / tm_k map e4m3 q_nope / k, tm_v the e4m3 V^T of the pre-pass, tm_q_rope
//     q_rope, tm_k_scales k_scales (1-D float32); q_scale is read directly.
//     S = q_scale[i] k_scales[j] (q_nope k^T + q_rope k_rope^T);
//   kFp8Rope: q, k, v in T; the rope is e4m3 with one float32 scale per key (rope_scales), dequantized
//     to T by the rope warp.
enum Variant : int { kBf16 = 0, kFp8PerToken = 1, kFp8Rope = 2 };

template <typename T, typename OutT, typename Mask, bool kPaged, int kVariant>
__global__ void __launch_bounds__(kThreads, 1) mla_prefill_kernel(
    const __grid_constant__ TensorMap tm_q, const __grid_constant__ TensorMap tm_k,
    const __grid_constant__ TensorMap tm_v, const __grid_constant__ TensorMap tm_rope,
    const __grid_constant__ TensorMap tm_q_rope, const __grid_constant__ TensorMap tm_k_scales,
    OutT* __restrict__ out, float* __restrict__ lse,
    const u32* __restrict__ q_offsets, const u32* __restrict__ kv_begin, const u32* __restrict__ kv_end,
    const u32* __restrict__ cache_offsets, const i64* __restrict__ q_start_pos,
    i64 o_st, i64 o_sh, i64 lse_st, const void* rope_base, i64 rope_row_stride, i64 rope_block_stride,
    const u32* __restrict__ lookup, i64 lookup_stride, int log2_page_size, u32 num_blocks, u32 max_pages,
    int num_heads, int heads_per_section, int batch, int num_m_blocks, float scale_log2, i64 mask_arg,
    int accumulate, int rope_box_rows, const float* __restrict__ q_scale, i64 q_scale_stride,
    const float* __restrict__ rope_scales, i64 rope_scale_row_stride, i64 rope_scale_block_stride,
    u32* __restrict__ tile_counter) {
  constexpr bool kFp8 = kVariant == kFp8PerToken;
  constexpr bool kRope8 = kVariant == kFp8Rope;
  constexpr bool kRopeWarp = kPaged || kRope8;  // warp 1 writes the rope rows into the K stages
  constexpr int kS = kStages<kFp8>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const SeqOffsets so{q_offsets, kv_begin, kv_end, cache_offsets, q_start_pos};
  const Mask mask{mask_arg};
  const int num_work = num_m_blocks * batch * num_heads;

  // Work tile idx: its rows and the span of keys [n_begin, n_end) any of its rows may see, in
  // num_tiles key tiles. Producer and consumers decode the same tiles, so they agree on every count.
  struct Work {
    WorkTile w;
    int m0, n_begin, n_end, num_tiles;
  };
  auto plan = [&](int idx, Work& k) -> bool {
    if (!decode_work_tile(so, idx, num_heads, heads_per_section, batch, num_m_blocks, kBlockM, k.w)) return false;
    k.m0 = k.w.m_block * kBlockM;
    const int rows = min(kBlockM, k.w.sq - k.m0);
    visible_key_span(mask, k.w, k.w.q_pos0 + k.m0, k.w.q_pos0 + k.m0 + rows - 1, k.n_begin, k.n_end);
    // fp8: tiles start on a multiple of kVtAlign keys (V^T's layout); the keys added are masked
    if (kFp8) k.n_begin &= ~(kVtAlign - 1);
    k.num_tiles = (k.n_end - k.n_begin + kBlockN - 1) / kBlockN;
    return true;
  };

  const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // layout: see kSmemBytes
  const u32 sQ = base;
  const u32 bar = base + kBarOffset<kFp8>;
  const u32 q_full = bar, q_empty = bar + 8;
  // The scheduler: work-tile indices for every role (dynamic with a counter, else round robin).
  const TileHandout handout{tile_counter, bar + kHandoutOffset, num_work};
  auto k_full = [&](int s) { return bar + 16 + 8 * s; };
  auto v_full = [&](int s) { return bar + 16 + 8 * (kS + s); };
  auto k_empty = [&](int s) { return bar + 16 + 8 * (2 * kS + s); };
  auto v_empty = [&](int s) { return bar + 16 + 8 * (3 * kS + s); };
  auto sK = [&](int s) { return base + kQBytes<kFp8> + s * kStageBytes<kFp8>; };
  auto sRope = [&](int s) { return sK(s) + kNopeBlocks<kFp8> * kBlk; };  // the K stage's rope block
  auto sKScales = [&](int s) { return sRope(s) + kBlk; };                // fp8
  auto sV = [&](int s) { return sK(s) + kKBytes<kFp8>; };
  // rope warp only: key_ok[s][0..127] per-key flags of K stage s, then at byte kBlockN "a key of
  // the span is unreadable" and at kBlockN + 1 "gathered by cp.async"
  unsigned char* key_ok = smem_raw + (base - smem_addr(smem_raw)) + kKeyOkOffset<kFp8>;

  const int wg = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, kConsumerThreads);
    for (int s = 0; s < kS; ++s) {
      // warp 0's expect_tx; with the rope warp also its lanes' 32 cp.async completion arrivals (or
      // plain arrivals in their place) and 32 plain arrivals after the flags
      mbar_init(k_full(s), kRopeWarp ? 1 + 64 : 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), kConsumerThreads);
      mbar_init(v_empty(s), kConsumerThreads);
    }
    handout.init(kConsumerThreads + (kRopeWarp ? 32 : 0));
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------ producers ------------------------------------
    regs_dealloc<kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      // Warp 0, one thread: TMA for Q, K (nope, and the rope when plain) and V.
      if (lane != 0) return;
      int it = 0;  // key tiles loaded so far: the position in the K/V ring, continued across work tiles
      int nq = 0;  // Q tiles loaded so far
      for (int n = 0, idx = blockIdx.x;; ++n, idx = handout.next(idx)) {
        handout.publish(n, idx);
        if (idx >= num_work) break;
        Work k;
        if (!plan(idx, k) || k.num_tiles == 0) continue;
        const WorkTile& w = k.w;
        mbar_wait(q_empty, (nq & 1) ^ 1);  // the consumers are done with the previous Q
        mbar_expect_tx(q_full, kQBytes<kFp8>);
        const int qrow = static_cast<int>(w.q_row0 + k.m0);
        if constexpr (kFp8) {
          tma_load_3d(sQ, &tm_q, q_full, 0, w.h, qrow);               // 128 e4m3 nope values
          tma_load_3d(sQ + kBlk, &tm_q_rope, q_full, 0, w.h, qrow);   // 64 rope values
        } else {
          for (int c = 0; c < kDqk / kColBlock; ++c) tma_load_3d(sQ + c * kBlk, &tm_q, q_full, c * kColBlock, w.h, qrow);
        }
        ++nq;
        // fp8: the sequence's first column in V^T (vt_layout.cuh)
        const i64 vt_col = kFp8 ? vt_col0(static_cast<u32>(w.kv_row0), w.b) + k.n_begin : 0;
        for (int t = 0; t < k.num_tiles; ++t, ++it) {
          const int s = it % kS;
          const u32 empty_parity = ((it / kS) & 1) ^ 1;  // the first pass over the ring does not wait
          const int row = static_cast<int>(w.kv_row0 + k.n_begin + t * kBlockN);
          mbar_wait(k_empty(s), empty_parity);
          // K: the nope block(s), the rope when plain (shared by every head), the key scales (fp8)
          constexpr int kScaleBytes = kScaleBox * 4;
          mbar_expect_tx(k_full(s), (kNopeBlocks<kFp8> + (kRopeWarp ? 0 : 1)) * kBlk + (kFp8 ? kScaleBytes : 0));
          for (int c = 0; c < kNopeBlocks<kFp8>; ++c) tma_load_3d(sK(s) + c * kBlk, &tm_k, k_full(s), c * kColBlock, w.h, row);
          if (!kRopeWarp) tma_load_2d(sRope(s), &tm_rope, k_full(s), 0, row);
          if (kFp8) tma_load_1d(sKScales(s), &tm_k_scales, k_full(s), row & ~3);  // 16-byte aligned start
          mbar_wait(v_empty(s), empty_parity);
          mbar_expect_tx(v_full(s), kVBytes<kFp8>);
          if constexpr (kFp8) {  // V^T: 128 values x 128 key columns (16-byte aligned: the tile starts on a group)
            tma_load_3d(sV(s), &tm_v, v_full(s), static_cast<int>(vt_col + t * kBlockN), 0, w.h);
          } else {
            for (int c = 0; c < 2; ++c) tma_load_3d(sV(s) + c * kBlk, &tm_v, v_full(s), c * kColBlock, w.h, row);
          }
        }
      }
    } else if (kRopeWarp && warp == 1) {
      // Warp 1 (the rope warp): writes each key tile's rope rows into the rope block of its K
      // stage, alongside warp 0's TMA of the nope blocks; its lanes' 64 arrivals and warp 0's
      // expect_tx complete the stage's k_full. Three ways:
      //  * paged 16-bit cache, tile starting on a multiple of rope_box_rows (min(page size, 128); 0
      //    when the cache has no tensor map) with every key readable: one TMA box per
      //    rope_box_rows keys from tm_rope (the cache as [num_blocks][page_size][64]), never
      //    crossing a page;
      //  * other 16-bit tiles: a cp.async gather row by row;
      //  * fp8 rope (plain or paged): each lane loads its rows' 64 e4m3 bytes and scale, and stores
      //    them dequantized to T.
      // Unreadable keys (bad block ids) are zero-filled and flagged; the consumers mask them.
      const RopeArgs ra{rope_base, rope_row_stride, rope_block_stride, lookup, lookup_stride, log2_page_size,
                        num_blocks, max_pages};
      using Paged = RopeSource<true>;
      int it = 0;
      for (int n = 0, idx = blockIdx.x;; ++n, idx += gridDim.x) {
        idx = handout.take(n, idx);
        if (idx >= num_work) break;
        Work k;
        if (!plan(idx, k) || k.num_tiles == 0) continue;
        const WorkTile& w = k.w;
        // The blocks of the lane's rope rows of a tile (keys lane + 32 i; kNoBlock past the span; 0
        // for a plain source), looked up one tile ahead so the page-table reads overlap the wait for
        // a free stage.
        constexpr int kRopeRows = kBlockN / 32;
        u32 blk[kRopeRows];
        auto lookup_rows = [&](int t) {
#pragma unroll
          for (int i = 0; i < kRopeRows; ++i) {
            const int j = k.n_begin + t * kBlockN + lane + 32 * i;
            blk[i] = j >= k.n_end ? kNoBlock : (kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u);
          }
        };
        lookup_rows(0);
        for (int t = 0; t < k.num_tiles; ++t, ++it) {
          const int s = it % kS;
          const int n0 = k.n_begin + t * kBlockN;
          const int rows = min(kBlockN, k.n_end - n0);  // keys of the span in this tile
          const i64 t0 = w.k_pos0 + n0;                 // cache position of the tile's row 0
          bool bad = false;                             // a key of the span cannot be read
#pragma unroll
          for (int i = 0; i < kRopeRows; ++i) bad |= lane + 32 * i < rows && blk[i] == kNoBlock;
          bad = __any_sync(0xffffffffu, bad);
          const bool boxes = kPaged && !kRope8 && rope_box_rows > 0 && !bad && (t0 & (rope_box_rows - 1)) == 0;
          mbar_wait(k_empty(s), ((it / kS) & 1) ^ 1);  // as warp 0: the first pass does not wait
          const u32 dst = sRope(s);
          unsigned char* ok_flags = key_ok + s * kFlagBytes;
          if constexpr (kRope8) {
#pragma unroll
            for (int i = 0; i < kRopeRows; ++i) {
              const int x = lane + 32 * i;
              const bool ok = blk[i] != kNoBlock;
              const unsigned char* src = nullptr;
              float sc = 0.f;
              if (ok) {
                const i64 kv_row = w.kv_row0 + n0 + x;
                if (kPaged) {
                  src = Paged::at<unsigned char>(ra, blk[i], t0 + x);
                  sc = rope_scales[static_cast<i64>(blk[i]) * rope_scale_block_stride + Paged::slot(ra, t0 + x) * rope_scale_row_stride];
                } else {
                  src = static_cast<const unsigned char*>(rope_base) + kv_row * rope_row_stride;
                  sc = rope_scales[kv_row * rope_scale_row_stride];
                }
              }
              store_rope_row_e4m3<T>(dst + x * 128, x, src, sc);
              ok_flags[x] = ok;
            }
            fence_proxy_async();      // the dequantized rows, visible to wgmma
            mbar_arrive(k_full(s));  // (in place of the cp.async arrivals)
          } else if (boxes) {
            // Rows past the span stay as they are: their scores are masked. Lane 0's expect_tx
            // and 31 plain arrivals here stand for the cp.async arrivals.
            const int nbox = (rows + rope_box_rows - 1) / rope_box_rows;
            if (lane == 0) mbar_expect_tx(k_full(s), nbox * rope_box_rows * 128);
            else mbar_arrive(k_full(s));
#pragma unroll
            for (int i = 0; i < kRopeRows; ++i) {
              const int x = lane + 32 * i;
              if (x < rows && (x & (rope_box_rows - 1)) == 0)
                tma_load_3d(dst + x * 128, &tm_rope, k_full(s), 0, Paged::slot(ra, t0 + x), static_cast<int>(blk[i]));
            }
          } else {
            // 8 chunks of 16 bytes per row, written in the 128-byte swizzle (chunk c of row x at
            // chunk c ^ (x % 8)).
#pragma unroll
            for (int i = 0; i < kRopeRows; ++i) {
              const int x = lane + 32 * i;
              const bool ok = blk[i] != kNoBlock;
              const T* src = ok ? Paged::at<T>(ra, blk[i], t0 + x) : static_cast<const T*>(rope_base);
#pragma unroll
              for (int c = 0; c < 8; ++c) cp_async_16(dst + x * 128 + ((c ^ (x & 7)) << 4), src + c * 8, ok);
              ok_flags[x] = ok;
            }
            mbar_cp_async_arrive(k_full(s));  // arrives when this lane's copies have landed
          }
          if (lane == 0) {
            ok_flags[kBlockN] = bad;
            ok_flags[kBlockN + 1] = !kRope8 && !boxes;  // gathered by cp.async: the consumers fence
          }
          __syncwarp();
          mbar_arrive(k_full(s));  // release: the flags are visible once the barrier completes
          if (t + 1 < k.num_tiles) lookup_rows(t + 1);
        }
      }
    }
    return;
  }

  // ------------------------------------ consumers ------------------------------------
  regs_alloc<kConsumerRegs>();
  const int cw = wg - 1;                           // consumer index: rows cw * 64 .. cw * 64 + 63
  const int ctid = threadIdx.x - 128;              // 0 .. 255 across both consumers
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const u32 sQw = sQ + cw * kWgRows * 128;         // this warpgroup's 64 rows inside each column block
  const unsigned long long dq = make_desc(sQw, 16, 1024);  // their wgmma descriptor (K-major)
  int it = 0, nq = 0;                              // the producer's counters, followed in step
  // fp8 per token: the two consumers take turns issuing their GEMMs (FlashAttention-3's pingpong),
  // so that one's softmax runs under the other's GEMMs (the e4m3 P V alone is too short to hide
  // it). Consumer 0 has the first turn; both run the same GEMM blocks (same work tiles and counts),
  // so turns alternate exactly, and consumer 0 takes the last pass after the loop.
  constexpr bool kPingpong = kFp8;
  auto turn_wait = [&]() { if constexpr (kPingpong) named_barrier_sync(kTurnBar + cw, kConsumerThreads); };
  auto turn_pass = [&]() { if constexpr (kPingpong) named_barrier_arrive(kTurnBar + 1 - cw, kConsumerThreads); };
  if (cw == 1) turn_pass();

  for (int n = 0, idx = blockIdx.x;; ++n, idx += gridDim.x) {
    idx = handout.take(n, idx);
    if (idx >= num_work) break;
    Work k;
    if (!plan(idx, k)) continue;
    const WorkTile& w = k.w;
    const int wr0 = k.m0 + cw * kWgRows;           // first sequence row of this warpgroup
    const int row0 = wr0 + warp_in_wg * 16 + (lane >> 2);  // sequence row of this thread's row g
    const i64 wq_lo = w.q_pos0 + wr0;
    const i64 wq_hi = w.q_pos0 + min(wr0 + kWgRows - 1, w.sq - 1);

    float o[kOTiles][4];
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    OnlineSoftmax sm;
    sm.init();
    // The softmax scale of each of the thread's two rows. fp8: S_ij = q_scale[i] k_scales[j] raw_ij;
    // k_scales[j] multiplies the scores (before the mask: scales may be 0), q_scale[i] >= 0 (the API
    // checks it) folds into the row's scale, as the maximum of q_scale[i] x is q_scale[i] max(x):
    // one multiply per score instead of two on the softmax's critical path. A zero q_scale becomes
    // kFloatMin (all scores 0 -> uniform weights; a zero scale would turn masked -inf scores into NaN).
    float row_scale[2] = {scale_log2, scale_log2};
    if constexpr (kFp8) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float qs = row0 + 8 * r < w.sq ? q_scale[(w.q_row0 + row0 + 8 * r) * q_scale_stride] : 1.f;
        const float rs = qs * scale_log2;
        row_scale[r] = rs == 0.f ? kFloatMin : rs;
      }
    }

    if (k.num_tiles > 0) {
      mbar_wait(q_full, nq & 1);
      ++nq;
      float sacc[kSTiles][4];
      u32 pa[kPvSteps<kFp8>][4];  // P of the previous tile, waiting for its P V
      // Every wgmma below runs on control flow that is the same for the whole warpgroup and has no
      // per-tile branch: ptxas would otherwise serialize the asynchronous wgmmas. A warpgroup whose
      // rows see nothing of a tile computes it anyway (the mask turns it into zeros).
      // Waits for key tile `it` (its K stage, rope rows included) and issues S = Q K^T,
      // committed as one group.
      auto issue_qk = [&](int it) {
        const int s = it % kS;
        mbar_wait(k_full(s), (it / kS) & 1);
        // rope rows gathered by cp.async are generic-proxy writes, wgmma reads through the async proxy
        if (kRopeWarp && key_ok[s * kFlagBytes + kBlockN + 1]) fence_proxy_async();
        fence_operands(sacc);
        const unsigned long long dk = make_desc(sK(s), 16, 1024), dr = make_desc(sRope(s), 16, 1024);
        wgmma_fence();
        if constexpr (kFp8) {
          // 4 e4m3 k-steps of 32 bytes over the nope block, then 4 16-bit k-steps over the rope
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) WgmmaE4m3::ss(sacc, desc_add(dq, kk * 32), desc_add(dk, kk * 32), kk > 0);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Wgmma<T>::ss(sacc, desc_add(dq, kBlk + kk * 32), desc_add(dr, kk * 32), 1);
        } else {
#pragma unroll
          for (int kk = 0; kk < kQkSteps; ++kk) {
            // k-step kk: column block kk / 4 (nope, nope, rope), 32-byte step kk % 4 inside the
            // 128-byte swizzled row
            const u32 step = (kk % 4) * 32;
            const unsigned long long dkk = kk / 4 < 2 ? desc_add(dk, (kk / 4) * kBlk + step) : desc_add(dr, step);
            Wgmma<T>::ss(sacc, desc_add(dq, (kk / 4) * kBlk + step), dkk, kk > 0);
          }
        }
        wgmma_commit();
      };
      auto issue_pv = [&](int s) {  // O += P V_s, committed as one group
        wgmma_fence();
        if constexpr (kFp8) pv_mma_e4m3(o, pa, sV(s));
        else pv_mma<T>(o, pa, sV(s));
        wgmma_commit();
      };
      // fp8: the key scales of this thread's columns of tile t (ring position it), read from its K
      // stage while the GEMMs run, so that their latency stays off the softmax's path.
      float ksc[kFp8 ? kSTiles : 1][2];
      auto load_key_scales = [&](int t, int it) {
        if constexpr (kFp8) {
          // the tile's scales start (kv_row0 + n0) % 4 floats into the box (see the producer)
          const float* p = reinterpret_cast<const float*>(smem_raw + (sKScales(it % kS) - smem_addr(smem_raw))) +
                           ((w.kv_row0 + k.n_begin + t * kBlockN) & 3) + 2 * (lane & 3);
#pragma unroll
          for (int nt = 0; nt < kSTiles; ++nt) ksc[nt][0] = p[nt * 8], ksc[nt][1] = p[nt * 8 + 1];
        }
      };
      // Masks S of tile t (ring position it) where needed, releases its K (and rope) stage, and
      // turns S into probabilities.
      auto scores_to_p = [&](int t, int it, float (&corr)[2]) {
        fence_operands(sacc);
        const int n0 = k.n_begin + t * kBlockN;
        if constexpr (kFp8) {  // dequantize: S_ij *= k_scales[j] (q_scale[i] is in row_scale)
#pragma unroll
          for (int nt = 0; nt < kSTiles; ++nt) {
            sacc[nt][0] *= ksc[nt][0];
            sacc[nt][1] *= ksc[nt][1];
            sacc[nt][2] *= ksc[nt][0];
            sacc[nt][3] *= ksc[nt][1];
          }
        }
        const unsigned char* ok = key_ok + (it % kS) * kFlagBytes;
        const bool tile_bad = kRopeWarp && ok[kBlockN];
        const bool full = n0 + kBlockN <= k.n_end && !tile_bad && wr0 < w.sq &&
                          mask.all_visible(wq_lo, wq_hi, w.k_pos0 + n0, w.k_pos0 + n0 + kBlockN - 1);
        if (!full) apply_mask(sacc, mask, w, row0, n0, k.n_end, tile_bad ? ok : nullptr);
        mbar_arrive(k_empty(it % kS));  // K (with its rope rows and their flags) fully read
        sm.update_scores<kFp8 ? kLog2PScale : 0>(sacc, row_scale, corr);  // fp8: kPScale * P (fp8.cuh)
      };
      auto pack = [&]() {
#pragma unroll
        for (int kk = 0; kk < kPvSteps<kFp8>; ++kk) {
          if constexpr (kFp8) pack_p_e4m3(sacc, kk, pa[kk]);
          else pack_p<T>(sacc, kk, pa[kk]);
        }
      };

      // Tile 0: S only (O is still zero, nothing to rescale).
      int prev_s = it % kS;
      u32 prev_parity = (it / kS) & 1;
      float corr[2];
      turn_wait();
      issue_qk(it);
      turn_pass();
      load_key_scales(0, it);
      wgmma_wait<0>();
      scores_to_p(0, it, corr);
      pack();
      ++it;
      // Tiles 1..n-1: S_t and P_{t-1} V_{t-1} in flight together; the softmax of S_t overlaps P V.
      for (int t = 1; t < k.num_tiles; ++t, ++it) {
        const int s = it % kS;
        const u32 parity = (it / kS) & 1;
        turn_wait();
        issue_qk(it);
        mbar_wait(v_full(prev_s), prev_parity);
        issue_pv(prev_s);
        turn_pass();
        load_key_scales(t, it);
        wgmma_wait<1>();  // S_t is ready (groups complete in order); P V may still run
        scores_to_p(t, it, corr);
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pa);
        mbar_arrive(v_empty(prev_s));
        OnlineSoftmax::rescale(o, corr);
        pack();
        prev_s = s;
        prev_parity = parity;
      }
      mbar_arrive(q_empty);  // every S of this work tile is done: the producer may load the next Q

      // The last tile's P V. Its V rows past the span's end (the neighbour's keys) are zeroed first,
      // by both consumers together, and the stores made visible to wgmma before either reads V.
      mbar_wait(v_full(prev_s), prev_parity);
      const int valid = k.n_end - (k.n_begin + (k.num_tiles - 1) * kBlockN);
      if (valid < kBlockN) {
        if constexpr (kFp8) {
          zero_vt_keys_from(sV(prev_s), valid, ctid, kConsumerThreads);  // V^T: key columns
        } else {
          for (int i = ctid; i < (kBlockN - valid) * (kDv / 8); i += kConsumerThreads) {
            const int r = valid + i / (kDv / 8);
            const int c = i % (kDv / 8);             // 16-byte chunk: block c / 8, chunk c % 8 of the row
            sts128(sV(prev_s) + (c / 8) * kBlk + r * 128 + (c % 8) * 16, 0u, 0u, 0u, 0u);
          }
        }
        fence_proxy_async();
        named_barrier_sync(kVZeroBar, kConsumerThreads);
      }
      turn_wait();
      issue_pv(prev_s);
      turn_pass();
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(pa);
      mbar_arrive(v_empty(prev_s));
    }
    if constexpr (kFp8) {  // O holds kPScale * P V and the row sums kPScale * sum(P) (fp8.cuh)
#pragma unroll
      for (int i = 0; i < kOTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] *= 1.f / kPScale;
      sm.row_sum[0] *= 1.f / kPScale;
      sm.row_sum[1] *= 1.f / kPScale;
    }
    store_rows<OutT>(o, sm, w, row0, out, o_st, o_sh, lse, lse_st, accumulate != 0);
  }
  if (cw == 0) turn_wait();  // consumer 1's last pass: every turn barrier ends balanced
}

}  // namespace sm90
}  // namespace mla
