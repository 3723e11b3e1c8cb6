// The Hopper consumer loop without its loads: what one key tile of the loop costs when the data
// is already in shared memory, and which of its parts (the GEMMs, the softmax, the turns) set that
// cost. Driven by pipe_probe.py; the kernel's own pieces (wgmma, P V, softmax, P packing) from
// kernels/sm90, the loop shape of kernels/sm90/mainloop.cuh (steps) rebuilt without barriers of
// the K/V ring: one K stage and one V stage, written once at the start, read by every tile.
//
// Every CTA (one per SM) runs V::kConsumers consumer warpgroups of 64 rows beside an idle producer
// warpgroup (the kernel's register split), `iters` key tiles each; each consumer's first thread
// writes its cycles (clock64) and nanoseconds (globaltimer) over the loop. The work is the
// kernel's per key tile: with three consumers (fp8: all-e4m3, or per token with S's rope by 16-bit
// wgmma) P V completed, then S issued and completed,
// then the key scales read where they multiply (fp8), the softmax, O's rescale and P packed; with
// two (16-bit) S_t issued beside P_{t-1} V_{t-1}, the softmax under P V. kParts leaves out the GEMMs or
// the softmax, and in fp8 the key scales (or their loads only), or sums the rows on the tensor pipe
// (and makes P's e4m3 bytes from the exponent);
// kActive < kConsumers runs only the first kActive consumers (no turns).
#include "sm90/mainloop.cuh"

namespace probe {
using namespace mla;
using namespace mla::sm90;

// The three-consumer per-token fp8 variant on 96-key tiles: S 48 registers and P 12, so that S, P and
// O fit a consumer's 160 apart and S can be issued beside P V (kTurns 3) with no kernel today.
struct Fp8K96 : Wide<VariantFp8> {
  static constexpr int kBlockN = 96;
};

constexpr int kGemms = 1;    // kParts bit: P V and S by wgmma
constexpr int kSoftmax = 2;  // kParts bit: key scales (fp8), softmax, O's rescale, P packed
constexpr int kNoScales = 4;  // kParts bit: fp8 without the key scales (one descale per head, as FlashAttention-3's)
constexpr int kConstScales = 8;  // kParts bit: fp8 key scales as constants (their multiplies without their loads)
constexpr int kRowSumMma = 16;   // kParts bit: fp8 row sums by the tensor pipe (P times a block of ones), not FADD
constexpr int kExpBytes = 32;    // kParts bit: with kRowSumMma, P's e4m3 bytes from the exponent (MLA_SM90_FP8_EXP_BYTES)

template <class V> constexpr int kQOffset = 0;
template <class V> constexpr int kKOffset = (kQBytes<V> + 1023) / 1024 * 1024;
template <class V> constexpr int kVOffset = kKOffset<V> + (kKBytes<V> + 1023) / 1024 * 1024;
template <class V> constexpr int kSmemBytes = kVOffset<V> + kVBytes<V>;
static_assert(kSmemBytes<Wide<VariantE4m3>> <= 227 * 1024 && kSmemBytes<Wide<VariantFp8>> <= 227 * 1024,
              "shared memory");

// Small finite values in every byte of the tiles (e4m3 |x| < 1, 16-bit 2^-7 <= |x| < 2^-5) and key
// scales of about 1/16, so that the softmax sees ordinary scores.
template <class V>
__device__ __forceinline__ void fill(unsigned char* smem) {
  u32* w = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < kSmemBytes<V> / 4; i += blockDim.x) {
    u32 h = (i + 1) * 2654435761u;
    h ^= h >> 15;
    w[i] = V::kFp8 ? (h & 0xB7B7B7B7u) : (h & 0x80FF80FFu) | 0x3C003C00u;
  }
  if constexpr (V::kFp8) {
    float* sc = reinterpret_cast<float*>(smem + kKOffset<V> + kKScalesOffset<V>);
    for (int i = threadIdx.x; i < kScaleBox<V>; i += blockDim.x) sc[i] = 0.0625f * (1.f + (i % 7) / 8.f);
  }
}


template <class V, int kParts, int kTurns, int kActive>
__global__ void __launch_bounds__(kThreads<V>, 1) pipe_probe(long long* cycles, long long* nanos, int iters) {
  extern __shared__ __align__(1024) unsigned char smem[];
  static_assert(kTurns == 0 || (kActive == V::kConsumers && V::kConsumers == 3),
                "turns: three consumers, every one running");
  static_assert(kTurns != 3 || V::kConsumers == 3, "turns 3: three consumers issuing S and P V in one turn");
  // the kernel's order: with three consumers P V is completed before S is issued (at 160
  // registers the two in flight spill and serialize every wgmma, here as in the fp8 kernel)
  // (kTurns 3: S and P V issued in one turn, both in flight, as two consumers do)
  constexpr bool kOverlap = V::kConsumers == 2 || kTurns == 3;
  constexpr bool kG = kParts & kGemms, kSm = kParts & kSoftmax;
  fill<V>(smem);
  fence_proxy_async();  // the generic stores made visible to wgmma
  __syncthreads();
  if (threadIdx.x < 128) {
    regs_dealloc<kProducerRegs<V>>();
    return;
  }
  regs_alloc<kConsumerRegs<V>>();
  const int cw = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;  // warp-uniform (uniform registers)
  if (cw >= kActive) return;
  const u32 base = __shfl_sync(0xffffffffu, smem_addr(smem), 0);  // uniform, as cw: descriptors in uniform registers
  const u32 q = base + kQOffset<V>, k = base + kKOffset<V>, v = base + kVOffset<V>;
  const unsigned long long dq = make_desc(q + cw * kWgRows * 128, 16, 1024);
  const unsigned long long dk = make_desc(k, 16, 1024);
  // the rope blocks (all-e4m3: 64-byte rows, 64-byte swizzle; 16-bit: the third 128-byte block)
  const unsigned long long dqr = make_desc(q + kQBlk<V> + cw * kWgRows * kDr, 16, 512, kDescSwizzle64);
  const unsigned long long dkr = make_desc(k + kBlk<V>, 16, 512, kDescSwizzle64);
  const unsigned long long dr16 = make_desc(k + kBlk<V>, 16, 1024);  // per token: the 16-bit rope block
  const u32 scale_at = k + kKScalesOffset<V> + 4 * key_scale_index(0);
  // Turns as the kernel's (mainloop.cuh): consumer c waits on kTurnBar + c and passes to c + 1
  // (modulo the consumers: warpgroup cw + 1 is consumer cw).
  auto turn_wait = [&] { if constexpr (kTurns != 0) named_barrier_sync(kTurnBar + cw, kTurnThreads); };
  auto turn_pass = [&] {
    if constexpr (kTurns != 0) named_barrier_arrive(kTurnBar + (threadIdx.x / 128) % V::kConsumers, kTurnThreads);
  };

  float o[kOTiles][4], sacc[kSTiles<V>][4];
  u32 pa[kPvSteps<V>][4];
#pragma unroll
  for (int i = 0; i < kSTiles<V>; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f, sacc[i][e] = 0.25f * e - 0.5f;
#pragma unroll
  for (int i = 0; i < kPvSteps<V>; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0x30303030u;
  OnlineSoftmax smx;
  smx.init();
  const float row_scale[2] = {0.0625f, 0.0625f};
  float corr[2];
  constexpr int kLog2P = V::kFp8 ? kLog2PScale : 0;
  float s_seen = 0.f;  // without the softmax, one value of each S is used, or ptxas drops the S wgmma
  auto use_s = [&] { if constexpr (!kSm) s_seen += sacc[0][0]; };

  auto issue_s = [&] {
    fence_operands(sacc);
    wgmma_fence();
    if constexpr (V::kRopeE4m3) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) WgmmaE4m3::ss(sacc, desc_add(dq, kk * 32), desc_add(dk, kk * 32), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) WgmmaE4m3::ss(sacc, desc_add(dqr, kk * 32), desc_add(dkr, kk * 32), 1);
    } else if constexpr (V::kFp8) {  // per token: the nope in e4m3, then the 16-bit rope (the kernel's issue_qk)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) WgmmaE4m3::ss(sacc, desc_add(dq, kk * 32), desc_add(dk, kk * 32), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        Wgmma<typename V::Elem>::ss(sacc, desc_add(dq, kQBlk<V> + kk * 32), desc_add(dr16, kk * 32), 1);
    } else {
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
        const u32 step = (kk / 4) * kBlk<V> + (kk % 4) * 32;
        Wgmma<typename V::Elem>::ss(sacc, desc_add(dq, (kk / 4) * kQBlk<V> + (kk % 4) * 32), desc_add(dk, step), kk > 0);
      }
    }
    wgmma_commit();
  };
  // kRowSumMma as the kernel's MLA_SM90_FP8_ROWSUM_MMA: P times ones beside P V (any 1 KiB of shared
  // memory as the ones: the values do not change the time), its sums added once P V is complete
  constexpr bool kRowSum = V::kFp8 && (kParts & kRowSumMma);
  constexpr bool kBytes = kRowSum && (kParts & kExpBytes);
  float lsum[1][4];
  const unsigned long long dones = make_desc(v, 16, 1024);
  auto issue_pv = [&] {
    wgmma_fence();
    if constexpr (V::kFp8) pv_mma_e4m3(o, pa, v);
    else pv_mma<typename V::Elem>(o, pa, v);
    if constexpr (kRowSum) {
#pragma unroll
      for (int kk = 0; kk < kPvSteps<V>; ++kk) WgmmaE4m3::rs_n8(lsum, pa[kk], dones, kk > 0);
    }
    wgmma_commit();
  };
  auto add_sums = [&] {
    if constexpr (kRowSum) {
      fence_operands(lsum);
      smx.row_sum[0] += lsum[0][0];
      smx.row_sum[1] += lsum[0][2];
    }
  };
  auto softmax = [&] {
    fence_operands(sacc);
    if constexpr (V::kFp8 && (kParts & kConstScales)) {
#pragma unroll
      for (int nt = 0; nt < kSTiles<V>; ++nt) scale_columns(sacc[nt], 0.0625f + nt / 256.f, 0.0625f - nt / 256.f);
    } else if constexpr (V::kFp8 && !(kParts & kNoScales)) {
      dequantize_scores_at(sacc, scale_at);
    }
    smx.update_scores<kLog2P, !kRowSum, 0, kBytes>(sacc, row_scale, corr);
  };

  if (kTurns != 0 && cw == V::kConsumers - 1) turn_pass();
  named_barrier_sync(kVZeroBar, 128 * kActive);
  // the start times go to global memory at once: four registers held across the loop would make
  // the three-consumer loop spill at 160 (the kernel's own has no spare register either)
  const int slot = blockIdx.x * V::kConsumers + cw;
  if (threadIdx.x % 128 == 0) {
    cycles[slot] = clock64();
    nanos[slot] = globaltimer();
  }
  for (int it = 0; it < iters; ++it) {
    if constexpr (!kOverlap) {  // P V completed before S: one GEMM in flight (three fp8 consumers)
      turn_wait();
      if constexpr (kG) issue_pv();
      if (kTurns == 2) turn_pass();
      if constexpr (kG) {
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pa);
        add_sums();
        issue_s();
      }
      if (kTurns == 1) turn_pass();
      if constexpr (kG) wgmma_wait<0>(), use_s();
      if constexpr (kSm) {
        softmax();
        OnlineSoftmax::rescale(o, corr);
        if constexpr (kRowSum) smx.rescale_sums(corr);
        pack_probabilities<V, kBytes>(sacc, pa);
      }
    } else {  // S_t beside P_{t-1} V_{t-1}, the softmax of t under P V (two consumers; fp8: in one turn)
      turn_wait();
      if constexpr (kG) issue_s(), issue_pv();
      turn_pass();
      if constexpr (kG) wgmma_wait<1>(), use_s();
      if constexpr (kSm) softmax();
      if constexpr (kG) {
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pa);
        add_sums();
      }
      if constexpr (kSm) {
        OnlineSoftmax::rescale(o, corr);
        if constexpr (kRowSum) smx.rescale_sums(corr);
        pack_probabilities<V, kBytes>(sacc, pa);
      }
    }
    fence_operands(o);
  }
  const long long c1 = clock64(), t1 = globaltimer();
  if (kTurns != 0 && cw == 0) turn_wait();  // the last pass, so that every turn barrier ends balanced
  // the loop's results feed a store the compiler cannot rule out
  float sink = smx.row_sum[0] + smx.row_sum[1] + s_seen;
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) sink += o[i][0] + o[i][3];  // not S: it would stay live across P V
#pragma unroll
  for (int i = 0; i < kPvSteps<V>; ++i) sink += __uint_as_float(pa[i][0] & 0x3f3f3f3fu);
  // the slot found again from the special registers (volatile reads): held across the loop, its
  // address spills in the tightest probe
  u32 cta, tid;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int end_slot = cta * V::kConsumers + tid / 128 - 1;
  if (tid % 128 == 0) {
    cycles[end_slot] = c1 - cycles[end_slot];
    nanos[end_slot] = t1 - nanos[end_slot];
  }
  if (sink == 1234.5f) cycles[end_slot] = -1;
}

// ---------------------------------------------------------------------------------------------
// The loads without the consumers: how fast one CTA per SM brings key tiles into a ring of shared-
// memory stages, as the kernel's producer does (bulk copies of 16 KiB blocks completing on the
// stage's full mbarrier, the stage refilled once its empty mbarrier completes), and whether the ring
// keeps up with the tensor work a tile feeds: the consumer warp holds each tile `hold` cycles
// (clock64) before it releases it. Tile i of group g is tile (g * cta_step + i) modulo `span_tiles`
// of `src`, loaded by bulk copies of `copy_bytes` (a column block of the kernel's K or V tile): a
// span that fits the L2 with every group walking it from its own offset is the kernel's case (the
// CTAs of an L2 section read the same heads' keys and values); a span past the L2 with groups apart
// reads DRAM.
//
// kCluster CTAs form a cluster (kCluster 1: none to speak of). Without multicast every CTA is its
// own group and loads its whole tile. With multicast the cluster is one group: its CTAs take the
// tile's copies in turn, each copy delivered into every CTA's stage and completing on every CTA's
// full mbarrier (each CTA's producer expects the whole tile), so that the L2 is read once per
// cluster and tile while every SM still takes the whole tile in; a stage is refilled only once the
// consumers of all the cluster's CTAs released it (the empty mbarrier counts kCluster arrivals, one
// from each CTA's consumer). The two rates say whether an SM's ~30 B/cycle from L2 is the L2's
// output or the SM's intake.
// ---------------------------------------------------------------------------------------------
constexpr int kMaxStages = 8;

__device__ __forceinline__ void bulk_load(u32 dst, const unsigned char* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The same copy delivered at the same offsets of every CTA of `mask` (dst and bar: this CTA's).
__device__ __forceinline__ void bulk_load_multicast(u32 dst, const unsigned char* src, u32 bytes, u32 bar,
                                                    unsigned short mask) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Arrive on the mbarrier at this CTA's shared address `bar` in the cluster's CTA `cta`.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void cluster_sync() {  // every thread of every CTA of the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// 64 threads: warp 0's lane 0 loads, warp 1 consumes and writes its cycles, nanoseconds and start
// (globaltimer). tile_bytes: a multiple of copy_bytes, itself a multiple of 16; stages * tile_bytes
// within the dynamic shared memory; the grid a multiple of kCluster.
template <int kCluster, bool kMulticast>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(64, 1)
    load_probe(const unsigned char* src, long long span_tiles, long long cta_step, int tiles, int tile_bytes,
               int copy_bytes, int stages, int hold, long long* cycles, long long* nanos, long long* starts) {
  static_assert(kCluster >= 1 && kCluster <= 8, "a portable cluster has at most 8 CTAs");
  static_assert(!kMulticast || kCluster > 1, "multicast needs a cluster");
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[kMaxStages], empty[kMaxStages];
  const u32 ring = smem_addr(smem);
  const u32 rank = kMulticast ? cluster_rank() : 0;
  const long long group = kMulticast ? blockIdx.x / kCluster : blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), kMulticast ? kCluster : 1);
    }
    fence_barrier_init();
  }
  if constexpr (kCluster > 1) cluster_sync();  // no copy nor arrival reaches a peer's barriers before their init
  else __syncthreads();
  const long long c0 = clock64(), t0 = globaltimer();
  if (threadIdx.x == 0) {  // the producer: wait for the stage to be free, then load the tile (its part) into it
    for (int i = 0; i < tiles; ++i) {
      const int s = i % stages;
      if (i >= stages) mbar_wait(smem_addr(&empty[s]), ((i / stages) - 1) & 1);
      const u32 bar = smem_addr(&full[s]);
      mbar_expect_tx(bar, tile_bytes);  // the whole tile, whichever CTA's copies bring it
      const unsigned char* tile = src + (group * cta_step + i) % span_tiles * tile_bytes;
      for (int b = 0, j = 0; b < tile_bytes; b += copy_bytes, ++j) {
        if constexpr (kMulticast) {
          if (j % kCluster == int(rank))
            bulk_load_multicast(ring + s * tile_bytes + b, tile + b, copy_bytes, bar, (1u << kCluster) - 1);
        } else {
          bulk_load(ring + s * tile_bytes + b, tile + b, copy_bytes, bar);
        }
      }
    }
  } else if (threadIdx.x == 32) {  // the consumer: wait for the tile, hold it, release it (in every CTA it came to)
    for (int i = 0; i < tiles; ++i) {
      const int s = i % stages;
      mbar_wait(smem_addr(&full[s]), (i / stages) & 1);
      const long long h0 = clock64();
      while (clock64() - h0 < hold) {
      }
      if constexpr (kMulticast) {
        for (int c = 0; c < kCluster; ++c) mbar_arrive_cluster(smem_addr(&empty[s]), c);
      } else {
        mbar_arrive(smem_addr(&empty[s]));
      }
    }
    cycles[blockIdx.x] = clock64() - c0;
    nanos[blockIdx.x] = globaltimer() - t0;
    starts[blockIdx.x] = t0;
  }
  if constexpr (kCluster > 1) cluster_sync();  // no CTA leaves while a peer's copies or arrivals may still reach it
}

// The same loads into two rings, as the kernel's producer fills them: each tile's K part (k_bytes:
// the nope blocks and the rope block) into a ring of k_stages stages and its V part (v_bytes) into a
// ring of v_stages, each stage with its own full / empty mbarriers. The consumer takes the tiles in
// the kernel's order: with v_lag 1 (the two 16-bit consumers: S of tile i issued beside P V of tile
// i - 1) it waits for K of tile i and V of tile i - 1, holds k_hold cycles (S's tensor time) and
// releases that K stage, then holds v_hold (P V's) and releases that V stage; with v_lag 0 it waits
// for, holds and releases K of tile i, then V of tile i. Tiles are k_bytes + v_bytes long in `src`,
// walked as load_probe walks them (no clusters). The producer fills V of tile i - k_ahead after K of
// tile i: k_ahead 0 puts each tile's V right behind its K, 1 fills in the consumer's order (K of tile
// i + 1 before V of tile i), so that a V stage not yet released does not hold back the next K.
__global__ void __launch_bounds__(64, 1)
    kv_probe(const unsigned char* src, long long span_tiles, long long cta_step, int tiles, int k_bytes, int v_bytes,
             int copy_bytes, int k_stages, int v_stages, int k_hold, int v_hold, int v_lag, int k_ahead,
             long long* cycles, long long* nanos, long long* starts) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long k_full[kMaxStages], k_empty[kMaxStages], v_full[kMaxStages],
      v_empty[kMaxStages];
  const u32 k_ring = smem_addr(smem), v_ring = k_ring + k_stages * k_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kMaxStages; ++s) {
      mbar_init(smem_addr(&k_full[s]), 1);
      mbar_init(smem_addr(&k_empty[s]), 1);
      mbar_init(smem_addr(&v_full[s]), 1);
      mbar_init(smem_addr(&v_empty[s]), 1);
    }
    fence_barrier_init();
  }
  __syncthreads();
  const long long c0 = clock64(), t0 = globaltimer();
  auto fill = [&](int i, int stages, int bytes, int offset, u32 ring, unsigned long long* full,
                  unsigned long long* empty) {
    const int s = i % stages;
    if (i >= stages) mbar_wait(smem_addr(&empty[s]), ((i / stages) - 1) & 1);
    const u32 bar = smem_addr(&full[s]);
    mbar_expect_tx(bar, bytes);
    const unsigned char* part = src + (blockIdx.x * cta_step + i) % span_tiles * (k_bytes + v_bytes) + offset;
    for (int b = 0; b < bytes; b += copy_bytes) bulk_load(ring + s * bytes + b, part + b, copy_bytes, bar);
  };
  auto take = [&](int i, int stages, unsigned long long* full) { mbar_wait(smem_addr(&full[i % stages]), (i / stages) & 1); };
  auto hold = [](int h) {
    const long long h0 = clock64();
    while (clock64() - h0 < h) {
    }
  };
  if (threadIdx.x == 0) {  // the producer: K of tile i, then V of tile i - k_ahead, each once its stage is free
    for (int i = 0; i < tiles + k_ahead; ++i) {
      if (i < tiles) fill(i, k_stages, k_bytes, 0, k_ring, k_full, k_empty);
      if (i >= k_ahead) fill(i - k_ahead, v_stages, v_bytes, k_bytes, v_ring, v_full, v_empty);
    }
  } else if (threadIdx.x == 32) {
    for (int i = 0; i < tiles + v_lag; ++i) {
      const int j = i - v_lag;  // the tile whose V this step multiplies
      if (i < tiles) take(i, k_stages, k_full);
      if (v_lag && j >= 0) take(j, v_stages, v_full);
      if (i < tiles) {
        hold(k_hold);
        mbar_arrive(smem_addr(&k_empty[i % k_stages]));
      }
      if (j >= 0 && j < tiles) {
        if (!v_lag) take(j, v_stages, v_full);
        hold(v_hold);
        mbar_arrive(smem_addr(&v_empty[j % v_stages]));
      }
    }
    cycles[blockIdx.x] = clock64() - c0;
    nanos[blockIdx.x] = globaltimer() - t0;
    starts[blockIdx.x] = t0;
  }
}

}  // namespace probe
