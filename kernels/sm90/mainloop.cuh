// The consumer mainloop: two warpgroups (three in fp8 under the causal and no mask), 64 query rows
// each. Per key tile, S = Q K^T by wgmma with both operands in shared memory, the online
// softmax in registers, and O += P V with P from registers and V read transposed from shared
// memory (fp8: e4m3 P and V^T).
//
//   * Intra-warpgroup overlap: a consumer issues S_t = Q K_t^T and then O += P_{t-1} V_{t-1}, waits
//     for S_t only, and runs the softmax of tile t while the tensor cores still work on P V; only
//     then does it wait for O and rescale it. The loop is peeled (tile 0, tiles 1..n-1, the last
//     P V) so that no wgmma sits under a per-tile branch: ptxas serializes every wgmma of a kernel
//     that has one in a divergent path (advisory C7518).
//   * Masked and fully visible tiles run in separate loop copies (MLA_SM90_SPLIT_MASKED): for the
//     masks here a warpgroup's fully visible tiles are one run [t_lo, t_hi) (softmax.cuh:
//     full_tile_range), so the tiles before and after it take the mask and the run itself none.
//     A warpgroup whose rows see nothing of a tile computes it anyway, masked to zeros: rare in
//     128-row blocks, and cheaper than serialized wgmma. In 192-row blocks (three fp8 consumers) the
//     first consumer sees nothing of the last key tile in every causal block: such tiles at a work
//     tile's end are skipped (kSkipTail, skip_tail).
//   * Half tiles (MLA_SM90_HALF_TILE, 16-bit variants): a warpgroup none of whose rows sees the
//     second half of the work tile's last key tile (consumer 0 on a causal diagonal) runs that
//     tile's P V over its first 64 keys and, when it is the work tile's only tile, its S by m64n64
//     wgmma: a one-tile work tile's tensor work falls by a quarter, a longer one's diagonal tile's
//     by a tenth. The first-tile and last-P V paths of either shape complete their wgmma before
//     the paths join; a loop copy for the S of a longer work tile's half tile made ptxas
//     serialize the wgmma of several families (C7511).
//   * fp8 per token: the consumers take turns issuing their GEMMs (pingpong, named barriers), so
//     that one's softmax runs under the others' GEMMs. Consumer 0 has the first turn; all run the
//     same GEMM blocks (same work tiles and counts; an idle consumer its turns alone), so turns go
//     round exactly, and consumer 0 takes the last pass after the loop. (MLA_SM90_FP8_TURNS: what a
//     turn covers with three consumers, or no turns.)
//   * Keys past a sequence's end arrive from TMA (the neighbour's rows, or zeros past Tk): their
//     scores are masked and, in the one partial tile, their V rows are zeroed in shared memory
//     before P V (fp8: their V^T columns), so a neighbour's NaN can never reach this sequence.
#pragma once
#include "config.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"
#include "softmax.cuh"

namespace mla {
namespace sm90 {

// O[64x128] += P[64xN] V[Nx128] for a key tile of N = 16 kSteps keys: P from registers (kSteps
// k-steps of 16 keys), V from the stage's shared memory read transposed. Keys 16kk .. 16kk+15 are
// rows of V: 16 rows x 128 bytes = 2048 bytes per k-step; V's two 64-wide column blocks are one
// block (N x 128 bytes: 16 KiB for 128 keys) apart (the LBO). kKeys: the tile's first kKeys keys
// only (the rest of P is zero: a half tile, Mainloop::run).
template <typename T, int kKeys = 0, int kSteps>
__device__ __forceinline__ void pv_mma(float (&o)[kOTiles][4], const u32 (&pa)[kSteps][4], u32 v_stage) {
  const unsigned long long dv = make_desc(v_stage, kSteps * 16 * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < (kKeys ? kKeys : 16 * kSteps) / 16; ++kk) Wgmma<T>::rs_tb(o, pa[kk], desc_add(dv, kk * 2048));
}
// fp8: O += P V with V^T (rows = values, 128 k positions of one byte) K-major: k-steps of 32 bytes,
// 4 for the kernels' 128-key tiles (fewer: the first keys of the stage, as pipe_probe's 96-key tiles).
template <int kSteps>
__device__ __forceinline__ void pv_mma_e4m3(float (&o)[kOTiles][4], const u32 (&pa)[kSteps][4], u32 vt_stage) {
  static_assert(kSteps <= 4, "V^T stages hold 128 keys (vt_layout.cuh)");
  const unsigned long long dv = make_desc(vt_stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) WgmmaE4m3::rs(o, pa[kk], desc_add(dv, kk * 32));
}

template <class V, class Mask, bool kPaged>
struct Mainloop {
  using T = typename V::Elem;
  static constexpr int kS = V::kStages;
  static constexpr int kBN = V::kBlockN;      // keys per key tile
  static constexpr int kST = kSTiles<V>;      // n-tiles of 8 keys in S
  static constexpr bool kRW = kRopeWarp<V, kPaged>;
  static constexpr bool kSumMma = kRowSumMma<V>;  // rows' sums of P on the tensor pipe
  // P's e4m3 bytes from the exponent (kExpBytes) in the mask-free key tiles; a tile on a mask's edge,
  // where a row's last (and a short row's only) keys are, takes exp2 rounded to e4m3
  template <int kMode> static constexpr bool kBytesIn = kExpBytes<V> && kMode == kMaskNone;
  // fp8 key scales: read from shared memory where they multiply with three consumers
  // (dequantize_scores_at), else into registers as soon as the K stage is full, before the GEMMs
  // (after them the loads queue behind the GEMMs' shared-memory reads: measured 7-8% slower)
  static constexpr bool kScalesInPlace = V::kFp8 && V::kConsumers == 3;
  static constexpr bool kScalesEarly = V::kFp8 && !kScalesInPlace;
  // ... in pairs where every tile's first key row is even (EvenKeyRows)
  static constexpr bool kScalePairs = kScalesInPlace && V::kEvenKeyRows;
  // Three consumers with a rope warp: the softmax step compiled on each side of the unreadable-key
  // branch (scores_to_p), so that its two paths join after the softmax; joined before it (S masked
  // or not, then one softmax) ptxas spills 76-104 bytes in the consumers at 160 registers.
  static constexpr bool kSoftmaxPerPath = kRW && V::kConsumers == 3;
  // A work tile's last key tile may be a half tile (config.cuh: kHalfTilesFor).
  static constexpr bool kHalfTiles = kHalfTilesFor<V, Mask>;
  // Three fp8 consumers with MLA_SM90_FP8_TURNS 2: a turn covers P V's issue only (steps).
  static constexpr bool kTurnCoversPvOnly = V::kFp8 && V::kConsumers == 3 && MLA_SM90_FP8_TURNS == 2;
  // Key tiles at a work tile's end that no row of this warpgroup sees skipped (config.cuh: kSkipTail).
  static constexpr bool kSkip = kSkipTail<V, Mask>;

  const Params& p;          // the kernel's __grid_constant__ parameter
  const Smem<V> sm;         // by value, as the mask: a reference member would put them on the stack
  const Mask mask;
  int cw;                   // consumer index: rows cw * 64 .. cw * 64 + 63 of each work tile
  int lane, warp_in_wg;
  unsigned long long dq;    // wgmma descriptor of this warpgroup's 64 Q rows (K-major)
  int it = 0, nq = 0;       // the producer's counters (key tiles, Q tiles), followed in step

  __device__ __forceinline__ Mainloop(const Params& p_, const Smem<V>& sm_, const Mask& mask_)
      : p(p_), sm(sm_), mask(mask_) {
    // warp-uniform through a shuffle, so that ptxas keeps the descriptors derived from it in
    // uniform registers (no R2UR moves before each wgmma)
    cw = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;
    lane = threadIdx.x % 32;
    warp_in_wg = (threadIdx.x / 32) % 4;
    dq = make_desc(sm.q() + cw * kWgRows * 128, 16, 1024);
    if (cw == V::kConsumers - 1) turn_pass();
  }
  // Turns go round the consumers in order: c waits on kTurnBar + c, passes to the next.
  __device__ __forceinline__ void turn_wait() const {
    if constexpr (V::kPingpong) named_barrier_sync(kTurnBar + cw, kTurnThreads);
  }
  __device__ __forceinline__ void turn_pass() const {
    if constexpr (V::kPingpong) {
      if constexpr (V::kConsumers == 2) named_barrier_arrive(kTurnBar + 1 - cw, kTurnThreads);
      else named_barrier_arrive(kTurnBar + (threadIdx.x / 128) % 3, kTurnThreads);  // consumer (cw + 1) % 3
    }
  }
  // After the last work tile: the last consumer's last pass, so every turn barrier ends balanced.
  __device__ __forceinline__ void finish() const {
    if (cw == 0) turn_wait();
  }
  // Whether this consumer has no row in work tile `work` (three consumers: a sequence's last block may
  // leave the third, or the second and third, without rows; kEndAligned: its first block the first,
  // or the first and second); it then runs run_idle. With two the second computes such rows masked
  // (a block's first 64 rows always exist).
  __device__ __forceinline__ bool idle(const WorkInfo& work) const {
    // kEndAligned: rows before the first, or past the last (a sequence of one block keeps its rows
    // at the block's start)
    if constexpr (kEndAligned<V>) return work.m0 + (cw + 1) * kWgRows <= 0 || work.m0 + cw * kWgRows >= work.w.sq;
    return V::kConsumers == 3 && work.m0 + cw * kWgRows >= work.w.sq;
  }
  // The first consumer that runs work tile `work` (kEndAligned: the consumers before it have no rows).
  static __device__ __forceinline__ int first_busy(const WorkInfo& work) {
    return kEndAligned<V> && work.m0 < 0 ? -work.m0 / kWgRows : 0;
  }
  // The sequence row of this thread's row g (rows g and g + 8) in work tile `work`.
  __device__ __forceinline__ int row0(const WorkInfo& work) const {
    return work.m0 + cw * kWgRows + warp_in_wg * 16 + (lane >> 2);
  }

  // This consumer's Q rows released to the Q warp once every S of the work tile is complete: with
  // kQEarlyRelease<V> as soon as the last one is (kAtLastS, `last`: that S was the work
  // tile's last), else after the last tile's softmax (the call after the loop).
  template <bool kAtLastS>
  __device__ __forceinline__ void release_q(bool last = true) const {
    if (kAtLastS == kQEarlyRelease<V> && last) TileHandout::release(sm.q_empty(cw));
  }

  // One work tile in flight: what the per-tile steps below share.
  struct Tile {
    const WorkInfo& work;
    int wr0;                         // first sequence row of this warpgroup
    int r0;                          // sequence row of this thread's row g
    int key_lo[2], key_hi[2];        // visible keys of rows g, g + 8 from n_begin (row_key_ranges)
    float row_scale[2];              // softmax scale (times log2 e) of the thread's two rows
    float sacc[kST][4];              // S of the current key tile, then its P
    u32 pa[kPvSteps<V>][4];          // P of the previous tile, waiting for its P V
    float ksc[V::kFp8 && !kScalesInPlace ? kST : 1][2];  // fp8: key scales of the thread's columns
    u32 scale_at;                    // kScalesInPlace: bytes from a scale box to the thread's first scale
    float corr[2];                   // rescale factors of O from the last softmax step
    float lsum[1][4];                // kSumMma: one P V's sums of P (rows g, g, g + 8, g + 8)
    u32 tile_flags;                  // the rope warp's flags of the current key tile (kRW)
    int prev_s;                      // ring stage and phase of the previous key tile
    u32 prev_parity;
  };

  // Waits for key tile `it` (its K stage, rope rows and fp8 key scales included).
  __device__ __forceinline__ void wait_k(int it) const { mbar_wait(sm.k_full(it % kS), (it / kS) & 1); }
  // One k-step of S: its 128 columns, or (kHalf) the first 64 only.
  template <bool kHalf>
  static __device__ __forceinline__ void qk16(float (&d)[kST][4], unsigned long long da, unsigned long long db, int acc) {
    if constexpr (kHalf) Wgmma<T>::ss_n64(d, da, db, acc);
    else Wgmma<T>::ss(d, da, db, acc);
  }
  // Issues S = Q K^T of key tile `it`, committed as one group, after waiting for it (with
  // kScalesEarly the caller waited before reading the key scales). kHalf: the tile's first 64 keys
  // only (S's n-tiles 8..15 are left as they were; scores_to_p<.., true> sets them to -inf).
  template <bool kHalf = false>
  __device__ __forceinline__ void issue_qk(Tile& tile, int it) const {
    static_assert(!(kHalf && V::kFp8), "half tiles: 16-bit variants only");
    const int s = it % kS;
    if (!kScalesEarly) wait_k(it);
    // the rope warp's flags: read now, used after S, so the load's latency passes under the GEMMs
    // (the rope warp fenced its rows for wgmma before it arrived)
    if (kRW) tile.tile_flags = sm.s.tile_flags[s];
    fence_operands_first<kHalf ? kST / 2 : kST>(tile.sacc);
    const unsigned long long dk = make_desc(sm.k(s), 16, 1024), dr = make_desc(sm.rope(s), 16, 1024);
    wgmma_fence();
    if constexpr (V::kRopeE4m3) {
      // 4 e4m3 k-steps of 32 bytes over the nope block, then 2 over the rope block: 64-byte rows with
      // the 64-byte swizzle, this warpgroup's 64 Q rope rows 64 * 64 bytes into Q's rope block
      const unsigned long long dqr = make_desc(sm.q() + kQBlk<V> + cw * kWgRows * kDr, 16, 512, kDescSwizzle64);
      const unsigned long long dkr = make_desc(sm.rope(s), 16, 512, kDescSwizzle64);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) WgmmaE4m3::ss(tile.sacc, desc_add(dq, kk * 32), desc_add(dk, kk * 32), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) WgmmaE4m3::ss(tile.sacc, desc_add(dqr, kk * 32), desc_add(dkr, kk * 32), 1);
    } else if constexpr (V::kFp8) {
      // 4 e4m3 k-steps of 32 bytes over the nope block, then 4 16-bit k-steps over the rope
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) WgmmaE4m3::ss(tile.sacc, desc_add(dq, kk * 32), desc_add(dk, kk * 32), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) qk16<kHalf>(tile.sacc, desc_add(dq, kQBlk<V> + kk * 32), desc_add(dr, kk * 32), 1);
    } else {
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
        // k-step kk: column block kk / 4 (nope, nope, rope), 32-byte step kk % 4 inside the
        // 128-byte swizzled row
        const u32 step = (kk % 4) * 32;
        const unsigned long long dkk = kk / 4 < 2 ? desc_add(dk, (kk / 4) * kBlk<V> + step) : desc_add(dr, step);
        qk16<kHalf>(tile.sacc, desc_add(dq, (kk / 4) * kQBlk<V> + step), dkk, kk > 0);
      }
    }
    wgmma_commit();
  }
  // O += P V of ring stage s, committed as one group (kHalf: the tile's first 64 keys).
  template <bool kHalf = false>
  __device__ __forceinline__ void issue_pv(Tile& tile, float (&o)[kOTiles][4], int s) const {
    static_assert(!(kHalf && V::kFp8), "half tiles: 16-bit variants only");
    constexpr int kKeys = kHalf ? kBN / 2 : kBN;
    wgmma_fence();
    if constexpr (V::kFp8) pv_mma_e4m3(o, tile.pa, sm.v(s));
    else pv_mma<T, kKeys>(o, tile.pa, sm.v(s));
    if constexpr (kSumMma) {  // every byte of the block is one: the same descriptor for each k-step
      const unsigned long long d1 = make_desc(sm.ones(), 16, 1024);
#pragma unroll
      for (int kk = 0; kk < kPvSteps<V>; ++kk) WgmmaE4m3::rs_n8(tile.lsum, tile.pa[kk], d1, kk > 0);
    }
    wgmma_commit();
  }
  // kSumMma, after a P V is complete: its sums of P added to the rows' (relative to the same
  // maximum as that P; row_sum is rescaled with O after each softmax step). Each lane of a quad holds
  // its rows' whole sums.
  __device__ __forceinline__ void add_row_sums(Tile& tile, OnlineSoftmax& smx) const {
    if constexpr (kSumMma) {
      fence_operands(tile.lsum);
      smx.row_sum[0] += tile.lsum[0][0];
      smx.row_sum[1] += tile.lsum[0][2];
    }
  }
  // fp8: the key scales of key tile t (ring position it) into registers (kScalesEarly: before the GEMMs).
  __device__ __forceinline__ void key_scales(Tile& tile, int t, int it) const {
    if constexpr (V::kFp8 && !kScalesInPlace)
      load_key_scales(reinterpret_cast<const float*>(sm.s.stage[it % kS].k + kKScalesOffset<V>),
                      tile.work.w.kv_row0 + tile.work.n_begin + t * kBN, tile.ksc);
  }
  // S of key tile t (ring position it) into probabilities: dequantized (fp8), masked as kMode says,
  // its K stage (with the rope rows and their flags) released. kHalf: S holds the tile's first 64
  // keys; the rest of the tile is set to -inf here.
  template <int kMode, bool kHalf = false>
  __device__ __forceinline__ void scores_to_p(Tile& tile, OnlineSoftmax& smx, int t, int it) const {
    constexpr int kTiles = kHalf ? kST / 2 : kST;  // n-tiles of S the GEMM wrote
    fence_operands_first<kTiles>(tile.sacc);
    const int s = it % kS;
    if constexpr (kScalesInPlace) dequantize_scores_at<kTiles, kScalePairs>(tile.sacc, sm.k_scales(s) + tile.scale_at);
    else if constexpr (V::kFp8) dequantize_scores<kTiles>(tile.sacc, tile.ksc);
#pragma unroll
    for (int nt = kTiles; nt < kST; ++nt) tile.sacc[nt][0] = tile.sacc[nt][1] = tile.sacc[nt][2] = tile.sacc[nt][3] = neg_inf();
    bool masked = kMode == kMaskApply;
    if (kMode == kMaskTest) masked = tile_needs_mask<kBN>(tile.key_lo, tile.key_hi, t);
    if (masked) mask_tile(tile.sacc, tile.key_lo, tile.key_hi, t);
    // a key of the tile could not be read (rare): its own mask, branch-free, so that the loops keep
    // the plain rope's code (a byte flag per score under the key-range test tripled them)
    const bool unreadable = kRW && (tile.tile_flags & kTileUnreadable);
    if constexpr (kSoftmaxPerPath) {
      if (unreadable) {
        mask_unreadable<kST, kSumMma>(tile.sacc, sm.s.key_ok[s]);
        softmax_step<kMode>(tile, smx, s);
      } else {
        softmax_step<kMode>(tile, smx, s);
      }
    } else {
      if (unreadable) mask_unreadable<kST, kSumMma>(tile.sacc, sm.s.key_ok[s]);
      softmax_step<kMode>(tile, smx, s);
    }
  }
  // The K stage of ring stage s released, then S (dequantized and masked) made probabilities.
  // kMode: the tile's masking; the maximum's slack (MLA_SM90_LAZY_RESCALE 2) in the mask-free tiles
  // only, the masked ones (a work tile's diagonal, few) keep their registers for the mask.
  template <int kMode>
  __device__ __forceinline__ void softmax_step(Tile& tile, OnlineSoftmax& smx, int s) const {
    TileHandout::release(sm.k_empty(s));
    constexpr int kLog2P = V::kFp8 ? kLog2PScale : 0;  // fp8: kPScale * P (fp8.cuh)
    constexpr int kSlackQ = kMode == kMaskNone ? kMaxSlackQ<V> : 0;
    smx.update_scores<kLog2P, !kSumMma, kSlackQ, kBytesIn<kMode>>(tile.sacc, tile.row_scale, tile.corr);
  }
  // A work tile's first key tile: S issued, completed and made probabilities (masked). The paths
  // of a branch between wgmma shapes join with no wgmma in flight and S whole (here and in last_pv):
  // otherwise ptxas serializes every wgmma of the kernel (advisories C7511 / C7515).
  template <bool kHalf>
  __device__ __forceinline__ void first_tile(Tile& tile, OnlineSoftmax& smx, int it) const {
    turn_wait();
    issue_qk<kHalf>(tile, it);
    turn_pass();
    if (!kScalesEarly) key_scales(tile, 0, it);
    wgmma_wait<0>();
    release_q<true>(tile.work.num_tiles == 1);
    scores_to_p<kMaskApply, kHalf>(tile, smx, 0, it);
  }
  // The last tile's P V, issued and completed.
  template <bool kHalf>
  __device__ __forceinline__ void last_pv(Tile& tile, float (&o)[kOTiles][4], int s) const {
    turn_wait();
    issue_pv<kHalf>(tile, o, s);
    turn_pass();
    wgmma_wait<0>();
  }
  // O rescaled by the last softmax step's factors; with kLazyRescale not when every factor of the
  // warp's rows is 1 (a warp-uniform branch around multiplies only).
  static __device__ __forceinline__ void rescale_o(float (&o)[kOTiles][4], const float (&corr)[2]) {
    if constexpr (kLazyRescale<V>) {
      if (__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) return;
    }
    OnlineSoftmax::rescale(o, corr);
  }
  // Key tiles t .. end - 1: S_t and P_{t-1} V_{t-1} in flight together; the softmax of S_t
  // overlaps P V. Without the overlap (three consumers, or fp8 with MLA_SM90_FP8_OVERLAP 0):
  // P_{t-1} V_{t-1} issued and completed, then S_t (fp8: the key scales read after it): one GEMM in
  // flight per warpgroup and nothing of tile t - 1 across the softmax of tile t (the register budget
  // of a third consumer warpgroup: with both GEMMs in flight at 160 registers ptxas serializes every
  // wgmma, C7512).
  template <int kMode>
  __device__ __forceinline__ void steps(Tile& tile, float (&o)[kOTiles][4], OnlineSoftmax& smx, int& t, int end) {
    for (; t < end; ++t, ++it) {
      const int s = it % kS;
      const u32 parity = (it / kS) & 1;
      if constexpr (!kOverlap<V>) {
        turn_wait();
        mbar_wait(sm.v_full(tile.prev_s), tile.prev_parity);
        issue_pv(tile, o, tile.prev_s);
        if (kTurnCoversPvOnly) turn_pass();
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(tile.pa);
        add_row_sums(tile, smx);
        TileHandout::release(sm.v_empty(tile.prev_s));
        if (kScalesEarly) wait_k(it);
        issue_qk(tile, it);
        if (!kTurnCoversPvOnly) turn_pass();
        wgmma_wait<0>();
        release_q<true>(t + 1 == tile.work.num_tiles);
        key_scales(tile, t, it);
        scores_to_p<kMode>(tile, smx, t, it);
        rescale_o(o, tile.corr);
        if constexpr (kSumMma) smx.rescale_sums(tile.corr);
        pack_probabilities<V, kBytesIn<kMode>>(tile.sacc, tile.pa);
      } else {
        if (kScalesEarly) wait_k(it), key_scales(tile, t, it);
        turn_wait();
        issue_qk(tile, it);
        mbar_wait(sm.v_full(tile.prev_s), tile.prev_parity);
        issue_pv(tile, o, tile.prev_s);
        turn_pass();
        if (!kScalesEarly) key_scales(tile, t, it);
        wgmma_wait<1>();  // S_t is ready (groups complete in order); P V may still run
        release_q<true>(t + 1 == tile.work.num_tiles);
        scores_to_p<kMode>(tile, smx, t, it);
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(tile.pa);
        TileHandout::release(sm.v_empty(tile.prev_s));
        rescale_o(o, tile.corr);
        pack_probabilities<V, kBytesIn<kMode>>(tile.sacc, tile.pa);
      }
      tile.prev_s = s;
      tile.prev_parity = parity;
    }
  }

  // A work tile's per-row state in `tile` (tile.work set): rows, visible key ranges, softmax scales; its
  // fully visible key tiles [t_lo, t_hi) of this warpgroup; returns whether the last key tile is a
  // half tile for it (1 or 0).
  __device__ __forceinline__ int prepare(Tile& tile, int& t_lo, int& t_hi) const {
    const WorkInfo& work = tile.work;
    const WorkTile& w = work.w;
    tile.wr0 = work.m0 + cw * kWgRows;
    tile.r0 = row0(work);
    row_key_ranges<kEndAligned<V>>(mask, w, tile.r0, work.n_begin, work.n_end, tile.key_lo, tile.key_hi);
    // the warpgroup's first row that exists (kEndAligned: rows before the sequence's first do not)
    const int wr_first = kEndAligned<V> ? max(tile.wr0, 0) : tile.wr0;
    if constexpr (kScalesInPlace) tile.scale_at = static_cast<u32>(4 * key_scale_index(w.kv_row0 + work.n_begin));  // bytes
    // fp8: S_ij = q_scale[i] k_scales[j] raw_ij; k_scales[j] multiplies the scores (before the mask:
    // scales may be 0), q_scale[i] >= 0 (the API checks it) folds into the row's scale, as the
    // maximum of q_scale[i] x is q_scale[i] max(x): one multiply per score instead of two on the
    // softmax's critical path. A zero q_scale becomes FLT_MIN (all scores 0 -> uniform weights; a
    // zero scale would turn masked -inf scores into NaN).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile.row_scale[r] = p.scale_log2;
      if constexpr (V::kFp8) {
        const float qs = row_exists<kEndAligned<V>>(tile.r0 + 8 * r, w.sq)
                             ? p.q_scale[(w.q_row0 + tile.r0 + 8 * r) * p.q_scale_stride] : 1.f;
        const float rs = qs * p.scale_log2;
        tile.row_scale[r] = rs == 0.f ? 1.17549435e-38f : rs;  // FLT_MIN
      }
    }
    t_lo = t_hi = 0;
    if constexpr (MLA_SM90_SPLIT_MASKED) full_tile_range<kBN>(mask, w, wr_first, work.n_begin, work.n_end, work.num_tiles, t_lo, t_hi);
    // A half last tile: none of this warpgroup's rows sees the second half of the last key tile
    // (consumer 0 on a causal diagonal), so its S and P V take the first 64 keys.
    return kHalfTiles ? last_tile_is_half<kBN>(mask, w, wr_first, work.n_begin, work.num_tiles, t_hi) : 0;
  }
  // Waits for this consumer's Q rows of the work tile; key tile 0's ring position becomes "previous".
  __device__ __forceinline__ void wait_q(Tile& tile) {
    mbar_wait(sm.q_full(cw), nq & 1);
    ++nq;
    tile.prev_s = it % kS;
    tile.prev_parity = (it / kS) & 1;
  }

  // The mainloop of work tile `work`: O (unnormalized; fp8: times kPScale) and the softmax state of this
  // thread's two rows.
  __device__ __forceinline__ void run(const WorkInfo& work, float (&o)[kOTiles][4], OnlineSoftmax& smx) {
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    smx.init();
    if (work.num_tiles == 0) return;
    Tile tile{work};
    tile.tile_flags = 0;
    int t_lo, t_hi;
    const int half = prepare(tile, t_lo, t_hi);
    wait_q(tile);
    // Tile 0: S only (O is still zero, nothing to rescale).
    if (kScalesEarly) wait_k(it), key_scales(tile, 0, it);
    if (kHalfTiles && half && work.num_tiles == 1) first_tile<kHalfTiles>(tile, smx, it);
    else first_tile<false>(tile, smx, it);
    pack_probabilities<V, kBytesIn<kMaskApply>>(tile.sacc, tile.pa);
    ++it;
    int t = 1;
    // kSkipTail: the key tiles this warpgroup computes (the rest of the work tile it cannot see)
    const int t_end = kSkip ? visible_tiles<kBN>(mask, work.w, kEndAligned<V> ? max(tile.wr0, 0) : tile.wr0, work.n_begin,
                                                  work.num_tiles)
                            : work.num_tiles;
    if constexpr (MLA_SM90_SPLIT_MASKED) {
      steps<kMaskApply>(tile, o, smx, t, t_lo);
      steps<kMaskNone>(tile, o, smx, t, t_hi);
      steps<kMaskApply>(tile, o, smx, t, t_end);
    } else {
      steps<kMaskTest>(tile, o, smx, t, t_end);
    }
    release_q<false>();  // every S of this work tile is done: the Q warp may load our next rows

    if (kSkip && t_end < work.num_tiles) {
      // The last computed tile's P V in the turn of the first skipped tile, then the skipped tiles'
      // protocol (skip_tail); each path completes its wgmma before they join.
      turn_wait();
      mbar_wait(sm.v_full(tile.prev_s), tile.prev_parity);
      issue_pv(tile, o, tile.prev_s);
      turn_pass();
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(tile.pa);
      TileHandout::release(sm.v_empty(tile.prev_s));
      skip_tail(work, t_end);
    } else {
      // The last tile's P V, after its V rows past the span's end are zeroed.
      const int last = tile.prev_s;
      zero_v_tail(work, last, tile.prev_parity);
      if (kHalfTiles && half) last_pv<kHalfTiles>(tile, o, last);
      else last_pv<false>(tile, o, last);
      fence_operands(o);
      fence_operands(tile.pa);
      TileHandout::release(sm.v_empty(last));
    }
    if constexpr (kSumMma) {
      add_row_sums(tile, smx);
      // each lane of a quad holds its rows' whole sums and the epilogue adds the quad's four
      // (row_weights: quad_sum), so each lane gives a quarter (exact: a power of two)
      smx.row_sum[0] *= 0.25f;
      smx.row_sum[1] *= 0.25f;
    }
  }

  // Threads of the consumers that run work tile `work` (not run_idle), which zero V's tail together:
  // every consumer's with two; with three, the idle ones (the last by rows; kEndAligned: the first, or the last) stay out of that
  // barrier, since an aligned bar.sync must be one instruction for all its threads (compute-
  // sanitizer's synccheck: "divergent threads in block" when run_idle had a copy of it).
  __device__ __forceinline__ int zeroing_threads(const WorkInfo& work) const {
    if constexpr (V::kConsumers == 3)
      return 128 * (min(V::kConsumers, (work.w.sq - work.m0 + kWgRows - 1) / kWgRows) - first_busy(work));
    else return kConsumerThreads<V>;
  }
  // Waits for the last key tile's V (ring stage `last`) and zeroes its rows past the span's end (the
  // neighbour's keys), by the consumers that run the work tile together, the stores made visible
  // to wgmma before any of them reads V.
  __device__ __forceinline__ void zero_v_tail(const WorkInfo& work, int last, u32 parity) const {
    mbar_wait(sm.v_full(last), parity);
    const int valid = work.n_end - (work.n_begin + (work.num_tiles - 1) * kBN);
    if (valid < kBN) {
      const int tid = thread_index_here() - 128 * (1 + first_busy(work));  // 0 .. zeroing threads - 1 (the consumers in order)
      const int nthreads = zeroing_threads(work);
      if constexpr (V::kFp8) {
        zero_vt_keys_from(sm.v(last), valid, tid, nthreads);  // V^T: key columns
      } else {
        for (int i = tid; i < (kBN - valid) * (kDv / 8); i += nthreads) {
          const int r = valid + i / (kDv / 8);
          const int c = i % (kDv / 8);  // 16-byte chunk: block c / 8, chunk c % 8 of the row
          sts128(sm.v(last) + (c / 8) * kBlk<V> + r * 128 + (c % 8) * 16, 0u, 0u, 0u, 0u);
        }
      }
      fence_proxy_async();
      named_barrier_sync(kVZeroBar, nthreads);
    }
  }

  // Key tile `it` with no GEMM of this consumer (run_idle, skip_tail): its turn, its K stage released
  // once full and, with has_prev, the previous tile's V stage (prev_s, prev_parity) released once
  // full; this tile then becomes the previous one.
  __device__ __forceinline__ void idle_tile(bool has_prev, int& prev_s, u32& prev_parity) const {
    const int s = it % kS;
    turn_wait();
    turn_pass();
    wait_k(it);
    TileHandout::release(sm.k_empty(s));
    if (has_prev) {
      mbar_wait(sm.v_full(prev_s), prev_parity);
      TileHandout::release(sm.v_empty(prev_s));
    }
    prev_s = s;
    prev_parity = (it / kS) & 1;
  }

  // kSkipTail: key tiles t_end .. of work tile `work`, which no row of this consumer sees (their P V
  // taken care of by the caller up to tile t_end - 1, in tile t_end's turn): no GEMM, the protocol
  // of run only, so that every count agrees: tile t_end's K stage released once full; per later key
  // tile a turn, its K stage and the previous tile's V stage released once full; the last tile's V
  // tail zeroed with the other running consumers (zeroing_threads counts this one), its last turn.
  __device__ __forceinline__ void skip_tail(const WorkInfo& work, int t_end) {
    wait_k(it);
    TileHandout::release(sm.k_empty(it % kS));
    int prev_s = it % kS;
    u32 prev_parity = (it / kS) & 1;
    ++it;
    for (int t = t_end + 1; t < work.num_tiles; ++t, ++it) idle_tile(true, prev_s, prev_parity);
    zero_v_tail(work, prev_s, prev_parity);
    turn_wait();
    turn_pass();
    TileHandout::release(sm.v_empty(prev_s));
  }

  // A work tile in which this consumer has no row (idle): no GEMM, the barrier protocol of run
  // only, step for step, so that every count agrees: its Q rows taken and released, per key tile
  // a turn and the K stage released once full, V released once full a tile later, the last
  // tile's turn and its V released once full (the others zero its tail: zeroing_threads).
  __device__ __forceinline__ void run_idle(const WorkInfo& work) {
    if (work.num_tiles == 0) return;
    mbar_wait(sm.q_full(cw), nq & 1);
    ++nq;
    TileHandout::release(sm.q_empty(cw));
    int prev_s = 0;
    u32 prev_parity = 0;
    for (int t = 0; t < work.num_tiles; ++t, ++it) idle_tile(t > 0, prev_s, prev_parity);
    mbar_wait(sm.v_full(prev_s), prev_parity);
    turn_wait();
    turn_pass();
    TileHandout::release(sm.v_empty(prev_s));
  }
};

}  // namespace sm90
}  // namespace mla
