// A record of the CUDA virtual-memory calls made while jaxgin sets NCCL up, so that the cleanup
// after a device fault can undo what NCCL itself no longer can.
//
// NCCL backs its communicator's buffers, the heap (ncclMemAlloc) and the symmetric windows with
// CUDA virtual-memory allocations (cuMemCreate, cuMemMap; each at least one 2 MiB granule) and
// returns them in ncclCommDestroy, ncclMemFree and the window's deregistration. Those allocations
// belong to the process, not to the CUDA context: after a kernel trapped, the context must be
// reset, the reset leaves them, and NCCL's abort cannot free them in a context in error. Measured
// on H200 with NCCL 2.28.9 and 2 ranks: about 100 of them, 200 MiB besides the heap (and 103
// mappings in all, the heap's and the peers' included). The driver
// has no call that lists a process's allocations, and NCCL calls the driver through entry points
// it looked up itself, so the ledger listens with CUPTI's callback API, which sees every call.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

namespace jaxgin {

class VmmLedger {
 public:
  // What one context's calls left behind: live mappings and reservations (address -> bytes) and
  // the handle references taken and not yet released.
  struct Books {
    std::map<CUdeviceptr, size_t> mappings, reservations;
    std::map<CUmemGenericAllocationHandle, int> references;
    std::set<CUdeviceptr> host_mappings;  // those of `mappings` whose allocation lives in host memory
  };
  VmmLedger() = default;
  VmmLedger(const VmmLedger&) = delete;
  VmmLedger& operator=(const VmmLedger&) = delete;
  ~VmmLedger();  // CUPTI must not call into a ledger that is gone

  // Starts recording. Returns "" or why nothing will be recorded (no CUPTI library in the process
  // or on the library path, or another CUPTI client, such as a running profiler, holds CUPTI).
  // Threads may record at once (the teardowns of several GPUs): each successful start() is
  // matched by one stop(), and recording stops with the last.
  std::string start();
  // Stops recording (the last stop() unsubscribes from CUPTI); what was recorded stays.
  void stop();
  // After the device that `context` belonged to was reset: unmaps every mapping recorded in
  // `context` that was not unmapped since, drops the allocation-handle references recorded (created,
  // imported or retained, not released since), then frees the address ranges reserved. Returns ""
  // or the first call that failed; the rest is still attempted.
  // `keep_host_memory`: leaves allocations that live in host memory (cuMem host allocations: NCCL's
  // GIN proxy queues among them) mapped, with their references and reserved ranges, for a thread
  // that may still read them (see teardown_device in runtime.cu). GPU memory is undone all the same.
  std::string undo(CUcontext context, bool keep_host_memory = false);

  // Called by CUPTI for each recorded call that succeeded.
  void on_call(CUcontext context, uint32_t callback_id, const void* params);

 private:
  std::mutex mutex_;  // books_, host_located_
  std::map<CUcontext, Books> books_;
  // Allocation handles created in host memory, while referenced (a handle value may be reused).
  std::set<CUmemGenericAllocationHandle> host_located_;
  std::mutex subscription_mutex_;  // subscriber_, recorders_
  void* subscriber_ = nullptr;
  int recorders_ = 0;
};

// The CUDA context current on the calling thread (the device's primary context once the runtime
// API made it current), or nullptr.
CUcontext current_context();

}  // namespace jaxgin
