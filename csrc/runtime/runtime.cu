// jaxgin's host runtime: per GPU an NCCL communicator, a symmetric heap window, an NCCL device
// communicator and the device-resident jaxgin_context that kernels receive.
#include "runtime.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "errors.h"
#include "heap_release.h"
#include "thread_settle.h"
#include "jaxgin_op_table.h"  // generated: the op families' preload hooks, op names
#include "../device/jaxgin_device.h"

namespace jaxgin {

namespace {
thread_local std::string last_error;

void check_versions() {
  int loaded = 0;
  ncclGetVersion(&loaded);
  if (loaded != NCCL_VERSION_CODE)
    throw Error("this jaxgin backend was compiled against NCCL " + std::to_string(NCCL_VERSION_CODE) +
                " headers but NCCL " + std::to_string(loaded) +
                " is loaded; NCCL's device API has no ABI stability, so rebuild (jaxgin does this "
                "automatically unless JAXGIN_BACKEND points at a prebuilt library)");
}

// Fills out[peer] with peer's heap base as this GPU maps it, nullptr for peers outside the LSA
// team. The window's layout is NCCL's device-side business, hence a kernel, through the device
// library (the only code that calls NCCL's device API).
__global__ void lsa_heaps_kernel(const jaxgin_context* ctx, int world, char** out) {
  for (int peer = (int)threadIdx.x; peer < world; peer += (int)blockDim.x)
    out[peer] = static_cast<char*>(jaxgin_peer_ptr(ctx, 0, peer));
}

// Allocation-handle references NCCL holds on the heap once its window is registered: ncclMemAlloc
// keeps cuMemCreate's (ncclMemFree drops it) and the window retains one (its deregistration drops
// it); read from NCCL 2.28-2.30's sources and checked by the dead-peer test, which measures the
// survivor's memory after finalize(). After a fault the runtime drops them itself.
constexpr int NCCL_HEAP_HANDLE_REFERENCES = 2;

std::vector<char*> lsa_heap_bases(const DeviceState& s, const jaxgin_context& c) {
  std::vector<char*> bases((size_t)c.world_size, nullptr);
  char** on_device = nullptr;
  JAXGIN_CUDA(cudaMalloc(&on_device, bases.size() * sizeof(char*)), s.device);
  lsa_heaps_kernel<<<1, 128>>>(s.context, c.world_size, on_device);
  cudaError_t launched = cudaGetLastError();
  cudaError_t copied = launched == cudaSuccess
                           ? cudaMemcpy(bases.data(), on_device, bases.size() * sizeof(char*), cudaMemcpyDeviceToHost)
                           : launched;
  cudaFree(on_device);
  JAXGIN_CUDA(copied, s.device);
  return bases;
}

jaxgin_channel_shape channel_shape(const jaxgin_runtime_config& c) {
  return jaxgin_channel_shape{c.channel_lanes, c.channel_slots, c.channel_slot_bytes};
}

// The runtime XLA FFI handlers use; one per process (jaxgin.initialize / finalize manage it).
std::mutex current_mutex;
jaxgin_runtime* current_runtime = nullptr;

void validate(const jaxgin_runtime_config& c) {
  if (c.world_size < 1 || c.local_count < 1 || c.local_count > c.world_size)
    throw Error("invalid runtime config: world_size=" + std::to_string(c.world_size) +
                ", local_count=" + std::to_string(c.local_count));
  for (int i = 0; i < c.local_count; i++)
    if (c.ranks[i] < 0 || c.ranks[i] >= c.world_size)
      throw Error("rank " + std::to_string(c.ranks[i]) + " of local GPU " + std::to_string(i) +
                  " is outside [0, " + std::to_string(c.world_size) + ")");
  if (c.channel_lanes < 1 || c.channel_lanes > 64 || c.channel_slots < 1 || c.channel_slot_bytes < 16 ||
      c.channel_slot_bytes % 16 != 0)
    throw Error("invalid exchange channel: lanes=" + std::to_string(c.channel_lanes) + " (1..64), slots=" +
                std::to_string(c.channel_slots) + " (>= 1), slot_bytes=" + std::to_string(c.channel_slot_bytes) +
                " (a positive multiple of 16)");
  uint64_t reserved = jaxgin_reserved_bytes(c.signal_count, c.barrier_slots, c.world_size, channel_shape(c));
  if (c.heap_bytes <= reserved)
    throw Error("heap_bytes=" + std::to_string(c.heap_bytes) + " leaves no room: jaxgin reserves " +
                std::to_string(reserved) + " bytes of the heap for " + std::to_string(c.signal_count) +
                " signals, " + std::to_string(c.barrier_slots) + " barrier slots and the exchange channel");
}

// $JAXGIN_GIN_CONTEXTS: the GIN contexts asked of NCCL (default 4), each a queue of its own to every
// peer; NCCL may grant another number, and the device code works with whatever it granted. Tests
// run other numbers so that no code relies on the default one.
int gin_context_count() {
  const char* v = std::getenv("JAXGIN_GIN_CONTEXTS");
  if (v == nullptr || *v == '\0') return 4;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > 64)
    throw Error(std::string("$JAXGIN_GIN_CONTEXTS must be an integer from 1 to 64, got '") + v + "'");
  return static_cast<int>(n);
}

// Why this communicator cannot have the GIN it needs, and what to do about it.
Error gin_unavailable(const jaxgin_runtime_config& cfg, int lsa_ranks, int dev, const std::string& detail) {
  std::string why = cfg.force_gin ? std::string("force_gin was requested")
                                  : "the ranks span several hosts (LSA team of " + std::to_string(lsa_ranks) +
                                        " of " + std::to_string(cfg.world_size) + " ranks)";
  std::string fix = cfg.force_gin ? "; unset force_gin (JAXGIN_FORCE_GIN) to use LSA within the host" : "";
  return Error(why + " but " + detail + " on CUDA device " + std::to_string(dev) +
               ": GIN needs an RDMA NIC (GDAKI or proxy backend) or an NCCL RMA plugin" + fix);
}

void setup_device(const jaxgin_runtime_config& cfg, DeviceState& s) {
  const int dev = s.device;
  JAXGIN_CUDA(cudaSetDevice(dev), dev);
  s.cuda_context = current_context();
  // Before any kernel can spin: every op family's preload hook (see the generated op table header).
  for (const PreloadHook& hook : kPreloadHooks) check_cuda(hook.load(), std::string(hook.name) + "()", dev);
  // Peers outside this rank's LSA team (other hosts) are reachable only through GIN.
  const ncclTeam_t lsa_team = ncclTeamLsa(s.comm);
  const bool spans_hosts = lsa_team.nRanks < cfg.world_size;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  JAXGIN_NCCL(ncclCommQueryProperties(s.comm, &props), s.comm, dev);
  if (!props.deviceApiSupport)
    throw Error("NCCL reports no Device API support for the communicator on CUDA device " +
                std::to_string(dev) + " (ncclCommProperties.deviceApiSupport = 0)");
  s.gin_type = (int)props.ginType;
  const bool want_gin = props.ginType != NCCL_GIN_TYPE_NONE;
  if (!want_gin && (cfg.force_gin || spans_hosts))
    throw gin_unavailable(cfg, lsa_team.nRanks, dev, "NCCL reports GIN type NONE for this communicator");
#else
  // NCCL 2.28 cannot say whether GIN exists, and refuses GIN requirements when it does not: ask
  // for GIN only where it is needed.
  const bool want_gin = cfg.force_gin || spans_hosts;
#endif

  JAXGIN_NCCL(ncclMemAlloc(&s.heap, cfg.heap_bytes), s.comm, dev);
  // Signals start at zero on every rank before any rank can reach another's heap: registration
  // below is collective, so no peer gets our address before this memset completed.
  JAXGIN_CUDA(cudaMemset(s.heap, 0, cfg.heap_bytes), dev);
  JAXGIN_CUDA(cudaDeviceSynchronize(), dev);
  JAXGIN_NCCL(ncclCommWindowRegister(s.comm, s.heap, cfg.heap_bytes, &s.window, NCCL_WIN_COLL_SYMMETRIC),
              s.comm, dev);
  if (s.window == nullptr)
    throw Error("ncclCommWindowRegister returned success with a NULL window on CUDA device " +
                std::to_string(dev) +
                ": NCCL cannot create symmetric memory here. It needs CUDA VMM (cuMem) allocations, "
                "peer access between the GPUs of a host (NVLink or PCIe P2P) and NCCL_WIN_ENABLE "
                "not set to 0; run with NCCL_DEBUG=INFO to see NCCL's reason");

  const jaxgin_channel_shape shape = channel_shape(cfg);
  const uint32_t signals = jaxgin_total_signals(cfg.signal_count, cfg.barrier_slots, cfg.world_size, shape);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
  if (want_gin) reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#else
  ncclDevCommRequirements reqs = {};
  reqs.ginForceEnable = want_gin;
#endif
  if (want_gin) {
    reqs.ginSignalCount = (int)signals;
    reqs.ginContextCount = gin_context_count();
  }
  ncclResult_t created = ncclDevCommCreate(s.comm, &reqs, &s.dev_comm);
  if (created != ncclSuccess && want_gin)
    throw gin_unavailable(cfg, lsa_team.nRanks, dev,
                          std::string("NCCL could not create a device communicator with GIN (") +
                              ncclGetErrorString(created) + ": " + ncclGetLastError(s.comm) + ")");
  if (created != ncclSuccess) throw_nccl(created, "ncclDevCommCreate", s.comm, dev);
  s.dev_comm_created = true;
  const int gin_contexts = (int)s.dev_comm.ginContextCount;
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 29, 0)
  s.gin_type = gin_contexts > 0 ? (int)s.dev_comm.ginTypes[0] : 0;
#endif
  if (want_gin && gin_contexts == 0)
    throw gin_unavailable(cfg, lsa_team.nRanks, dev, "NCCL created the device communicator without GIN contexts");

  JAXGIN_CUDA(cudaMalloc(&s.consumed, signals * sizeof(uint64_t)), dev);
  JAXGIN_CUDA(cudaMemset(s.consumed, 0, signals * sizeof(uint64_t)), dev);
  const size_t counters = 2ull * cfg.world_size * cfg.channel_lanes * sizeof(uint64_t);
  JAXGIN_CUDA(cudaMalloc(&s.channel_counters, counters), dev);
  JAXGIN_CUDA(cudaMemset(s.channel_counters, 0, counters), dev);
  JAXGIN_CUDA(cudaHostAlloc(&s.fault, sizeof(jaxgin_fault), cudaHostAllocMapped | cudaHostAllocPortable), dev);
  std::memset(s.fault, 0, sizeof(jaxgin_fault));
  jaxgin_fault* fault_on_device = nullptr;
  JAXGIN_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&fault_on_device), s.fault, 0), dev);

  jaxgin_context& c = s.host_context;
  c.comm = s.dev_comm;
  c.window = s.window;
  c.heap = static_cast<char*>(s.heap);
  c.heap_bytes = cfg.heap_bytes;
  c.user_offset = jaxgin_reserved_bytes(cfg.signal_count, cfg.barrier_slots, cfg.world_size, shape);
  c.channel_lanes = shape.lanes;
  c.channel_slots = shape.slots;
  c.channel_slot_bytes = shape.slot_bytes;
  c.channel_offset = jaxgin_signal_area_bytes(signals);
  c.staging_offset = c.channel_offset + jaxgin_ring_bytes(cfg.world_size, shape);
  c.line_offset = c.staging_offset + jaxgin_staging_bytes(cfg.world_size, shape);
  c.channel_signal_base = cfg.signal_count + cfg.barrier_slots;
  c.channel_sent = s.channel_counters;
  c.channel_received = s.channel_counters + (size_t)cfg.world_size * cfg.channel_lanes;
  c.consumed = s.consumed;
  c.fault = fault_on_device;
  c.timeout_ns = cfg.timeout_ns;
  // NCCL's timed GIN calls count clock64() cycles. At the top clock rate this is the timeout; at a
  // lower clock it is longer, never shorter.
  int clock_khz = 0;
  JAXGIN_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev), dev);
  c.timeout_cycles = cfg.timeout_ns / 1000000 * (uint64_t)std::max(clock_khz, 1);
  c.signal_count = cfg.signal_count;
  c.barrier_slots = cfg.barrier_slots;
  c.rank = s.dev_comm.rank;
  c.world_size = s.dev_comm.nRanks;
  c.lsa_rank = s.dev_comm.lsaRank;
  c.lsa_size = s.dev_comm.lsaSize;
  c.gin_contexts = gin_contexts;
  c.force_gin = cfg.force_gin;
  if (c.rank != s.rank)
    throw Error("NCCL assigned rank " + std::to_string(c.rank) + " where jaxgin asked for " +
                std::to_string(s.rank));
  JAXGIN_CUDA(cudaMalloc(&s.context, sizeof(jaxgin_context)), dev);
  JAXGIN_CUDA(cudaMemcpy(s.context, &c, sizeof(jaxgin_context), cudaMemcpyHostToDevice), dev);
  s.lsa_heaps = lsa_heap_bases(s, c);
  s.heap_mappings = mappings_of_heap(s.heap, s.lsa_heaps, NCCL_HEAP_HANDLE_REFERENCES);
  JAXGIN_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), dev);
}

// After a fault and ncclCommAbort: whether NCCL's GIN proxy threads that serve `device` can no
// longer read NCCL's GIN memory. NCCL 2.32's abort stops and joins them only at the end of its
// communicator cleanup (ncclGinHostFinalize, late in commFree), and that cleanup returns at its
// first CUDA error, which in a context in error comes before. The threads then keep polling the
// GPU's descriptor queues, NCCL cuMem host allocations, and a thread polling one that the cleanup
// below unmaps dies with SIGSEGV (measured on H100 with jaxgin's host transport). NCCL has no call
// that stops them; jaxgin's host transport (NCCL_RMA_PLUGIN) parks them at their next call into
// it, which each makes every iteration. With another GIN proxy plugin (or none loaded by that
// name) the threads cannot be stopped: false.
bool gin_proxy_threads_stopped(int device) {
  const char* plugin = std::getenv("NCCL_RMA_PLUGIN");
  if (plugin == nullptr || *plugin == '\0') return false;
  // Only if NCCL already loaded it: loading it here would not reach NCCL's threads.
  void* library = dlopen(plugin, RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return false;
  using Park = int (*)(int device, int timeout_ms);
  auto park = reinterpret_cast<Park>(dlsym(library, "jaxgin_transport_park_proxy_threads"));
  // A thread is between two calls for microseconds; one that has not come back in seconds is
  // stuck outside the plugin (spinning on a descriptor the trapped kernel left half written).
  const bool stopped = park != nullptr && park(device, 5000) == 0;
  dlclose(library);  // drops only the reference NOLOAD took
  return stopped;
}

// How long a broken GPU's reset waits for the process's other threads to stop (thread_settle.h):
// XLA's thread finishes a faulted program in milliseconds of CPU time, seconds where ranks share
// the cores.
constexpr int kResetSettleMs = 10000;

// Best effort, reverse order of setup_device; returns the first error instead of stopping.
// `ledger`: what NCCL mapped during setup, or nullptr when it was not recorded.
std::string teardown_device(DeviceState& s, VmmLedger* ledger) {
  std::string first;
  auto note = [&](const std::string& what) { if (first.empty()) first = what; };
  if (cudaSetDevice(s.device) != cudaSuccess) note("cudaSetDevice failed");
  // Set when NCCL's GIN proxy threads may still run after the abort (gin_proxy_threads_stopped):
  // the host memory they poll then stays mapped. GPU memory is released all the same.
  bool keep_host_memory = false;
  // A kernel that trapped leaves the CUDA context unusable (the error is sticky: every later call
  // returns it, so a second synchronize tells it from an error that was merely pending). Then only
  // ncclCommAbort is safe, and what the context holds comes back only with the context itself: the
  // device is reset. Whatever else lived in that context (JAX's arrays on this GPU) was lost with
  // the fault already.
  const bool broken = cudaDeviceSynchronize() != cudaSuccess && cudaDeviceSynchronize() != cudaSuccess;
  if (!broken) {
    for (auto& [name, op] : s.op_states) note(op->release());
    if (s.stream && cudaStreamDestroy(s.stream) != cudaSuccess) note("cudaStreamDestroy failed");
    if (s.context && cudaFree(s.context) != cudaSuccess) note("cudaFree(context) failed");
    if (s.consumed && cudaFree(s.consumed) != cudaSuccess) note("cudaFree(consumed) failed");
    if (s.channel_counters && cudaFree(s.channel_counters) != cudaSuccess) note("cudaFree(channel counters) failed");
    if (s.fault && cudaFreeHost(s.fault) != cudaSuccess) note("cudaFreeHost(fault) failed");
    if (s.dev_comm_created && ncclDevCommDestroy(s.comm, &s.dev_comm) != ncclSuccess) note("ncclDevCommDestroy failed");
    if (s.window && ncclCommWindowDeregister(s.comm, s.window) != ncclSuccess) note("ncclCommWindowDeregister failed");
    if (s.heap && ncclMemFree(s.heap) != ncclSuccess) note("ncclMemFree failed");
  }
  if (s.comm) {
    if (broken) {
      // Whatever the abort still manages to unmap or release must not be undone a second time.
      const bool recording = ledger != nullptr && ledger->start().empty();
      ncclCommAbort(s.comm);
      if (recording) ledger->stop();
      // Before the reset and the undo below free what NCCL's GIN proxy threads read.
      if (s.gin_type == kGinTypeProxy && !gin_proxy_threads_stopped(s.device)) keep_host_memory = true;
    } else {
      if (ncclCommFinalize(s.comm) != ncclSuccess) note("ncclCommFinalize failed");
      if (ncclCommDestroy(s.comm) != ncclSuccess) note("ncclCommDestroy failed");
    }
  }
  // Not NCCL's virtual-memory allocations, the heaps among them (measured on H200: the reset
  // returned the context's 0.75 GiB, not the 2 GiB test heap nor NCCL's 200 MiB of buffers): they
  // are undone after it, all of them when the ledger recorded setup, else the heaps.
  std::string busy;
  if (broken && !other_threads_settled(kResetSettleMs, busy)) {
    note("CUDA device " + std::to_string(s.device) + " was not reset after the fault: other threads of this process "
         "were still running " + std::to_string(kResetSettleMs / 1000) + " s later (" + busy + "), and if one of "
         "them uses the GPU (XLA's, finishing the faulted program), a reset under it would crash the process; the "
         "GPU's memory stays allocated until the process exits");
  } else if (broken) {
    if (cudaDeviceReset() != cudaSuccess) {
      note("CUDA device " + std::to_string(s.device) + " is in error and could not be reset; its memory stays "
           "allocated until the process exits");
    } else if (ledger != nullptr) {
      if (keep_host_memory)
        std::fprintf(stderr, "jaxgin: NCCL's GIN proxy thread(s) for CUDA device %d were not seen to stop after the "
                     "fault; the host memory they poll (NCCL's GIN queues) stays allocated until the process exits\n",
                     s.device);
      const std::string e = ledger->undo(s.cuda_context, keep_host_memory);
      if (!e.empty())
        note("NCCL's memory on CUDA device " + std::to_string(s.device) + " could not all be released after the "
             "reset (" + e + "); what remains stays allocated until the process exits");
    } else if (s.heap) {
      const std::string e = unmap_heaps_after_reset(s.heap_mappings);
      if (!e.empty())
        note("the symmetric heaps mapped on CUDA device " + std::to_string(s.device) +
             " could not be unmapped after the reset (" + e + "); they stay allocated until the process exits");
    }
  }
  s = DeviceState{s.device, s.rank};
  return first;
}

void teardown_all(jaxgin_runtime* rt) {
  rt->vmm_ledger.stop();
  VmmLedger* ledger = rt->vmm_ledger_unavailable.empty() ? &rt->vmm_ledger : nullptr;
  for_each_device(rt, [&](DeviceState& s) {
    std::string e = teardown_device(s, ledger);
    if (!e.empty()) throw Error(e);
  });
}

}  // namespace

void set_last_error(const std::string& message) { last_error = message; }

DeviceState& device_for_ordinal(int ordinal, int64_t generation) {
  std::lock_guard<std::mutex> lock(current_mutex);
  if (current_runtime == nullptr)
    throw Error("jaxgin is not initialized in this process (or was finalized): call jaxgin.initialize() before "
                "running a program that uses jaxgin ops");
  if (current_runtime->config.generation != generation)
    throw Error("this program was compiled for an earlier jaxgin.initialize() (runtime generation " +
                std::to_string(generation) + ", current " + std::to_string(current_runtime->config.generation) +
                "); its heap offsets are stale. Re-trace it: jax.clear_caches() after re-initializing");
  for (auto& s : current_runtime->devices)
    if (s.device == ordinal) return s;
  throw Error("jaxgin drives no GPU with CUDA ordinal " + std::to_string(ordinal) +
              " in this process; jaxgin.initialize() covers the devices of jax.local_devices()");
}

std::vector<int> driven_devices() {
  std::lock_guard<std::mutex> lock(current_mutex);
  std::vector<int> ordinals;
  if (current_runtime != nullptr)
    for (const auto& s : current_runtime->devices) ordinals.push_back(s.device);
  return ordinals;
}

void for_each_device(jaxgin_runtime* rt, const std::function<void(DeviceState&)>& fn) {
  std::vector<std::exception_ptr> errors(rt->devices.size());
  if (rt->devices.size() == 1) {
    fn(rt->devices[0]);
    return;
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < rt->devices.size(); i++)
    threads.emplace_back([&, i] {
      try {
        fn(rt->devices[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

namespace {
// What a signal id is used for, for fault reports.
std::string signal_name(const jaxgin_context& c, uint32_t signal) {
  const uint32_t lanes = c.channel_lanes;
  const uint32_t base = c.channel_signal_base;
  const uint32_t data_end = base + (uint32_t)c.world_size * lanes;
  if (signal >= base && signal < data_end)
    return "signal " + std::to_string(signal) + " (exchange data from rank " + std::to_string((signal - base) / lanes) +
           ", lane " + std::to_string((signal - base) % lanes) + ")";
  if (signal >= data_end && signal < data_end + (uint32_t)c.world_size * lanes)
    return "signal " + std::to_string(signal) + " (exchange credit from rank " +
           std::to_string((signal - data_end) / lanes) + ", lane " + std::to_string((signal - data_end) % lanes) + ")";
  if (signal >= c.signal_count && signal < c.signal_count + c.barrier_slots)
    return "signal " + std::to_string(signal) + " (barrier slot " + std::to_string(signal - c.signal_count) + ")";
  return "signal " + std::to_string(signal);
}
}  // namespace

OpState& op_state_slot(DeviceState& s, const std::string& name, const std::function<std::unique_ptr<OpState>()>& make) {
  static std::mutex slots;
  std::lock_guard<std::mutex> lock(slots);
  std::unique_ptr<OpState>& slot = s.op_states[name];
  if (!slot) slot = make();
  return *slot;
}

std::string describe_fault(const DeviceState& s) {
  const jaxgin_fault* f = s.fault;
  if (f == nullptr || f->code == JAXGIN_FAULT_NONE) return "";
  const jaxgin_context& c = s.host_context;
  std::string where = "rank " + std::to_string(f->rank) + " (CUDA device " + std::to_string(s.device) +
                      "), CTA " + std::to_string(f->block) + ", in " + jaxgin_op_name(f->op);
  std::string peer = f->peer >= 0 ? ", peer rank " + std::to_string(f->peer) : "";
  const std::string after = " s at ";
  const std::string timeout = "device-side wait timed out after " + std::to_string(c.timeout_ns / 1e9) + after;
  switch (f->code) {
    case JAXGIN_FAULT_WAIT_TIMEOUT:
      if (f->op == JAXGIN_OP_WAIT_SIGNAL)
        return timeout + where + ": waited for " + std::to_string(f->expected) +
               " puts into the mailbox whose signals start at " + std::to_string(f->signal) + " but only " +
               std::to_string(f->observed) + " arrived (fewer senders put than the count, or a sender died)";
      if (f->op == JAXGIN_OP_WAIT_SIGNAL_FROM)
        return timeout + where + peer + ": that sender's next put into the mailbox (data " + signal_name(c, f->signal) +
               ") never arrived: its arrival count was to reach " + std::to_string(f->expected) + " but stayed at " +
               std::to_string(f->observed) + " (the sender never put, ran a different program, or died)";
      if (f->op == JAXGIN_OP_PUT_SIGNAL)
        return timeout + where + peer + ": the receiver never consumed this rank's previous put into the mailbox "
               "(credit " + signal_name(c, f->signal) + " stayed at " + std::to_string(f->observed) + ", needed " +
               std::to_string(f->expected) + "); every put_signal needs a matching wait_signal on the receiver "
               "before the next put to it";
      return timeout + where + peer + ": " + signal_name(c, f->signal) + " was expected to reach " +
             std::to_string(f->expected) + " but stayed at " + std::to_string(f->observed) +
             " (a peer never sent, ran a different program, or died)";
    case JAXGIN_FAULT_PEER_UNREACHABLE:
      return "peer rank " + std::to_string(f->peer) + " is unreachable from " + where +
             ": it is not in this rank's LSA (NVLink) team and the communicator has no GIN";
    case JAXGIN_FAULT_HEAP_RANGE:
      return "put out of the symmetric heap at " + where + peer + ": its bytes end at heap offset " +
             std::to_string(f->observed) + " but the heap has " + std::to_string(f->expected) +
             " bytes (source and destination must be symmetric-heap addresses: allocate them with "
             "tritongin.empty or jaxgin's heap)";
    case JAXGIN_FAULT_FLAG_TIMEOUT:
      if (f->op == JAXGIN_OP_MATMUL_ALL_TO_ALL || f->op == JAXGIN_OP_ALL_GATHER_MATMUL)
        return timeout + where + peer + (f->signal == kWaitedForChunk
                   ? ": that peer never handed over its chunk of call " + std::to_string(f->expected) +
                         " (it has handed over " + std::to_string(f->observed) + ")"
                   : ": that peer never finished reading this rank's chunk of call " + std::to_string(f->expected) +
                         " (it finished " + std::to_string(f->observed) + ")") +
               "; every device of the axis must run the same op, in the same order (a peer ran a different "
               "program, or died)";
      return timeout + where + ": the flag at heap offset " + std::to_string((uint64_t)f->signal * 8) +
             " was expected to reach " + std::to_string(f->expected) + " but stayed at " +
             std::to_string(f->observed) + " (the peer that sets it never got there, ran a different program, or died)";
    case JAXGIN_FAULT_FLUSH_TIMEOUT:
      return "device-side flush timed out after " + std::to_string(c.timeout_ns / 1e9) + after + where + peer +
             ": NCCL's GIN backend did not take this rank's puts (their sources stay in use); the GIN proxy "
             "thread or the network below it stalled, or stopped after an error (see the transport's lines on "
             "stderr)";
    case JAXGIN_FAULT_NOT_LSA_PEER:
      return "peer_ptr asked for peer rank " + std::to_string(f->peer) + " at " + where +
             ", which is not in this rank's LSA (NVLink) team (ranks " + std::to_string(c.rank - c.lsa_rank) +
             " to " + std::to_string(c.rank - c.lsa_rank + c.lsa_size - 1) +
             "); reach it with put_signal, which goes through GIN";
    case JAXGIN_FAULT_BAD_ARGUMENT:
      if (f->op == JAXGIN_OP_PUT_SIGNAL || f->op == JAXGIN_OP_WAIT_SIGNAL_FROM)
        return std::string(f->op == JAXGIN_OP_PUT_SIGNAL ? "peer" : "source") + " index " +
               std::to_string((int64_t)f->observed) + " is out of range at " + where +
               ": the mesh axis has " + std::to_string(f->expected) + " devices, so it must be in [0, " +
               std::to_string(f->expected) + ")";
      return "argument out of range at " + where + peer + ": got " + std::to_string(f->observed) +
             ", limit " + std::to_string(f->expected) + " (signal ids < signal_count, peers < world size, "
             "barrier CTAs < barrier_slots)";
    default:
      return "unknown device fault code " + std::to_string(f->code) + " at " + where;
  }
}

}  // namespace jaxgin

using jaxgin::c_api;
using jaxgin::Error;

extern "C" {

int jaxgin_backend_abi(void) { return JAXGIN_BACKEND_ABI; }

const char* jaxgin_last_error(void) { return jaxgin::last_error.c_str(); }

int jaxgin_nccl_versions(int32_t* loaded, int32_t* compiled_against) {
  return c_api([&] {
    int v = 0;
    JAXGIN_NCCL(ncclGetVersion(&v), nullptr, -1);
    *loaded = v;
    *compiled_against = NCCL_VERSION_CODE;
  });
}

int jaxgin_unique_id(char* out) {
  return c_api([&] {
    ncclUniqueId id;
    JAXGIN_NCCL(ncclGetUniqueId(&id), nullptr, -1);
    static_assert(sizeof(id) == JAXGIN_UNIQUE_ID_BYTES, "ncclUniqueId size changed");
    std::memcpy(out, &id, sizeof(id));
  });
}

int jaxgin_device_memory(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  return c_api([&] {
    size_t f = 0, t = 0;
    JAXGIN_CUDA(cudaSetDevice(device), device);
    JAXGIN_CUDA(cudaMemGetInfo(&f, &t), device);
    *free_bytes = f;
    *total_bytes = t;
  });
}

int jaxgin_runtime_create(const jaxgin_runtime_config* config, jaxgin_runtime** out) {
  return c_api([&] {
    jaxgin::check_versions();
    jaxgin::validate(*config);
    auto rt = std::make_unique<jaxgin_runtime>();
    rt->config = *config;
    rt->config.devices = nullptr;
    rt->config.ranks = nullptr;
    rt->config.unique_id = nullptr;
    for (int i = 0; i < config->local_count; i++) {
      jaxgin::DeviceState s;
      s.device = config->devices[i];
      s.rank = config->ranks[i];
      rt->devices.push_back(std::move(s));
    }
    ncclUniqueId id;
    std::memcpy(&id, config->unique_id, sizeof(id));
    // From the communicators' creation to the device communicators': everything NCCL maps.
    rt->vmm_ledger_unavailable =
        config->record_vmm_calls ? rt->vmm_ledger.start() : "recording was switched off (JAXGIN_RECORD_NCCL_MEMORY=0)";
    // One NCCL group creates the communicators of all local GPUs (NCCL's rule for one process
    // driving several GPUs).
    JAXGIN_NCCL(ncclGroupStart(), nullptr, -1);
    for (auto& s : rt->devices) {
      cudaError_t e = cudaSetDevice(s.device);
      if (e != cudaSuccess) {
        ncclGroupEnd();
        jaxgin::throw_cuda(e, "cudaSetDevice", s.device);
      }
      ncclCommInitRank(&s.comm, config->world_size, id, s.rank);
    }
    ncclResult_t grouped = ncclGroupEnd();
    if (grouped != ncclSuccess) {
      for (auto& s : rt->devices)
        if (s.comm) ncclCommAbort(s.comm);
      jaxgin::throw_nccl(grouped, "ncclCommInitRank (grouped over the local GPUs)", nullptr, rt->devices[0].device);
    }
    try {
      jaxgin::for_each_device(rt.get(), [&](jaxgin::DeviceState& s) { jaxgin::setup_device(rt->config, s); });
      rt->vmm_ledger.stop();
    } catch (...) {
      try {
        jaxgin::teardown_all(rt.get());
      } catch (...) {
      }
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(jaxgin::current_mutex);
      if (jaxgin::current_runtime != nullptr) {
        try {
          jaxgin::teardown_all(rt.get());
        } catch (...) {
        }
        throw Error("a jaxgin runtime already exists in this process; finalize it first");
      }
      jaxgin::current_runtime = rt.get();
    }
    *out = rt.release();
  });
}

int jaxgin_runtime_device_info(const jaxgin_runtime* rt, int32_t local_index, jaxgin_device_info* out) {
  return c_api([&] {
    if (local_index < 0 || local_index >= (int)rt->devices.size())
      throw Error("local GPU index " + std::to_string(local_index) + " out of range");
    const jaxgin::DeviceState& s = rt->devices[local_index];
    const jaxgin_context& c = s.host_context;
    *out = jaxgin_device_info{};
    out->device = s.device;
    out->rank = c.rank;
    out->world_size = c.world_size;
    out->lsa_rank = c.lsa_rank;
    out->lsa_size = c.lsa_size;
    out->gin_type = s.gin_type;
    out->gin_contexts = c.gin_contexts;
    out->force_gin = c.force_gin;
    out->heap_bytes = c.heap_bytes;
    out->user_offset = c.user_offset;
    out->heap_base = reinterpret_cast<uint64_t>(s.heap);
    out->context = reinterpret_cast<uint64_t>(s.context);
    out->timeout_ns = c.timeout_ns;
    out->signal_count = c.signal_count;
    out->barrier_slots = c.barrier_slots;
    out->channel_lanes = c.channel_lanes;
    out->channel_slots = c.channel_slots;
    out->channel_slot_bytes = c.channel_slot_bytes;
    std::snprintf(out->vmm_ledger_unavailable, sizeof(out->vmm_ledger_unavailable), "%s",
                  rt->vmm_ledger_unavailable.c_str());
  });
}

namespace {
// `text` into the caller's buffer of `capacity` bytes, cut to fit, always terminated (when it has room).
void copy_out(const std::string& text, char* out, uint64_t capacity) {
  if (capacity == 0) return;
  const size_t n = std::min<size_t>(text.size(), capacity - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}
}  // namespace

int jaxgin_device_faults(const jaxgin_runtime* rt, char* out, uint64_t capacity) {
  return c_api([&] {
    std::string all;
    for (const auto& s : rt->devices) {
      std::string fault = jaxgin::describe_fault(s);
      if (!fault.empty()) all += (all.empty() ? "" : "\n") + fault;
    }
    copy_out(all, out, capacity);
  });
}

int jaxgin_communicator_errors(const jaxgin_runtime* rt, char* out, uint64_t capacity) {
  return c_api([&] {
    std::string all;
    for (const auto& s : rt->devices) {
      ncclResult_t async = ncclSuccess;
      if (s.comm == nullptr || ncclCommGetAsyncError(s.comm, &async) != ncclSuccess || async == ncclSuccess ||
          async == ncclInProgress)
        continue;
      const char* last = ncclGetLastError(s.comm);
      all += (all.empty() ? "" : "\n") + std::string("rank ") + std::to_string(s.rank) + " (CUDA device " +
             std::to_string(s.device) + "): NCCL's communicator reports an asynchronous error, " +
             ncclGetErrorString(async) + (last && *last ? std::string(" (") + last + ")" : std::string()) +
             (s.host_context.gin_contexts > 0
                  ? ": its GIN backend may have stopped taking this GPU's puts (NCCL's progress thread ends at "
                    "its first error)"
                  : "");
    }
    copy_out(all, out, capacity);
  });
}

int jaxgin_runtime_destroy(jaxgin_runtime* rt) {
  return c_api([&] {
    std::unique_ptr<jaxgin_runtime> owned(rt);
    {
      std::lock_guard<std::mutex> lock(jaxgin::current_mutex);
      if (jaxgin::current_runtime == rt) jaxgin::current_runtime = nullptr;
    }
    jaxgin::teardown_all(rt);
  });
}

}  // extern "C"
