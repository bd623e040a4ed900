#include "heap_release.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "driver_entry.h"

namespace jaxgin {
namespace {

heap_mapping mapping_at(const void* p) {
  heap_mapping m;
  CUdeviceptr base = 0;
  size_t bytes = 0;
  const VmmDriver& calls = vmm_driver();
  if (calls.address_range && calls.address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS) {
    m.base = (uintptr_t)base;
    m.bytes = bytes;
  }
  return m;
}

// Unmaps one mapping and then drops `extra_references` handle references that others took on its
// allocation and can no longer drop. The handle is retained first: unmapping needs no handle, but
// the references can only be named through it, and the retained one is dropped again with them.
std::string unmap(const heap_mapping& m, int extra_references) {
  if (m.bytes == 0) return "";  // not a virtual-memory mapping: the reset returned it
  const VmmDriver& calls = vmm_driver();
  CUmemGenericAllocationHandle handle;
  CUresult r = calls.retain_handle(&handle, reinterpret_cast<void*>(m.base));
  if (r != CUDA_SUCCESS) return driver_failure("cuMemRetainAllocationHandle", r);
  r = calls.unmap((CUdeviceptr)m.base, m.bytes);
  CUresult released = calls.release(handle);
  if (r != CUDA_SUCCESS) return driver_failure("cuMemUnmap", r);
  for (int i = 0; i < extra_references && released == CUDA_SUCCESS; i++) released = calls.release(handle);
  return released == CUDA_SUCCESS ? "" : driver_failure("cuMemRelease", released);
}

}  // namespace

heap_mappings mappings_of_heap(void* heap, const std::vector<char*>& lsa_heaps, int own_handle_references) {
  vmm_driver();  // looked up now, while the context is healthy
  heap_mappings m;
  m.own = mapping_at(heap);
  m.own_handle_references = own_handle_references;
  for (char* p : lsa_heaps)
    if (p != nullptr) m.window.push_back(mapping_at(p));
  return m;
}

std::string unmap_heaps_after_reset(const heap_mappings& m) {
  const VmmDriver& calls = vmm_driver();
  if (!calls.retain_handle || !calls.unmap || !calls.release || !calls.address_free)
    return "the CUDA driver's virtual-memory calls could not be found";
  for (const heap_mapping& w : m.window) {
    const std::string e = unmap(w, 0);  // an import's reference was dropped once it was mapped
    if (!e.empty()) return "NCCL's window mapping at " + std::to_string(w.base) + ": " + e;
  }
  const std::string e = unmap(m.own, m.own_handle_references);
  if (!e.empty()) return "the heap's mapping: " + e;
  if (m.own.bytes == 0) return "";
  const CUresult r = calls.address_free((CUdeviceptr)m.own.base, m.own.bytes);
  return r == CUDA_SUCCESS ? "" : driver_failure("cuMemAddressFree", r);
}

}  // namespace jaxgin
