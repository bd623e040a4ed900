// jaxgin's host transport as its callers see it: the NCCL RMA plugin table (ncclRmaPlugin_v14, the
// symbol NCCL looks up), the entry points on devices, RMA contexts and puts (connect.cc and
// regions.cc hold the rest), and the C functions jaxgin.transport calls. Every export of the library.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "transport_internal.h"

namespace jaxgin::transport::detail {
namespace {

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

rmaResult_t plugin_create_context(void* coll_comm, rmaConfig_t* config, void** rma_ctx) {
  auto* c = static_cast<Comm*>(coll_comm);
  if (config->nContexts < 1) return rmaInvalidArgument;
  auto* x = new Context;
  x->comm = c;
  x->contexts = config->nContexts;
  // A seed of its own per rank and context, the same in every run with the same seed.
  std::seed_seq seeds{static_cast<uint64_t>(c->unkind.seed), static_cast<uint64_t>(c->rank),
                      static_cast<uint64_t>(c->contexts_made++)};
  x->random.seed(seeds);
  x->queues.resize(static_cast<size_t>(config->nContexts) * c->nranks);
  x->starved_until.resize(x->queues.size());
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
    for (Op* op : q) release_op(op);  // a request NCCL still holds stays (NCCL no longer tests it)
  for (cudaStream_t s : x->streams)
    if (s) cudaStreamDestroy(s);
  for (cudaEvent_t e : x->all_events) cudaEventDestroy(e);
  delete x;
  return rmaSuccess;
}

rmaResult_t plugin_iput(void* rma_ctx, int context, uint64_t src_off, void* src, size_t size, uint64_t dst_off,
                        void* dst, uint32_t rank, void** request) {
  park_if_asked(static_cast<Context*>(rma_ctx)->comm->device);
  return enqueue(static_cast<Context*>(rma_ctx), context, src_off, static_cast<Region*>(src), size, dst_off,
                 static_cast<Region*>(dst), rank, nullptr, 0, 0, true, request);
}

rmaResult_t plugin_iput_signal(void* rma_ctx, int context, uint64_t src_off, void* src, size_t size, uint64_t dst_off,
                               void* dst, uint32_t rank, uint64_t signal_off, void* signal, uint64_t signal_value,
                               uint32_t signal_op, bool strong, void** request) {
  auto* x = static_cast<Context*>(rma_ctx);
  park_if_asked(x->comm->device);
  if (!signal || (signal_op != RMA_SIGNAL_OP_INC && signal_op != RMA_SIGNAL_OP_ADD)) {
    WARN(x->comm, "rank %d: signal operation %u on %s region: expected INC (1) or ADD (2) on a registered region",
         x->comm->rank, signal_op, signal ? "a" : "no");
    return rmaInvalidArgument;
  }
  uint64_t delta = signal_op == RMA_SIGNAL_OP_INC ? 1 : signal_value;
  return enqueue(x, context, src_off, static_cast<Region*>(src), size, dst_off, static_cast<Region*>(dst), rank,
                 static_cast<Region*>(signal), signal_off, delta, strong, request);
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
  const int state = op->state.load(std::memory_order_acquire);
  // The unkind mode's kBackpressure holds a completion back a while (release_at, set before state).
  *done = state != 0 && std::chrono::steady_clock::now() >= op->release_at;
  if (!*done) return rmaSuccess;
  release_op(op);
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
}  // namespace jaxgin::transport::detail

using namespace jaxgin::transport::detail;

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
  std::lock_guard<std::mutex> g(jaxgin::transport::detail::lost_lock);
  const auto& lost = jaxgin::transport::detail::lost_ranks;
  for (int i = 0; i < capacity && i < static_cast<int>(lost.size()); i++) out[i] = lost[i];
  return static_cast<int>(lost.size());
}

}  // extern "C"
