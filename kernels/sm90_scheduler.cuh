// Work-tile hand-out of the persistent Hopper kernel (the scheduler role).
//
// Every role of a CTA (the producer warp, the rope warp, both consumer warpgroups) walks the same
// sequence of work-tile indices (tile_scheduler.cuh decodes them), so all of them agree on every
// barrier count. Two modes:
//   * static (counter == nullptr): blockIdx.x, then + gridDim.x each time (round robin);
//   * dynamic: the first index is blockIdx.x; each next one comes from a global counter, taken by
//     the producer thread once it has issued the loads of its current tile, so tiles go out in the
//     order in which CTAs free up (longest first, as the indices are ordered: FlashAttention-3's
//     dynamic persistent scheduler). The round robin leaves CTAs idle when tile costs differ
//     (ragged batches, indices that decode to nothing); the hand-out keeps every CTA busy to the end.
//     The producer passes each index to the other roles through a 2-slot ring in shared memory:
//     full(s) completes on the producer's 1 arrival, empty(s) on one arrival of every reader thread
//     (kReaders: the consumers' 256 threads, plus the rope warp's 32 lanes when it runs).
// The counter is zero between launches: each CTA's producer takes exactly one index past the end
// (then stops), and the CTA that takes the gridDim.x-th such index resets the counter; no CTA
// touches it afterwards. Launches that share a counter must not overlap (one counter per stream).
#pragma once
#include "sm90.cuh"

namespace mla {
namespace sm90 {

struct TileHandout {
  u32* counter;          // global, 2 words: [0] indices handed out past the first gridDim.x, [1] CTAs done
  u32 bar;               // shared memory: 4 mbarriers full(0), full(1), empty(0), empty(1), then 2 int slots
  int num_work;

  static constexpr int kBarBytes = 4 * 8;
  static constexpr int kSlotBytes = 2 * 4;

  __device__ __forceinline__ bool dynamic() const { return counter != nullptr; }
  __device__ __forceinline__ u32 full(int s) const { return bar + 8 * s; }
  __device__ __forceinline__ u32 empty(int s) const { return bar + 16 + 8 * s; }
  __device__ __forceinline__ u32 slot(int s) const { return bar + kBarBytes + 4 * s; }

  // One thread, before the CTA's first __syncthreads (with the other mbarrier inits).
  __device__ __forceinline__ void init(u32 readers) const {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), readers);
    }
  }
  // Producer thread: hand-out n is `idx` (a no-op in static mode).
  __device__ __forceinline__ void publish(int n, int idx) const {
    if (!dynamic()) return;
    const int s = n & 1;
    mbar_wait(empty(s), ((n >> 1) & 1) ^ 1);  // the first pass over the 2 slots does not wait
    asm volatile(
        "st.shared.u32 [%0], %1;\n"
        "mbarrier.arrive.release.cta.shared::cta.b64 _, [%2];\n" ::"r"(slot(s)), "r"(idx), "r"(full(s)) : "memory");
  }
  // Producer thread: the index after `idx`.
  __device__ __forceinline__ int next(int idx) const {
    if (!dynamic()) return idx + static_cast<int>(gridDim.x);
    const int nxt = static_cast<int>(gridDim.x + atomicAdd(counter, 1u));
    if (nxt >= num_work && atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
      counter[0] = 0;  // every CTA has taken its index past the end: ready for the next launch
      counter[1] = 0;
    }
    return nxt;
  }
  // Reader threads: hand-out n (`idx_static` is what the round robin gives).
  __device__ __forceinline__ int take(int n, int idx_static) const {
    if (!dynamic()) return idx_static;
    const int s = n & 1;
    mbar_wait(full(s), (n >> 1) & 1);
    int idx;
    asm volatile(
        "ld.shared.u32 %0, [%1];\n"
        "mbarrier.arrive.shared::cta.b64 _, [%2];\n" : "=r"(idx) : "r"(slot(s)), "r"(empty(s)) : "memory");
    return idx;
  }
};

}  // namespace sm90
}  // namespace mla
