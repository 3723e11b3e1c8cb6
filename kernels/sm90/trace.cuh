// Cycle stamps of each consumer's work tiles (MLA_SM90_TRACE 1; benchmarks/trace_tiles.py reads
// them): where a consumer's time goes between its key-tile loops. Off by default, and then nothing
// here is compiled into the kernel (TileTrace's calls are empty).
//
// Each consumer warpgroup's first thread writes, per work tile, the SM's clock64 before it takes
// the tile (ta), once it has it (tb: the scheduler's hand-out), after the mainloop (tc: the Q wait,
// the first S, the loop and the last P V) and after the epilogue (td), with the tile's key tiles and
// whether the consumer had no rows in it (run_idle); the take that finds no tile leaves ta and tb.
// Cycles, not nanoseconds: the power cap's clock does not move them. A header per consumer holds
// clock64 / globaltimer at its start and end (globaltimer compares CTAs of different SMs; clock64
// does not).
#pragma once
#include "config.cuh"

#ifndef MLA_SM90_TRACE
#define MLA_SM90_TRACE 0
#endif

namespace mla {
namespace sm90 {

constexpr int kTraceCtas = 160;    // CTAs recorded (a persistent launch has one per SM)
constexpr int kTraceSlots = 3;     // consumer warpgroups per CTA recorded (the most any variant has)
constexpr int kTraceTiles = 256;   // work tiles recorded per consumer (more set the header's overflow word)
constexpr int kTraceWords = 6;     // u64 per record; the header is one record
// word of a record: ta, tb, tc, td, key tiles | idle << 32, the tile's first row m0 (as i64)
// header: 1 once the consumer exits, clock64 and globaltimer at the start, at the end, 1 if it took more
// work tiles than kTraceTiles

}  // namespace sm90
}  // namespace mla

#if MLA_SM90_TRACE
// The layout as the reader finds it: CTAs, slots, tiles, words.
extern "C" __device__ const int mla_sm90_trace_shape[4] = {mla::sm90::kTraceCtas, mla::sm90::kTraceSlots,
                                                           mla::sm90::kTraceTiles, mla::sm90::kTraceWords};
extern "C" __device__ unsigned long long
    mla_sm90_trace[mla::sm90::kTraceCtas * mla::sm90::kTraceSlots * (1 + mla::sm90::kTraceTiles) * mla::sm90::kTraceWords];
#endif

namespace mla {
namespace sm90 {

// One consumer's stamps, each written as it is taken (no register held across the loop: with three
// fp8 consumers at 160 registers, stamps kept in registers made ptxas spill). Record n is work tile n
// of the consumer's loop; every call is empty unless MLA_SM90_TRACE. Word w of record n: kTa .. kTd.
enum TraceWord : int { kTa = 0, kTb = 1, kTc = 2, kTd = 3 };
struct TileTrace {
#if MLA_SM90_TRACE
  // This consumer's header (its first thread, CTAs under kTraceCtas), or null. The thread and CTA
  // indices are read anew at each stamp (volatile), so that ptxas keeps no address across the loop.
  static __device__ __forceinline__ unsigned long long* header() {
    unsigned tid, cta;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
    const int consumer = static_cast<int>(tid / 128) - 1;
    return tid % 128 == 0 && cta < kTraceCtas && consumer >= 0 && consumer < kTraceSlots
               ? mla_sm90_trace + (static_cast<size_t>(cta) * kTraceSlots + consumer) * (1 + kTraceTiles) * kTraceWords
               : nullptr;
  }
#endif
  static __device__ __forceinline__ void begin() {
#if MLA_SM90_TRACE
    if (unsigned long long* h = header()) h[1] = clock64(), h[2] = globaltimer();
#endif
  }
  template <int kWord>
  static __device__ __forceinline__ void stamp(int n) {
#if MLA_SM90_TRACE
    unsigned long long* h = header();
    if (h && n < kTraceTiles) h[(1 + n) * kTraceWords + kWord] = clock64();
#else
    (void)n;
#endif
  }
  // After the epilogue, or after run_idle (idle: then tc is td). Past kTraceTiles the header's last
  // word is set instead (the reader refuses such a trace).
  static __device__ __forceinline__ void stored(int n, int num_tiles, int m0, bool idle) {
#if MLA_SM90_TRACE
    unsigned long long* h = header();
    if (h && n < kTraceTiles) {
      unsigned long long* r = h + (1 + n) * kTraceWords;
      const unsigned long long td = clock64();
      if (idle) r[kTc] = td;
      r[kTd] = td;
      r[4] = static_cast<unsigned>(num_tiles) | (static_cast<unsigned long long>(idle) << 32);
      r[5] = static_cast<unsigned long long>(static_cast<long long>(m0));
    } else if (h) {
      h[5] = 1;
    }
#else
    (void)n, (void)num_tiles, (void)m0, (void)idle;
#endif
  }
  // At the consumer's exit (no count kept: the reader counts the records with an epilogue stamp).
  static __device__ __forceinline__ void finish() {
#if MLA_SM90_TRACE
    if (unsigned long long* h = header()) h[0] = 1, h[3] = clock64(), h[4] = globaltimer();
#endif
  }
};

}  // namespace sm90
}  // namespace mla
