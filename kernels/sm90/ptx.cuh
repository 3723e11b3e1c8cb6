// Hopper (sm_90a) primitives: mbarriers, the bulk tensor copy engine (TMA), wgmma with shared-memory
// descriptors, register reallocation and named barriers. Small wrappers over PTX, one per concept.
#pragma once
#include "../common.cuh"
#include "../params_abi.cuh"

namespace mla {
namespace sm90 {

// ---------------------------------------------------------------------------------------------
// mbarrier: a transaction-counting barrier in shared memory (8 bytes).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {  // arrive + expect `bytes`
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes));
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar));
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar), "r"(parity));
}
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::); }
// Generic-proxy smem writes (st.shared, cp.async) made visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::); }

// ---------------------------------------------------------------------------------------------
// TMA: tiled bulk tensor copies global -> shared, completing on an mbarrier. The tensor map is a
// field of the kernel's __grid_constant__ parameter struct (built on the host with
// cuTensorMapEncodeTiled); a parameter struct field of this kind is exported as kParamMap.
// ---------------------------------------------------------------------------------------------
struct alignas(64) TensorMap { unsigned long long opaque[16]; };
}  // namespace sm90
template <> struct ParamKind<sm90::TensorMap> { static constexpr int value = kParamMap; };
namespace sm90 {

__device__ __forceinline__ void tma_load_1d(u32 dst, const TensorMap* map, u32 bar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0) : "memory");
}
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
// TMA store shared -> global of a box (the map's box at coordinates c0, c1, c2), in this thread's
// bulk group: the caller fences the generic-proxy writes of the box (fence_proxy_async) before it,
// commits the group, and waits for the group's reads of shared memory before the box is written
// again (bulk_wait_read) and for the whole group before the CTA exits (bulk_wait).
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, u32 src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
// Non-tensor bulk copies (a contiguous range of `bytes`, a multiple of 16 at 16-byte aligned
// addresses): global -> shared completing on an mbarrier, and shared -> global adding float32
// values to what is there (the reduction happens at the destination, in this thread's bulk group).
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// stmatrix: four 8x8 b16 matrices per warp, register i of each lane holding its two elements of
// matrix i in the mma accumulator layout (row lane / 4, columns 2 (lane % 4) + {0, 1}); .trans
// stores each matrix transposed: lane l supplies the address of stored row l % 8 of matrix l / 8,
// which receives column l % 8 of the matrix (8 values, 16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// threadIdx.x read where it is used: the compiler can neither hoist this read nor values derived
// from it, so per-thread addresses of rarely run code (e.g. a partial tile's clean-up) are not
// kept live in registers across a whole loop.
__device__ __forceinline__ int thread_index_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// ---------------------------------------------------------------------------------------------
// Register reallocation between warpgroup roles, and named barriers among a subset of warps.
// ---------------------------------------------------------------------------------------------
template <int N> __device__ __forceinline__ void regs_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void regs_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting: the other `threads - (this warpgroup)` complete the barrier with bar.sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma shared-memory descriptors for tiles stored as 64-element (128-byte) wide column blocks of
// 16-bit values with the 128-byte swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B):
// block b of a tile with R rows starts at b * R * 128 bytes; 8-row groups are 1024 bytes apart.
//   K-major operand (rows = M or N, contiguous = K): LBO unused (16), SBO = 1024.
//   MN-major operand (rows = K, contiguous = N, used transposed): LBO = bytes of one column block
//   (distance between 64-wide N blocks), SBO = 1024.
//
// Rows of 64 bytes with the 64-byte swizzle (CU_TENSOR_MAP_SWIZZLE_64B: 16-byte chunk c of row r
// stored at chunk c ^ ((r / 2) % 4), the same address bits 4-5 ^ 7-8 rule as wgmma's 64-byte mode),
// K-major: 8-row groups are 8 * 64 = 512 bytes apart (SBO), LBO unused (16). Bits 62-63 of the
// descriptor are the layout: 1 = 128-byte swizzle, 2 = 64-byte swizzle (PTX ISA, "Matrix
// Descriptor Format"; CUTLASS's GmmaDescriptor LayoutType::B128 / B64). A k-step of 32 bytes is a
// start-address advance inside the row, as for the 128-byte swizzle.
// ---------------------------------------------------------------------------------------------
constexpr unsigned long long kDescSwizzle128 = 1, kDescSwizzle64 = 2;
__device__ __forceinline__ unsigned long long desc_encode(u32 x) { return (x & 0x3FFFF) >> 4; }
__device__ __forceinline__ unsigned long long make_desc(u32 smem, u32 lbo, u32 sbo,
                                                        unsigned long long layout = kDescSwizzle128) {
  return desc_encode(smem) | (desc_encode(lbo) << 16) | (desc_encode(sbo) << 32) | (layout << 62);
}
// The descriptor of the tile `bytes` (a multiple of 16) further on: only the start-address field
// (bits 0-13, address / 16) moves, by one 32-bit add on the low word. It cannot carry into the
// LBO field: shared-memory addresses stay below 2^18 (227 KiB per CTA). Equal to make_desc(smem +
// bytes, ...) but without re-encoding (and-mask, shift, or) per wgmma k-step.
__device__ __forceinline__ unsigned long long desc_add(unsigned long long desc, u32 bytes) {
  const u32 lo = static_cast<u32>(desc) + (bytes >> 4), hi = static_cast<u32>(desc >> 32);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Register fences for operands of asynchronous wgmma: the empty volatile asm "rewrites" each
// register, so the compiler can neither move reads of an accumulator above the wgmma.wait_group
// that completes it, nor reuse an A-operand register while the wgmma reading it is in flight.
// The first K of N rows only: the rest is neither read nor kept live by the fence.
template <int K, int N> __device__ __forceinline__ void fence_operands_first(float (&a)[N][4]) {
  static_assert(K <= N, "rows of the array");
#pragma unroll
  for (int i = 0; i < K; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(a[i][j])::"memory");
}
template <int N> __device__ __forceinline__ void fence_operands(float (&a)[N][4]) { fence_operands_first<N>(a); }
template <int N> __device__ __forceinline__ void fence_operands(u32 (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// Accumulator registers of an m64n128 f32 tile, as 16 n-tiles of 4 (the mma.sync C layout per warp).
#define MLA_ACC16(a)                                                                                      \
  "+f"(a[0][0]), "+f"(a[0][1]), "+f"(a[0][2]), "+f"(a[0][3]), "+f"(a[1][0]), "+f"(a[1][1]), "+f"(a[1][2]),   \
  "+f"(a[1][3]), "+f"(a[2][0]), "+f"(a[2][1]), "+f"(a[2][2]), "+f"(a[2][3]), "+f"(a[3][0]), "+f"(a[3][1]),   \
  "+f"(a[3][2]), "+f"(a[3][3]), "+f"(a[4][0]), "+f"(a[4][1]), "+f"(a[4][2]), "+f"(a[4][3]), "+f"(a[5][0]),   \
  "+f"(a[5][1]), "+f"(a[5][2]), "+f"(a[5][3]), "+f"(a[6][0]), "+f"(a[6][1]), "+f"(a[6][2]), "+f"(a[6][3]),   \
  "+f"(a[7][0]), "+f"(a[7][1]), "+f"(a[7][2]), "+f"(a[7][3]), "+f"(a[8][0]), "+f"(a[8][1]), "+f"(a[8][2]),   \
  "+f"(a[8][3]), "+f"(a[9][0]), "+f"(a[9][1]), "+f"(a[9][2]), "+f"(a[9][3]), "+f"(a[10][0]), "+f"(a[10][1]), \
  "+f"(a[10][2]), "+f"(a[10][3]), "+f"(a[11][0]), "+f"(a[11][1]), "+f"(a[11][2]), "+f"(a[11][3]),            \
  "+f"(a[12][0]), "+f"(a[12][1]), "+f"(a[12][2]), "+f"(a[12][3]), "+f"(a[13][0]), "+f"(a[13][1]),            \
  "+f"(a[13][2]), "+f"(a[13][3]), "+f"(a[14][0]), "+f"(a[14][1]), "+f"(a[14][2]), "+f"(a[14][3]),            \
  "+f"(a[15][0]), "+f"(a[15][1]), "+f"(a[15][2]), "+f"(a[15][3])

// The first 8 n-tiles of the same array: the accumulator of an m64n64 tile (its first 64 columns).
#define MLA_ACC8(a)                                                                                       \
  "+f"(a[0][0]), "+f"(a[0][1]), "+f"(a[0][2]), "+f"(a[0][3]), "+f"(a[1][0]), "+f"(a[1][1]), "+f"(a[1][2]),   \
  "+f"(a[1][3]), "+f"(a[2][0]), "+f"(a[2][1]), "+f"(a[2][2]), "+f"(a[2][3]), "+f"(a[3][0]), "+f"(a[3][1]),   \
  "+f"(a[3][2]), "+f"(a[3][3]), "+f"(a[4][0]), "+f"(a[4][1]), "+f"(a[4][2]), "+f"(a[4][3]), "+f"(a[5][0]),   \
  "+f"(a[5][1]), "+f"(a[5][2]), "+f"(a[5][3]), "+f"(a[6][0]), "+f"(a[6][1]), "+f"(a[6][2]), "+f"(a[6][3]),   \
  "+f"(a[7][0]), "+f"(a[7][1]), "+f"(a[7][2]), "+f"(a[7][3])

// The first 12 n-tiles: the accumulator of an m64n96 tile (S of a 96-key tile).
#define MLA_ACC12(a)                                                                                      \
  "+f"(a[0][0]), "+f"(a[0][1]), "+f"(a[0][2]), "+f"(a[0][3]), "+f"(a[1][0]), "+f"(a[1][1]),               \
  "+f"(a[1][2]), "+f"(a[1][3]), "+f"(a[2][0]), "+f"(a[2][1]), "+f"(a[2][2]), "+f"(a[2][3]),               \
  "+f"(a[3][0]), "+f"(a[3][1]), "+f"(a[3][2]), "+f"(a[3][3]), "+f"(a[4][0]), "+f"(a[4][1]),               \
  "+f"(a[4][2]), "+f"(a[4][3]), "+f"(a[5][0]), "+f"(a[5][1]), "+f"(a[5][2]), "+f"(a[5][3]),               \
  "+f"(a[6][0]), "+f"(a[6][1]), "+f"(a[6][2]), "+f"(a[6][3]), "+f"(a[7][0]), "+f"(a[7][1]),               \
  "+f"(a[7][2]), "+f"(a[7][3]), "+f"(a[8][0]), "+f"(a[8][1]), "+f"(a[8][2]), "+f"(a[8][3]),               \
  "+f"(a[9][0]), "+f"(a[9][1]), "+f"(a[9][2]), "+f"(a[9][3]), "+f"(a[10][0]), "+f"(a[10][1]),             \
  "+f"(a[10][2]), "+f"(a[10][3]), "+f"(a[11][0]), "+f"(a[11][1]), "+f"(a[11][2]), "+f"(a[11][3])

#define MLA_D48                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
  "%42, %43, %44, %45, %46, %47}"

#define MLA_D32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "   \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define MLA_D64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "   \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "     \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "     \
  "%62, %63}"

// S's k-step on a key tile of N = 8 NT keys (operands: D's 4 NT registers, then da, db and the
// accumulate flag, numbered DA, DB, P).
#define MLA_WGMMA_SS(PTXT, NT, N, ACC, D, DA, DB, P)                                                      \
  static __device__ __forceinline__ void ss(float (&d)[NT][4], unsigned long long da, unsigned long long db,\
                                            int accumulate) {                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." PTXT "." PTXT " " D                     \
                 ", %" DA ", %" DB ", p, 1, 1, 0, 0;\n}\n"                                                \
                 : ACC(d)                                                                                 \
                 : "l"(da), "l"(db), "r"(accumulate));                                                    \
  }

template <typename T> struct Wgmma;

#define MLA_DEFINE_WGMMA(TYPE, PTXT)                                                                       \
  template <> struct Wgmma<TYPE> {                                                                         \
    /* D[64xN] (+)= A[64x16] * B[16xN], both K-major in shared memory (B stored [n][k]): S of a key tile */\
    MLA_WGMMA_SS(PTXT, 16, "128", MLA_ACC16, MLA_D64, "64", "65", "66")                                   \
    MLA_WGMMA_SS(PTXT, 12, "96", MLA_ACC12, MLA_D48, "48", "49", "50")                                    \
    MLA_WGMMA_SS(PTXT, 8, "64", MLA_ACC8, MLA_D32, "32", "33", "34")                                      \
    /* D[64x64] (+)= A[64x16] * B[16x64]: ss on the first 64 columns (B's first 64 rows), d[8..15] untouched */ \
    static __device__ __forceinline__ void ss_n64(float (&d)[16][4], unsigned long long da, unsigned long long db, \
                                                  int accumulate) {                                        \
      ss(reinterpret_cast<float(&)[8][4]>(d), da, db, accumulate);                                          \
    }                                                                                                      \
    /* D[64x128] += A[64x16] (registers) * B[16x128] (smem, MN-major: stored [k][n], transposed) */        \
    static __device__ __forceinline__ void rs_tb(float (&d)[16][4], const u32 (&a)[4], unsigned long long db) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                            \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTXT "." PTXT " " MLA_D64                 \
                   ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                       \
                   : MLA_ACC16(d)                                                                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                                 \
    }                                                                                                      \
  };

MLA_DEFINE_WGMMA(__nv_bfloat16, "bf16")
MLA_DEFINE_WGMMA(__half, "f16")
#undef MLA_DEFINE_WGMMA

}  // namespace sm90
}  // namespace mla
