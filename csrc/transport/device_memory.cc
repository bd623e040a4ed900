#include "device_memory.h"

#include <cuda.h>
#include <unistd.h>

#include <mutex>

namespace jaxgin::transport {

namespace {

struct Driver {
  CUresult (*retain)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long) =
      nullptr;
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*free_address)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  // Optional: older drivers lack the stream atomic reduction, and the library works without it.
  CUresult (*batch_mem_op)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  // The transport's own context (create_own_context). cuCtxCreate changed its arguments twice:
  // this is its CUDA 12.5 form (12.0 gives the 11.4 one, with execution-affinity parameters).
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*context_create)(CUcontext*, CUctxCreateParams*, unsigned int, CUdevice) = nullptr;
  CUresult (*context_destroy)(CUcontext) = nullptr;
  CUresult (*context_push)(CUcontext) = nullptr;
  CUresult (*context_pop)(CUcontext*) = nullptr;
  std::string missing, missing_for_contexts;
};

template <typename F>
void resolve(const char* symbol, F& fn, std::string& missing, unsigned int version = 12000) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    if (!missing.empty()) missing += ", ";
    missing += symbol;
    return;
  }
  fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("cuMemRetainAllocationHandle", d.retain, d.missing);
    resolve("cuMemRelease", d.release, d.missing);
    resolve("cuMemGetAddressRange", d.address_range, d.missing);
    resolve("cuMemExportToShareableHandle", d.export_handle, d.missing);
    resolve("cuMemImportFromShareableHandle", d.import_handle, d.missing);
    resolve("cuMemAddressReserve", d.reserve, d.missing);
    resolve("cuMemAddressFree", d.free_address, d.missing);
    resolve("cuMemMap", d.map, d.missing);
    resolve("cuMemUnmap", d.unmap, d.missing);
    resolve("cuMemSetAccess", d.set_access, d.missing);
    resolve("cuStreamWriteValue64", d.write_value64, d.missing);
    resolve("cuGetErrorString", d.error_string, d.missing);
    std::string optional;
    resolve("cuStreamBatchMemOp", d.batch_mem_op, optional);
    resolve("cuDeviceGetAttribute", d.device_attribute, optional);
    resolve("cuDeviceGet", d.device_get, d.missing_for_contexts);
    resolve("cuCtxCreate", d.context_create, d.missing_for_contexts, 12050);
    resolve("cuCtxDestroy", d.context_destroy, d.missing_for_contexts);
    resolve("cuCtxPushCurrent", d.context_push, d.missing_for_contexts);
    resolve("cuCtxPopCurrent", d.context_pop, d.missing_for_contexts);
  });
  return d;
}

bool check(CUresult r, const char* what, std::string& error) {
  if (r == CUDA_SUCCESS) return true;
  const char* text = "unknown error";
  if (driver().error_string) driver().error_string(r, &text);
  error = std::string(what) + " failed: " + text;
  return false;
}

bool ready(std::string& error) {
  if (driver().missing.empty()) return true;
  error = "the CUDA driver lacks " + driver().missing;
  return false;
}

}  // namespace

bool export_allocation(const void* ptr, int& fd, uint64_t& allocation_bytes, uint64_t& offset, std::string& error) {
  fd = -1;
  if (!ready(error)) return false;
  const Driver& d = driver();
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (!check(d.address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(ptr)), "cuMemGetAddressRange", error))
    return false;
  CUmemGenericAllocationHandle handle;
  if (!check(d.retain(&handle, const_cast<void*>(ptr)), "cuMemRetainAllocationHandle", error)) return false;
  int shared = -1;
  bool ok = check(d.export_handle(&shared, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                  "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)", error);
  d.release(handle);
  if (!ok) return false;
  fd = shared;
  allocation_bytes = bytes;
  offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
  return true;
}

bool import_allocation(int fd, uint64_t allocation_bytes, int device, void*& mapped, std::string& error) {
  mapped = nullptr;
  if (!ready(error)) return false;
  const Driver& d = driver();
  CUmemGenericAllocationHandle handle;
  if (!check(d.import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             "cuMemImportFromShareableHandle", error))
    return false;
  CUdeviceptr va = 0;
  bool ok = check(d.reserve(&va, allocation_bytes, 0, 0, 0), "cuMemAddressReserve", error);
  if (ok && !check(d.map(va, allocation_bytes, 0, handle, 0), "cuMemMap", error)) {
    d.free_address(va, allocation_bytes);
    ok = false;
  }
  d.release(handle);  // the mapping keeps the memory alive
  if (!ok) return false;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!check(d.set_access(va, allocation_bytes, &access, 1), "cuMemSetAccess", error)) {
    unmap_allocation(reinterpret_cast<void*>(va), allocation_bytes);
    return false;
  }
  mapped = reinterpret_cast<void*>(va);
  return true;
}

void unmap_allocation(void* mapped, uint64_t allocation_bytes) {
  if (!mapped || !driver().unmap) return;
  driver().unmap(reinterpret_cast<CUdeviceptr>(mapped), allocation_bytes);
  driver().free_address(reinterpret_cast<CUdeviceptr>(mapped), allocation_bytes);
}

bool create_own_context(int device, void*& context, std::string& error) {
  context = nullptr;
  const Driver& d = driver();
  if (!d.missing_for_contexts.empty()) {
    error = "the CUDA driver lacks " + d.missing_for_contexts;
    return false;
  }
  CUdevice handle = 0;
  CUcontext made = nullptr;
  if (!check(d.device_get(&handle, device), "cuDeviceGet", error) ||
      !check(d.context_create(&made, nullptr, 0, handle), "cuCtxCreate", error))
    return false;
  // cuCtxCreate leaves the new context current on this thread, which is the caller's (NCCL's):
  // take it off again, so that the caller's own CUDA calls keep their context.
  CUcontext popped = nullptr;
  if (!check(d.context_pop(&popped), "cuCtxPopCurrent", error)) {
    d.context_destroy(made);
    return false;
  }
  context = made;
  return true;
}

void destroy_own_context(void* context) {
  if (context && driver().context_destroy) driver().context_destroy(static_cast<CUcontext>(context));
}

bool push_context(void* context, std::string& error) {
  return check(driver().context_push(static_cast<CUcontext>(context)), "cuCtxPushCurrent", error);
}

void pop_context() {
  CUcontext popped = nullptr;
  driver().context_pop(&popped);
}

bool write_value64(cudaStream_t stream, void* address, uint64_t value, std::string& error) {
  if (!ready(error)) return false;
  // Default flags: the write waits until earlier writes of the stream are visible.
  return check(driver().write_value64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                                      value, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64", error);
}

// The stream atomic reduction is declared by CUDA 13.5's headers (not by 13.0's); a library built
// with older headers writes signals instead.
#if CUDA_VERSION >= 13050
bool can_add_value64(int device) {
  const Driver& d = driver();
  if (!d.batch_mem_op || !d.device_attribute) return false;
  int reductions = 0, wide = 0;
  if (d.device_attribute(&reductions, CU_DEVICE_ATTRIBUTE_ATOMIC_REDUCTION_SUPPORTED, device) != CUDA_SUCCESS ||
      d.device_attribute(&wide, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS)
    return false;
  return reductions != 0 && wide != 0;
}

bool add_value64(cudaStream_t stream, void* address, uint64_t value, std::string& error) {
  CUstreamBatchMemOpParams op{};
  op.atomicReduction.operation = CU_STREAM_MEM_OP_ATOMIC_REDUCTION;
  op.atomicReduction.flags = 0;
  op.atomicReduction.reductionOp = CU_STREAM_ATOMIC_REDUCTION_OP_ADD;
  op.atomicReduction.dataType = CU_STREAM_ATOMIC_REDUCTION_UNSIGNED_64;
  op.atomicReduction.address = reinterpret_cast<CUdeviceptr>(address);
  op.atomicReduction.value = value;
  return check(driver().batch_mem_op(reinterpret_cast<CUstream>(stream), 1, &op, 0),
               "cuStreamBatchMemOp(atomic add)", error);
}
#else
bool can_add_value64(int) { return false; }
bool add_value64(cudaStream_t, void*, uint64_t, std::string& error) {
  error = "this library was built with CUDA headers older than 13.5, which lack the stream atomic add";
  return false;
}
#endif

}  // namespace jaxgin::transport
