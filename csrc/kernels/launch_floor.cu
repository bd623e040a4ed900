// An empty kernel, for the exchange-latency tool (ffi/diagnostics.cu): the launch floor any
// one-kernel op pays.
#include "diagnostics.h"

namespace {
__global__ void empty_kernel() {}
}  // namespace

cudaError_t jaxgin::launch_empty(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  return cudaGetLastError();
}
