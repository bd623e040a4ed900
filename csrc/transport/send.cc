// The sending side of the host transport: puts queued per (RMA context, peer) and delivered in that
// order, their copies out of GPU memory (into pinned staging chunks, or straight into a peer's
// mapped memory), copies queued again when their stream stalls, and the staging chunks' pool.
// The unkind mode (Unkind) reads sources late and again, completes puts before they deliver,
// delivers out of order where NCCL allows it, holds completions and starves queues.
//
// An op's life: its source is read (the copy out of GPU memory finishes; under the unkind mode a
// host source is copied into the op), then checked (kReread), then it delivers (data and signal
// sent to the peer, or applied here) once the ops it may not overtake have; its put's request
// completes when all its ops delivered (kEarlyCompletion: when all were read and checked).
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
  const bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
  fail(c, "sending to rank " + std::to_string(peer) + " failed (" + std::strerror(errno) + "): " +
              (timed_out ? "it read nothing for JAXGIN_TRANSPORT_CONNECT_TIMEOUT (its process stopped or hangs)"
                         : "that process exited or its host is unreachable") +
              "; what this rank puts to it from now on is dropped");
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

// Whether `peer`'s connection is gone: what is still queued for it is dropped (see deliver).
bool peer_gone(Comm* c, int peer) {
  std::lock_guard<std::mutex> g(c->lock);
  return c->peer_gone[peer];
}

// Runs when the op may deliver (the ops it may not overtake have) and its source was read. To a
// peer whose connection is gone the op is dropped, and by default counts as delivered: an error
// returned to NCCL's GIN progress thread ends that thread (NCCL's ncclGinProgress returns on the
// first one), and then no put of this GPU to any peer is read again, so a kernel whose GPU-to-proxy
// queue fills spins in NCCL's descriptor post for good instead of reaching its bounded wait or
// flush. JAXGIN_TRANSPORT_PEER_LOSS=fail returns that error, as a NIC's plugin does (see
// peer_loss_mode). queryLastError reports the loss (fail() recorded it), and jaxgin's fault lines
// name the rank.
bool dropped_past_lost_peer(Comm* c) {
  counters[kOpsDropped]++;
  return !c->fail_past_lost_peers;
}

bool deliver(Comm* c, Op* op) {
  const char* read = op->bytes.empty() ? nullptr : op->bytes.data();  // read by the op itself
  if (op->route != Route::kLocal && peer_gone(c, op->peer)) return dropped_past_lost_peer(c);
  switch (op->route) {
    case Route::kLocal:
      if (op->local_destination)
        std::memcpy(op->local_destination, read ? read : op->local_source, op->size);
      return !op->has_signal || apply_signal(c, op->signal_region, op->signal_offset, op->signal_delta);
    case Route::kMapped:
      if (!op->has_signal) return true;
      {
        Message m = signal_message(op);
        if (send_to(c, op->peer, m, nullptr, 0)) return true;
        // the peer is gone (send_to recorded it): dropped, as above
        return peer_gone(c, op->peer) && dropped_past_lost_peer(c);
      }
    case Route::kStaged: {
      Message m = signal_message(op);
      m.type = MessageType::kPut;
      m.region = op->region;
      m.offset = op->offset;
      m.size = op->size;
      if (!op->has_signal) m.signal_region = kNoRegion;
      if (send_to(c, op->peer, m, read ? read : op->host_source ? op->host_source : op->staging, op->size))
        return true;
      return peer_gone(c, op->peer) && dropped_past_lost_peer(c);  // as above
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

using Clock = std::chrono::steady_clock;

// The unkind mode's random choices. Called with x->lock held.
uint64_t draw(Context* x, uint64_t n) { return n > 1 ? x->random() % n : 0; }
bool coin(Context* x) { return (x->random() & 1) != 0; }
Clock::duration random_delay(Context* x) {
  return std::chrono::microseconds(draw(x, static_cast<uint64_t>(x->comm->unkind.delay.count()) + 1));
}

// Sets the outcome of a put's request, once. Called with x->lock held.
void complete(Context* x, Op* request, Clock::time_point now) {
  if (request->completed) return;
  request->completed = true;
  if (request->undelivered > 0) counters[kCompletedBeforeDelivery]++;
  if (x->comm->unkind.has(kBackpressure) && coin(x)) {
    request->release_at = now + random_delay(x);  // before state: test() reads it after state
    counters[kCompletionsHeld]++;
  }
  request->state.store(request->failed ? -1 : 1, std::memory_order_release);
}

// Queues a copy out of GPU memory that start_copy left for later (kLateRead). Called with x->lock held.
bool queue_copy(Context* x, Op* op, Clock::time_point now) {
  Comm* c = x->comm;
  op->copy_waiting = false;
  op->copy_started = op->copy_queued = now;
  return cuda_ok(c, cudaMemcpyAsync(op->copy_to, op->copy_source, op->size, cudaMemcpyDefault, op->stream),
                 "cudaMemcpyAsync") &&
         cuda_ok(c, cudaEventRecord(op->event, op->stream), "cudaEventRecord");
}

// A put whose source changed after it was read: counted, and said on stderr (the first ten per
// context). Called with x->lock held.
void report_changed_source(Context* x, Op* op) {
  Comm* c = x->comm;
  counters[kSourcesChanged]++;
  if (x->sources_changed_said++ < 10)
    WARN(c, "rank %d: the source of a put of %zu bytes to rank %d (region %lu, offset %lu) changed after the "
         "transport read it and before the put completed: a kernel rewrote a put's source before a flush said it "
         "could be reused (a NIC that sends it again sends the new bytes)", c->rank, op->size, op->peer,
         (unsigned long)op->region, (unsigned long)op->offset);
}

// kReread: reads the op's source again and compares it with what was read. A source in GPU memory
// is read on the op's stream into a second pinned staging chunk (pinned: a copy into pageable
// memory would hold this thread until the stream gets to it); without a chunk or a copy event
// free, or for a copy made straight into its destination, the op goes unchecked. True once done.
// Called with x->lock held.
bool check_source(Context* x, Op* op) {
  Comm* c = x->comm;
  if (!c->unkind.has(kReread) || op->size == 0 || op->failed) return true;
  if (!op->bytes.empty()) {
    if (std::memcmp(op->bytes.data(), op->source, op->size) != 0) report_changed_source(x, op);
    return true;
  }
  if (!op->staging) return true;
  if (!op->reread_event) {
    if (x->events.empty()) return true;
    op->reread = pool_get(c);
    if (!op->reread) return true;
    op->reread_event = x->events.back();
    x->events.pop_back();
    if (cuda_ok(c, cudaMemcpyAsync(op->reread, op->copy_source, op->size, cudaMemcpyDefault, op->stream),
                "cudaMemcpyAsync(reading a source again)") &&
        cuda_ok(c, cudaEventRecord(op->reread_event, op->stream), "cudaEventRecord"))
      return false;
    x->events.push_back(op->reread_event);  // the communicator failed; the chunk is not reused
    op->reread_event = nullptr;
    op->reread = nullptr;
    return true;
  }
  const cudaError_t e = cudaEventQuery(op->reread_event);
  if (e == cudaErrorNotReady) return false;
  x->events.push_back(op->reread_event);
  op->reread_event = nullptr;
  if (cuda_ok(c, e, "reading a source again") && std::memcmp(op->reread, op->staging, op->size) != 0)
    report_changed_source(x, op);
  pool_put(c, op->reread);
  op->reread = nullptr;
  return true;
}

// Moves the op's read of its source on as far as it goes now, then (when `check`) its kReread;
// true once both are done. `behind`: the ops queued behind it, for report_stalled_copy. Called
// with x->lock held.
bool settle(Context* x, Op* op, Clock::time_point now, size_t behind, bool check) {
  Comm* c = x->comm;
  if (!op->read) {
    if (now < op->read_at) return false;
    if (op->copy_waiting && !queue_copy(x, op, now)) op->failed = true;
    if (op->event && !op->failed) {
      const cudaError_t e = cudaEventQuery(op->event);
      if (e == cudaErrorNotReady) {
        if (op->staging && c->requeue_after.count() > 0 && now - op->copy_queued > c->requeue_after)
          requeue_copy(x, op, now);
        if (!op->copy_stall_reported && now - op->copy_started > c->stall_report_after)
          report_stalled_copy(c, op, now, behind);
        return false;
      }
      if (!cuda_ok(c, e, "a transport copy")) op->failed = true;
    }
    if (op->event) {
      x->events.push_back(op->event);
      op->event = nullptr;
    }
    if (!op->bytes.empty()) std::memcpy(op->bytes.data(), op->source, op->size);
    op->read = true;
    if (c->unkind.has(kEarlyCompletion)) op->deliver_at = now + random_delay(x);
  }
  if (!op->checked) {
    if (!check || !check_source(x, op)) return false;
    op->checked = true;
    if (Op* r = op->request) {
      r->failed = r->failed || op->failed;
      if (--r->unread == 0 && c->unkind.has(kEarlyCompletion)) complete(x, r, now);
    }
  }
  return true;
}

// Whether the op at `position` of its queue may deliver before the ops ahead of it: a put's last
// op (its request) waits for the put's other ops; without the unkind mode's reordering every op
// waits for those ahead; with it a weak signal (kWeakOvertake) and data without a signal
// (kPieces) may go first. Nothing passes a strong signal (the caller stops there).
bool may_go(const Unkind& u, const Op* op, size_t position) {
  if (op->request == op && op->undelivered > 1) return false;
  if (position == 0) return true;
  if (op->has_signal) return !op->strong && u.has(kWeakOvertake);
  return u.has(kPieces);
}

// Delivers the op (taken off its queue) and counts it for its put. Called with x->lock held.
void finish(Context* x, Op* op, Clock::time_point now) {
  Comm* c = x->comm;
  const bool ok = !op->failed && deliver(c, op);
  TRACE("rank %d deliver peer %d size %zu ok %d req %p", c->rank, op->peer, op->size, ok,
        static_cast<void*>(op->request));
  release_staging(x, op);
  if (Op* r = op->request) {
    r->failed = r->failed || !ok;
    if (--r->undelivered == 0) complete(x, r, now);
  }
  release_op(op);  // the queue's hold
}

}  // namespace

void release_op(Op* op) {
  if (op->holders.fetch_sub(1, std::memory_order_acq_rel) == 1) delete op;
}

void progress(Context* x) {
  CopyContextScope scope(x->comm);
  Comm* c = x->comm;
  const Unkind& u = c->unkind;
  std::lock_guard<std::mutex> g(x->lock);
  if (!x->parked.empty()) reclaim_parked(x);
  const Clock::time_point now = Clock::now();
  // Under the unkind mode every op's source is read when its time comes, not only the first's.
  if (u.on)
    for (auto& queue : x->queues)
      for (Op* op : queue) settle(x, op, now, 0, u.has(kEarlyCompletion));
  for (size_t q = 0; q < x->queues.size(); q++) {
    auto& queue = x->queues[q];
    // kStarve: a queue not starving starts to, one call in four, for up to the delay.
    if (u.has(kStarve) && now >= x->starved_until[q] && draw(x, 4) == 0)
      x->starved_until[q] = now + random_delay(x);
    if (now < x->starved_until[q]) continue;
    if (!u.reorders()) {
      while (!queue.empty()) {
        Op* op = queue.front();
        if (!may_go(u, op, 0) || !settle(x, op, now, queue.size() - 1, true) || now < op->deliver_at) break;
        queue.pop_front();
        finish(x, op, now);
      }
      continue;
    }
    std::vector<size_t> ready;
    while (true) {
      ready.clear();
      for (size_t i = 0; i < queue.size(); i++) {
        Op* op = queue[i];
        if (i > 0 && op->has_signal && op->strong) break;
        if (may_go(u, op, i) && settle(x, op, now, 0, true) && now >= op->deliver_at) ready.push_back(i);
      }
      if (ready.empty()) break;
      const size_t pick = ready[draw(x, ready.size())];
      if (pick > 0) counters[kDeliveredOutOfOrder]++;
      Op* op = queue[pick];
      queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(pick));
      finish(x, op, now);
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
// to wait on; under kLateRead only takes the event and leaves the copy to settle(), a random
// while later.
bool start_copy(Context* x, Op* op, void* to, const void* from, size_t bytes) {
  Comm* c = x->comm;
  const bool late = c->unkind.has(kLateRead);
  bool got = wait_to_take(x, "copy event", [&] {
    std::lock_guard<std::mutex> g(x->lock);
    if (x->events.empty()) return false;
    op->event = x->events.back();
    x->events.pop_back();
    op->stream = x->streams[x->peer_stream[op->peer]];
    if (late) op->read_at = std::chrono::steady_clock::now() + random_delay(x);
    return true;
  });
  op->copy_to = static_cast<char*>(to);
  op->copy_source = static_cast<const char*>(from);
  op->copy_started = op->copy_queued = std::chrono::steady_clock::now();
  if (got && late) {
    op->copy_waiting = true;
    return true;
  }
  return got && cuda_ok(c, cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, op->stream), "cudaMemcpyAsync") &&
         cuda_ok(c, cudaEventRecord(op->event, op->stream), "cudaEventRecord");
}

// Where a put is cut into pieces: the offsets where pieces start, 0 first. Staged puts travel in
// pieces of at most kChunkBytes; kPieces cuts every put of 2 bytes or more into 2 to 4 besides.
std::vector<uint64_t> piece_starts(Context* x, Route route, size_t size) {
  std::vector<uint64_t> starts{0};
  if (route == Route::kStaged)
    for (uint64_t at = kChunkBytes; at < size; at += kChunkBytes) starts.push_back(at);
  if (x->comm->unkind.has(kPieces) && size >= 2) {
    std::lock_guard<std::mutex> g(x->lock);
    const uint64_t cuts = 1 + draw(x, 3);
    for (uint64_t i = 0; i < cuts; i++) starts.push_back(1 + draw(x, size - 1));
  }
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  return starts;
}

}  // namespace

rmaResult_t enqueue(Context* x, int context, uint64_t src_off, Region* src, size_t size, uint64_t dst_off,
                    Region* dst, uint32_t peer, Region* signal, uint64_t signal_off, uint64_t signal_delta,
                    bool strong, void** request) {
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
  if (static_cast<int>(peer) != c->rank && peer_gone(c, static_cast<int>(peer))) {
    // Dropped, and done at once (a null request is done), or refused: see deliver.
    TRACE("rank %d drop ctx %d peer %u size %zu: the peer is gone", c->rank, context, peer, size);
    return dropped_past_lost_peer(c) ? rmaSuccess : rmaRemoteError;
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
  const Unkind& u = c->unkind;
  const int index = context * c->nranks + static_cast<int>(peer);
  Route route = static_cast<int>(peer) == c->rank ? Route::kLocal
                : (size == 0 || dst->peer_base[peer]) ? Route::kMapped
                                                      : Route::kStaged;
  // One op per piece (staged chunks; kPieces' cuts), and under kPieces one more for the signal,
  // after them. Each joins the queue as soon as its copy is under way, so that a put larger than
  // the staging pool delivers its first chunks while later ones wait. The last op is the request.
  const std::vector<uint64_t> starts = size > 0 ? piece_starts(x, route, size) : std::vector<uint64_t>{0};
  const bool signal_apart = signal && u.has(kPieces) && size > 0;
  const size_t count = starts.size() + (signal_apart ? 1 : 0);
  std::vector<Op*> ops(count);
  for (Op*& op : ops) op = new Op;
  Op* last = ops.back();
  last->holders = 2;  // the queue and NCCL
  last->undelivered = last->unread = static_cast<int>(count);
  for (size_t i = 0; i < count; i++) {
    Op* op = ops[i];
    op->context = x;
    op->route = route;
    op->peer = static_cast<int>(peer);
    op->request = last;
    op->region = dst ? dst->seq : 0;
    if (i < starts.size()) {
      op->offset = dst_off + starts[i];
      op->size = (i + 1 < starts.size() ? starts[i + 1] : size) - starts[i];
    }
  }
  if (signal) {
    last->has_signal = true;
    last->strong = strong;
    last->signal_region = signal->seq;
    last->signal_offset = signal_off;
    last->signal_delta = signal_delta;
  }
  // Under the unkind mode a source in host memory is read into the op (when its time comes), not
  // at delivery, so that a late read, a second read and an early completion have their meaning.
  const bool read_host = u.on != 0;
  for (size_t i = 0; i < count; i++) {
    Op* op = ops[i];
    const uint64_t at = i < starts.size() ? starts[i] : 0;
    const size_t bytes = op->size;
    bool ok = true;
    if (u.has(kBackpressure))  // a tiny queue: wait for room
      ok = wait_to_take(x, "place in a full queue", [&] {
        std::lock_guard<std::mutex> g(x->lock);
        return x->queues[index].size() < kUnkindQueueLimit;
      });
    const char* from = src && bytes > 0 ? src->base + src_off + at : nullptr;
    if (ok && from && (route == Route::kStaged || (!src->on_device && !dst->on_device)) && !src->on_device &&
        read_host) {
      op->source = from;
      op->bytes.resize(bytes);
      if (u.has(kLateRead)) {
        std::lock_guard<std::mutex> g(x->lock);
        op->read_at = std::chrono::steady_clock::now() + random_delay(x);
      }
    }
    if (!ok) {
    } else if (route == Route::kStaged) {
      if (!from) {
      } else if (!src->on_device) {
        op->host_source = from;
      } else {
        ok = wait_to_take(x, "staging chunk", [&] { return (op->staging = pool_get(c)) != nullptr; }) &&
             start_copy(x, op, op->staging, from, bytes);
      }
      if (from) {
        counters[kPutsStaged] += i == 0;  // a put counts once, whatever pieces it travels in
        counters[kBytesStaged] += bytes;
      }
    } else if (from) {
      char* to = (route == Route::kLocal ? dst->base : dst->peer_base[peer]) + op->offset;
      if (!src->on_device && !dst->on_device) {
        op->local_destination = to;
        op->local_source = from;
      } else {
        ok = start_copy(x, op, to, from, bytes);
      }
      counters[route == Route::kLocal ? kPutsLocal : kPutsMapped] += i == 0;
      if (route == Route::kMapped) counters[kBytesMapped] += bytes;
    }
    if (!ok) {
      // Ops already queued still deliver (their data, no signal, for no request); the request fails.
      std::lock_guard<std::mutex> g(x->lock);
      for (Op* queued : x->queues[index])
        if (queued->request == last) queued->request = nullptr;
      for (size_t j = i; j < count; j++) {
        if (ops[j]->event) x->events.push_back(ops[j]->event);
        pool_put(c, ops[j]->staging);
        delete ops[j];
      }
      return rmaUnhandledCudaError;
    }
    std::lock_guard<std::mutex> g(x->lock);
    x->queues[index].push_back(op);
  }
  TRACE("rank %d enqueue ctx %d peer %u route %d size %zu src %lu+%lu dst %lu+%lu signal %ld+%lu +%lu %s ops %zu "
        "req %p", c->rank, context, peer, static_cast<int>(route), size, (unsigned long)(src ? src->seq : 0),
        (unsigned long)src_off, (unsigned long)(dst ? dst->seq : 0), (unsigned long)dst_off,
        signal ? (long)signal->seq : -1L, (unsigned long)signal_off, (unsigned long)signal_delta,
        strong ? "strong" : "weak", count, static_cast<void*>(last));
  *request = last;
  return rmaSuccess;
}

}  // namespace jaxgin::transport::detail
