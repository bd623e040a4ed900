// Private to jaxgin's host transport: the types its files share (a communicator, its regions, RMA
// contexts and queued puts), its constants and the functions one file calls in another, all in
// jaxgin::transport::detail. Nothing declared here is exported (-fvisibility=hidden, and exports.map
// for libstdc++'s templates instantiated over these types); plugin.cc holds every export.
//
// How it works. jaxgin's host transport is an NCCL RMA plugin (interface v14) that makes NCCL's GIN
// proxy backend work on hosts without an RDMA NIC. NCCL's proxy thread reads the GPU's put/signal
// descriptors and calls iput / iputSignal (plugin.cc); this library moves the bytes and applies
// the signals.
//
// Data: to a peer on the same host, a CUDA copy straight into the peer's region, mapped here
// through cuMem IPC (the copy engines carry it over NVLink); to a peer on another host, or into a
// region that cannot be mapped, the bytes travel in a kPut message and the receiver copies them
// in. Signals: always applied by the receiving rank (NCCL's signal memory cannot be exported), by
// its agent thread, in stream order after the data of that put, and only once every earlier
// operation of the same context to that peer has delivered. That FIFO per (context, peer) gives
// strong signals their meaning (all earlier puts visible first) and weak ones more than they need.
// That is kinder than a NIC; JAXGIN_TRANSPORT_UNKIND turns on what NCCL's rules allow a NIC to do
// instead (see Unkind).
//
// The files: plugin.cc (NCCL's plugin table, the entry points on RMA contexts and puts, the C
// functions jaxgin.transport calls), connect.cc (listening, connecting, closing), regions.cc
// (symmetric registration), send.cc (the sending side), receive.cc (the receiving side and its agent
// thread), faults.cc (lost peers, parking NCCL's proxy threads) and support.cc (counters, logging,
// failures, settings).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device_memory.h"
#include "rma_api.h"
#include "wire.h"

namespace jaxgin::transport::detail {

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
// kSourcesChanged to kCompletionsHeld count what the unkind mode did (see Unkind); kOpsDropped the
// operations towards ranks whose connection was gone (send.cc, deliver).
enum Counter { kPutsMapped, kPutsStaged, kPutsLocal, kBytesMapped, kBytesStaged, kSignalsApplied, kRegions,
               kCopiesRequeued, kSourcesChanged, kDeliveredOutOfOrder, kCompletedBeforeDelivery, kCompletionsHeld,
               kOpsDropped, kCounterCount };
// Their names, the keys of jaxgin.transport.counters() (read through jaxgin_transport_counter_names).
constexpr const char* kCounterNames[] = {"puts_mapped",     "puts_staged",     "puts_local",
                                         "bytes_mapped",    "bytes_staged",    "signals_applied",
                                         "regions",         "copies_requeued", "sources_changed",
                                         "delivered_out_of_order", "completed_before_delivery", "completions_held",
                                         "ops_dropped"};
static_assert(sizeof(kCounterNames) / sizeof(kCounterNames[0]) == kCounterCount, "a name per counter");
extern std::atomic<uint64_t> counters[kCounterCount];  // support.cc

// Ranks whose connection ended without a goodbye, in the order seen (faults.cc; under lost_lock).
extern std::mutex lost_lock;
extern std::vector<int> lost_ranks;
void record_lost_peer(int rank, int peer);

// NCCL's GIN progress threads that call into this library, per CUDA device, and the request to
// park them after a device fault: see faults.cc.
struct ProxyThreads {
  std::mutex lock;
  std::condition_variable changed;
  std::map<int, int> live, parked;  // per CUDA device: threads that called in and did not exit; parked ones
  std::map<int, bool> parking;      // per CUDA device: park its threads at their next call
  std::atomic<bool> any_parking{false};
};
// The one instance (faults.cc).
ProxyThreads& proxy_threads();
// Called first by every entry point NCCL's GIN progress thread uses: parks the thread when asked.
void park_if_asked(int device);

struct Plugin {
  uint64_t comm_id;
  rmaLogger_t log;
};

// The unkind (adversarial) mode, JAXGIN_TRANSPORT_UNKIND: a comma list of behaviours (or all, or
// none, the default), each something NCCL's GIN semantics (nccl_device/gin.h) allow a NIC to do
// and this transport otherwise never does. Random choices come from JAXGIN_TRANSPORT_SEED (mixed
// with the rank and the RMA context's number); delays are up to JAXGIN_TRANSPORT_UNKIND_DELAY_US.
enum UnkindBehaviour : uint32_t {
  // The source is read (copied out of GPU memory, or out of host memory) a random while after the
  // put was posted, never at the post.
  kLateRead = 1u << 0,
  // Just before a put completes, its source is read again (as a NIC's retransmission would) and
  // compared with what was sent: a change means the kernel rewrote a put's source before a flush
  // said it could; it is counted (sources_changed) and said on stderr.
  kReread = 1u << 1,
  // A put completes (test() done: NCCL's flush returns, counters count) once its source is read;
  // its data and signal reach the peer a random while later. gin.h: a flush only frees sources.
  kEarlyCompletion = 1u << 2,
  // A weak signal (and its put) may reach the peer before earlier operations of its queue, weak
  // signals of earlier puts included. gin.h: a weak signal settles only its own put.
  kWeakOvertake = 1u << 3,
  // Every put is written in 2 to 4 pieces, in random order, its signal after the last of them; the
  // data of later puts may land before that of earlier ones (never before an earlier strong signal).
  kPieces = 1u << 4,
  // Completions held back a random while after the put delivered, at most two operations queued
  // per (context, peer) (iput waits for room), and NCCL's GPU-to-proxy queues made tiny
  // (jaxgin.transport.enable sets NCCL_GIN_PROXY_QUEUE_SIZE): the GPU meets a full queue.
  kBackpressure = 1u << 5,
  // Now and then a (context, peer) queue is left alone for a random while: contexts starve at
  // random, so operations on different contexts land in any order.
  kStarve = 1u << 6,
};
constexpr const char* kUnkindNames[] = {"late_read",     "reread", "early_completion", "weak_overtake",
                                        "pieces",        "backpressure", "starve"};
constexpr int kUnkindCount = sizeof(kUnkindNames) / sizeof(kUnkindNames[0]);
constexpr size_t kUnkindQueueLimit = 2;  // operations per (context, peer) under kBackpressure

struct Unkind {
  uint32_t on = 0;
  uint64_t seed = 0;
  std::chrono::microseconds delay{2000};
  bool has(UnkindBehaviour b) const { return (on & b) != 0; }
  // Whether operations of a queue may deliver out of posting order.
  bool reorders() const { return has(kWeakOvertake) || has(kPieces); }
};
// Reads JAXGIN_TRANSPORT_UNKIND, _SEED and _UNKIND_DELAY_US (support.cc); false with `error` set
// when one of them is not understood.
bool read_unkind(Unkind& unkind, std::string& error);

// Logs through NCCL's logger, and warnings on stderr too (support.cc); `file` and `line` are the
// caller's (the WARN and INFO macros pass them).
void log_message(rmaLogger_t log, rmaLogLevel_t level, const char* file, int line, const char* fmt, ...);
// Whether JAXGIN_TRANSPORT_TRACE is set (TRACE prints then).
bool tracing();
#define TRACE(...)                                          \
  do {                                                      \
    if (tracing()) {                                        \
      std::fprintf(stderr, "jaxgin transport trace: " __VA_ARGS__); \
      std::fputc('\n', stderr);                             \
    }                                                       \
  } while (0)
#define WARN(comm, ...) log_message((comm)->log, RMA_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define INFO(comm, ...) log_message((comm)->log, RMA_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)

// Relaxes the calling thread's stream-capture mode, once per thread.
void relax_capture_mode();

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
  bool strong = true;  // the signal settles every earlier put of the queue (else only its own put)
  uint64_t signal_region = 0, signal_offset = 0, signal_delta = 0;
  // A put is one op or several (its pieces, then in the unkind mode's kPieces an op for its
  // signal): the last is the request NCCL holds, and every op of the put points at it. The
  // request counts its put's ops not yet delivered and not yet read from their source; it
  // completes when none is left to deliver (or, under kEarlyCompletion, to read). Under x->lock.
  Op* request = nullptr;
  int undelivered = 0, unread = 0;
  bool failed = false;     // on the request: an op of its put failed
  bool completed = false;  // on the request: its state is set
  bool read = false;       // the source has been read (the copy out of it finished)
  // Where the source is when the op reads it itself (host memory) or reads it again (kReread),
  // and what it read there: host-memory sources are read into `bytes` under the unkind mode.
  const char* source = nullptr;
  std::vector<char> bytes;
  bool copy_waiting = false;  // kLateRead: the copy out of GPU memory is queued at read_at
  char* copy_to = nullptr;
  std::chrono::steady_clock::time_point read_at{}, deliver_at{}, release_at{};
  // kReread of a source in GPU memory: read again into `reread` (a staging chunk) on the op's stream.
  char* reread = nullptr;
  cudaEvent_t reread_event = nullptr;
  bool checked = false;  // kReread done (or not needed)
  // Who still holds the op: the queue until it delivered, NCCL until test() said done (requests).
  std::atomic<int> holders{1};
  std::atomic<int> state{0};  // 0 in flight, 1 done, -1 failed
};
// Drops one holder of `op`; the last frees it.
void release_op(Op* op);

// Settings read from the environment (support.cc, where each is explained).
std::chrono::milliseconds read_stall_report_after();  // $JAXGIN_TRANSPORT_STALL_REPORT_S
std::chrono::milliseconds read_requeue_after();       // $JAXGIN_TRANSPORT_REQUEUE_MS
// Each: its value; empty, with `error` set (if not already), when unknown.
std::string copy_context_mode(std::string& error);    // $JAXGIN_TRANSPORT_COPY_CONTEXT
std::string peer_loss_mode(std::string& error);       // $JAXGIN_TRANSPORT_PEER_LOSS
int hardware_queues();                                // $CUDA_DEVICE_MAX_CONNECTIONS

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
  Unkind unkind;           // read in connect
  bool fail_past_lost_peers = false;  // JAXGIN_TRANSPORT_PEER_LOSS=fail (see peer_loss_mode)
  int contexts_made = 0;   // RMA contexts created: each seeds its random choices with its number

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
  // The unkind mode's random choices (under lock), how many reported source changes so far, and
  // until when each queue starves (kStarve; [context * nranks + peer]).
  std::mt19937_64 random;
  int sources_changed_said = 0;
  std::vector<std::chrono::steady_clock::time_point> starved_until;
};

// Failures and CUDA calls (support.cc).
void fail(Comm* c, const std::string& why);
bool cuda_ok(Comm* c, cudaError_t e, const char* what);
// Sets the calling thread's current device, once per thread.
void use_device(int device);

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

// The receiving side (receive.cc).
// The receiving side's CUDA resources, made in connect.
bool create_apply_resources(Comm* c);
// Adds `delta` to a signal word of this rank, in stream order after the data received before.
bool apply_signal(Comm* c, uint64_t region, uint64_t offset, uint64_t delta);
// The agent thread's body: reads what peers send until closeColl wakes it.
void agent_loop(Comm* c);

// The sending side (send.cc).
// Delivers what has finished of the context's queues, in order.
void progress(Context* x);
// Queues a put (and its signal, strong or weak) to `peer`; `*request` is what test() is called with.
rmaResult_t enqueue(Context* x, int context, uint64_t src_off, Region* src, size_t size, uint64_t dst_off,
                    Region* dst, uint32_t peer, Region* signal, uint64_t signal_off, uint64_t signal_delta,
                    bool strong, void** request);

// Entry points of the plugin table (plugin.cc) defined in connect.cc and regions.cc.
rmaResult_t plugin_listen(void* ctx, int dev, void* handle, void** listen_comm);
rmaResult_t plugin_close_listen(void* listen_comm);
rmaResult_t plugin_connect(void* ctx, void* handles[], int nranks, int rank, void* listen_comm, void** coll_comm);
rmaResult_t plugin_close_coll(void* coll_comm);
rmaResult_t plugin_reg_mr(void* coll_comm, void* data, size_t size, int type, uint64_t flags, void** mhandle);
rmaResult_t plugin_reg_mr_dmabuf(void* coll_comm, void* data, size_t size, int type, uint64_t offset, int fd,
                                 uint64_t flags, void** mhandle);
rmaResult_t plugin_dereg_mr(void* coll_comm, void* mhandle);

}  // namespace jaxgin::transport::detail
