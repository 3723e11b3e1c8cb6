// The Hopper backward kernel's arguments: the tensor maps its loads take, then the fields every
// backward main kernel takes (backward.cuh). One struct passed by value as a __grid_constant__
// parameter; its layout is exported from the compiled module (params_abi.cuh).
#pragma once
#include "../backward.cuh"
#include "../sm90/ptx.cuh"

namespace mla {
namespace sm90_bwd {

using sm90::TensorMap;

// TMA maps: q [Tq, H, 192] and dout [Tq, H, 128] (boxes of 64 values x 64 rows, 128-byte swizzle),
// k [Tk, H, 128] (32 x 96, 64-byte swizzle), v (64 x 96, 128-byte swizzle), k_rope rows (32 x 96,
// 64-byte swizzle).
#define MLA_BWD_SM90_PARAMS(X)                                                                            \
  X(TensorMap, tm_q) X(TensorMap, tm_k) X(TensorMap, tm_v) X(TensorMap, tm_rope) X(TensorMap, tm_do)      \
  MLA_BWD_COMMON_PARAMS(X)

MLA_DEFINE_PARAMS(Params, MLA_BWD_SM90_PARAMS)

}  // namespace sm90_bwd
}  // namespace mla
