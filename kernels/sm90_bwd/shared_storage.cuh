// The backward kernel's shared memory: one struct, and the shared-space addresses of its parts.
//
//   [q: 2 stages][dout: 2 stages][k][v][P^T][dS^T][dq staging: a half per consumer][statistics]
//   [mbarriers][work slots]
//
// Tiles start on 1 KiB boundaries (the swizzle patterns repeat every 1 KiB, or 512 bytes for k's
// 64-byte swizzle); the dq staging and the statistics are read and written by bulk copies, 16-byte
// aligned.
#pragma once
#include "config.cuh"

namespace mla {
namespace sm90_bwd {

constexpr int kWorkSlots = 2;  // key tiles published ahead of their readers

struct alignas(1024) SharedStorage {
  unsigned char q[kStages][kQBytes];
  unsigned char dout[kStages][kDoBytes];
  unsigned char k[kKBytes];  // column blocks 0-3: the head's k; 4-5: the rope, loaded once a work tile
  unsigned char v[kVBytes];
  unsigned char pt[kPdsBytes];   // P^T: key rows of the block's 64 queries
  unsigned char dst[kPdsBytes];  // dS^T
  float dq_stage[kConsumers][kDqHalf];
  float lse[kStages][kBlockM];    // lse_log2 of the stage's rows
  float dpsum[kStages][kBlockM];  // D of the stage's rows
  // q_full: the producer's expect_tx (q and lse); q_empty: one arrival per consumer warp; dout's
  // likewise. kv: the head's k and v; rope: the tile's rope rows. dq_full(c): consumer c's four
  // warps' arrivals once its half is staged; dq_empty(c): the dq thread's, once the reduction has
  // read it. work_full(s) / work_empty(s): the slot's producer, then its readers (kWorkReaders).
  unsigned long long q_full[kStages], q_empty[kStages], do_full[kStages], do_empty[kStages];
  unsigned long long kv_full, kv_empty, rope_full, rope_empty;
  unsigned long long dq_full[kConsumers], dq_empty[kConsumers];
  unsigned long long work_full[kWorkSlots], work_empty[kWorkSlots];
  bwd::KeyTile work[kWorkSlots];
};
static_assert((kStages * (kQBytes + kDoBytes) + kKBytes + kVBytes + 2 * kPdsBytes) % 16 == 0 && kDqHalf % 4 == 0 &&
                  kStatBytes % 16 == 0, "the bulk copies' staging and statistics: 16-byte aligned");

// Dynamic shared memory: the struct, plus the slack to align its base to 1 KiB.
constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");

// Readers of a work slot: every consumer warp, and the dq thread.
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kWorkReaders = kConsumerWarps + 1;

struct Smem {
  SharedStorage& s;
  u32 base;

  __device__ __forceinline__ u32 at(const void* part) const {
    return base + static_cast<u32>(static_cast<const unsigned char*>(part) - reinterpret_cast<const unsigned char*>(&s));
  }
  __device__ __forceinline__ u32 q(int st) const { return at(s.q[st]); }
  __device__ __forceinline__ u32 dout(int st) const { return at(s.dout[st]); }
  __device__ __forceinline__ u32 k() const { return at(s.k); }
  __device__ __forceinline__ u32 rope() const { return at(s.k) + kKNopeBlocks * kKBlk; }
  __device__ __forceinline__ u32 v() const { return at(s.v); }
  __device__ __forceinline__ u32 pt() const { return at(s.pt); }
  __device__ __forceinline__ u32 dst() const { return at(s.dst); }
  __device__ __forceinline__ u32 dq_stage(int c) const { return at(s.dq_stage[c]); }
  __device__ __forceinline__ u32 lse(int st) const { return at(s.lse[st]); }
  __device__ __forceinline__ u32 dpsum(int st) const { return at(s.dpsum[st]); }
  __device__ __forceinline__ u32 q_full(int st) const { return at(&s.q_full[st]); }
  __device__ __forceinline__ u32 q_empty(int st) const { return at(&s.q_empty[st]); }
  __device__ __forceinline__ u32 do_full(int st) const { return at(&s.do_full[st]); }
  __device__ __forceinline__ u32 do_empty(int st) const { return at(&s.do_empty[st]); }
  __device__ __forceinline__ u32 kv_full() const { return at(&s.kv_full); }
  __device__ __forceinline__ u32 kv_empty() const { return at(&s.kv_empty); }
  __device__ __forceinline__ u32 rope_full() const { return at(&s.rope_full); }
  __device__ __forceinline__ u32 rope_empty() const { return at(&s.rope_empty); }
  __device__ __forceinline__ u32 dq_full(int c) const { return at(&s.dq_full[c]); }
  __device__ __forceinline__ u32 dq_empty(int c) const { return at(&s.dq_empty[c]); }
  __device__ __forceinline__ u32 work_full(int sl) const { return at(&s.work_full[sl]); }
  __device__ __forceinline__ u32 work_empty(int sl) const { return at(&s.work_empty[sl]); }
};

// The struct at the 1 KiB-aligned address at or after `raw`.
__device__ __forceinline__ Smem shared_storage(unsigned char* raw) {
  const u32 raw_addr = smem_addr(raw);
  const u32 pad = (1024 - (raw_addr & 1023)) & 1023;
  return Smem{*reinterpret_cast<SharedStorage*>(raw + pad), raw_addr + pad};
}

}  // namespace sm90_bwd
}  // namespace mla
