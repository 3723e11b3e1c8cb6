// Hopper MLA backward kernel (sm_90a): warp-specialized, TMA + wgmma, laid out by role
// (kernels/sm90_bwd/config.cuh lists the files). Key-block CTAs: a work tile is 96 keys of one
// sequence and a group of heads; for each head the CTA loops over the query blocks that see the
// keys, recomputing P from lse, and adds each block's dq into the float32 workspace (backward.cuh).
// The rope's gradient is summed over the group's heads in registers: no [Tk, H, 64] buffer exists.
// Around it run the pre-pass and post-passes of kernels/mla_backward_prepost.cu.
#include "backward.cuh"
#include "mask.cuh"
#include "sm90_bwd/config.cuh"
#include "sm90_bwd/mainloop.cuh"
#include "sm90_bwd/params.cuh"
#include "sm90_bwd/producer.cuh"
#include "sm90_bwd/scheduler.cuh"
#include "sm90_bwd/shared_storage.cuh"

namespace mla {
namespace sm90_bwd {

// What the launch code reads from the module besides the parameter layout (params_abi.cuh): dynamic
// shared memory in bytes, threads per CTA, query rows per block (a dq chunk), keys per work tile.
#define MLA_BWD_SM90_GEOMETRY(X) X(smem, kSmemBytes) X(threads, kThreads) X(block_m, kBlockM) X(block_n, kBlockN)
MLA_DEFINE_GEOMETRY(MLA_BWD_SM90_GEOMETRY)

template <typename T, typename Mask>
__global__ void __launch_bounds__(kThreads, 1) mla_backward_kernel(const __grid_constant__ Params p) {
  using namespace sm90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int num_work = p.num_n_blocks * p.batch * ((p.num_heads + p.heads_per_group - 1) / p.heads_per_group);
  auto scheduler = [&](const Smem& sm) {
    return KeyTiles{TileHandout{p.tile_counter, num_work, 0u, nullptr}, sm};
  };
  if (threadIdx.x == 0) {
    const Smem sm = shared_storage(smem_raw);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.q_full(s), 1);
      mbar_init(sm.do_full(s), 1);
      mbar_init(sm.q_empty(s), kConsumerWarps);
      mbar_init(sm.do_empty(s), kConsumerWarps);
    }
    mbar_init(sm.kv_full(), 1);
    mbar_init(sm.rope_full(), 1);
    mbar_init(sm.kv_empty(), kConsumerWarps);
    mbar_init(sm.rope_empty(), kConsumerWarps);
    for (int c = 0; c < kConsumers; ++c) {
      mbar_init(sm.dq_full(c), 128);  // every thread of consumer c, after its staging stores
      mbar_init(sm.dq_empty(c), 1);
    }
    for (int s = 0; s < kWorkSlots; ++s) {
      mbar_init(sm.work_full(s), 1);
      mbar_init(sm.work_empty(s), kWorkReaders);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const Mask mask{p.mask_arg};
  if (threadIdx.x < 128) {  // the producer warpgroup
    regs_dealloc<kProducerRegs>();
    const Smem sm = shared_storage(smem_raw);
    if (threadIdx.x == 0) producer_load(p, sm, scheduler(sm), mask);
    if (threadIdx.x == 32) dq_reduce(p, sm, scheduler(sm), mask);
    return;
  }

  regs_alloc<kConsumerRegs>();
  const Smem sm = shared_storage(smem_raw);
  const KeyTiles sched = scheduler(sm);
  Consumer<T, Mask> consumer(p, sm, mask);
  for (int n = 0;; ++n) {
    bwd::KeyTile t;
    sched.take(n, t, true);
    if (!t.valid) break;
    consumer.run(t);
  }
}

}  // namespace sm90_bwd
}  // namespace mla
