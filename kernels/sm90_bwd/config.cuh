// Geometry of the Hopper backward kernel (kernels/mla_backward_sm90.cu), laid out by role as the
// forward is (kernels/sm90/):
//   config.cuh          this file: tile sizes, warpgroup roles, registers, named barriers
//   wgmma.cuh           the five GEMMs' wgmma shapes
//   shared_storage.cuh  the shared memory as one struct, and its addresses
//   scheduler.cuh       persistent CTAs take key tiles from a counter; decoded once, handed over
//   producer.cuh        warp 0: TMA of the rope, k, v, q, dout and the rows' statistics;
//                       warp 1: the dq chunks' bulk reductions into dq_accum
//   mainloop.cuh        the two consumer warpgroups: the five GEMMs of each query block; dk, dv
//                       stored per head, the rope's head-group sum per key tile
//
// A work tile is 96 keys; each of the two consumer warpgroups owns 48 of them and, per query block of
// 64 rows, computes (the layout of FlashAttention's SM90 backward for head dims 192 / 128):
//   S^(w)  = Q K_w^T       [64 x 48]   SS, K-major Q and K
//   dP^(w) = dO V_w^T      [64 x 48]   SS
//   P = exp2(scale_log2 S - lse_log2), dS = P (dP - D): registers, then to shared memory transposed
//   dV_w^T += dO^T P_w^T   [128 x 48]  SS, dO read transposed (MN-major)
//   dK_w^T += Q^T dS_w^T   [192 x 48]  SS, Q read transposed
//   dQ[:, 96w : 96w + 96] = dS K       [64 x 96] SS over all 96 keys, both operands transposed
// dK and dV are kept transposed (head dims on wgmma's M): 72 + 48 accumulator registers per
// thread instead of 96 + 64 for 64 keys, which leaves room for S, dP and dQ.
#pragma once
#include "../backward.cuh"
#include "../sm90/ptx.cuh"

namespace mla {
namespace sm90_bwd {

using bwd::kDqk;
using bwd::kDr;
using bwd::kDv;

constexpr int kBlockM = 64;                  // query rows of a query block
constexpr int kBlockN = 96;                  // keys of a work tile
constexpr int kConsumers = 2;                // consumer warpgroups
constexpr int kWgKeys = kBlockN / kConsumers;  // 48 keys per consumer
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr int kStages = 2;                   // ring of q / dout stages
static_assert(kBlockM == bwd::kChunkRows, "a query block is one dq chunk");

// Shared tiles. q and dout: 64-value column blocks of 64 rows, 128-byte swizzle (8 KiB each). k (nope
// and rope): 32-value column blocks of 96 rows, 64-byte swizzle (6 KiB each), so that each
// consumer's 96 dq columns start on a block (dQ's B operand). v: 64-value blocks of 96 rows. P^T and
// dS^T: 96 key rows of the 64 queries' 128 bytes, 128-byte swizzle.
constexpr int kQBlk = kBlockM * 128;
constexpr int kQBytes = kQBlk * (kDqk / 64);           // 24 KiB
constexpr int kDoBytes = kQBlk * (kDv / 64);           // 16 KiB
constexpr int kKBlk = kBlockN * 64;
constexpr int kKNopeBlocks = kDv / 32;                 // 4
constexpr int kKBlocks = kDqk / 32;                    // 6
constexpr int kKBytes = kKBlk * kKBlocks;              // 36 KiB
constexpr int kVBlk = kBlockN * 128;
constexpr int kVBytes = kVBlk * (kDv / 64);            // 24 KiB
constexpr int kPdsBytes = kBlockN * 128;               // 12 KiB
constexpr int kDqHalf = kBlockM * (kDqk / kConsumers); // 64 x 96 floats per consumer
constexpr int kStatBytes = kBlockM * 4;                // lse_log2 or D of a query block

// Registers per thread: the producer warpgroup (the load and dq threads decode tiles) and the consumers.
// The launch gives each thread 65536 / kThreads rounded down to a multiple of 8 (168), and
// setmaxnreg.inc waits until the CTA's pool holds what it asks: the counts after the reallocation
// must fit in what the launch gave (as the forward's, sm90/config.cuh: kLaunchRegs), or the consumers
// wait forever (48 + 2 x 232 hung: 64 more registers per consumer thread than the producer's 120
// freed ones). The producer's threads then spill a few scalars under the two-bound masks.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * kLaunchRegs, "register budget");

// Named barriers (0 is __syncthreads), the first four over the two consumer warpgroups: dS^T free to
// be overwritten (both consumers' dQ of the previous query block complete), P^T / dS^T written (and
// any rows zeroed), and k's rows past the sequence zeroed, q's and dout's rows past it zeroed; then
// one per consumer over its own 128 threads: its P^T rows written (they are its dV's alone).
constexpr int kPdsFreeBar = 1;
constexpr int kPdsReadyBar = 2;
constexpr int kKZeroBar = 3;
constexpr int kRowZeroBar = 4;
constexpr int kPtReadyBar = 5;  // + the consumer's index

}  // namespace sm90_bwd
}  // namespace mla
