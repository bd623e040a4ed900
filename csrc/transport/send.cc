// The sending side of the host transport: puts queued per (RMA context, peer) and delivered in that
// order, their copies out of GPU memory (into pinned staging chunks, or straight into a peer's
// mapped memory), copies queued again when their stream stalls, and the staging chunks' pool.
#include <errno.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "transport_internal.h"

namespace jaxgin::transport::detail {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace jaxgin::transport::detail
