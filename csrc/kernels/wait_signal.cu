// Host-callable wait on a signal, through the device library's bounded wait.
#include <string>

#include "../device/jaxgin_device.h"
#include "../runtime/errors.h"
#include "../runtime/runtime.h"
#include "preload.h"

namespace {
__global__ void wait_signal_kernel(const void* ctx, uint32_t signal, uint64_t value) {
  jaxgin_wait_signal(ctx, signal, value);
}
}  // namespace

cudaError_t jaxgin::preload_wait_signal_kernel() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, wait_signal_kernel);
}

extern "C" int jaxgin_wait_signal_on_device(jaxgin_runtime* rt, int32_t local_index, uint32_t signal,
                                            uint64_t value) {
  return jaxgin::c_api([&] {
    if (local_index < 0 || local_index >= (int)rt->devices.size())
      throw jaxgin::Error("local GPU index " + std::to_string(local_index) + " out of range");
    jaxgin::DeviceState& s = rt->devices[local_index];
    if (signal >= s.host_context.signal_count)
      throw jaxgin::Error("signal " + std::to_string(signal) + " is out of range: this runtime has " +
                          std::to_string(s.host_context.signal_count) + " signals");
    JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
    wait_signal_kernel<<<1, 32, 0, s.stream>>>(s.context, signal, value);
    JAXGIN_CUDA(cudaGetLastError(), s.device);
    cudaError_t e = cudaStreamSynchronize(s.stream);
    if (e != cudaSuccess) {
      std::string fault = jaxgin::describe_fault(s);
      throw jaxgin::DeviceFaultError(fault.empty() ? std::string("wait kernel failed: ") + cudaGetErrorString(e) : fault);
    }
  });
}
