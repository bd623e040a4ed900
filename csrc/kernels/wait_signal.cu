// A wait on a signal, through the device library's bounded wait (jaxgin_wait_signal_on_device).
#include "../device/jaxgin_device.h"
#include "diagnostics.h"
#include "jaxgin_op_table.h"  // generated: the preload hook this file defines

namespace {
__global__ void wait_signal_kernel(const void* ctx, uint32_t signal, uint64_t value) {
  jaxgin_wait_signal(ctx, signal, value);
}
}  // namespace

cudaError_t jaxgin::preload_wait_signal_kernel() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, wait_signal_kernel);
}

cudaError_t jaxgin::launch_wait_signal(const jaxgin_context* ctx, uint32_t signal, uint64_t value, cudaStream_t stream) {
  wait_signal_kernel<<<1, 32, 0, stream>>>(ctx, signal, value);
  return cudaGetLastError();
}
