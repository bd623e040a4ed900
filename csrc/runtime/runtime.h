// Host-side state of jaxgin on the GPUs one process drives.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>
#include <functional>
#include <map>
#include <string>
#include <vector>
#include "backend_api.h"
#include "heap_release.h"
#include "vmm_ledger.h"
#include "../device/impl/context__types.h"

namespace jaxgin {

// What the chunked matmul ops (csrc/ffi/chunked_matmul.cu) keep per GPU, made on their first call:
// a cuBLAS handle and its workspace, a second stream with the events that fork it from XLA's
// stream and join it back (for the copies that run beside the matmuls), and the calls made so far
// of each op configuration (by heap offset of its block).
struct ChunkedMatmulState {
  void* blas = nullptr;
  void* workspace = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  std::map<int64_t, uint64_t> calls;
};

// Everything jaxgin owns on one GPU, in creation order (destroyed in reverse).
struct DeviceState {
  int device = -1;
  int rank = -1;
  CUcontext cuda_context = nullptr;  // the device's primary context, as the VMM ledger names it
  ncclComm_t comm = nullptr;
  void* heap = nullptr;
  ncclWindow_t window = nullptr;
  bool dev_comm_created = false;
  ncclDevComm dev_comm{};
  int gin_type = 0;
  uint64_t* consumed = nullptr;
  uint64_t* channel_counters = nullptr;  // [sent: world*lanes][received: world*lanes]
  jaxgin_fault* fault = nullptr;  // host-mapped pinned
  jaxgin_context* context = nullptr;  // device copy of `host_context`
  jaxgin_context host_context{};
  // Heap base of every rank as this GPU addresses it; nullptr for ranks outside the LSA team.
  // Fixed once the window exists, so launches can pass peer addresses by value.
  std::vector<char*> lsa_heaps;
  heap_mappings heap_mappings;  // unmapped after a fault if the VMM ledger is unavailable (heap_release.h)
  cudaStream_t stream = nullptr;
  ChunkedMatmulState chunked;
};

}  // namespace jaxgin

struct jaxgin_runtime {
  jaxgin_runtime_config config{};
  std::vector<jaxgin::DeviceState> devices;
  // NCCL's virtual-memory calls while the runtime was set up, for the cleanup after a fault.
  jaxgin::VmmLedger vmm_ledger;
  std::string vmm_ledger_unavailable;  // "" when the ledger recorded setup
};

namespace jaxgin {

// Runs fn(state) on one thread per local GPU and rethrows the first failure, naming the device.
// NCCL's collective setup calls (window registration, device communicators) block until every
// rank arrives, so in a process that drives several GPUs each must run on its own thread.
void for_each_device(jaxgin_runtime* rt, const std::function<void(DeviceState&)>& fn);

// A human-readable account of a device-side fault, or "" when none was recorded.
std::string describe_fault(const DeviceState& state);

// Frees what the chunked matmul ops made on this GPU (nothing if they never ran); "" or the first error.
std::string release_chunked_matmul(ChunkedMatmulState& state);

// The runtime that owns CUDA device `ordinal` in this process, for XLA FFI handlers. Throws an
// Error that says what to do when there is none (not initialized, or finalized).
DeviceState& device_for_ordinal(int ordinal, int64_t generation);

}  // namespace jaxgin
