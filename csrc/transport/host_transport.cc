// jaxgin's host transport: an NCCL RMA plugin (interface v14) that makes NCCL's GIN proxy backend
// work on hosts without an RDMA NIC. NCCL's proxy thread reads the GPU's put/signal descriptors
// and calls iput / iputSignal here; this library moves the bytes and applies the signals.
//
// Data: to a peer on the same host, a CUDA copy straight into the peer's region, mapped here
// through cuMem IPC (the copy engines carry it over NVLink); to a peer on another host, or into a
// region that cannot be mapped, the bytes travel in a kPut message and the receiver copies them
// in. Signals: always applied by the receiving rank (NCCL's signal memory cannot be exported), by
// its agent thread, in stream order after the data of that put, and only once every earlier
// operation of the same context to that peer has delivered. That FIFO per (context, peer) gives
// strong signals their meaning (all earlier puts visible first) and weak ones more than they need.
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device_memory.h"
#include "rma_api.h"
#include "wire.h"

namespace jaxgin::transport {
namespace {

constexpr size_t kChunkBytes = 4u << 20;  // staged puts travel in pieces of this size
// Everything a put needs from CUDA is made before the first put: pinned chunks for staged sends
// (at connect) and copy events (per RMA context). NCCL's proxy thread must never create or destroy
// a CUDA object while the GPU waits on this transport: creating one takes a driver lock that
// cuGraphLaunch holds while it waits for the GPU. Measured on one H100 under XLA command buffers:
// XLA's thread in cuGraphLaunch, waiting for a graph queued behind a jaxgin kernel; NCCL's proxy
// thread in cuEventCreate, waiting for that lock; the kernel waiting for the proxy thread's put.
// When they run out, a put waits for earlier ones to deliver.
constexpr int kStagingChunks = 16;        // 64 MiB of pinned memory per communicator with staged peers
constexpr int kCopyEvents = 1024;         // per RMA context

// What moved, for tests and diagnostics: read through jaxgin_transport_counters().
enum Counter { kPutsMapped, kPutsStaged, kPutsLocal, kBytesMapped, kBytesStaged, kSignalsApplied, kRegions,
               kCopiesRequeued, kCounterCount };
// Their names, the keys of jaxgin.transport.counters() (read through jaxgin_transport_counter_names).
constexpr const char* kCounterNames[] = {"puts_mapped",  "puts_staged",     "puts_local", "bytes_mapped",
                                         "bytes_staged", "signals_applied", "regions",    "copies_requeued"};
static_assert(sizeof(kCounterNames) / sizeof(kCounterNames[0]) == kCounterCount, "a name per counter");
std::atomic<uint64_t> counters[kCounterCount];

// Ranks whose connection ended without a goodbye (their process exited or their host is gone),
// for fault reports: read through jaxgin_transport_lost_peers(). A wait that times out on a
// survivor may name the neighbour it waited for, which was itself only waiting; this names the
// rank that really went away.
std::mutex lost_lock;
std::vector<int> lost_ranks;

void record_lost_peer(int rank, int peer) {
  {
    std::lock_guard<std::mutex> g(lost_lock);
    for (int r : lost_ranks)
      if (r == peer) return;
    lost_ranks.push_back(peer);
  }
  // On stderr at once, whatever NCCL's log level: JAX's coordination service may end this process
  // soon after a peer died, before a timed-out wait can be reported.
  std::fprintf(stderr, "jaxgin transport: rank %d: rank %d's process ended (its connection closed without a goodbye); "
               "waits for it will time out\n", rank, peer);
}

// --- stopping NCCL's GIN proxy threads after a device fault -------------------------------
//
// After a kernel trapped, ncclCommAbort frees the communicator through a chain of steps that each
// return at the first CUDA error, and the step that stops and joins NCCL's GIN progress threads
// (ncclGinHostFinalize) comes late in it: in a context in error it is never reached, and the
// threads go on polling the GPU's descriptor queues (NCCL's cuMem host allocations) for good.
// jaxgin's cleanup then resets the GPU and unmaps NCCL's recorded allocations; a thread still
// polling a queue then faults on the unmapped page. NCCL has no call that stops those threads, but
// every iteration of one calls in here (rmaProgress, and iput / test while work is in flight), and
// nothing in NCCL waits for it after such an abort. So the runtime asks, per CUDA device, that those
// threads be parked: each sleeps forever at its next call, holding nothing of this library, and
// the runtime proceeds once every thread that serves that device is parked or has exited.
struct ProxyThreads {
  std::mutex lock;
  std::condition_variable changed;
  std::map<int, int> live, parked;  // per CUDA device: threads that called in and did not exit; parked ones
  std::map<int, bool> parking;      // per CUDA device: park its threads at their next call
  std::atomic<bool> any_parking{false};
};
// Never destroyed: a thread may leave (and count itself out) while the process exits.
ProxyThreads& proxy_threads() {
  static ProxyThreads* t = new ProxyThreads;
  return *t;
}

// Counts the calling thread in for `device` on its first call, out again when it exits.
struct ProxyThreadMembership {
  int device = 0;
  bool counted = false;
  ~ProxyThreadMembership() {
    if (!counted) return;
    ProxyThreads& t = proxy_threads();
    {
      std::lock_guard<std::mutex> g(t.lock);
      t.live[device]--;
    }
    t.changed.notify_all();
  }
};

// Called first by every entry point NCCL's GIN progress thread uses. Cheap unless the thread is
// new or a device is being stopped.
void park_if_asked(int device) {
  thread_local ProxyThreadMembership membership;
  ProxyThreads& t = proxy_threads();
  if (!membership.counted) {
    std::lock_guard<std::mutex> g(t.lock);
    membership.device = device;
    membership.counted = true;
    t.live[device]++;
  }
  if (!t.any_parking.load(std::memory_order_acquire)) return;
  {
    std::unique_lock<std::mutex> g(t.lock);
    if (!t.parking[membership.device]) return;
    t.parked[membership.device]++;
  }
  t.changed.notify_all();
  // Never returns: NCCL would read its queues again. The process ends it at exit.
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

struct Plugin {
  uint64_t comm_id;
  rmaLogger_t log;
};

void log_message(rmaLogger_t log, rmaLogLevel_t level, int line, const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  if (log) log(level, RMA_LOG_SUBSYS_NET, __FILE__, line, "jaxgin transport: %s", text);
  // A warning is on stderr whatever NCCL_DEBUG says: NCCL's logger prints nothing by default, and
  // an error returned to NCCL's GIN progress thread ends that thread silently (every later put of
  // the communicator is then never read), so the warning is the only trace of why.
  if (level == RMA_LOG_WARN || (!log && std::getenv("JAXGIN_TRANSPORT_DEBUG")))
    std::fprintf(stderr, "jaxgin transport: %s\n", text);
}
// JAXGIN_TRANSPORT_TRACE=1: one stderr line per request and per delivery (debugging only).
bool tracing() {
  static const bool on = std::getenv("JAXGIN_TRANSPORT_TRACE") != nullptr;
  return on;
}
#define TRACE(...)                                          \
  do {                                                      \
    if (tracing()) {                                        \
      std::fprintf(stderr, "jaxgin transport trace: " __VA_ARGS__); \
      std::fputc('\n', stderr);                             \
    }                                                       \
  } while (0)
#define WARN(comm, ...) log_message((comm)->log, RMA_LOG_WARN, __LINE__, __VA_ARGS__)
#define INFO(comm, ...) log_message((comm)->log, RMA_LOG_INFO, __LINE__, __VA_ARGS__)

// CUDA calls from NCCL's proxy thread must not be refused while another thread captures a graph.
void relax_capture_mode() {
  thread_local bool done = false;
  if (done) return;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  done = true;
}

struct Listener {
  Plugin* plugin;
  Address address;
  int tcp_fd = -1;
  int unix_fd = -1;
};

// One symmetric registration. `seq` is its position in the communicator's registration order,
// which is the same on every rank: messages name regions by it.
struct Region {
  uint64_t seq;
  char* base;
  size_t size;
  bool on_device;
  bool never_reset;  // NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET: only this transport writes its signals
  // Device memory that the transport's own context failed to read at registration (memory bound to
  // the application's context, not a cuMem mapping): copying from or into it fails its put.
  std::string unreachable;
  std::vector<char*> peer_base;         // per rank: where that rank's region is mapped here, or null
  std::vector<void*> peer_mapping;      // what to unmap
  std::vector<uint64_t> peer_mapping_bytes;
};

struct PeerRegistration {
  Message message;
  int fd = -1;
};

enum class Route { kLocal, kMapped, kStaged };

struct Context;

struct Op {
  Context* context;
  Route route;
  int peer;
  size_t size = 0;
  const char* host_source = nullptr;  // staged from host memory: sent straight from the source
  char* staging = nullptr;            // staged from device memory: a pinned copy
  char* local_destination = nullptr;  // kLocal from host to host: copied at delivery
  const char* local_source = nullptr;
  cudaEvent_t event = nullptr;
  // The copy out of GPU memory: where from, on which stream, when it was first queued (start_copy;
  // report_stalled_copy measures from there) and when last (requeue_copy measures from there).
  const char* copy_source = nullptr;
  cudaStream_t stream = nullptr;
  std::chrono::steady_clock::time_point copy_started{}, copy_queued{};
  bool copy_stall_reported = false;
  // Events of earlier copies of this op into `staging` that were queued again elsewhere: the chunk
  // goes back to the pool only once they have run too (release_staging).
  std::vector<cudaEvent_t> abandoned;
  uint64_t region = 0, offset = 0;
  bool has_signal = false;
  uint64_t signal_region = 0, signal_offset = 0, signal_delta = 0;
  bool returned = false;    // handed to NCCL as a request: test() frees it
  std::atomic<int> state{0};  // 0 in flight, 1 delivered, -1 failed
};

// $JAXGIN_TRANSPORT_STALL_REPORT_S (default 10): how long a put may wait for its copy out of GPU
// memory before report_stalled_copy says so. Read when a communicator is made.
std::chrono::milliseconds read_stall_report_after() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_STALL_REPORT_S");
  const double seconds = v && *v ? std::atof(v) : 10.0;
  return std::chrono::milliseconds(static_cast<int64_t>((seconds > 0 ? seconds : 10.0) * 1000));
}

// $JAXGIN_TRANSPORT_REQUEUE_MS (default 200; 0: never): how long a staged put's copy out of GPU
// memory may sit on its stream before requeue_copy queues it again on another one. A copy that
// finishes normally takes well under a millisecond, or a few time slices where many processes
// share the GPU. Read when a communicator is made.
std::chrono::milliseconds read_requeue_after() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_REQUEUE_MS");
  const long ms = v && *v ? std::atol(v) : 200;
  return std::chrono::milliseconds(ms > 0 ? ms : 0);
}

// Where the copies out of GPU memory run (JAXGIN_TRANSPORT_COPY_CONTEXT): "own" (the default), a
// CUDA context of this transport's own; "shared", the application's context (CUDA's primary
// context, where XLA's streams live). A context's streams share its few hardware queues, and XLA
// queues work that waits for a kernel spinning on a put: under XLA command buffers at world 8 that
// held a staged copy on every stream of the shared context, fifty spares included (measured on
// emulated hosts, 2026-11-26). A NIC reads GPU memory outside the application's queues; the own
// context is the closest a copy engine gets. Empty when the value is unknown.
std::string copy_context_mode() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_COPY_CONTEXT");
  const std::string mode = v && *v ? v : "own";
  return mode == "own" || mode == "shared" ? mode : std::string();
}

// CUDA spreads a context's streams over this many hardware queues (CUDA_DEVICE_MAX_CONNECTIONS,
// default 8): the spare streams a context rotates through, so that one of them sits in each.
int hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int n = v && *v ? std::atoi(v) : 8;
  return std::min(std::max(n, 1), 32);
}

struct Comm {
  // NCCL's logger, copied: the plugin context it came from may be finalized before this closes.
  rmaLogger_t log = nullptr;
  std::chrono::milliseconds stall_report_after = read_stall_report_after();
  std::chrono::milliseconds requeue_after = read_requeue_after();
  int rank = 0, nranks = 0, device = -1;
  // The CUDA context the copies out of GPU memory run in (see copy_context_mode); null: the
  // application's. The receiving side (apply stream) stays in the application's context: it
  // writes NCCL's signal words, which another context may not be able to address.
  void* own_context = nullptr;
  std::vector<Address> addresses;
  std::vector<bool> same_host;
  std::vector<int> out, in;
  std::vector<std::unique_ptr<std::mutex>> out_lock;
  std::thread agent;
  int wake[2] = {-1, -1};
  std::atomic<bool> closing{false};

  std::mutex lock;  // regions, registrations, failure
  std::condition_variable changed;
  std::vector<Region*> regions;
  std::vector<std::map<uint64_t, PeerRegistration>> peer_registrations;
  std::vector<bool> peer_gone;
  std::atomic<bool> failed{false};
  std::string failure;
  std::set<std::string> warned;  // the failures printed: a repeat of one is not printed again

  // The receiving side's CUDA resources, all made in connect: creating streams or pinned memory
  // later, on the agent or proxy thread, could wait on kernels that are spinning for this very
  // transport's signals.
  std::mutex apply_lock;  // the apply stream and the signal values it writes
  cudaStream_t apply_stream = nullptr;
  bool apply_stream_used = false;
  bool adds_in_stream = false;  // the driver adds to device words itself (no read, no known value)
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> signal_values;
  uint64_t* read_word = nullptr;  // pinned: where a resettable signal word is read into
  cudaEvent_t read_done = nullptr;
  char* receive_staging[2] = {nullptr, nullptr};
  cudaEvent_t receive_done[2] = {nullptr, nullptr};
  int next_staging = 0;

  std::mutex pool_lock;  // pinned chunks for staged sends
  std::vector<char*> pool;
  std::vector<char*> pool_all;
};

struct Context {
  Comm* comm;
  int contexts;
  std::mutex lock;
  std::vector<std::deque<Op*>> queues;  // [context * nranks + peer]
  std::vector<cudaEvent_t> events;      // free copy events (under lock); all of them in all_events
  std::vector<cudaEvent_t> all_events;
  // Copies out of GPU memory, on streams made in createContext (in the transport's own context
  // unless JAXGIN_TRANSPORT_COPY_CONTEXT=shared): the first nranks one per peer, then
  // hardware_queues() spares. CUDA places a context's streams in a few hardware queues, and work in
  // one queue runs in order: in the application's context a copy in the queue of XLA's stream waits
  // behind the jaxgin calls XLA has launched after the one that spins for this very put (measured
  // on emulated hosts at world 8: a few puts to one rank never left while every other rank's
  // flowed). requeue_copy then queues such a copy again on a spare, and peer_stream moves that
  // peer's later copies there too. That helps only while some queue is free: under XLA command
  // buffers every queue was held (fifty spares tried in turn), which the own context avoids.
  std::vector<cudaStream_t> streams;
  std::vector<int> peer_stream;  // [peer]: index into streams of where its copies go now
  int next_spare = 0;
  // Staging chunks of delivered puts whose abandoned copies have not run yet, with their events.
  std::vector<std::pair<char*, std::vector<cudaEvent_t>>> parked;
};

// Every later call of a failed communicator fails again, for the same few reasons (once CUDA was
// gone at process exit, each of NCCL's calls printed the same two lines, thousands of them, which
// hid the cause): each reason is printed once. The set stays small: its reasons are fixed texts.
void fail(Comm* c, const std::string& why) {
  bool repeat;
  {
    std::lock_guard<std::mutex> g(c->lock);
    if (c->failure.empty()) c->failure = why;
    c->failed = true;
    repeat = !c->warned.insert(why).second;
  }
  c->changed.notify_all();
  if (!repeat) WARN(c, "rank %d: %s", c->rank, why.c_str());
}

bool cuda_ok(Comm* c, cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  fail(c, std::string(what) + " failed: " + cudaGetErrorString(e));
  return false;
}

// The calling thread's current device, set once per thread (NCCL's proxy thread serves one device).
void use_device(int device) {
  thread_local int current = -1;
  if (device < 0 || device == current) return;
  cudaSetDevice(device);
  current = device;
}

// Makes the context of the sending side's streams and events current for a scope: the transport's
// own (pushed, then popped, so that NCCL's thread keeps its context) or the application's.
class CopyContextScope {
 public:
  explicit CopyContextScope(Comm* c) {
    std::string error;
    if (c->own_context) {
      pushed_ = push_context(c->own_context, error);
      if (!pushed_) fail(c, "making the transport's CUDA context current: " + error);
    } else {
      use_device(c->device);
    }
  }
  ~CopyContextScope() {
    if (pushed_) pop_context();
  }
  CopyContextScope(const CopyContextScope&) = delete;
  CopyContextScope& operator=(const CopyContextScope&) = delete;

 private:
  bool pushed_ = false;
};

Region* find_region(Comm* c, uint64_t seq) {
  std::lock_guard<std::mutex> g(c->lock);
  return seq < c->regions.size() ? c->regions[seq] : nullptr;
}

// --- the receiving side --------------------------------------------------------------------

// Made once, in connect, on ranks with a CUDA device.
bool create_apply_resources(Comm* c) {
  cudaSetDevice(c->device);
  if (!cuda_ok(c, cudaStreamCreateWithFlags(&c->apply_stream, cudaStreamNonBlocking), "cudaStreamCreate") ||
      !cuda_ok(c, cudaHostAlloc(&c->read_word, sizeof(uint64_t), cudaHostAllocPortable), "cudaHostAlloc") ||
      !cuda_ok(c, cudaEventCreateWithFlags(&c->read_done, cudaEventDisableTiming), "cudaEventCreate"))
    return false;
  for (int i = 0; i < 2; i++) {
    if (!cuda_ok(c, cudaHostAlloc(&c->receive_staging[i], kChunkBytes, cudaHostAllocPortable), "cudaHostAlloc") ||
        !cuda_ok(c, cudaEventCreateWithFlags(&c->receive_done[i], cudaEventDisableTiming), "cudaEventCreate"))
      return false;
  }
  c->adds_in_stream = can_add_value64(c->device);
  return true;
}

bool have_apply_stream(Comm* c) {
  if (c->apply_stream) return true;
  return cuda_ok(c, cudaErrorNoDevice, "using device memory on a rank without a CUDA device");
}

// Waits for `event` boundedly: the agent must never hang, whatever the GPU is doing.
bool wait_event(Comm* c, cudaEvent_t event, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(connect_timeout_ms());
  while (true) {
    cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) return cuda_ok(c, e, what);
    if (std::chrono::steady_clock::now() > deadline) {
      fail(c, std::string(what) + " did not finish within JAXGIN_TRANSPORT_CONNECT_TIMEOUT");
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Adds `delta` to the signal word. Called with apply_lock held.
bool apply_signal_locked(Comm* c, uint64_t region, uint64_t offset, uint64_t delta) {
  Region* r = find_region(c, region);
  if (!r || offset % 8 != 0 || offset + 8 > r->size) {
    fail(c, "a signal names word " + std::to_string(offset) + " of region " + std::to_string(region) +
                (r ? " of " + std::to_string(r->size) + " bytes" : ", which is not registered here"));
    return false;
  }
  counters[kSignalsApplied]++;
  TRACE("rank %d apply region %lu +%lu delta %lu", c->rank, (unsigned long)region, (unsigned long)offset,
        (unsigned long)delta);
  auto* word = reinterpret_cast<uint64_t*>(r->base + offset);
  if (!r->on_device) {
    // Host words change at once, so device copies queued before must land first.
    if (c->apply_stream_used && !cuda_ok(c, cudaStreamSynchronize(c->apply_stream), "cudaStreamSynchronize"))
      return false;
    __atomic_fetch_add(word, delta, __ATOMIC_SEQ_CST);
    return true;
  }
  if (!have_apply_stream(c)) return false;
  c->apply_stream_used = true;
  std::string error;
  if (c->adds_in_stream) {
    if (add_value64(c->apply_stream, word, delta, error)) return true;
    fail(c, error);
    return false;
  }
  // Without the stream add: this rank is the only writer of a never-reset signal, so its value is
  // known here (NCCL zeroes signals when it makes them) and one stream write suffices. Other words
  // may be reset by their kernels, so they are read first.
  auto key = std::make_pair(region, offset);
  auto known = c->signal_values.find(key);
  uint64_t value = 0;
  if (r->never_reset) {
    if (known != c->signal_values.end()) value = known->second;
  } else {
    if (!cuda_ok(c, cudaMemcpyAsync(c->read_word, word, 8, cudaMemcpyDeviceToHost, c->apply_stream),
                 "reading a signal") ||
        !cuda_ok(c, cudaEventRecord(c->read_done, c->apply_stream), "cudaEventRecord") ||
        !wait_event(c, c->read_done, "reading a signal word"))
      return false;
    value = *c->read_word;
  }
  value += delta;
  c->signal_values[key] = value;
  // The word's new value, as queued: a trace that shows it while the kernel reads less tells a
  // stream write that never ran from a value that was wrong here.
  TRACE("rank %d write region %lu +%lu value %lu", c->rank, (unsigned long)region, (unsigned long)offset,
        (unsigned long)value);
  if (!write_value64(c->apply_stream, word, value, error)) {
    fail(c, error);
    return false;
  }
  return true;
}

bool apply_signal(Comm* c, uint64_t region, uint64_t offset, uint64_t delta) {
  std::lock_guard<std::mutex> g(c->apply_lock);
  return apply_signal_locked(c, region, offset, delta);
}

// A kPut's payload: straight into host regions, through pinned staging into device regions.
bool receive_put(Comm* c, int fd, int peer, const Message& m) {
  Region* r = find_region(c, m.region);
  if (!r || m.offset + m.size > r->size) {
    fail(c, "rank " + std::to_string(peer) + " put " + std::to_string(m.size) + " bytes at offset " +
                std::to_string(m.offset) + " of region " + std::to_string(m.region) +
                (r ? " of " + std::to_string(r->size) + " bytes" : ", which is not registered here"));
    return false;
  }
  std::lock_guard<std::mutex> g(c->apply_lock);
  if (!r->on_device) {
    if (c->apply_stream_used && !cuda_ok(c, cudaStreamSynchronize(c->apply_stream), "cudaStreamSynchronize"))
      return false;
    if (!recv_all(fd, r->base + m.offset, m.size)) return false;
  } else {
    if (!have_apply_stream(c)) return false;
    c->apply_stream_used = true;
    for (uint64_t done = 0; done < m.size;) {
      size_t n = std::min<uint64_t>(kChunkBytes, m.size - done);
      int i = c->next_staging;
      c->next_staging ^= 1;
      // Two buffers: one fills from the socket while the other drains to the GPU.
      if (!wait_event(c, c->receive_done[i], "a staged put's copy")) return false;
      if (!recv_all(fd, c->receive_staging[i], n)) return false;
      if (!cuda_ok(c, cudaMemcpyAsync(r->base + m.offset + done, c->receive_staging[i], n, cudaMemcpyHostToDevice,
                                      c->apply_stream), "cudaMemcpyAsync(staged put)") ||
          !cuda_ok(c, cudaEventRecord(c->receive_done[i], c->apply_stream), "cudaEventRecord"))
        return false;
      done += n;
    }
  }
  if (m.signal_region != kNoRegion) return apply_signal_locked(c, m.signal_region, m.signal_offset, m.signal_delta);
  return true;
}

// Reads what peers send until closeColl wakes it. A connection that ends without kBye means the
// peer is gone: every later operation towards it fails and queryLastError reports it.
void agent_loop(Comm* c) {
  if (c->device >= 0) cudaSetDevice(c->device);
  relax_capture_mode();
  std::vector<pollfd> fds;
  std::vector<int> peer_of;
  fds.push_back({c->wake[0], POLLIN, 0});
  peer_of.push_back(-1);
  for (int p = 0; p < c->nranks; p++)
    if (c->in[p] >= 0) {
      fds.push_back({c->in[p], POLLIN, 0});
      peer_of.push_back(p);
    }
  while (true) {
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      fail(c, std::string("poll: ") + std::strerror(errno));
      return;
    }
    if (fds[0].revents) return;
    for (size_t i = 1; i < fds.size(); i++) {
      if (fds[i].fd < 0 || !fds[i].revents) continue;
      int peer = peer_of[i];
      Message m;
      int passed = -1;
      bool ok = recv_message(fds[i].fd, m, passed);
      if (ok && m.type == MessageType::kRegister) {
        {
          std::lock_guard<std::mutex> g(c->lock);
          c->peer_registrations[peer][m.region] = PeerRegistration{m, passed};
        }
        c->changed.notify_all();
      } else if (ok && m.type == MessageType::kPut) {
        ok = receive_put(c, fds[i].fd, peer, m);
      } else if (ok && m.type == MessageType::kSignal) {
        ok = apply_signal(c, m.signal_region, m.signal_offset, m.signal_delta);
      } else if (ok && m.type == MessageType::kBye) {
        fds[i].fd = -1;  // a clean goodbye
        continue;
      } else if (ok) {
        ok = false;
      }
      if (!ok) {
        if (passed >= 0 && m.type != MessageType::kRegister) close(passed);
        fds[i].fd = -1;
        if (c->closing) continue;
        {
          std::lock_guard<std::mutex> g(c->lock);
          c->peer_gone[peer] = true;
        }
        record_lost_peer(c->rank, peer);
        fail(c, "the connection from rank " + std::to_string(peer) +
                    " ended without a goodbye: that process exited or its host is unreachable");
      }
    }
  }
}

// --- the sending side ----------------------------------------------------------------------

// A free staging chunk, or null when all are in flight.
char* pool_get(Comm* c) {
  std::lock_guard<std::mutex> g(c->pool_lock);
  if (c->pool.empty()) return nullptr;
  char* p = c->pool.back();
  c->pool.pop_back();
  return p;
}

void pool_put(Comm* c, char* p) {
  if (!p) return;
  std::lock_guard<std::mutex> g(c->pool_lock);
  c->pool.push_back(p);
}

bool send_to(Comm* c, int peer, const Message& m, const void* payload, size_t bytes) {
  std::lock_guard<std::mutex> g(*c->out_lock[peer]);
  if (send_message(c->out[peer], m, -1) && (bytes == 0 || send_all(c->out[peer], payload, bytes))) return true;
  {
    std::lock_guard<std::mutex> l(c->lock);
    c->peer_gone[peer] = true;
  }
  fail(c, "sending to rank " + std::to_string(peer) + " failed (" + std::strerror(errno) +
              "): that process exited or its host is unreachable");
  return false;
}

Message signal_message(const Op* op) {
  Message m{};
  m.magic = kMessageMagic;
  m.type = MessageType::kSignal;
  m.region = kNoRegion;
  m.signal_region = op->signal_region;
  m.signal_offset = op->signal_offset;
  m.signal_delta = op->signal_delta;
  return m;
}

// Runs when every earlier operation of the queue has delivered and this one's copy finished.
bool deliver(Comm* c, Op* op) {
  switch (op->route) {
    case Route::kLocal:
      if (op->local_destination) std::memcpy(op->local_destination, op->local_source, op->size);
      return !op->has_signal || apply_signal(c, op->signal_region, op->signal_offset, op->signal_delta);
    case Route::kMapped:
      if (!op->has_signal) return true;
      {
        Message m = signal_message(op);
        return send_to(c, op->peer, m, nullptr, 0);
      }
    case Route::kStaged: {
      Message m = signal_message(op);
      m.type = MessageType::kPut;
      m.region = op->region;
      m.offset = op->offset;
      m.size = op->size;
      if (!op->has_signal) m.signal_region = kNoRegion;
      return send_to(c, op->peer, m, op->host_source ? op->host_source : op->staging, op->size);
    }
  }
  return false;
}

// A put whose copy out of GPU memory has not finished holds back every later put to that rank (a
// context's queue delivers in order), and the receiver's wait then times out naming a signal, not
// this. Said once per put, on stderr, with what is known here: seen on emulated hosts at world 8,
// where the copies of a few puts to one rank never finished while every other rank's flowed.
void report_stalled_copy(Comm* c, Op* op, std::chrono::steady_clock::time_point now, size_t behind) {
  op->copy_stall_reported = true;
  const double waited = std::chrono::duration<double>(now - op->copy_started).count();
  WARN(c, "rank %d: a put of %zu bytes to rank %d has waited %.1f s for its copy out of this GPU's memory "
       "(a CUDA copy, queued on %zu stream(s) of the transport, not finished); later puts to rank %d wait behind "
       "it (%zu on this context)", c->rank, op->size, op->peer, waited, op->abandoned.size() + 1, op->peer, behind);
}

// The op's staging chunk goes back to the pool, or, while copies of it queued earlier have yet to
// run (they would write into it after its next owner filled it), waits in `parked` for them.
// Called with x->lock held.
void release_staging(Context* x, Op* op) {
  if (!op->staging) return;
  if (op->abandoned.empty())
    pool_put(x->comm, op->staging);
  else
    x->parked.emplace_back(op->staging, std::move(op->abandoned));
  op->staging = nullptr;
  op->abandoned.clear();
}

// Parked chunks and events whose copies have all run (or failed) come free. Called with x->lock held.
void reclaim_parked(Context* x) {
  for (auto it = x->parked.begin(); it != x->parked.end();) {
    bool ran = true;
    for (cudaEvent_t e : it->second) ran = ran && cudaEventQuery(e) != cudaErrorNotReady;
    if (!ran) {
      ++it;
      continue;
    }
    for (cudaEvent_t e : it->second) x->events.push_back(e);
    pool_put(x->comm, it->first);
    it = x->parked.erase(it);
  }
}

// Whether a copy straight into peer memory (mapped or local, not staged) towards `peer` is still
// pending on `stream`. Called with x->lock held.
bool direct_copy_pending(Context* x, int peer, cudaStream_t stream) {
  const size_t nranks = static_cast<size_t>(x->comm->nranks);
  for (size_t q = static_cast<size_t>(peer); q < x->queues.size(); q += nranks)
    for (const Op* o : x->queues[q])
      if (o->event && !o->staging && o->stream == stream) return true;
  return false;
}

// Queues a staged op's copy out of GPU memory again, on a spare stream: its own has not run it
// within requeue_after, as happens when the stream sits in the hardware queue of a stream that
// waits for a kernel spinning on this very put (see Context::streams). The copy writes the same
// bytes into the same chunk (the source stays as it is until the put completes), so the first to
// finish delivers the put; the chunk is reused only after both ran (release_staging). The peer's
// later copies move to that spare too, unless a copy straight into the peer's memory is pending
// on the old stream: a later one landing first would then be overwritten by older bytes.
// Called with x->lock held; does nothing when no copy event is free (the next progress retries).
void requeue_copy(Context* x, Op* op, std::chrono::steady_clock::time_point now) {
  Comm* c = x->comm;
  const int spares = static_cast<int>(x->streams.size()) - c->nranks;
  if (x->events.empty() || spares < 1) return;
  int index = -1;
  for (int tries = 0; tries < spares && index < 0; tries++) {
    const int candidate = c->nranks + x->next_spare++ % spares;
    if (x->streams[candidate] != op->stream) index = candidate;
  }
  if (index < 0) return;
  cudaEvent_t event = x->events.back();
  cudaStream_t stream = x->streams[index];
  if (!cuda_ok(c, cudaMemcpyAsync(op->staging, op->copy_source, op->size, cudaMemcpyDefault, stream),
               "cudaMemcpyAsync(a requeued copy)") ||
      !cuda_ok(c, cudaEventRecord(event, stream), "cudaEventRecord"))
    return;
  x->events.pop_back();
  const cudaStream_t stuck = op->stream;
  const double waited_ms = std::chrono::duration<double, std::milli>(now - op->copy_queued).count();
  op->abandoned.push_back(op->event);
  op->event = event;
  op->stream = stream;
  op->copy_queued = now;
  counters[kCopiesRequeued]++;
  const bool moved = x->streams[x->peer_stream[op->peer]] == stuck && !direct_copy_pending(x, op->peer, stuck);
  if (moved) x->peer_stream[op->peer] = index;
  TRACE("rank %d requeue peer %d size %zu after %.0f ms spare %d moved %d", c->rank, op->peer, op->size, waited_ms,
        index - c->nranks, moved);
  INFO(c, "rank %d: a copy of %zu bytes towards rank %d had not run after %.0f ms on its stream; queued again on "
       "spare stream %d%s", c->rank, op->size, op->peer, waited_ms, index - c->nranks,
       moved ? ", where that rank's later copies go too" : "");
}

void progress(Context* x) {
  CopyContextScope scope(x->comm);
  Comm* c = x->comm;
  std::lock_guard<std::mutex> g(x->lock);
  if (!x->parked.empty()) reclaim_parked(x);
  for (auto& queue : x->queues) {
    while (!queue.empty()) {
      Op* op = queue.front();
      bool ok = true;
      if (op->event) {
        cudaError_t e = cudaEventQuery(op->event);
        if (e == cudaErrorNotReady) {
          const auto now = std::chrono::steady_clock::now();
          if (op->staging && c->requeue_after.count() > 0 && now - op->copy_queued > c->requeue_after)
            requeue_copy(x, op, now);
          if (!op->copy_stall_reported && now - op->copy_started > c->stall_report_after)
            report_stalled_copy(c, op, now, queue.size() - 1);
          break;
        }
        ok = cuda_ok(c, e, "a transport copy");
        x->events.push_back(op->event);
        op->event = nullptr;
      }
      ok = ok && deliver(c, op);
      TRACE("rank %d deliver peer %d size %zu ok %d req %p", c->rank, op->peer, op->size, ok, static_cast<void*>(op));
      queue.pop_front();
      release_staging(x, op);
      if (op->returned) {
        op->state = ok ? 1 : -1;
      } else {
        delete op;
      }
    }
  }
}

// Delivers what it can until `take` succeeds, for up to the connect timeout: staging chunks and
// copy events come back as earlier puts deliver. Called without x->lock.
template <class Take>
bool wait_to_take(Context* x, const char* what, Take take) {
  if (take()) return true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(connect_timeout_ms());
  while (std::chrono::steady_clock::now() < deadline) {
    progress(x);
    if (take()) return true;
    if (x->comm->failed) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  fail(x->comm, std::string("no ") + what + " came free within JAXGIN_TRANSPORT_CONNECT_TIMEOUT: earlier puts did not "
                "deliver");
  return false;
}

// Queues the op's copy on its peer's stream with an event from the context's pool for progress()
// to wait on.
bool start_copy(Context* x, Op* op, void* to, const void* from, size_t bytes) {
  Comm* c = x->comm;
  bool got = wait_to_take(x, "copy event", [&] {
    std::lock_guard<std::mutex> g(x->lock);
    if (x->events.empty()) return false;
    op->event = x->events.back();
    x->events.pop_back();
    op->stream = x->streams[x->peer_stream[op->peer]];
    return true;
  });
  op->copy_source = static_cast<const char*>(from);
  op->copy_started = op->copy_queued = std::chrono::steady_clock::now();
  return got && cuda_ok(c, cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, op->stream), "cudaMemcpyAsync") &&
         cuda_ok(c, cudaEventRecord(op->event, op->stream), "cudaEventRecord");
}

rmaResult_t enqueue(Context* x, int context, uint64_t src_off, Region* src, size_t size, uint64_t dst_off,
                    Region* dst, uint32_t peer, Region* signal, uint64_t signal_off, uint64_t signal_delta,
                    void** request) {
  Comm* c = x->comm;
  *request = nullptr;
  if (context < 0 || context >= x->contexts || peer >= static_cast<uint32_t>(c->nranks)) {
    WARN(c, "rank %d: put on context %d (of %d) to rank %u (of %d): out of range", c->rank, context, x->contexts,
         peer, c->nranks);
    return rmaInvalidArgument;
  }
  if (size > 0 && (!src || !dst || src_off + size > src->size || dst_off + size > dst->size)) {
    WARN(c, "rank %d: put of %zu bytes from offset %lu of a %zu-byte region to offset %lu of a %zu-byte region",
         c->rank, size, (unsigned long)src_off, src ? src->size : 0, (unsigned long)dst_off, dst ? dst->size : 0);
    return rmaInvalidArgument;
  }
  if (signal && (signal_off % 8 != 0 || signal_off + 8 > signal->size)) {
    WARN(c, "rank %d: signal at offset %lu of a %zu-byte region", c->rank, (unsigned long)signal_off, signal->size);
    return rmaInvalidArgument;
  }
  {
    std::lock_guard<std::mutex> g(c->lock);
    if (c->peer_gone[peer]) {
      WARN(c, "rank %d: put to rank %u, whose connection is gone: %s", c->rank, peer, c->failure.c_str());
      return rmaRemoteError;
    }
  }
  for (Region* r : {size > 0 ? src : nullptr, size > 0 && static_cast<int>(peer) == c->rank ? dst : nullptr})
    if (r && !r->unreachable.empty()) {
      WARN(c, "rank %d: a put of %zu bytes to rank %u copies %s region %lu, which the transport's own CUDA context "
           "cannot reach (%s); set JAXGIN_TRANSPORT_COPY_CONTEXT=shared to copy in the application's context",
           c->rank, size, peer, r == src ? "from" : "into", (unsigned long)r->seq, r->unreachable.c_str());
      return rmaInvalidUsage;
    }
  TRACE("rank %d request ctx %d peer %u size %zu", c->rank, context, peer, size);
  CopyContextScope scope(c);
  relax_capture_mode();
  const int index = context * c->nranks + static_cast<int>(peer);
  Route route = static_cast<int>(peer) == c->rank ? Route::kLocal
                : (size == 0 || dst->peer_base[peer]) ? Route::kMapped
                                                      : Route::kStaged;
  // One op per staged chunk, else one. Each joins the queue as soon as its copy is under way, so
  // that a put larger than the staging pool delivers its first chunks while later ones wait.
  const size_t pieces = route == Route::kStaged ? (size + kChunkBytes - 1) / kChunkBytes : 1;
  Op* last = nullptr;
  for (size_t i = 0; i < pieces; i++) {
    const uint64_t at = i * kChunkBytes;
    const size_t bytes = route == Route::kStaged ? std::min<uint64_t>(kChunkBytes, size - at) : size;
    Op* op = new Op;
    op->context = x;
    op->route = route;
    op->peer = static_cast<int>(peer);
    op->size = bytes;
    op->region = dst ? dst->seq : 0;
    op->offset = dst_off + at;
    if (i + 1 == pieces) {
      last = op;
      op->returned = true;
      if (signal) {
        op->has_signal = true;
        op->signal_region = signal->seq;
        op->signal_offset = signal_off;
        op->signal_delta = signal_delta;
      }
    }
    bool ok = true;
    const char* from = src ? src->base + src_off + at : nullptr;
    if (route == Route::kStaged) {
      if (!src->on_device) {
        op->host_source = from;
      } else {
        ok = wait_to_take(x, "staging chunk", [&] { return (op->staging = pool_get(c)) != nullptr; }) &&
             start_copy(x, op, op->staging, from, bytes);
      }
      counters[kPutsStaged]++;
      counters[kBytesStaged] += bytes;
    } else if (size > 0) {
      char* to = route == Route::kLocal ? dst->base + dst_off : dst->peer_base[peer] + dst_off;
      if (!src->on_device && !dst->on_device) {
        op->local_destination = to;
        op->local_source = from;
      } else {
        ok = start_copy(x, op, to, from, size);
      }
      counters[route == Route::kLocal ? kPutsLocal : kPutsMapped]++;
      if (route == Route::kMapped) counters[kBytesMapped] += size;
    }
    if (!ok) {
      // Chunks already queued still deliver (their data, no signal); the request fails.
      std::lock_guard<std::mutex> g(x->lock);
      if (op->event) x->events.push_back(op->event);
      pool_put(c, op->staging);
      delete op;
      return rmaUnhandledCudaError;
    }
    std::lock_guard<std::mutex> g(x->lock);
    x->queues[index].push_back(op);
  }
  TRACE("rank %d enqueue ctx %d peer %u route %d size %zu src %lu+%lu dst %lu+%lu signal %ld+%lu +%lu ops %zu req %p",
        c->rank, context, peer, static_cast<int>(route), size, (unsigned long)(src ? src->seq : 0),
        (unsigned long)src_off, (unsigned long)(dst ? dst->seq : 0), (unsigned long)dst_off,
        signal ? (long)signal->seq : -1L, (unsigned long)signal_off, (unsigned long)signal_delta, pieces,
        static_cast<void*>(last));
  *request = last;
  return rmaSuccess;
}

// --- the interface ---------------------------------------------------------------------------

rmaResult_t plugin_init(void** ctx, uint64_t comm_id, rmaLogger_t log) {
  *ctx = new Plugin{comm_id, log};
  return rmaSuccess;
}

rmaResult_t plugin_devices(int* ndev) {
  *ndev = 1;
  return rmaSuccess;
}

rmaResult_t plugin_properties(int dev, rmaProperties_t* props) {
  if (dev != 0) return rmaInvalidArgument;
  std::memset(props, 0, sizeof(*props));
  static char name[] = "jaxgin-host";
  props->name = name;
  props->pciPath = nullptr;
  props->guid = host_id();
  props->ptrSupport = RMA_PTR_HOST | RMA_PTR_CUDA;
  props->speed = 400000;
  props->maxComms = 1 << 16;
  props->maxRecvs = 8;  // NCCL sizes each GPU-to-proxy queue to 32 x this
  props->netDeviceType = RMA_DEVICE_GIN_PROXY;
  props->netDeviceVersion = 1;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = 0;
  props->maxP2pBytes = size_t(1) << 40;
  props->maxCollBytes = size_t(1) << 40;
  props->maxMultiRequestSize = 1;
  props->railId = -1;
  props->planeId = -1;
  return rmaSuccess;
}

rmaResult_t plugin_listen(void* ctx, int /*dev: there is one*/, void* handle, void** listen_comm) {
  auto* l = new Listener{static_cast<Plugin*>(ctx), {}, -1, -1};
  std::string error;
  if (!listen_on(l->address, l->tcp_fd, l->unix_fd, error)) {
    log_message(l->plugin->log, RMA_LOG_WARN, __LINE__, "listen failed: %s", error.c_str());
    if (l->tcp_fd >= 0) close(l->tcp_fd);
    if (l->unix_fd >= 0) close(l->unix_fd);
    delete l;
    return rmaSystemError;
  }
  std::memset(handle, 0, RMA_HANDLE_MAXSIZE);
  std::memcpy(handle, &l->address, sizeof(Address));
  *listen_comm = l;
  return rmaSuccess;
}

rmaResult_t plugin_close_listen(void* listen_comm) {
  auto* l = static_cast<Listener*>(listen_comm);
  if (l->tcp_fd >= 0) close(l->tcp_fd);
  if (l->unix_fd >= 0) close(l->unix_fd);
  delete l;
  return rmaSuccess;
}

void close_comm_fds(Comm* c) {
  for (int fd : c->out)
    if (fd >= 0) close(fd);
  for (int fd : c->in)
    if (fd >= 0) close(fd);
  for (int fd : c->wake)
    if (fd >= 0) close(fd);
}

rmaResult_t plugin_connect(void* /*see below*/, void* handles[], int nranks, int rank, void* listen_comm, void** coll_comm) {
  auto* l = static_cast<Listener*>(listen_comm);
  auto* c = new Comm;
  // Not from `ctx`: NCCL 2.32 passes its NET plugin's context here, not the one init() made for
  // this plugin (reading a logger through it crashed a second initialize()). The listener was
  // made from the right one.
  c->log = l->plugin->log;
  c->rank = rank;
  c->nranks = nranks;
  const std::string copy_context = copy_context_mode();
  if (copy_context.empty()) {
    WARN(c, "rank %d: JAXGIN_TRANSPORT_COPY_CONTEXT=%s: expected own (the default) or shared", rank,
         std::getenv("JAXGIN_TRANSPORT_COPY_CONTEXT"));
    delete c;
    return rmaInvalidArgument;
  }
  if (cudaGetDevice(&c->device) != cudaSuccess) {
    cudaGetLastError();
    c->device = -1;  // host memory only (the CPU tests)
  }
  {
    // A new communicator on this device starts with running threads; those parked for an earlier
    // one stay parked (and counted as such).
    ProxyThreads& t = proxy_threads();
    std::lock_guard<std::mutex> g(t.lock);
    t.parking[c->device] = false;
  }
  c->addresses.resize(nranks);
  c->same_host.assign(nranks, false);
  c->out.assign(nranks, -1);
  c->in.assign(nranks, -1);
  c->peer_registrations.resize(nranks);
  c->peer_gone.assign(nranks, false);
  for (int p = 0; p < nranks; p++) c->out_lock.emplace_back(new std::mutex);
  const bool only_tcp = tcp_only();
  int unix_peers = 0;
  std::string error;
  for (int p = 0; p < nranks; p++) {
    std::memcpy(&c->addresses[p], handles[p], sizeof(Address));
    if (c->addresses[p].magic != kAddressMagic) {
      WARN(c, "rank %d: rank %d's connection handle is not a jaxgin transport address (two RMA plugins?)", rank, p);
      delete c;
      return rmaInvalidUsage;
    }
    c->same_host[p] = !only_tcp && c->addresses[p].host_id == l->address.host_id;
  }
  // Every rank dials every peer, then accepts its peers' calls; the kernel completes a connect
  // without waiting for accept, so the order cannot deadlock.
  for (int p = 0; p < nranks; p++) {
    if (p == rank) continue;
    c->out[p] = connect_to(c->addresses[p], c->same_host[p], error);
    Message hello{};
    hello.magic = kMessageMagic;
    hello.type = MessageType::kHello;
    hello.rank = static_cast<uint32_t>(rank);
    if (c->out[p] < 0 || !send_message(c->out[p], hello)) {
      WARN(c, "rank %d could not reach rank %d: %s", rank, p, error.empty() ? std::strerror(errno) : error.c_str());
      close_comm_fds(c);
      delete c;
      return rmaRemoteError;
    }
    unix_peers += c->same_host[p];
  }
  for (int accepted = 0; accepted < nranks - 1; accepted++) {
    int fd = accept_one(l->tcp_fd, l->unix_fd, connect_timeout_ms(), error);
    Message hello;
    int passed = -1;
    bool ok = fd >= 0 && recv_message(fd, hello, passed) && hello.type == MessageType::kHello &&
              hello.rank < static_cast<uint32_t>(nranks) && static_cast<int>(hello.rank) != rank &&
              c->in[hello.rank] < 0;
    if (!ok) {
      WARN(c, "rank %d: accepting peers failed after %d of %d: %s", rank, accepted, nranks - 1,
           error.empty() ? "a bad greeting" : error.c_str());
      if (fd >= 0) close(fd);
      close_comm_fds(c);
      delete c;
      return rmaRemoteError;
    }
    c->in[hello.rank] = fd;
  }
  if (c->device >= 0 && !create_apply_resources(c)) {
    close_comm_fds(c);
    delete c;
    return rmaUnhandledCudaError;
  }
  if (c->device >= 0 && copy_context == "own" && !create_own_context(c->device, c->own_context, error)) {
    WARN(c, "rank %d: the transport's own CUDA context on device %d: %s (JAXGIN_TRANSPORT_COPY_CONTEXT=shared "
         "copies in the application's context instead)", rank, c->device, error.c_str());
    close_comm_fds(c);
    delete c;
    return rmaUnhandledCudaError;
  }
  if (pipe2(c->wake, O_CLOEXEC) != 0) {
    close_comm_fds(c);
    destroy_own_context(c->own_context);
    delete c;
    return rmaSystemError;
  }
  c->agent = std::thread(agent_loop, c);
  // Staged sends (peers on other hosts, or regions that cannot be mapped) take pinned chunks made
  // here, never on the proxy thread (see kStagingChunks).
  if (c->device >= 0) {
    const int chunks = unix_peers < nranks - 1 ? kStagingChunks : 2;
    for (int i = 0; i < chunks; i++) {
      char* chunk = nullptr;
      if (!cuda_ok(c, cudaHostAlloc(&chunk, kChunkBytes, cudaHostAllocPortable), "cudaHostAlloc(staging chunk)")) break;
      c->pool_all.push_back(chunk);
      c->pool.push_back(chunk);
    }
  }
  INFO(c, "rank %d of %d on CUDA device %d: %d peers on this host (CUDA IPC + Unix sockets), %d over TCP; "
       "signals applied by %s", rank, nranks, c->device, unix_peers, nranks - 1 - unix_peers,
       c->adds_in_stream ? "stream atomic adds" : "stream writes of known values");
  *coll_comm = c;
  return rmaSuccess;
}

// Reads a word of a new device region from the transport's own context, synchronously (nothing of
// the application's runs there, so nothing can hold it up), and records in the region why that
// failed. NCCL registers memory that the sending side never copies (its signal words) too, so a
// failure is reported only when a put copies from or into the region.
void probe_from_own_context(Comm* c, Region* r) {
  if (r->size == 0) return;
  std::string error;
  if (!push_context(c->own_context, error)) {
    r->unreachable = error;
    return;
  }
  uint64_t word = 0;
  const cudaError_t e = cudaMemcpy(&word, r->base, std::min<size_t>(r->size, sizeof(word)), cudaMemcpyDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    r->unreachable = std::string("cudaMemcpy from it in the transport's own CUDA context failed: ") +
                     cudaGetErrorString(e);
    INFO(c, "rank %d: region %lu (%zu bytes at %p): %s", c->rank, (unsigned long)r->seq, r->size,
         static_cast<void*>(r->base), r->unreachable.c_str());
  }
  pop_context();
}

rmaResult_t plugin_reg_mr(void* coll_comm, void* data, size_t size, int type, uint64_t flags, void** mhandle) {
  auto* c = static_cast<Comm*>(coll_comm);
  auto* r = new Region;
  r->base = static_cast<char*>(data);
  r->size = size;
  r->on_device = type == RMA_PTR_CUDA;
  r->never_reset = flags & 2;  // NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET
  r->peer_base.assign(c->nranks, nullptr);
  r->peer_mapping.assign(c->nranks, nullptr);
  r->peer_mapping_bytes.assign(c->nranks, 0);
  {
    std::lock_guard<std::mutex> g(c->lock);
    r->seq = c->regions.size();
    c->regions.push_back(r);
  }
  counters[kRegions]++;
  if (r->on_device && c->own_context) probe_from_own_context(c, r);
  if (c->device >= 0) cudaSetDevice(c->device);
  bool any_same_host = false;
  for (int p = 0; p < c->nranks; p++) any_same_host |= p != c->rank && c->same_host[p];
  Message m{};
  m.magic = kMessageMagic;
  m.type = MessageType::kRegister;
  m.region = r->seq;
  m.size = size;
  m.flags = r->on_device ? static_cast<uint32_t>(kRegionOnDevice) : 0u;
  int fd = -1;
  std::string error;
  if (r->on_device && any_same_host) {
    if (export_allocation(data, fd, m.allocation_bytes, m.allocation_offset, error))
      m.flags |= kRegionExported;
    else
      INFO(c, "rank %d: region %lu (%zu bytes) cannot be shared (%s); puts into it travel through its owner",
           c->rank, (unsigned long)r->seq, size, error.c_str());
  }
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    std::lock_guard<std::mutex> g(*c->out_lock[p]);
    if (!send_message(c->out[p], m, c->same_host[p] ? fd : -1)) {
      if (fd >= 0) close(fd);
      fail(c, "sending registration " + std::to_string(r->seq) + " to rank " + std::to_string(p) + " failed");
      return rmaRemoteError;
    }
  }
  if (fd >= 0) close(fd);
  // Registration is collective: wait for every peer's matching one.
  std::unique_lock<std::mutex> g(c->lock);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(connect_timeout_ms());
  auto all_arrived = [&] {
    for (int p = 0; p < c->nranks; p++)
      if (p != c->rank && !c->peer_registrations[p].count(r->seq)) return false;
    return true;
  };
  if (!c->changed.wait_until(g, deadline, [&] { return all_arrived() || c->failed.load(); }) || !all_arrived()) {
    std::string why = c->failed ? c->failure : "a peer did not register within JAXGIN_TRANSPORT_CONNECT_TIMEOUT";
    g.unlock();
    WARN(c, "rank %d: symmetric registration %lu failed: %s", c->rank, (unsigned long)r->seq, why.c_str());
    return rmaRemoteError;
  }
  std::vector<PeerRegistration> peers(c->nranks);
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    peers[p] = c->peer_registrations[p][r->seq];
    c->peer_registrations[p].erase(r->seq);
  }
  g.unlock();
  rmaResult_t result = rmaSuccess;
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    const Message& theirs = peers[p].message;
    if (theirs.size != size || (theirs.flags & kRegionOnDevice) != (m.flags & kRegionOnDevice)) {
      WARN(c, "rank %d: symmetric registration %lu is %zu bytes of %s memory here but %lu bytes of %s memory on "
           "rank %d: ranks registered different regions in the same order",
           c->rank, (unsigned long)r->seq, size, r->on_device ? "device" : "host", (unsigned long)theirs.size,
           (theirs.flags & kRegionOnDevice) ? "device" : "host", p);
      result = rmaInvalidUsage;
    } else if (peers[p].fd >= 0 && (theirs.flags & kRegionExported) && c->device >= 0) {
      void* mapped = nullptr;
      if (import_allocation(peers[p].fd, theirs.allocation_bytes, c->device, mapped, error)) {
        r->peer_mapping[p] = mapped;
        r->peer_mapping_bytes[p] = theirs.allocation_bytes;
        r->peer_base[p] = static_cast<char*>(mapped) + theirs.allocation_offset;
      } else {
        INFO(c, "rank %d: mapping rank %d's region %lu failed (%s); puts to it travel through rank %d", c->rank, p,
             (unsigned long)r->seq, error.c_str(), p);
      }
    }
    if (peers[p].fd >= 0) close(peers[p].fd);
  }
  *mhandle = r;
  return result;
}

rmaResult_t plugin_reg_mr_dmabuf(void* coll_comm, void* data, size_t size, int type, uint64_t, int, uint64_t flags,
                                 void** mhandle) {
  return plugin_reg_mr(coll_comm, data, size, type, flags, mhandle);
}

rmaResult_t plugin_dereg_mr(void* coll_comm, void* mhandle) {
  auto* c = static_cast<Comm*>(coll_comm);
  auto* r = static_cast<Region*>(mhandle);
  {
    std::lock_guard<std::mutex> g(c->apply_lock);
    if (c->apply_stream) cudaStreamSynchronize(c->apply_stream);
    for (auto it = c->signal_values.begin(); it != c->signal_values.end();)
      it = it->first.first == r->seq ? c->signal_values.erase(it) : std::next(it);
  }
  {
    std::lock_guard<std::mutex> g(c->lock);
    c->regions[r->seq] = nullptr;
  }
  for (int p = 0; p < c->nranks; p++) unmap_allocation(r->peer_mapping[p], r->peer_mapping_bytes[p]);
  delete r;
  return rmaSuccess;
}

rmaResult_t plugin_create_context(void* coll_comm, rmaConfig_t* config, void** rma_ctx) {
  auto* c = static_cast<Comm*>(coll_comm);
  if (config->nContexts < 1) return rmaInvalidArgument;
  auto* x = new Context;
  x->comm = c;
  x->contexts = config->nContexts;
  x->queues.resize(static_cast<size_t>(config->nContexts) * c->nranks);
  x->streams.assign(c->nranks, nullptr);
  for (int p = 0; p < c->nranks; p++) x->peer_stream.push_back(p);
  if (c->device >= 0) {
    CopyContextScope scope(c);
    // Made one after another, the spares land in every hardware queue CUDA deals streams to.
    x->streams.resize(c->nranks + hardware_queues(), nullptr);
    bool ok = true;
    for (size_t i = 0; ok && i < x->streams.size(); i++)
      ok = cuda_ok(c, cudaStreamCreateWithFlags(&x->streams[i], cudaStreamNonBlocking), "cudaStreamCreate");
    for (int i = 0; ok && i < kCopyEvents; i++) {
      cudaEvent_t event = nullptr;
      ok = cuda_ok(c, cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
      if (ok) x->all_events.push_back(event);
    }
    if (!ok) {
      for (cudaStream_t s : x->streams)
        if (s) cudaStreamDestroy(s);
      for (cudaEvent_t e : x->all_events) cudaEventDestroy(e);
      delete x;
      return rmaUnhandledCudaError;
    }
    x->events = x->all_events;
  }
  *rma_ctx = x;
  return rmaSuccess;
}

rmaResult_t plugin_destroy_context(void* rma_ctx) {
  auto* x = static_cast<Context*>(rma_ctx);
  CopyContextScope scope(x->comm);
  // Deliver what is still in flight, boundedly: a peer that is gone fails its operations.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    progress(x);
    std::lock_guard<std::mutex> g(x->lock);
    bool empty = true;
    for (auto& q : x->queues) empty &= q.empty();
    if (empty) break;
  }
  for (auto& q : x->queues)
    for (Op* op : q)
      if (!op->returned) delete op;
  for (cudaStream_t s : x->streams)
    if (s) cudaStreamDestroy(s);
  for (cudaEvent_t e : x->all_events) cudaEventDestroy(e);
  delete x;
  return rmaSuccess;
}

rmaResult_t plugin_close_coll(void* coll_comm) {
  auto* c = static_cast<Comm*>(coll_comm);
  c->closing = true;
  Message bye{};
  bye.magic = kMessageMagic;
  bye.type = MessageType::kBye;
  for (int p = 0; p < c->nranks; p++)
    if (c->out[p] >= 0) send_message(c->out[p], bye);
  char one = 1;
  if (write(c->wake[1], &one, 1) != 1) WARN(c, "rank %d: could not wake the agent thread", c->rank);
  if (c->agent.joinable()) c->agent.join();
  close_comm_fds(c);
  if (c->apply_stream) {
    cudaStreamSynchronize(c->apply_stream);
    cudaStreamDestroy(c->apply_stream);
  }
  if (c->read_word) cudaFreeHost(c->read_word);
  if (c->read_done) cudaEventDestroy(c->read_done);
  for (int i = 0; i < 2; i++) {
    if (c->receive_staging[i]) cudaFreeHost(c->receive_staging[i]);
    if (c->receive_done[i]) cudaEventDestroy(c->receive_done[i]);
  }
  for (char* p : c->pool_all) cudaFreeHost(p);
  for (Region* r : c->regions)
    if (r) {
      for (int p = 0; p < c->nranks; p++) unmap_allocation(r->peer_mapping[p], r->peer_mapping_bytes[p]);
      delete r;
    }
  for (auto& per_peer : c->peer_registrations)
    for (auto& entry : per_peer)
      if (entry.second.fd >= 0) close(entry.second.fd);
  // After destroy_context destroyed its streams: nothing of the transport's is queued there.
  destroy_own_context(c->own_context);
  delete c;
  return rmaSuccess;
}

rmaResult_t plugin_iput(void* rma_ctx, int context, uint64_t src_off, void* src, size_t size, uint64_t dst_off,
                        void* dst, uint32_t rank, void** request) {
  park_if_asked(static_cast<Context*>(rma_ctx)->comm->device);
  return enqueue(static_cast<Context*>(rma_ctx), context, src_off, static_cast<Region*>(src), size, dst_off,
                 static_cast<Region*>(dst), rank, nullptr, 0, 0, request);
}

rmaResult_t plugin_iput_signal(void* rma_ctx, int context, uint64_t src_off, void* src, size_t size, uint64_t dst_off,
                               void* dst, uint32_t rank, uint64_t signal_off, void* signal, uint64_t signal_value,
                               uint32_t signal_op, bool /*strong: every signal here is strong*/, void** request) {
  auto* x = static_cast<Context*>(rma_ctx);
  park_if_asked(x->comm->device);
  if (!signal || (signal_op != RMA_SIGNAL_OP_INC && signal_op != RMA_SIGNAL_OP_ADD)) {
    WARN(x->comm, "rank %d: signal operation %u on %s region: expected INC (1) or ADD (2) on a registered region",
         x->comm->rank, signal_op, signal ? "a" : "no");
    return rmaInvalidArgument;
  }
  uint64_t delta = signal_op == RMA_SIGNAL_OP_INC ? 1 : signal_value;
  return enqueue(x, context, src_off, static_cast<Region*>(src), size, dst_off, static_cast<Region*>(dst), rank,
                 static_cast<Region*>(signal), signal_off, delta, request);
}

rmaResult_t plugin_iget(void* rma_ctx, int, uint64_t, void*, size_t, uint64_t, void*, uint32_t, void** request) {
  *request = nullptr;
  WARN(static_cast<Context*>(rma_ctx)->comm, "get is not implemented by the jaxgin host transport");
  return rmaInvalidUsage;
}

rmaResult_t plugin_iflush(void*, int, void*, uint32_t, void** request) {
  // Flush makes earlier gets visible; there are none. Put completions are reported by test().
  *request = nullptr;
  return rmaSuccess;
}

// The first argument is whatever handle NCCL's GIN layer keeps for the connection, which need not
// be this library's Comm: the device comes from the request's own context instead.
rmaResult_t plugin_test(void* /*coll_comm*/, void* request, int* done) {
  auto* op = static_cast<Op*>(request);
  if (!op) {  // NCCL tests no null request, but a flush's is null: done
    *done = 1;
    return rmaSuccess;
  }
  park_if_asked(op->context->comm->device);
  if (op->state == 0) progress(op->context);
  int state = op->state;
  *done = state != 0;
  if (state == 0) return rmaSuccess;
  delete op;
  return state > 0 ? rmaSuccess : rmaRemoteError;
}

rmaResult_t plugin_progress(void* rma_ctx) {
  park_if_asked(static_cast<Context*>(rma_ctx)->comm->device);
  progress(static_cast<Context*>(rma_ctx));
  return rmaSuccess;
}

rmaResult_t plugin_query_last_error(void* rma_ctx, bool* has_error) {
  *has_error = static_cast<Context*>(rma_ctx)->comm->failed;
  return rmaSuccess;
}

rmaResult_t plugin_finalize(void* ctx) {
  delete static_cast<Plugin*>(ctx);
  return rmaSuccess;
}

}  // namespace
}  // namespace jaxgin::transport

using namespace jaxgin::transport;

extern "C" {

// The symbol NCCL looks up in the library NCCL_RMA_PLUGIN names.
extern __attribute__((visibility("default"))) const rmaPlugin_v14_t ncclRmaPlugin_v14;
const rmaPlugin_v14_t ncclRmaPlugin_v14 = {
    "jaxgin-host",        plugin_init,           plugin_devices,        plugin_properties,  plugin_listen,
    plugin_connect,       plugin_create_context, plugin_reg_mr,         plugin_reg_mr_dmabuf, plugin_dereg_mr,
    plugin_destroy_context, plugin_close_coll,   plugin_close_listen,   plugin_iput,        plugin_iput_signal,
    plugin_iget,          plugin_iflush,         plugin_test,           plugin_progress,    plugin_query_last_error,
    plugin_finalize,
};

// Totals since the library loaded, in the order of jaxgin_transport_counter_names; returns how
// many counters there are (at most `n` are written).
__attribute__((visibility("default"))) int jaxgin_transport_counters(uint64_t* out, int n) {
  for (int i = 0; i < n && i < kCounterCount; i++) out[i] = counters[i].load();
  return kCounterCount;
}

// The counters' names, in order; returns how many there are (at most `n` are written).
__attribute__((visibility("default"))) int jaxgin_transport_counter_names(const char** out, int n) {
  for (int i = 0; i < n && i < kCounterCount; i++) out[i] = kCounterNames[i];
  return kCounterCount;
}

// After a device fault on CUDA device `device`, once its communicator was aborted: parks NCCL's
// GIN progress threads serving that device at their next call into this library (see
// park_if_asked) and waits up to `timeout_ms` for all of them. Returns how many still run: 0 when
// none can touch NCCL's GIN memory any more. A thread that never returns to this library (one
// spinning on a descriptor the GPU left half written) is among those counted.
__attribute__((visibility("default"))) int jaxgin_transport_park_proxy_threads(int device, int timeout_ms) {
  ProxyThreads& t = proxy_threads();
  std::unique_lock<std::mutex> g(t.lock);
  t.parking[device] = true;
  t.any_parking.store(true, std::memory_order_release);
  auto running = [&] { return t.live[device] - t.parked[device]; };
  t.changed.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return running() <= 0; });
  return std::max(running(), 0);
}

// The ranks whose process the transport saw end, in the order seen; returns how many (it may
// exceed `capacity`, which bounds what is written).
__attribute__((visibility("default"))) int jaxgin_transport_lost_peers(int* out, int capacity) {
  std::lock_guard<std::mutex> g(jaxgin::transport::lost_lock);
  const auto& lost = jaxgin::transport::lost_ranks;
  for (int i = 0; i < capacity && i < static_cast<int>(lost.size()); i++) out[i] = lost[i];
  return static_cast<int>(lost.size());
}

}  // extern "C"
