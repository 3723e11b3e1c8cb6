// Geometry of the Hopper kernel, its variants as traits types, and the switches that select
// alternative code paths for measurements. Every constant the launch code needs is exported from
// the compiled module (mla_prefill_sm90.cu: kGeometry), never written again in Python.
#pragma once
#include "../common.cuh"
#include "../vt_layout.cuh"

namespace mla {
namespace sm90 {

constexpr int kWgRows = 64;                         // query rows of a consumer warpgroup: one wgmma M
constexpr int kKeyTile = 128;                       // keys per key tile of every variant
constexpr int kQWarp = 2;                           // the producer warpgroup's Q loader (warp 1 may be the rope warp)
constexpr int kColBlock = 64;                       // 16-bit elements per 128-byte swizzled column block
constexpr int kOTiles = kDv / 8;                    // n-tiles of 8 values in O (16)
constexpr int kQkSteps = kDqk / 16;                 // 16-bit wgmma k-steps of S (12)
constexpr int kKeyWordsMax = 4;                     // rope warp: words of readable bits a stage holds (one 16-byte load)
constexpr u32 kTileUnreadable = 1u;  // rope warp: the tile's flags word

// Named barriers (0 is __syncthreads): the consumers after zeroing V rows, the consumers' turns
// (kTurnBar + c: consumer c may issue its GEMMs), consumer c's output staging (kEpilogueBar<V> + c).
constexpr int kVZeroBar = 1;
constexpr int kTurnBar = 2;
constexpr int kTurnThreads = 2 * 128;  // a turn barrier: the warpgroup that waits and the one that passes

// The epilogue's output staging (epilogue.cuh): per consumer, its 64 rows x 64 16-bit values (one
// half of O's columns) at a time, 128 bytes a row.
constexpr int kOutStageHalf = kDv / 2;                              // values of a row per pass
constexpr int kOutStageRowBytes = kOutStageHalf * 2;                // 128

// ---------------------------------------------------------------------------------------------
// Variants. Each is a traits type: the 16-bit element type, what Q K^T and P V read, the K/V ring
// depth, and whether the two consumers take turns issuing their GEMMs.
// ---------------------------------------------------------------------------------------------

// 16-bit q, k, v and rope (bf16 or fp16): 2-stage ring of 80 KiB stages; the two consumers issue
// their GEMMs as soon as each is ready (no turns).
template <typename T>
struct Variant16 {
  using Elem = T;
  static constexpr bool kFp8 = false;               // e4m3 nope parts, V^T and P
  static constexpr bool kRope8 = false;             // e4m3 rope with one scale per key
  static constexpr bool kRopeE4m3 = false;          // e4m3 q / k rope under the per-token scales
  static constexpr bool kEvenKeyRows = false;       // every sequence's first key row even (EvenKeyRows)
  static constexpr int kNopeBlocks = 2;             // column blocks of a row's 128 nope values
  static constexpr int kBlockN = kKeyTile;
  static constexpr int kStages = 2;
  static constexpr bool kPingpong = false;
  static constexpr int kConsumers = 2;              // consumer warpgroups of kWgRows query rows
};

// fp8 per token: e4m3 q_nope, k and V^T (the pre-pass of transpose_v.cu) with float32 scales per
// token, bf16 rope; S = q_scale[i] k_scales[j] (q_nope k^T + q_rope k_rope^T). Key tiles start on
// multiples of kVtAlign keys (vt_layout.cuh). The e4m3 P V is half as long as the 16-bit one, too
// short to hide the softmax: the consumers take turns (FlashAttention-3's pingpong).
struct VariantFp8 {
  using Elem = __nv_bfloat16;
  static constexpr bool kFp8 = true;
  static constexpr bool kRope8 = false;
  static constexpr bool kRopeE4m3 = false;
  static constexpr bool kEvenKeyRows = false;
  static constexpr int kNopeBlocks = 1;
  static constexpr int kStages = 3;
  static constexpr bool kPingpong = true;
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = kKeyTile;
};

// 16-bit q, k, v with an e4m3 rope and one float32 scale per key, dequantized by the rope warp:
// Variant16 otherwise.
template <typename T>
struct VariantFp8Rope : Variant16<T> {
  static constexpr bool kRope8 = true;
};

// All e4m3: VariantFp8 with the rope quantized under the same per-token scales as the nope parts
// (e4m3 q_rope and k_rope), so S = q_scale[i] k_scales[j] (q k^T) is one 192-deep e4m3 GEMM: 4
// k-steps of 32 over the 128-byte-swizzled nope block, 2 over the rope block, whose rows are 64
// bytes (TMA and wgmma with the 64-byte swizzle). Key scales, V^T and the pingpong as VariantFp8.
// A plain rope only: a paged e4m3 rope is refused by the host (no rope warp in this variant).
struct VariantE4m3 : VariantFp8 {
  static constexpr bool kRopeE4m3 = true;
};

// Variant V for launches in which every sequence's first key row (cache_row_offsets[b]) is even,
// which the host knows from the offsets it read: a key tile's first row is then even too (its
// sequence's first plus a multiple of kVtAlign), so its scales start at an even float of their
// box (the box starts at the 16-byte boundary at or before it) and a thread reads the two scales
// of an n-tile in one 8-byte load (softmax.cuh: dequantize_scores_at). The fp8 kernels of
// three consumers only (their scales are read where they multiply), with a plain rope (beside the
// rope warp the pairs spill under the null mask); the geometry is V's.
template <class V>
struct EvenKeyRows : V {
  static constexpr bool kEvenKeyRows = true;
};

// fp8 with three consumer warpgroups under the causal mask and no mask (two, as the window and
// chunked masks keep, measured 6-11% slower at 1x8192, 3-7% at 4x2048, 2-3% faster at 16x512;
// benchmarks/NOTES.md): 192-row work tiles, so that each
// K/V tile loaded serves 50% more query rows and three softmaxes interleave with the GEMMs. The
// register file then allows 160 per consumer thread and 32 per producer thread (below), so:
//   * P V is completed before S is issued (MLA_SM90_FP8_OVERLAP's 0: one GEMM in flight);
//   * a scheduler warp (warp 3) decodes and hands out the work tiles, and warp 0 only issues the
//     loads, which fit 32 registers;
//   * the key scales are read from shared memory where they multiply (S, O and a tile's 32
//     scales do not fit 160 together);
//   * a consumer with no row in the sequence (its 64 rows of a last block) keeps the barrier
//     protocol only (Mainloop::run_idle);
//   * the causal and null masks only (a row's keys have one end); the window and chunked masks,
//     whose second bound takes registers, keep two (a third spills).
// How the three consumers share the tensor pipe: in turns, each issuing its P V and then, once P V
// is complete, its S before passing the turn (1); in turns that cover P V's issue only, S issued
// after the turn has passed (2); or without turns, each issuing as soon as it is ready (0).
#ifndef MLA_SM90_FP8_TURNS
#define MLA_SM90_FP8_TURNS 1
#endif
template <class V>
struct Wide : V {
  static constexpr int kConsumers = 3;
  static constexpr bool kPingpong = MLA_SM90_FP8_TURNS != 0;
};

// Variant V as it is compiled under Mask: its three-consumer form (the fp8 variants under a mask
// whose rows' keys have no lower end).
template <class V, class Mask>
constexpr bool kWideFor = V::kFp8 && !Mask::kBoundedBelow;
template <class V, class Mask, bool kWide = kWideFor<V, Mask>>
struct ForMaskT {
  using type = V;
};
template <class V, class Mask>
struct ForMaskT<V, Mask, true> {
  using type = Wide<V>;
};
template <class V, class Mask> using ForMask = typename ForMaskT<V, Mask>::type;

// The key tile of variant V: V::kBlockN keys, S in kSTiles<V> n-tiles of 8 keys, each 128-byte
// swizzled column block of a K or V tile kBlk<V> bytes (16 KiB for 128 keys), the rope warp's
// readable bits in kKeyWords<V> words (key 32 w + b: word w, bit b). fp8: a tile's key scales come as
// one TMA box of kScaleBox<V> floats starting at the 16-byte boundary at or before the tile's first
// key (a 1-D box must start 16-byte aligned).
template <class V> constexpr int kSTiles = V::kBlockN / 8;
template <class V> constexpr int kBlk = V::kBlockN * 128;
template <class V> constexpr int kKeyWords = V::kBlockN / 32;
template <class V> constexpr int kScaleBox = V::kBlockN + 4;

// The work tile and the warpgroups of variant V: V::kConsumers consumer warpgroups of kWgRows rows
// beside the producer warpgroup.
template <class V> constexpr int kBlockM = kWgRows * V::kConsumers;  // query rows per work tile
template <class V> constexpr int kThreads = 128 * (1 + V::kConsumers);
template <class V> constexpr int kConsumerThreads = 128 * V::kConsumers;
template <class V> constexpr int kQBlk = kBlockM<V> * 128;  // one column block of the Q tile
template <class V> constexpr int kEpilogueBar = kTurnBar + V::kConsumers;
template <class V> constexpr int kOutStageBytes = V::kConsumers * kWgRows * kOutStageRowBytes;  // 16 KiB for 2
// Registers per thread after setmaxnreg (within what the launch gives: kRegisterBudget). With two
// consumers the producer warps get more than a bare TMA issuer's 24: warp 0 decodes the work tiles,
// takes them from the counter and publishes them, the rope warp keeps a tile's page lookups in
// registers (at 56 ptxas spills in the fp8 variants); the consumers need no more than 224 (no
// spills). With three: 160 each, and the decoding moves to the scheduler warp (kSchedulerWarp).
template <class V> constexpr int kProducerRegs = V::kConsumers == 3 ? 32 : 72;
template <class V> constexpr int kConsumerRegs = V::kConsumers == 3 ? 160 : 216;
// The launch gives every thread the most registers __launch_bounds__(kThreads<V>, 1) allows, a
// multiple of 8 (168 for 384 threads, 128 for 512), and setmaxnreg.inc waits until the CTA's pool
// holds what it asks: the counts after the reallocation must fit in what the launch gave, or the
// consumers wait forever (e.g. 32 + 2 x 240 > 3 x 168; FlashAttention-3 pairs 240 with 24).
template <class V> constexpr int kLaunchRegs = 65536 / kThreads<V> / 8 * 8;
template <class V>
constexpr bool kRegisterBudget = kProducerRegs<V> + V::kConsumers * kConsumerRegs<V> <= (1 + V::kConsumers) * kLaunchRegs<V>;
static_assert(kRegisterBudget<Variant16<__half>> && kRegisterBudget<VariantFp8> && kRegisterBudget<Wide<VariantFp8>>,
              "register budget");
// A warp of the producer warpgroup that only decodes and hands out the work tiles (three consumers).
template <class V> constexpr bool kSchedulerWarp = V::kConsumers == 3;
constexpr int kSchedWarp = 3;

// Bytes of one tile in shared memory:
//   Q: the nope block(s), then the rope block (q's last 64 values; q_rope in the fp8 variants);
//   K: the nope block(s), then the rope block, then (fp8) the key scales in a 1 KiB slot;
//   V: 16-bit: two column blocks; fp8: one e4m3 block of V^T (128 values x 128 keys).
// The rope block: 128 rows of 64 16-bit values (16 KiB, 128-byte swizzle), or of 64 e4m3 bytes
// (8 KiB, 64-byte swizzle: VariantE4m3). VariantE4m3: Q 24 KiB, K 25 KiB, V 16 KiB.
template <class V> constexpr int kRopeRowBytes = V::kRopeE4m3 ? kDr : 2 * kDr;
template <class V> constexpr int kRopeBytes = V::kBlockN * kRopeRowBytes<V>;
template <class V> constexpr int kQBytes = V::kNopeBlocks * kQBlk<V> + kBlockM<V> * kRopeRowBytes<V>;
template <class V> constexpr int kKScalesOffset = V::kNopeBlocks * kBlk<V> + kRopeBytes<V>;  // fp8: the key scales
template <class V> constexpr int kKBytes = kKScalesOffset<V> + (V::kFp8 ? 1024 : 0);
template <class V> constexpr int kVBytes = V::kNopeBlocks * kBlk<V>;
template <class V> constexpr int kPvSteps = V::kFp8 ? V::kBlockN / 32 : V::kBlockN / 16;  // wgmma k-steps of O
// A rope warp flags each key tile's unreadable keys (paged cache) and writes an fp8 rope's rows
// dequantized into the K stages; every other rope (plain, or a paged 16-bit one gathered into key
// rows before the launch: rope_gather.cu) comes by warp 0's TMA.
template <class V, bool kPaged> constexpr bool kRopeWarp = kPaged || V::kRope8;
template <class V> constexpr bool kRopeByTma = !V::kRope8;

// ---------------------------------------------------------------------------------------------
// Switches: alternative code paths kept for same-process A/B measurements (benchmarks/ab.py,
// `ours:def=NAME:0`); the defaults are the measured choices (benchmarks/NOTES.md).
// ---------------------------------------------------------------------------------------------
// Fully visible key tiles run in a loop without mask code; tiles on a mask's edge in their own.
#ifndef MLA_SM90_SPLIT_MASKED
#define MLA_SM90_SPLIT_MASKED 1
#endif
// The epilogue's normalization and lse with MUFU reciprocal and log2 instead of IEEE division and logf.
#ifndef MLA_SM90_FAST_EPILOGUE
#define MLA_SM90_FAST_EPILOGUE 1
#endif
// 16-bit outputs staged through shared memory and written with 16-byte stores of whole 128-byte
// row halves, instead of 4-byte stores from the fragments (not when accumulating).
#ifndef MLA_SM90_SMEM_EPILOGUE
#define MLA_SM90_SMEM_EPILOGUE 1
#endif
// The staged rows of a consumer whose 64 rows all exist stored by one TMA store per half (`out`'s
// map, Params::tm_out, which the host builds where the module's geometry says the variant uses it
// and the output allows: Params::out_by_tma) instead of the threads' 16-byte stores. 1 (the
// default): in the fp8 kernels of three consumers (measured 0.2-3.8% faster, per token and
// all-e4m3); 2: in every kernel (the 16-bit kernel measured 0.4-1.6% faster on six cases but 4%
// slower, in some rounds 5.5%, at H16-1x8192); 0: the threads' stores always.
#ifndef MLA_SM90_TMA_EPILOGUE
#define MLA_SM90_TMA_EPILOGUE 1
#endif


// Three fp8 consumers: each row's sum of probabilities taken on the tensor pipe, P times a block of
// ones (an m64n8k32 wgmma beside each of P V's k-steps; once P V is complete its sums join the rows'
// running sums, which O's rescale factors multiply; the sums then are of the e4m3 P that P V
// multiplies), instead of 64 FADD per thread and key tile in the softmax. 1 (the default): in every
// fp8 kernel, all-e4m3 and per token, plain and paged (measured 2.9-3.6% faster from 4096 keys in
// the plain kernels, 0.4-1.4% in the paged per-token ones, level at 64x128; benchmarks/NOTES.md);
// the paged kernels read the unreadable-key words one by one, without which they spill. 0: the
// FADD sums. Every kernel of a variant sums alike, so that a paged rope gives the plain rope's bits.
#ifndef MLA_SM90_FP8_ROWSUM_MMA
#define MLA_SM90_FP8_ROWSUM_MMA 1
#endif
template <class V>
constexpr bool kRowSumMma = V::kFp8 && V::kConsumers == 3 && MLA_SM90_FP8_ROWSUM_MMA != 0;

// With the row sums on the tensor pipe: in the mask-free key tiles, P's e4m3 bytes made on the FMA
// pipe from the exponent (e4m3.cuh: exp_byte; a fused multiply-add per score, a conversion to f16x2
// and a half max per two, a byte permute per four) instead of exp2 on the special-function unit and
// a conversion, its mantissa linear between powers of 2; the tiles on a mask's edge keep exp2
// rounded to e4m3 (mainloop.cuh: kBytesIn). 1, the default: all-e4m3 5-6% and per token 3.5-4%
// faster from 4096 keys, level at 16 x 512 and 64 x 128 (benchmarks/NOTES.md). 0: exp2 rounded to
// e4m3 in every tile.
#ifndef MLA_SM90_FP8_EXP_BYTES
#define MLA_SM90_FP8_EXP_BYTES 1
#endif
template <class V>
constexpr bool kExpBytes = kRowSumMma<V> && MLA_SM90_FP8_EXP_BYTES != 0;

// Query blocks of three consumers (192 rows) counted from each sequence's end, so that a sequence
// whose length is not a multiple of 192 leaves its part-filled block at its start, where a causal
// mask shows it the fewest keys, rather than at its end, where it sees the most: the block's
// consumers without rows idle (run_idle) through every key tile of the block. Rows before a
// sequence's first (a block's start may be negative) are never stored, as rows past its end are
// not; a sequence of one block keeps its rows at the block's start. (Blocks from the start, the
// last one part-filled, measured 2-9% more time up to 4096 keys, 0-1% at 8192-16384.)
template <class V>
constexpr bool kEndAligned = V::kConsumers == 3;
// The staged epilogue's TMA stores (MLA_SM90_TMA_EPILOGUE above), in the fp8 kernels of three
// consumers, whose blocks are counted from the sequences' ends (with blocks from the start the
// per-token paged causal kernel spilled 280 bytes with them).
template <class V>
constexpr bool kTmaEpilogue = MLA_SM90_TMA_EPILOGUE == 2 ||
                              (MLA_SM90_TMA_EPILOGUE == 1 && V::kFp8 && V::kConsumers == 3 && kEndAligned<V>);

// Three consumers under a mask bounded above (causal): the key tiles at the end of a work tile
// that no row of a consumer's 64 sees (on a 192-row diagonal, the last tile for the first consumer
// in every block and for the second in every other one) get no S, softmax nor P V from it, only
// their turns and stage releases (Mainloop::skip_tail). For finite inputs the output is the same
// bits as computing them masked (their P is 0, their rescale factor exactly 1); measured 0.3-3.3%
// faster on the causal cases, level at 64 x 128 (benchmarks/NOTES.md).
template <class V, class Mask>
constexpr bool kSkipTail = V::kFp8 && V::kConsumers == 3 && Mask::kBoundedAbove;

// fp8: S_t issued beside P_{t-1} V_{t-1} and the softmax of tile t run while P V works (1), or P V
// completed before S is issued (0: one GEMM in flight, no tile t - 1 state across the softmax;
// mainloop.cuh: steps).
#ifndef MLA_SM90_FP8_OVERLAP
#define MLA_SM90_FP8_OVERLAP 1
#endif
// O's rescale after a key tile skipped when no row maximum of the warp moved (every factor 1: the
// same bits), decided by a warp vote (mainloop.cuh: rescale_o): 1. 2: the same, with each row's
// maximum kept through the mask-free tiles until one raises it by more than kMaxSlackQ / 4 (log2
// units; the probabilities then reach 2^slack, within what P's type holds), so that the vote finds
// every factor 1 on most tiles past a row's first ones (FlashAttention-4's conditional rescale).
// 3 (the default): as 1 in the per-token fp8 kernels of three consumers only (bf16 rope), measured
// 0.4-1.2% faster from 8192 keys and within 1% either way below; the all-e4m3 ones measured up to
// 0.6% slower with the vote, the 16-bit ones level or slower (benchmarks/NOTES.md). Off (0): the
// rescale always runs.
#ifndef MLA_SM90_LAZY_RESCALE
#define MLA_SM90_LAZY_RESCALE 3
#endif
// Whether variant V's consumers vote on O's rescale (mainloop.cuh: rescale_o).
template <class V>
constexpr bool kLazyRescale = MLA_SM90_LAZY_RESCALE == 1 || MLA_SM90_LAZY_RESCALE == 2 ||
                              (MLA_SM90_LAZY_RESCALE == 3 && V::kFp8 && !V::kRopeE4m3 && V::kConsumers == 3);
// The slack in quarters of a log2 unit: fp8 0.75 (kPScale * P <= 2^8.75 = 431, under e4m3's 448),
// 16-bit 8 (P <= 256).
template <class V> constexpr int kMaxSlackQ = MLA_SM90_LAZY_RESCALE == 2 ? (V::kFp8 ? 3 : 32) : 0;
// S_t issued beside P_{t-1} V_{t-1} (the overlap): with two consumers, in fp8 as the switch above
// says; never with three (P V completed before S).
template <class V> constexpr bool kOverlap = V::kConsumers == 2 && (!V::kFp8 || MLA_SM90_FP8_OVERLAP);

// A work tile's last key tile as a half tile for a warpgroup that sees none of its second half
// (consumer 0 on a causal diagonal): P V over 4 of its 8 k-steps, and S by m64n64 wgmma when it
// is the work tile's only key tile (16-bit variants; mainloop.cuh).
#ifndef MLA_SM90_HALF_TILE
#define MLA_SM90_HALF_TILE 1
#endif
// Whether variant V under Mask has half tiles (softmax.cuh: last_tile_is_half): with a mask bounded
// above, in the 16-bit variants of two consumers on 128-key tiles. Not in the fp8 variants: their
// chunked-mask kernels would spill (they run at the register limit), and their time goes to the
// softmax, which a half tile does not shorten.
template <class V, class Mask>
constexpr bool kHalfTilesFor = MLA_SM90_HALF_TILE && MLA_SM90_SPLIT_MASKED && Mask::kBoundedAbove && !V::kFp8 &&
                               V::kConsumers == 2 && V::kBlockN == 128;

// Keys a work tile's key span starts on a multiple of (scheduler.cuh): fp8, V^T's aligned groups
// (kVtAlign keys, vt_layout.cuh); any key otherwise.
template <class V> constexpr int kKeyAlign = V::kFp8 ? kVtAlign : 1;

// Slots of the work tiles handed out (scheduler.cuh), a power of two.
constexpr int kWorkSlots = 2;
// A 16-bit consumer releases its Q rows as soon as its work tile's last S is complete, instead of
// after that tile's softmax: the Q warp's load of the next rows starts a softmax earlier (measured
// 0.2-0.5% faster). The fp8 variants release after the softmax (the early release measured 0.3-1.5%
// slower in the three-consumer all-e4m3 kernel).
template <class V> constexpr bool kQEarlyRelease = !V::kFp8;

// Arrivals each consumer-released barrier expects: one per consumer thread (arrivals from one
// elected lane per warp measured 0.7-1.4% slower).
template <class V> constexpr int kConsumerArrivals = kConsumerThreads<V>;

}  // namespace sm90
}  // namespace mla
