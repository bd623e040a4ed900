#include "heap_release.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <mutex>

#include "driver_entry.h"

namespace jaxgin {
namespace {

struct DriverCalls {
  CUresult (*retain_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

std::once_flag resolved;
DriverCalls calls;

template <class Fn>
void resolve(const char* name, Fn& fn) {
  fn = driver_entry_point<Fn>(name);
}

void resolve_calls() {
  std::call_once(resolved, [] {
    resolve("cuMemRetainAllocationHandle", calls.retain_handle);
    resolve("cuMemGetAddressRange", calls.address_range);
    resolve("cuMemUnmap", calls.unmap);
    resolve("cuMemRelease", calls.release);
    resolve("cuMemAddressFree", calls.address_free);
    resolve("cuGetErrorName", calls.error_name);
  });
}

std::string failed(const char* call, CUresult r) {
  const char* name = nullptr;
  if (calls.error_name == nullptr || calls.error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "?";
  return std::string(call) + " failed (" + name + ")";
}

heap_mapping mapping_at(const void* p) {
  heap_mapping m;
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (calls.address_range && calls.address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS) {
    m.base = (uintptr_t)base;
    m.bytes = bytes;
  }
  return m;
}

// Unmaps one mapping. Only mappings hold the memory: ncclMemAlloc and NCCL's window release their
// handles once mapped (measured with NCCL 2.28.9: a second release of a mapping's handle fails),
// so the handle retained here to check the mapping is released again and nothing more.
std::string unmap(const heap_mapping& m) {
  if (m.bytes == 0) return "";  // not a virtual-memory mapping: the reset returned it
  CUmemGenericAllocationHandle handle;
  CUresult r = calls.retain_handle(&handle, reinterpret_cast<void*>(m.base));
  if (r != CUDA_SUCCESS) return failed("cuMemRetainAllocationHandle", r);
  r = calls.unmap((CUdeviceptr)m.base, m.bytes);
  const CUresult released = calls.release(handle);
  if (r != CUDA_SUCCESS) return failed("cuMemUnmap", r);
  return released == CUDA_SUCCESS ? "" : failed("cuMemRelease", released);
}

}  // namespace

heap_mappings mappings_of_heap(void* heap, const std::vector<char*>& lsa_heaps) {
  resolve_calls();
  heap_mappings m;
  m.own = mapping_at(heap);
  for (char* p : lsa_heaps)
    if (p != nullptr) m.window.push_back(mapping_at(p));
  return m;
}

std::string unmap_heaps_after_reset(const heap_mappings& m) {
  if (!calls.retain_handle || !calls.unmap || !calls.release || !calls.address_free)
    return "the CUDA driver's virtual-memory calls could not be found";
  for (const heap_mapping& w : m.window) {
    const std::string e = unmap(w);
    if (!e.empty()) return "NCCL's window mapping at " + std::to_string(w.base) + ": " + e;
  }
  const std::string e = unmap(m.own);
  if (!e.empty()) return "the heap's mapping: " + e;
  if (m.own.bytes == 0) return "";
  const CUresult r = calls.address_free((CUdeviceptr)m.own.base, m.own.bytes);
  return r == CUDA_SUCCESS ? "" : failed("cuMemAddressFree", r);
}

}  // namespace jaxgin
