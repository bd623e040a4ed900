// CUDA pieces of the host transport: sharing a registered GPU region with another process on the
// same host (cuMem export to a file descriptor, import and map), and the stream memory operation
// that applies a signal. The driver API is reached through the runtime's entry-point query, so the
// library loads (and its host-memory paths work) on machines without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jaxgin::transport {

// The allocation behind `ptr` as a POSIX file descriptor, its size and where `ptr` sits in it.
// False when the memory is not a cuMem allocation with a shareable handle (NCCL's own signal
// buffers, for one); `error` says why.
bool export_allocation(const void* ptr, int& fd, uint64_t& allocation_bytes, uint64_t& offset, std::string& error);
// Maps an exported allocation into this process for `device`; `mapped` is its base.
bool import_allocation(int fd, uint64_t allocation_bytes, int device, void*& mapped, std::string& error);
void unmap_allocation(void* mapped, uint64_t allocation_bytes);
// A CUDA context of the transport's own on `device`, beside the application's (the primary context,
// where XLA's streams live). Work on its streams sits in hardware queues of its own: never behind
// work the application queued. Not current on return.
bool create_own_context(int device, void*& context, std::string& error);
void destroy_own_context(void* context);
// Makes `context` current on the calling thread over whatever was; pop_context restores that.
bool push_context(void* context, std::string& error);
void pop_context();
// Writes `value` to the 64-bit word at `address` in stream order, after all earlier work of
// `stream` is visible (a stream memory operation: no kernel, no SM needed).
bool write_value64(cudaStream_t stream, void* address, uint64_t value, std::string& error);
// Whether `device` can add to a 64-bit word in stream order (CUDA's stream atomic reduction, when
// both the driver and the headers this library was built with have it): then signals need neither
// a read nor a known value.
bool can_add_value64(int device);
// Adds `value` to the 64-bit word at `address` atomically, in stream order after all earlier work
// of `stream`. Only where can_add_value64 said so.
bool add_value64(cudaStream_t stream, void* address, uint64_t value, std::string& error);

}  // namespace jaxgin::transport
