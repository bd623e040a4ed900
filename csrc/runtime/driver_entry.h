// CUDA driver calls looked up through the runtime (cudaGetDriverEntryPointByVersion), so the
// backend needs no link against libcuda.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

namespace jaxgin {

// `name`'s entry point with its ABI as of CUDA 12.0 (e.g. cuMemGetAddressRange is its _v2 there),
// or nullptr when the driver has none. Look calls up while the context is healthy: a runtime whose
// context is in error may refuse later.
template <class Fn>
Fn driver_entry_point(const char* name) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &address, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Fn>(address);
}

}  // namespace jaxgin
