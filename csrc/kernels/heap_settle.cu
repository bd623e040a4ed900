// The meeting of every rank that freeing a heap region and finalize() need (jaxgin_heap_clear,
// jaxgin_runtime_settle; ffi/heap_free.cu): one CTA per GIN context, each in the device library's barrier. A CTA's
// barrier signals are strong and go on its own context, so once every CTA of this rank has met
// its peers, every put any peer made to this rank earlier, on any context, has landed.
#include "../device/jaxgin_device.h"
#include "heap_settle.h"
#include "jaxgin_op_table.h"  // generated: the preload hook this file defines

namespace {
__global__ void heap_settle_kernel(const void* ctx) { jaxgin_barrier(ctx); }
}  // namespace

cudaError_t jaxgin::preload_heap_settle_kernel() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, heap_settle_kernel);
}

cudaError_t jaxgin::launch_heap_settle(const jaxgin_context* ctx, int ctas, cudaStream_t stream) {
  heap_settle_kernel<<<ctas, 32, 0, stream>>>(ctx);
  return cudaGetLastError();
}
