// The Hopper kernel's shared memory: one struct per variant, and the shared-space addresses of its
// parts (what TMA, wgmma and the mbarrier instructions take).
//
//   [Q][stage 0: K V][stage 1: K V](fp8: [stage 2: K V])[output staging][mbarriers][work slots][key flags]
//
// Tiles are 64-element column blocks with the 128-byte swizzle (what TMA writes; ptx.cuh), so Q and
// each K and V start on a 1 KiB boundary. The output staging is the epilogue's own (epilogue.cuh):
// half of each consumer's 64 x 128 16-bit rows at a time, so that no K/V stage is held past the
// mainloop (the 16-bit variants have 17 KiB left beside their two 80 KiB stages, not 32).
#pragma once
#include "config.cuh"
#include "scheduler.cuh"

namespace mla {
namespace sm90 {

// The scheduler's mbarriers: full(0), full(1), empty(0), empty(1), and issued with the scheduler warp.
template <class V> constexpr int kWorkBars = 2 * kWorkSlots + (kSchedulerWarp<V> ? 1 : 0);

// The block of ones the row sums multiply P by (kRowSumMma: 8 rows of 128 e4m3 ones, 1 KiB, written
// once per CTA before the roles start); an empty base otherwise, which takes no space.
template <bool kOn> struct OnesBlock {};
template <> struct OnesBlock<true> { alignas(1024) unsigned char ones[1024]; };

template <class V>
struct alignas(1024) SharedStorage : OnesBlock<kRowSumMma<V>> {
  struct alignas(1024) Stage {
    unsigned char k[kKBytes<V>];  // 1024-multiple: v stays 1 KiB aligned
    unsigned char v[kVBytes<V>];
  };
  unsigned char q[kQBytes<V>];
  Stage stage[V::kStages];
  unsigned char out_stage[kOutStageBytes<V>];
  // mbarriers: each consumer's Q rows (TMA / that consumer), each stage's K and V (TMA, plus the
  // rope warp for K / the consumers), and the scheduler's (kWorkBars)
  unsigned long long q_full[V::kConsumers], q_empty[V::kConsumers];
  unsigned long long k_full[V::kStages], v_full[V::kStages], k_empty[V::kStages], v_empty[V::kStages];
  unsigned long long work_bars[kWorkBars<V>];
  WorkInfo work[kWorkSlots];
  // rope warp only, per K stage s: key_ok[s], a readable bit per key (read by the consumers only
  // when the tile has an unreadable key), and tile_flags[s]: kTileUnreadable or 0
  alignas(16) u32 key_ok[V::kStages][kKeyWordsMax];  // words past kKeyWords<V> unused
  u32 tile_flags[V::kStages];
};
static_assert(kKBytes<VariantFp8> % 1024 == 0 && kKBytes<Variant16<__half>> % 1024 == 0 &&
                  kKBytes<VariantE4m3> % 1024 == 0 && kQBytes<VariantE4m3> % 1024 == 0,
              "V stages 1 KiB aligned");

// Dynamic shared memory of variant V: the struct, plus the slack to align its base to 1 KiB.
template <class V> constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage<V>)) + 1024;
static_assert(kSmemBytes<Variant16<__half>> <= 227 * 1024 && kSmemBytes<VariantFp8> <= 227 * 1024 &&
                  kSmemBytes<VariantFp8Rope<__half>> <= 227 * 1024 && kSmemBytes<VariantE4m3> <= 227 * 1024 &&
                  kSmemBytes<Wide<VariantFp8>> <= 227 * 1024 && kSmemBytes<Wide<VariantE4m3>> <= 227 * 1024,
              "shared memory per CTA");

// Shared-space addresses of the parts of SharedStorage<V> at `base` (what TMA, wgmma and the
// mbarrier instructions take). Offsets are pointer differences inside the struct, which the
// compiler folds to constants.
template <class V>
struct Smem {
  using S = SharedStorage<V>;
  S& s;
  u32 base;

  __device__ __forceinline__ u32 at(const void* part) const {
    return base + static_cast<u32>(static_cast<const unsigned char*>(part) - reinterpret_cast<const unsigned char*>(&s));
  }
  __device__ __forceinline__ u32 q() const { return at(s.q); }
  __device__ __forceinline__ u32 k(int st) const { return at(s.stage[st].k); }
  __device__ __forceinline__ u32 rope(int st) const { return k(st) + V::kNopeBlocks * kBlk<V>; }  // the K rope block
  __device__ __forceinline__ u32 k_scales(int st) const { return k(st) + kKScalesOffset<V>; }  // fp8
  __device__ __forceinline__ u32 v(int st) const { return at(s.stage[st].v); }
  __device__ __forceinline__ u32 q_full(int c) const { return at(&s.q_full[c]); }
  __device__ __forceinline__ u32 q_empty(int c) const { return at(&s.q_empty[c]); }
  __device__ __forceinline__ u32 k_full(int st) const { return at(&s.k_full[st]); }
  __device__ __forceinline__ u32 v_full(int st) const { return at(&s.v_full[st]); }
  __device__ __forceinline__ u32 k_empty(int st) const { return at(&s.k_empty[st]); }
  __device__ __forceinline__ u32 v_empty(int st) const { return at(&s.v_empty[st]); }
  __device__ __forceinline__ u32 work_bars() const { return at(s.work_bars); }
  __device__ __forceinline__ u32 ones() const { return at(s.ones); }  // kRowSumMma
};

// The shared storage of this CTA: the dynamic shared memory's base rounded up to 1 KiB. With
// kWholeWarp (every lane of the warp calling), the base goes through a shuffle so that ptxas knows
// it is warp-uniform and keeps addresses and wgmma descriptors derived from it in uniform
// registers; a single thread (the barrier initialization) must not shuffle.
template <class V, bool kWholeWarp = true>
__device__ __forceinline__ Smem<V> shared_storage(unsigned char* smem_raw) {
  const u32 raw = smem_addr(smem_raw);
  u32 base = (raw + 1023u) & ~1023u;
  if constexpr (kWholeWarp) base = __shfl_sync(0xffffffffu, base, 0);
  return Smem<V>{*reinterpret_cast<SharedStorage<V>*>(smem_raw + (base - raw)), base};
}

}  // namespace sm90
}  // namespace mla
