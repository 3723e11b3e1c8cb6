// The backward's wgmma shapes: D[64 x N] (+)= A[64 x 16] B[16 x N], both operands in shared memory,
// each K-major (kTransA / kTransB = 0) or MN-major (1: stored with M or N contiguous, read
// transposed; 16-bit types only). N = 48 (a consumer's keys: S, dP, dV^T, dK^T) and N = 96 (its dq
// columns). Descriptors: sm90/ptx.cuh (make_desc).
#pragma once
#include "../sm90/ptx.cuh"

namespace mla {
namespace sm90_bwd {

#define MLA_ACC6(a)                                                                                       \
  "+f"(a[0][0]), "+f"(a[0][1]), "+f"(a[0][2]), "+f"(a[0][3]), "+f"(a[1][0]), "+f"(a[1][1]), "+f"(a[1][2]),   \
  "+f"(a[1][3]), "+f"(a[2][0]), "+f"(a[2][1]), "+f"(a[2][2]), "+f"(a[2][3]), "+f"(a[3][0]), "+f"(a[3][1]),   \
  "+f"(a[3][2]), "+f"(a[3][3]), "+f"(a[4][0]), "+f"(a[4][1]), "+f"(a[4][2]), "+f"(a[4][3]), "+f"(a[5][0]),   \
  "+f"(a[5][1]), "+f"(a[5][2]), "+f"(a[5][3])
#define MLA_D24                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "   \
  "%22, %23}"

// One wgmma of N = 8 NT columns (operands: D's 4 NT registers, then da, db, the accumulate flag and
// the two transpose immediates, numbered DA .. TB).
#define MLA_BWD_WGMMA(PTXT, NT, N, ACC, D, DA, DB, P, TA, TB)                                             \
  template <int kTransA, int kTransB>                                                                     \
  static __device__ __forceinline__ void ss(float (&d)[NT][4], unsigned long long da, unsigned long long db, \
                                            int accumulate) {                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." PTXT "." PTXT " " D                    \
                 ", %" DA ", %" DB ", p, 1, 1, %" TA ", %" TB ";\n}\n"                                    \
                 : ACC(d)                                                                                \
                 : "l"(da), "l"(db), "r"(accumulate), "n"(kTransA), "n"(kTransB));                        \
  }

template <typename T> struct Wgmma;

#define MLA_DEFINE_BWD_WGMMA(TYPE, PTXT)                                                                  \
  template <> struct Wgmma<TYPE> {                                                                        \
    MLA_BWD_WGMMA(PTXT, 6, "48", MLA_ACC6, MLA_D24, "24", "25", "26", "27", "28")                         \
    MLA_BWD_WGMMA(PTXT, 12, "96", MLA_ACC12, MLA_D48, "48", "49", "50", "51", "52")                       \
  };

MLA_DEFINE_BWD_WGMMA(__nv_bfloat16, "bf16")
MLA_DEFINE_BWD_WGMMA(__half, "f16")
#undef MLA_DEFINE_BWD_WGMMA
#undef MLA_BWD_WGMMA

}  // namespace sm90_bwd
}  // namespace mla
