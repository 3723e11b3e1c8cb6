// Which key tile a CTA takes next (backward.cuh: decode_key_tile's order), decoded once by the load
// thread and handed to the consumers and the dq thread through a ring of kWorkSlots slots in shared
// memory: work_full(s) completes on the load thread's arrival, work_empty(s) on one arrival per
// reader warp (kWorkReaders). Indices come from the launch's counter as CTAs free up, exactly as the
// forward's (sm90/scheduler.cuh: TileHandout::next, whose counter protocol this shares).
#pragma once
#include "../sm90/scheduler.cuh"
#include "config.cuh"
#include "params.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90_bwd {

struct KeyTiles {
  sm90::TileHandout counter;  // its counter and num_work only: the index after idx (next)
  Smem sm;

  static __device__ __forceinline__ int slot_of(int n) { return n & (kWorkSlots - 1); }
  static __device__ __forceinline__ u32 pass_of(int n) { return (static_cast<u32>(n) / kWorkSlots) & 1u; }

  __device__ __forceinline__ int next(int idx) const { return counter.next(idx); }
  // Load thread: from index idx on, the first key tile of some sequence into t (t.valid = 0 past the
  // end); returns its index.
  template <class Mask>
  __device__ __forceinline__ int find(const Params& p, const Mask& mask, int idx, bwd::KeyTile& t) const {
    const SeqOffsets so{p.q_offsets, p.kv_begin, p.kv_end, p.cache_offsets, p.q_start_pos};
    for (; idx < counter.num_work; idx = next(idx))
      if (bwd::decode_key_tile(so, mask, idx, p.num_heads, p.heads_per_group, p.batch, p.num_n_blocks, kBlockN,
                               p.tail_groups, p.deterministic != 0, t))
        return idx;
    t.valid = 0;
    return idx;
  }
  // Load thread: hand-out n is t, once the readers have released hand-out n - kWorkSlots.
  __device__ __forceinline__ void publish(int n, const bwd::KeyTile& t) const {
    sm90::mbar_wait(sm.work_empty(slot_of(n)), pass_of(n) ^ 1);  // the first pass does not wait
    sm.s.work[slot_of(n)] = t;
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(sm.work_full(slot_of(n))) : "memory");
  }
  // A reader: hand-out n into t. Consumer warps release the slot once every lane has read it (one
  // arrival per warp); the dq thread releases it alone.
  __device__ __forceinline__ void take(int n, bwd::KeyTile& t, bool whole_warp) const {
    const int s = slot_of(n);
    sm90::mbar_wait(sm.work_full(s), pass_of(n));
    asm volatile("" ::: "memory");  // the slot is read after the wait
    t = sm.s.work[s];
    if (whole_warp) __syncwarp();
    if (!whole_warp || threadIdx.x % 32 == 0) sm90::mbar_arrive(sm.work_empty(s));
  }
};

}  // namespace sm90_bwd
}  // namespace mla
