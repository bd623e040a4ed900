// CUDA driver calls looked up through the runtime (cudaGetDriverEntryPointByVersion), so the
// backend needs no link against libcuda.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

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

// The driver's virtual-memory calls the runtime makes itself, to undo NCCL's mappings after a fault
// (heap_release.h, vmm_ledger.h), and the context query the ledger names contexts with. Looked up
// once, on first use, which is during setup while the context is healthy; an entry is nullptr
// where the driver lacks it.
struct VmmDriver {
  CUresult (*retain_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*current_context)(CUcontext*) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

inline const VmmDriver& vmm_driver() {
  static const VmmDriver calls = [] {
    VmmDriver d;
    d.retain_handle = driver_entry_point<decltype(d.retain_handle)>("cuMemRetainAllocationHandle");
    d.address_range = driver_entry_point<decltype(d.address_range)>("cuMemGetAddressRange");
    d.unmap = driver_entry_point<decltype(d.unmap)>("cuMemUnmap");
    d.release = driver_entry_point<decltype(d.release)>("cuMemRelease");
    d.address_free = driver_entry_point<decltype(d.address_free)>("cuMemAddressFree");
    d.current_context = driver_entry_point<decltype(d.current_context)>("cuCtxGetCurrent");
    d.error_name = driver_entry_point<decltype(d.error_name)>("cuGetErrorName");
    return d;
  }();
  return calls;
}

// "<call> failed (<the driver's name for r>)".
inline std::string driver_failure(const char* call, CUresult r) {
  const char* name = nullptr;
  const VmmDriver& d = vmm_driver();
  if (d.error_name == nullptr || d.error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "?";
  return std::string(call) + " failed (" + name + ")";
}

}  // namespace jaxgin
