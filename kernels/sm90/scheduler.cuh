// The scheduler role of the persistent Hopper kernel: which work tile a CTA takes next, decoded
// once and handed to every role through shared memory.
//
// Work tiles are (query block, sequence, head) in the linear order of tile_scheduler.cuh (heads in
// L2-sized sections, the longest query blocks first). Two modes:
//   * static (tile_counter == nullptr): blockIdx.x, then + gridDim.x each time (round robin);
//   * dynamic: the first index is blockIdx.x; each next one comes from a global counter, taken by
//     the producer thread once it has issued the loads of its current tile, so tiles go out in the
//     order in which CTAs free up (FlashAttention-3's dynamic persistent scheduler). The round robin
//     leaves CTAs idle when tile costs differ (ragged batches, indices that decode to nothing).
// The producer thread decodes each index (tile_scheduler.cuh: decode_work_tile and the visible key
// span), skips indices without rows, and publishes the result as a WorkInfo in a ring of kWorkSlots slots in
// shared memory: full(s) completes on the producer's one arrival, empty(s) on one arrival per
// reader (kConsumerArrivals<V> of the consumers, plus the rope warp's when it runs). Every role thus
// walks the same work tiles and agrees on every barrier count, and nobody else decodes (no integer
// divisions nor dependent global loads on the consumers' path).
// With three consumers (kSchedulerWarp<V>: 32 registers per producer thread) the decoding is the
// scheduler warp's (run): one thread finds, publishes, and takes the next index once warp 0, now
// one more reader of the slots (take_one), has issued the current tile's loads (the issued barrier:
// one arrival per work tile), so indices go out in the same order as with two.
// The counter is zero between launches: each CTA's producer takes exactly one index past the end
// (then stops), and the CTA that takes the gridDim.x-th such index resets the counter; no CTA
// touches it afterwards. Launches that share a counter must not overlap (one counter per stream).
#pragma once
#include "../tile_scheduler.cuh"
#include "../vt_layout.cuh"
#include "config.cuh"
#include "params.cuh"
#include "ptx.cuh"

namespace mla {
namespace sm90 {

// One work tile as every role needs it.
struct alignas(16) WorkInfo {
  WorkTile w;          // sequence, head, query block; row offsets and positions
  int m0;              // the tile's first query row in its sequence (kEndAligned: may be negative)
  int n_begin, n_end;  // keys [n_begin, n_end) of the sequence that some row of the tile may see
  int num_tiles;       // key tiles of the variant's kBlockN keys from n_begin (0: nothing visible)
  int valid;           // 0: no more work for this CTA
};

__device__ __forceinline__ SeqOffsets seq_offsets(const Params& p) {
  return SeqOffsets{p.q_offsets, p.kv_begin, p.kv_end, p.cache_offsets, p.q_start_pos};
}

// Decodes work tile idx; false when it has no rows (its sequence is shorter than the query block).
template <class V, class Mask>
__device__ __forceinline__ bool plan_work(const Params& p, const Mask& mask, int idx, WorkInfo& work) {
  if (!decode_work_tile(seq_offsets(p), idx, p.num_heads, p.heads_per_section, p.batch, p.num_m_blocks,
                        kBlockM<V>, work.w, kEndAligned<V>, p.tail_blocks))
    return false;
  if constexpr (kEndAligned<V>) {
    work.m0 = work.w.sq - (work.w.m_block + 1) * kBlockM<V>;  // negative for a sequence's part-filled first block
    // a sequence of one block keeps its rows at the block's start: the same keys either way, and its
    // first consumer busy (its rows end-aligned measured 0.4-1.4% slower at 64x128)
    if (work.w.sq <= kBlockM<V>) work.m0 = 0;
  } else {
    work.m0 = work.w.m_block * kBlockM<V>;
  }
  const int first = max(work.m0, 0);                          // the tile's first and last rows that exist
  const int last = min(work.m0 + kBlockM<V>, work.w.sq) - 1;
  visible_key_span(mask, work.w, work.w.q_pos0 + first, work.w.q_pos0 + last, work.n_begin, work.n_end);
  // fp8 per token: key tiles start on a multiple of kVtAlign keys (V^T's layout: kKeyAlign); the
  // keys added are masked
  if (kKeyAlign<V> > 1) work.n_begin &= ~(kKeyAlign<V> - 1);
  work.num_tiles = (work.n_end - work.n_begin + V::kBlockN - 1) / V::kBlockN;
  work.valid = 1;
  return true;
}

struct TileHandout {
  u32* counter;  // global, 2 words: [0] indices handed out past the first gridDim.x, [1] CTAs done
  int num_work;  // work-tile indices of the launch
  u32 bars;      // shared: mbarriers full(s), then empty(s) for each slot s (and issued: kWorkBars)
  WorkInfo* slots;  // shared: the kWorkSlots slots

  __device__ __forceinline__ u32 full(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ u32 empty(int s) const { return bars + 8 * kWorkSlots + 8 * s; }
  __device__ __forceinline__ u32 issued() const { return bars + 16 * kWorkSlots; }  // with the scheduler warp
  // Hand-out n's slot, and the parity of that slot's pass (its n / kWorkSlots-th use).
  static_assert((kWorkSlots & (kWorkSlots - 1)) == 0, "a power of two: the slot and pass are bits of n");
  static __device__ __forceinline__ int slot_of(int n) { return n & (kWorkSlots - 1); }
  static __device__ __forceinline__ u32 pass_of(int n) { return (static_cast<u32>(n) / kWorkSlots) & 1u; }

  // One thread, before the CTA's first __syncthreads (with the other mbarrier inits).
  template <class V>
  __device__ __forceinline__ void init(u32 readers) const {
    for (int s = 0; s < kWorkSlots; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), readers);
    }
    if (kSchedulerWarp<V>) mbar_init(issued(), 1);
  }
  // Producer thread: the index after `idx`.
  __device__ __forceinline__ int next(int idx) const {
    if (counter == nullptr) return idx + static_cast<int>(gridDim.x);
    const int nxt = static_cast<int>(gridDim.x + atomicAdd(counter, 1u));
    if (nxt >= num_work && atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
      counter[0] = 0;  // every CTA has taken its index past the end: ready for the next launch
      counter[1] = 0;
    }
    return nxt;
  }
  // Producer thread: from index idx on, the first work tile with rows into `work` (work.valid = 0 past the
  // end); returns its index.
  template <class V, class Mask>
  __device__ __forceinline__ int find(const Params& p, const Mask& mask, int idx, WorkInfo& work) const {
    for (; idx < num_work; idx = next(idx))
      if (plan_work<V>(p, mask, idx, work)) return idx;
    work.valid = 0;
    return idx;
  }
  // Producer thread: hand-out n is `work`.
  __device__ __forceinline__ void publish(int n, const WorkInfo& work) const {
    slot(n) = work;
    published(n);
  }
  // Hand-out n's slot, once its readers have released hand-out n - 2; published(n) hands it out.
  __device__ __forceinline__ WorkInfo& slot(int n) const {
    mbar_wait(empty(slot_of(n)), pass_of(n) ^ 1);  // the first pass over the slots does not wait
    return slots[slot_of(n)];
  }
  __device__ __forceinline__ void published(int n) const {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(full(slot_of(n))) : "memory");
  }
  // The scheduler warp's thread: every hand-out, each next index taken once warp 0 has issued the
  // loads of the current work tile.
  template <class V, class Mask>
  __device__ __forceinline__ void run(const Params& p, const Mask& mask) const {
    int idx = blockIdx.x;
    for (int n = 0;; ++n) {
      WorkInfo& work = slot(n);  // decoded in place: at 32 registers a WorkInfo held whole spills
      idx = find<V>(p, mask, idx, work);
      published(n);
      if (!work.valid) break;
      mbar_wait(issued(), n & 1);
      idx = next(idx);
    }
  }
  // Hand-out n into `work` once published; returns its slot, for the reader's release.
  __device__ __forceinline__ int read(int n, WorkInfo& work) const {
    const int s = slot_of(n);
    mbar_wait(full(s), pass_of(n));
    asm volatile("" ::: "memory");  // the slot is read after the wait
    work = slots[s];
    return s;
  }
  // Warp 0's thread with the scheduler warp: hand-out n, one arrival.
  __device__ __forceinline__ void take_one(int n, WorkInfo& work) const { mbar_arrive(empty(read(n, work))); }
  // Reader threads (whole warps): hand-out n, every lane releasing the slot once it has read it.
  __device__ __forceinline__ void take(int n, WorkInfo& work) const { release(empty(read(n, work))); }
  // A reader thread's arrival on a barrier counted in kConsumerArrivals<V> units (one per thread).
  static __device__ __forceinline__ void release(u32 bar) { mbar_arrive(bar); }
};

}  // namespace sm90
}  // namespace mla
