// Benchmark helper: one thread spins for `ns` nanoseconds of the GPU's global timer. Launched just
// before a timed call, it keeps the GPU busy while the host enqueues that call, so the CUDA events
// around the call measure GPU time only (host launch overhead is measured and reported apart).
#include "common.cuh"

namespace mla {

__global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long t0 = globaltimer();
  while (globaltimer() - t0 < ns) {
  }
}

}  // namespace mla
