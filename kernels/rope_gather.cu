// The paged 16-bit rope's gather for the Hopper kernel: each key's 64 rope values copied out of the
// paged cache, in the key rows of k / v (key j of sequence b at row kv_begin[b] + j of a [Tk][64]
// buffer), so that the attention kernel reads the rope of a key tile as one TMA box whatever the
// page size, as it reads a plain k_rope. A key whose page the table cannot resolve (a block id
// outside [0, num_blocks), a page past the table) is written as zeros; the attention kernel's rope
// warp reads the same table and masks it. Rows of no sequence are not written (the attention
// kernel masks them). A bandwidth-bound copy of 128 bytes per key: 8 threads per row, 16 bytes each.
#include "common.cuh"
#include "params_abi.cuh"
#include "prefill_params.cuh"
#include "rope_source.cuh"

namespace mla {

namespace rope_gather {
constexpr int kThreads = 128;
constexpr int kRowsPerCta = kThreads / 8;  // 8 threads of 16 bytes per 128-byte row

// The arguments (params_abi.cuh): the cache as RopeArgs (rope_source.cuh; element strides of the
// 16-bit type), the sequences' key rows [kv_begin[b], kv_end[b]) and absolute positions of key 0
// (cache_offsets, or null: 0) of `batch` sequences, and the destination rows dst[tk][64].
#define MLA_ROPE_GATHER_PARAMS(X)                                                                        \
  MLA_ROPE_PARAMS(X) X(const u32*, kv_begin) X(const u32*, kv_end) X(const u32*, cache_offsets) X(int, batch)               \
  X(void*, dst) X(i64, tk)
MLA_DEFINE_PARAMS(Params, MLA_ROPE_GATHER_PARAMS)
// What the launch code reads besides the parameters (params_abi.cuh): threads per CTA, rows per CTA
// and stride step.
#define MLA_GATHER_GEOMETRY(X) X(threads, kThreads) X(rows_per_cta, kRowsPerCta)
MLA_DEFINE_GEOMETRY(MLA_GATHER_GEOMETRY)
}  // namespace rope_gather

// Grid: (x, y); CTA (x, y) copies rows x * kRowsPerCta + i (stride gridDim.x * kRowsPerCta) of the
// sequences y, y + gridDim.y, ...
__global__ void __launch_bounds__(rope_gather::kThreads) rope_gather_kernel(const __grid_constant__ rope_gather::Params p) {
  using Paged = RopeSource<true>;
  using Row = unsigned short;  // a 16-bit element: the strides count them
  const RopeArgs ra{p.rope_base, p.rope_row_stride, p.rope_block_stride, p.lookup, p.lookup_stride,
                    p.log2_page_size, p.num_blocks, p.max_pages};
  const int chunk = threadIdx.x % 8;
  for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const i64 begin = p.kv_begin[b], end = p.kv_end[b];
    const i64 pos0 = p.cache_offsets ? static_cast<i64>(p.cache_offsets[b]) : 0;
    for (i64 j = static_cast<i64>(blockIdx.x) * rope_gather::kRowsPerCta + threadIdx.x / 8; begin + j < end;
         j += static_cast<i64>(gridDim.x) * rope_gather::kRowsPerCta) {
      const i64 row = begin + j;
      if (row >= p.tk) break;  // offsets past k's rows (unchecked calls): nothing to write
      const i64 t = pos0 + j;
      const u32 blk = Paged::block(ra, b, t);
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (blk != kNoBlock) v = *reinterpret_cast<const uint4*>(Paged::at<Row>(ra, blk, t) + 8 * chunk);
      reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.dst) + row * 128)[chunk] = v;
    }
  }
}

}  // namespace mla
