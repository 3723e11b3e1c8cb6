// The consumer warpgroups: consumer c owns keys 48c .. 48c + 47 of each work tile. Per head of the
// tile's group it keeps dV^T and dK^T (head dims x its 48 keys) in registers across the query
// blocks; dK^T's rope rows (column block 2 of Q) are not reset between heads, so they end the tile
// holding the group's sum over heads, staged for the dq thread's bulk reduction into rope_part's one
// slot (stage_rope). Per query block (step):
//   1. S = Q K_c^T and dP = dO V_c^T, issued back to back (wgmma, both operands in shared memory);
//   2. once S is done: P = exp2(scale_log2 S - lse_log2), then P^T to shared memory by stmatrix;
//      dV^T += dO^T P^T issued at once over the consumer's own 48 keys (its own P^T rows alone: a
//      barrier of its 128 threads), so that it runs under the dS math;
//   3. once dP is done: dS = P (dP - D), dS^T to shared memory;
//   4. dQ's 96 columns of the consumer = dS K over all 96 keys of the tile (both consumers' dS^T),
//      then dK^T += Q^T dS^T over its own keys;
//   5. dq staged in shared memory for the dq thread's bulk reduction.
// The two consumers meet twice per step on named barriers: before writing dS^T (both are done with
// the previous step's, which the other's dQ read) and after (the other's dS^T is there).
//
// Masks and bounds. A step's tile (64 query rows x the consumer's 48 keys) that is not wholly visible
// and inside its sequence takes the per-element predicate: invisible pairs get P = dS = 0 by a
// select, never by arithmetic, so that nothing read past a sequence's end (TMA loads the next
// sequence's rows) reaches a gradient through a zero factor. Rows of q and dout past the sequence
// (a sequence's last query block) and rows of k past it (its last key block) are zeroed in shared
// memory before the GEMMs that sum over them (dK^T, dV^T; dQ), for the same reason.
#pragma once
#include "../softmax.cuh"
#include "config.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"
#include "wgmma.cuh"

namespace mla {
namespace sm90_bwd {

template <typename T, class Mask>
struct Consumer {
  const Params& p;
  const Smem sm;
  const Mask mask;
  int cw;          // consumer index
  int wi, lane;    // warp in the warpgroup, lane
  int it = 0;      // query blocks consumed: the position in the q / dout ring
  int heads = 0;   // heads consumed (kv_full's completions)
  int tiles = 0;   // tiles whose rope was loaded
  int staged = 0;  // stagings: dq halves and the tiles' rope rows (dq_empty's)

  __device__ __forceinline__ Consumer(const Params& p_, const Smem& sm_, const Mask& mask_)
      : p(p_), sm(sm_), mask(mask_) {
    cw = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;  // warp-uniform
    wi = (threadIdx.x / 32) % 4;
    lane = threadIdx.x % 32;
  }

  // One arrival per warp on a barrier counted in consumer warps, once the warp is done.
  __device__ __forceinline__ void release(u32 bar) const {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bar);
  }
  __device__ __forceinline__ void both_consumers(int bar) const { sm90::named_barrier_sync(bar, kConsumerThreads); }

  // 16-byte pieces [0, n) of shared rows zeroed by the two consumers together: row r of piece i is
  // rows_from + i / per_row; `at(row, piece)` gives its address.
  template <class At>
  __device__ __forceinline__ void zero_rows(int rows, int per_row, At at) const {
    const int tid = threadIdx.x - 128;  // 0 .. 255 over both consumers
    for (int i = tid; i < rows * per_row; i += kConsumerThreads) {
      const u32 a = at(i / per_row, i % per_row);
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
    }
  }

  // The visible-key interval [lo, hi) of each of the thread's two rows (row0, row0 + 8 of the block's
  // query rows), as columns of the consumer's 48 keys from key `key0` of the sequence.
  __device__ __forceinline__ void row_intervals(const WorkTile& w, int row0, int key0, int (&lo)[2], int (&hi)[2]) const {
    const i64 kpos0 = w.k_pos0 + key0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      lo[r] = hi[r] = 0;
      if (row < w.sq) {
        const i64 qp = w.q_pos0 + row;
        i64 k_lo, k_hi;
        mask.key_range(qp, qp, k_lo, k_hi);
        const i64 c_lo = k_lo - kpos0, c_hi = k_hi - kpos0;
        const int last = min(kWgKeys, w.sk - key0);
        lo[r] = static_cast<int>(c_lo < 0 ? 0 : (c_lo > kWgKeys ? kWgKeys : c_lo));
        hi[r] = static_cast<int>(c_hi < 0 ? 0 : (c_hi > last ? last : c_hi));
      }
    }
  }

  // Accumulator element e of n-tile nt: row (g + 8 (e / 2)) of the warp's 16, column 8 nt + 2 t + e % 2.
  __device__ __forceinline__ int col_of(int nt, int e) const { return 8 * nt + 2 * (lane % 4) + (e & 1); }

  // Four 8x8 matrices of a [64 x 48] accumulator, as packed 16-bit pairs, stored transposed into a
  // [96 keys][64 queries] tile (128-byte rows, 128-byte swizzle): n-tiles 2j and 2j + 1, rows g and
  // g + 8 of the warp. Lane l addresses stored row (key) l % 8 of matrix l / 8.
  __device__ __forceinline__ void store_transposed(u32 tile, const u32 (&x)[6][2]) const {
    const int mat = lane / 8, r = lane % 8;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int key = cw * kWgKeys + 8 * (2 * j + mat / 2) + r;
      const int chunk = 2 * wi + (mat & 1);  // 8 queries: the warp's rows 16 wi + 8 (mat & 1) ..
      sm90::stmatrix_x4_trans(tile + key * 128 + ((chunk ^ (key & 7)) << 4), x[2 * j][0], x[2 * j][1],
                              x[2 * j + 1][0], x[2 * j + 1][1]);
    }
  }

  // The tile: zero dk^T's rope rows, then per head the query blocks, dk and dv stored per head, the
  // rope rows' sum staged at the end (a tile that no query sees adds nothing: the slot is zeroed).
  __device__ __forceinline__ void run(const bwd::KeyTile& t) {
    float dk[3][6][4], dv[2][6][4];
    zero(dk[2]);
    const bool any = t.m_begin < t.m_end;
    if (any) {
      sm90::mbar_wait(sm.rope_full(), tiles & 1);
      ++tiles;
    }
    for (int hh = 0; hh < t.heads; ++hh) {
      const int h = t.h0 + hh;
      zero(dk[0]);
      zero(dk[1]);
      zero(dv[0]);
      zero(dv[1]);
      if (any) {
        sm90::mbar_wait(sm.kv_full(), heads & 1);
        ++heads;
        const int keys = t.w.sk - t.n0;  // keys of the tile that exist
        if (keys < kBlockN) {  // k's rows past the sequence, nope and rope
          zero_rows(kBlockN - keys, kKBlocks * 4,
                    [&](int r, int i) { return sm.k() + (i / 4) * kKBlk + (keys + r) * 64 + (i % 4) * 16; });
          sm90::fence_proxy_async();
          both_consumers(kKZeroBar);
        }
#pragma unroll 1
        for (int m = t.m_begin; m < t.m_end; ++m) step(t, m, dk, dv);
        release(sm.kv_empty());
      }
      store_head(t, h, dk, dv);
    }
    if (any) {
      release(sm.rope_empty());
      stage_rope(dk[2]);
    }
  }

  template <int N>
  static __device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
  }

  // wgmma descriptors (sm90/ptx.cuh) of the operands' first k-step, which desc_add moves through the
  // k-steps (constant offsets: one add each).
  __device__ __forceinline__ unsigned long long desc_k_s() const {  // S's B: this consumer's keys
    return sm90::make_desc(sm.k() + cw * kWgKeys * 64, 16, 512, sm90::kDescSwizzle64);
  }
  __device__ __forceinline__ unsigned long long desc_v() const {  // dP's B
    return sm90::make_desc(sm.v() + cw * kWgKeys * 128, 16, 1024);
  }
  __device__ __forceinline__ unsigned long long desc_keys(u32 tile) const {  // dV^T's and dK^T's B: P^T, dS^T rows
    return sm90::make_desc(tile + cw * kWgKeys * 128, 16, 1024);
  }

  // acc += A^T B over the query block's 64 rows (4 k-steps of 16 queries), one 64-dim block of A per
  // mb: dV^T (A = dO, B = P^T) and dK^T (A = Q, B = dS^T) over this consumer's keys (desc_keys).
  template <int MB>
  static __device__ __forceinline__ void add_over_queries(float (&acc)[MB][6][4], unsigned long long a,
                                                          unsigned long long b) {
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        Wgmma<T>::template ss<1, 0>(acc[mb], sm90::desc_add(a, mb * kQBlk + kk * 2048), sm90::desc_add(b, kk * 32), 1);
  }

  // S = Q K_c^T (12 k-steps of 16 over 192) and dP = dO V_c^T (8 over 128) of query block `it`, once
  // its rows are in; two commit groups.
  __device__ __forceinline__ void issue_s_dp(float (&sc)[6][4], float (&dp)[6][4]) const {
    using namespace sm90;
    using G = Wgmma<T>;
    const int s = it % kStages;
    const u32 parity = (it / kStages) & 1;
    const unsigned long long q = make_desc(sm.q(s), 16, 1024), dout = make_desc(sm.dout(s), 16, 1024);
    const unsigned long long k = desc_k_s(), v = desc_v();
    mbar_wait(sm.q_full(s), parity);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk)
      G::template ss<0, 0>(sc, desc_add(q, (kk / 4) * kQBlk + (kk % 4) * 32), desc_add(k, (kk / 2) * kKBlk + (kk % 2) * 32),
                           kk > 0);
    wgmma_commit();
    mbar_wait(sm.do_full(s), parity);
#pragma unroll
    for (int kk = 0; kk < kDv / 16; ++kk)
      G::template ss<0, 0>(dp, desc_add(dout, (kk / 4) * kQBlk + (kk % 4) * 32),
                           desc_add(v, (kk / 4) * kVBlk + (kk % 4) * 32), kk > 0);
    wgmma_commit();
  }

  // P = exp2(scale_log2 S - lse_log2) in place, packed to 16 bits; kMasked: 0 outside each row's
  // visible columns [lo, hi) (a select: whatever S holds there).
  template <bool kMasked>
  __device__ __forceinline__ void probabilities(float (&sc)[6][4], const float (&lse)[2], const int (&lo)[2],
                                                const int (&hi)[2], u32 (&packed)[6][2]) const {
#pragma unroll
    for (int nt = 0; nt < 6; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = fast_exp2(fmaf(sc[nt][e], p.scale_log2, -lse[e / 2]));
        const int col = col_of(nt, e);
        sc[nt][e] = !kMasked || (col >= lo[e / 2] && col < hi[e / 2]) ? x : 0.f;
      }
      packed[nt][0] = Elem<T>::pack(sc[nt][0], sc[nt][1]);
      packed[nt][1] = Elem<T>::pack(sc[nt][2], sc[nt][3]);
    }
  }
  // dS = P (dP - D) in dp, packed to 16 bits; kMasked: 0 outside the visible columns, by a select.
  template <bool kMasked>
  __device__ __forceinline__ void score_grads(const float (&sc)[6][4], float (&dp)[6][4], const float (&d)[2],
                                              const int (&lo)[2], const int (&hi)[2], u32 (&packed)[6][2]) const {
#pragma unroll
    for (int nt = 0; nt < 6; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = sc[nt][e] * (dp[nt][e] - d[e / 2]);
        const int col = col_of(nt, e);
        dp[nt][e] = !kMasked || (col >= lo[e / 2] && col < hi[e / 2]) ? x : 0.f;
      }
      packed[nt][0] = Elem<T>::pack(dp[nt][0], dp[nt][1]);
      packed[nt][1] = Elem<T>::pack(dp[nt][2], dp[nt][3]);
    }
  }

  // Query block m.
  __device__ __forceinline__ void step(const bwd::KeyTile& t, int m, float (&dk)[3][6][4], float (&dv)[2][6][4]) {
    using namespace sm90;
    using G = Wgmma<T>;
    const WorkTile& w = t.w;
    const int s = it % kStages;
    float sc[6][4], dp[6][4];
    issue_s_dp(sc, dp);

    // P, then dS
    const int row0 = 16 * wi + lane / 4;  // the thread's rows row0, row0 + 8 of the query block
    const int qrow0 = m * kBlockM;        // the block's first row in the sequence
    const int key0 = t.n0 + cw * kWgKeys; // the consumer's first key in the sequence
    const bool full = qrow0 + kBlockM <= w.sq && key0 + kWgKeys <= w.sk &&
                      mask.all_visible(w.q_pos0 + qrow0, w.q_pos0 + qrow0 + kBlockM - 1, w.k_pos0 + key0,
                                       w.k_pos0 + key0 + kWgKeys - 1);
    int lo[2] = {0, 0}, hi[2] = {kWgKeys, kWgKeys};
    if (!full) row_intervals(w, qrow0 + row0, key0, lo, hi);
    const float lse[2] = {lds_f32(sm.lse(s) + 4 * row0), lds_f32(sm.lse(s) + 4 * (row0 + 8))};
    const float d[2] = {lds_f32(sm.dpsum(s) + 4 * row0), lds_f32(sm.dpsum(s) + 4 * (row0 + 8))};
    const int rows = w.sq - qrow0;
    const bool whole = rows >= kBlockM;  // no row past the sequence
    wgmma_wait<1>();
    fence_operands(sc);
    u32 packed[6][2];
    if (full) probabilities<false>(sc, lse, lo, hi, packed);
    else probabilities<true>(sc, lse, lo, hi, packed);
    // P^T rows of this consumer's keys: read by its own dV^T alone (desc_keys), which the previous
    // block's last wait saw done
    const u32 pt = sm.pt(), dst = sm.dst();
    store_transposed(pt, packed);
    if (!whole) {  // the sequence's last query block: q's and dout's rows past it zeroed, once both
      wgmma_wait<0>();  // consumers' S and dP (which read them) are done
      both_consumers(kRowZeroBar);
      const u32 q = sm.q(s), dout = sm.dout(s);
      zero_rows(kBlockM - rows, 5 * 8, [&](int r, int i) {
        const int blk = i / 8;
        return (blk < 3 ? q + blk * kQBlk : dout + (blk - 3) * kQBlk) + (rows + r) * 128 + (i % 8) * 16;
      });
    }
    fence_proxy_async();
    if (whole) sm90::named_barrier_sync(kPtReadyBar + cw, 128);  // this consumer's P^T rows in
    else both_consumers(kRowZeroBar);                            // and both consumers' zeroed rows
    // dV^T += dO^T P^T (4 k-steps of 16 queries), a commit group of its own under the dS math
    const unsigned long long dot = make_desc(sm.dout(s), kQBlk, 1024), qt = make_desc(sm.q(s), kQBlk, 1024);
    const unsigned long long ptk = desc_keys(pt), dstk = desc_keys(dst);
    wgmma_fence();
    add_over_queries(dv, dot, ptk);
    wgmma_commit();
    wgmma_wait<1>();  // dP, committed before dV^T
    fence_operands(dp);
    if (full) score_grads<false>(sc, dp, d, lo, hi, packed);
    else score_grads<true>(sc, dp, d, lo, hi, packed);
    both_consumers(kPdsFreeBar);  // both consumers' previous dQ (which read all of dS^T) complete
    store_transposed(dst, packed);
    fence_proxy_async();
    both_consumers(kPdsReadyBar);  // dS^T whole

    // dQ = dS K (6 k-steps of 16 keys), then dK^T += Q^T dS^T (4 k-steps of 16 queries): two commit
    // groups
    float dq[12][4];
    const unsigned long long dq_a = make_desc(dst, kPdsBytes, 1024);                          // dS, transposed
    const unsigned long long dq_b = make_desc(sm.k() + 3 * cw * kKBlk, kKBlk, 512, kDescSwizzle64);  // K, transposed
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      G::template ss<1, 1>(dq, desc_add(dq_a, kk * 2048), desc_add(dq_b, kk * 1024), kk > 0);
    wgmma_commit();
    add_over_queries(dk, qt, dstk);
    wgmma_commit();

    // dq staged once dQ (and dV^T, committed before it) is done: float4 (n-tile nt, thread) at
    // (nt * 128 + thread) * 16 bytes (post-pass: kDqWgmma), while dK^T runs
    wgmma_wait<1>();
    fence_operands(dq);
    mbar_wait(sm.dq_empty(cw), (staged & 1) ^ 1);  // the first pass does not wait
    ++staged;
    const u32 stage = sm.dq_stage(cw) + (threadIdx.x % 128) * 16;
#pragma unroll
    for (int nt = 0; nt < 12; ++nt)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(stage + nt * 128 * 16), "f"(dq[nt][0]),
                   "f"(dq[nt][1]), "f"(dq[nt][2]), "f"(dq[nt][3])
                   : "memory");
    // no proxy fence here: the arrive releases the stores, and the dq thread, having acquired them,
    // fences them to the async proxy before its bulk reduction (a proxy fence orders what precedes
    // it in causality order, whichever thread wrote it), off the consumers' path
    mbar_arrive(sm.dq_full(cw));

    // this block's rows released once dV^T and dK^T are done
    ++it;
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) fence_operands(dv[mb]);
#pragma unroll
    for (int mb = 0; mb < 3; ++mb) fence_operands(dk[mb]);
    release(sm.q_empty(s));
    release(sm.do_empty(s));
  }

  static __device__ __forceinline__ float lds_f32(u32 addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
    return x;
  }

  // dv (unscaled) and dk's nope rows (times scale) of head h for the tile's keys that exist:
  // accumulator element (dim 64 mb + 16 wi + g + 8 (e / 2), key 48 cw + col_of(nt, e)).
  __device__ __forceinline__ void store_head(const bwd::KeyTile& t, int h, const float (&dk)[3][6][4],
                                             const float (&dv)[2][6][4]) const {
    T* dkp = static_cast<T*>(p.dk) + h * p.dk_sh;
    T* dvp = static_cast<T*>(p.dv) + h * p.dv_sh;
    const int key0 = t.n0 + cw * kWgKeys;
#pragma unroll
    for (int nt = 0; nt < 6; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + col_of(nt, e);
        if (key >= t.w.sk) continue;
        const i64 row = t.w.kv_row0 + key;
        const int dim = 16 * wi + lane / 4 + 8 * (e / 2);
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          dvp[row * p.dv_st + 64 * mb + dim] = from_float<T>(dv[mb][nt][e]);
          dkp[row * p.dk_st + 64 * mb + dim] = from_float<T>(p.scale * dk[mb][nt][e]);
        }
      }
  }

  // The rope rows' sum over the group's heads (times scale) staged in the consumer's dq staging as
  // rope_part's rows: float (key 48 cw + k, dim d) at k * 64 + d, so that the dq thread adds the
  // consumer's keys that exist by one bulk reduction (producer.cuh: dq_reduce). The staging is free
  // once the dq thread has read the tile's last dq half (dq_empty), as for a query block.
  __device__ __forceinline__ void stage_rope(const float (&dkr)[6][4]) {
    sm90::mbar_wait(sm.dq_empty(cw), (staged & 1) ^ 1);
    ++staged;
    const u32 stage = sm.dq_stage(cw);
#pragma unroll
    for (int nt = 0; nt < 6; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dim = 16 * wi + lane / 4 + 8 * (e / 2);
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(stage + (col_of(nt, e) * kDr + dim) * 4),
                     "f"(p.scale * dkr[nt][e])
                     : "memory");
      }
    sm90::mbar_arrive(sm.dq_full(cw));
  }
};

}  // namespace sm90_bwd
}  // namespace mla
