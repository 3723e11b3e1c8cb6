// A kernel's parameters as one struct passed by value, described to the host by the compiled module
// itself: the launch code reads the struct's size and each field's name, offset, size and kind from
// two exported arrays and packs its argument buffer from them (mla_cupy/_launch.py: ArgPack), so no
// parameter list is written twice.
//
// A kernel source lists its fields once, as an X-macro of (type, name) pairs:
//     #define MY_PARAMS(X) X(const u32*, offsets) X(int, num_heads) ...
//     MLA_DEFINE_PARAMS(Params, MY_PARAMS)
// which defines `struct Params` and, in the enclosing namespace,
//     kParamLayout[] = {sizeof(Params), field count, bytes of kParamNames,
//                       then per field: offset, size, kind}
//     kParamNames[]  = "name0,name1,...,"
// Field kinds (ParamKind): a device pointer, int32, uint32, int64, float32, or a 128-byte TMA map.
//
// What else the launch code reads from a module (threads per CTA, tile sizes, how the work is cut)
// is its geometry, named ints listed once as an X-macro of (name, value) pairs (a value with a
// comma in parentheses):
//     #define MY_GEOMETRY(X) X(threads, kThreads) X(rows_per_cta, kRowsPerCta)
//     MLA_DEFINE_GEOMETRY(MY_GEOMETRY)
// which defines, in the enclosing namespace,
//     kGeometryNames[] = "threads,rows_per_cta,"
//     kGeometry[]      = {field count, bytes of kGeometryNames, then the values}
// A module whose geometry depends on template arguments defines the names with
// MLA_GEOMETRY_NAMES(list) and each table as a variable template initialized with
// MLA_GEOMETRY_VALUES(list).
#pragma once
#include <cuda/std/cstddef>  // offsetof
#include "common.cuh"

namespace mla {

enum ParamKindCode : int { kParamPtr = 0, kParamI32 = 1, kParamU32 = 2, kParamI64 = 3, kParamF32 = 4, kParamMap = 5 };

template <typename T> struct ParamKind;
template <typename T> struct ParamKind<T*> { static constexpr int value = kParamPtr; };
template <> struct ParamKind<int> { static constexpr int value = kParamI32; };
template <> struct ParamKind<u32> { static constexpr int value = kParamU32; };
template <> struct ParamKind<i64> { static constexpr int value = kParamI64; };
template <> struct ParamKind<float> { static constexpr int value = kParamF32; };

}  // namespace mla

#define MLA_PARAM_FIELD(type, name) type name;
#define MLA_PARAM_COUNT(type, name) +1
#define MLA_PARAM_NAME(type, name) #name ","
#define MLA_PARAM_LAYOUT(type, name) \
  static_cast<int>(offsetof(MLA_PARAMS_STRUCT_, name)), static_cast<int>(sizeof(type)), ::mla::ParamKind<type>::value,

// `list` is an X-macro over (type, name); the struct must be standard-layout (offsets by offsetof).
#define MLA_GEOMETRY_NAME(name, value) #name ","
#define MLA_GEOMETRY_COUNT(name, value) +1
#define MLA_GEOMETRY_VALUE(name, value) , static_cast<int>(value)
#define MLA_GEOMETRY_NAMES(list) __device__ const char kGeometryNames[] = list(MLA_GEOMETRY_NAME);
#define MLA_GEOMETRY_VALUES(list) {0 list(MLA_GEOMETRY_COUNT), static_cast<int>(sizeof(kGeometryNames)) list(MLA_GEOMETRY_VALUE)}
#define MLA_DEFINE_GEOMETRY(list) \
  MLA_GEOMETRY_NAMES(list)        \
  __device__ const int kGeometry[] = MLA_GEOMETRY_VALUES(list);

#define MLA_DEFINE_PARAMS(Struct, list)                                                                       \
  struct Struct {                                                                                             \
    list(MLA_PARAM_FIELD)                                                                                     \
  };                                                                                                          \
  using MLA_PARAMS_STRUCT_ = Struct;                                                                          \
  __device__ const char kParamNames[] = list(MLA_PARAM_NAME);                                                 \
  __device__ const int kParamLayout[] = {static_cast<int>(sizeof(Struct)), 0 list(MLA_PARAM_COUNT),           \
                                         static_cast<int>(sizeof(kParamNames)), list(MLA_PARAM_LAYOUT)};
