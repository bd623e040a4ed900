// Host-side state of jaxgin on the GPUs one process drives.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include "backend_api.h"
#include "heap_release.h"
#include "vmm_ledger.h"
#include "../device/jaxgin_types.h"

namespace jaxgin {

// DeviceState::gin_type of NCCL's proxy GIN backend, where CPU threads carry the GPU's puts:
// NCCL_GIN_TYPE_PROXY (2.29+), NCCL_NET_DEVICE_GIN_PROXY in 2.28's devComm.ginTypes: the same value.
constexpr int kGinTypeProxy = 2;

// $JAXGIN_MAX_QUEUED_CALLS (csrc/ffi/launch_pacing.cu): its default and largest value, from the op
// table (Python's initialize() checks the setting against the same values).
constexpr int kDefaultMaxQueuedCalls = JAXGIN_DEFAULT_MAX_QUEUED_CALLS;
constexpr int kMaxQueuedCallsLimit = JAXGIN_MAX_QUEUED_CALLS_LIMIT;

// What an op keeps on one GPU from its first call until the runtime ends (a library handle, a
// stream, call counts). The runtime knows no op: it holds these in named slots
// (DeviceState::op_states, through op_state below) and releases them first at teardown, while
// the CUDA context is still usable.
struct OpState {
  virtual ~OpState() = default;
  // Frees what the op made; "" or the first error.
  virtual std::string release() = 0;
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
  std::map<std::string, std::unique_ptr<OpState>> op_states;  // by op name
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

// The slot named `name` on `state`, filled by make() on first use (under one lock for all slots).
OpState& op_state_slot(DeviceState& state, const std::string& name,
                       const std::function<std::unique_ptr<OpState>()>& make);

// Op `T`'s state on `state`, default-constructed on first use; the op fills it in itself.
template <class T>
T& op_state(DeviceState& state, const std::string& name) {
  return static_cast<T&>(op_state_slot(state, name, [] { return std::unique_ptr<OpState>(new T()); }));
}

// The runtime that owns CUDA device `ordinal` in this process, for XLA FFI handlers. Throws an
// Error that says what to do when there is none (not initialized, or finalized).
DeviceState& device_for_ordinal(int ordinal, int64_t generation);

// The CUDA ordinals of the GPUs the live runtime drives in this process; empty when there is none.
std::vector<int> driven_devices();

}  // namespace jaxgin
