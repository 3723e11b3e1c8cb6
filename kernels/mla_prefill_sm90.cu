// Hopper MLA prefill kernel (sm_90a): warp-specialized, TMA + wgmma, FlashAttention-3 style, laid
// out by role (kernels/sm90/):
//   config.cuh          geometry, the variants as traits types, measurement switches
//   params.cuh          the arguments: one struct, its layout exported to the launch code
//   shared_storage.cuh  the shared memory as one struct
//   scheduler.cuh       persistent CTAs take work tiles from a counter; decoded once (by warp 0, or
//                       the scheduler warp 3), handed over
//   producer.cuh        warp 0: TMA of K, V into a ring of stages; warp 2: each consumer's Q rows
//   rope_warp.cuh       warp 1 (paged or fp8 rope): the rope rows of each K stage
//   mainloop.cuh        the consumer warpgroups (two; three in fp8 under the causal and no mask):
//                       S = Q K^T, online softmax, O += P V
//   softmax.cuh         the per-tile score work: fp8 dequantization, masks, P
//   epilogue.cuh        normalization, merge, stores of out and lse
//   trace.cuh           MLA_SM90_TRACE: each consumer's cycle stamps per work tile (off by default)
//
// A K tile is 128 keys x 192: two 64-wide column blocks of the head's nope part from k, then the
// 64 rope values every head shares, from k_rope by their own tensor map (or written by the rope
// warp). Nothing materializes [Tk, H, 192]. Key tiles a mask removes entirely are never loaded.
//
// Variants (config.cuh): Variant16<T> (bf16 / fp16), VariantFp8 (e4m3 nope parts and V^T with
// per-token scales, bf16 rope, the consumers in pingpong), VariantFp8Rope<T> (e4m3 rope with one
// scale per key, dequantized by the rope warp), VariantE4m3 (VariantFp8 with an e4m3 rope under the
// per-token scales: Q K^T one 192-deep e4m3 GEMM); EvenKeyRows<V> (the two fp8 ones, for batches
// whose sequences all start at an even key row: the key scales read in pairs).
#include "common.cuh"
#include "mask.cuh"
#include "sm90/config.cuh"
#include "sm90/epilogue.cuh"
#include "sm90/mainloop.cuh"
#include "sm90/params.cuh"
#include "sm90/producer.cuh"
#include "sm90/rope_warp.cuh"
#include "sm90/scheduler.cuh"
#include "sm90/shared_storage.cuh"
#include "sm90/trace.cuh"

namespace mla {
namespace sm90 {

// What the launch code reads from the module besides the parameter layout (params.cuh,
// params_abi.cuh), per variant V0 and mask, as compiled under that mask (V: ForMask): dynamic shared
// memory in bytes, threads per CTA, query rows per work tile, keys per key tile, floats of the fp8
// key-scale box, rows of a consumer warpgroup (of a Q box, and of an output box), 1 if the staged
// epilogue stores by TMA (kTmaEpilogue: the host then builds out's map); and how the work is cut,
// which the reference's reach of a NaN in v follows (mla_cupy/_registry.py: sm90_schedule): half
// tiles on the diagonal (kHalfTilesFor), key tiles skipped at a work tile's end (kSkipTail), query
// blocks counted from each sequence's end (kEndAligned), keys a key span starts on a multiple of
// (kKeyAlign).
#define MLA_SM90_GEOMETRY(X)                                                                         \
  X(smem, kSmemBytes<V>) X(threads, kThreads<V>) X(block_m, kBlockM<V>) X(block_n, V::kBlockN)       \
  X(scale_box, kScaleBox<V>) X(q_rows, kWgRows) X(out_tma, kTmaEpilogue<V>)                          \
  X(half_tiles, (kHalfTilesFor<V, Mask>)) X(skip_tail, (kSkipTail<V, Mask>)) X(end_aligned, kEndAligned<V>) \
  X(key_align, kKeyAlign<V>)
MLA_GEOMETRY_NAMES(MLA_SM90_GEOMETRY)
template <class V0, class Mask, class V = ForMask<V0, Mask>>
__device__ const int kGeometry[] = MLA_GEOMETRY_VALUES(MLA_SM90_GEOMETRY);
#undef MLA_SM90_GEOMETRY

template <class V0, typename OutT, typename Mask, bool kPaged>
__global__ void __launch_bounds__(kThreads<ForMask<V0, Mask>>, 1) mla_prefill_kernel(const __grid_constant__ Params p) {
  using V = ForMask<V0, Mask>;  // the variant as compiled under this mask (config.cuh)
  constexpr bool kRW = kRopeWarp<V, kPaged>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Each role derives the shared-memory addresses itself, after its register reallocation: values
  // live across setmaxnreg go through the stack.
  auto storage = [&] { return shared_storage<V>(smem_raw); };
  auto scheduler = [&](const Smem<V>& sm) {
    return TileHandout{p.tile_counter, p.num_m_blocks * p.batch * p.num_heads, sm.work_bars(), sm.s.work};
  };

  if (threadIdx.x == 0) {  // one thread: no warp-wide shuffle in shared_storage
    const Smem<V> sm = shared_storage<V, false>(smem_raw);
    for (int c = 0; c < V::kConsumers; ++c) {  // each consumer's Q rows: warp 2's expect_tx, that consumer's release
      mbar_init(sm.q_full(c), 1);
      mbar_init(sm.q_empty(c), kConsumerArrivals<V> / V::kConsumers);
    }
    for (int s = 0; s < V::kStages; ++s) {
      // warp 0's expect_tx; with the rope warp also one arrival per lane (rope_warp.cuh)
      mbar_init(sm.k_full(s), kRW ? 1 + 32 : 1);
      mbar_init(sm.v_full(s), 1);
      mbar_init(sm.k_empty(s), kConsumerArrivals<V>);
      mbar_init(sm.v_empty(s), kConsumerArrivals<V>);
    }
    // readers of the work slots: the consumers, the Q warp and the rope warp (one arrival per
    // lane), and warp 0's thread when the scheduler warp hands out
    scheduler(sm).template init<V>(kConsumerArrivals<V> + 32 + (kRW ? 32 : 0) + (kSchedulerWarp<V> ? 1 : 0));
    fence_barrier_init();
  }
  if constexpr (kRowSumMma<V>) {  // e4m3 1.0 (0x38) in every byte of the ones block, for wgmma (the async proxy)
    if (threadIdx.x < 64) {
      sts128(shared_storage<V, false>(smem_raw).ones() + 16 * threadIdx.x, 0x38383838u, 0x38383838u, 0x38383838u,
             0x38383838u);
      fence_proxy_async();
    }
  }
  __syncthreads();

  const int warp = threadIdx.x / 32;
  if (warp < 4) {  // the producer warpgroup
    regs_dealloc<kProducerRegs<V>>();
    const Smem<V> sm = storage();
    if (warp == 0 && threadIdx.x == 0) producer_load<V, Mask, kPaged>(p, sm, scheduler(sm), Mask{p.mask_arg});
    if (kRW && warp == 1) rope_warp_load<V, kPaged>(p, sm, scheduler(sm));
    if (warp == kQWarp) q_load<V>(p, sm, scheduler(sm));
    if (kSchedulerWarp<V> && warp == kSchedWarp && threadIdx.x % 32 == 0)
      scheduler(sm).template run<V>(p, Mask{p.mask_arg});
    return;
  }

  regs_alloc<kConsumerRegs<V>>();
  const Smem<V> sm = storage();
  const TileHandout sched = scheduler(sm);
  Mainloop<V, Mask, kPaged> mainloop(p, sm, Mask{p.mask_arg});
  TileTrace::begin();  // MLA_SM90_TRACE: cycle stamps per work tile (trace.cuh); else nothing
  for (int n = 0;; ++n) {
    WorkInfo work;
    TileTrace::stamp<kTa>(n);
    sched.take(n, work);
    TileTrace::stamp<kTb>(n);
    if (!work.valid) break;
    if constexpr (V::kConsumers == 3) {
      if (mainloop.idle(work)) {  // no row of this consumer in the work tile
        mainloop.run_idle(work);
        TileTrace::stored(n, work.num_tiles, work.m0, true);
        continue;
      }
    }
    float o[kOTiles][4];
    OnlineSoftmax smx;
    mainloop.run(work, o, smx);
    TileTrace::stamp<kTc>(n);
    epilogue_store<V, OutT>(p, sm, work, mainloop.row0(work), o, smx);
    TileTrace::stored(n, work.num_tiles, work.m0, false);
  }
  TileTrace::finish();
  epilogue_drain<V, OutT>();
  mainloop.finish();
}

}  // namespace sm90
}  // namespace mla
