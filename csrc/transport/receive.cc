// The receiving side of the host transport: the agent thread that reads what peers send (their
// registrations, staged puts and signals), copies staged puts in through pinned buffers and applies
// signals in stream order after the data.
#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport_internal.h"

namespace jaxgin::transport::detail {
namespace {

Region* find_region(Comm* c, uint64_t seq) {
  std::lock_guard<std::mutex> g(c->lock);
  return seq < c->regions.size() ? c->regions[seq] : nullptr;
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

}  // namespace

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

bool apply_signal(Comm* c, uint64_t region, uint64_t offset, uint64_t delta) {
  std::lock_guard<std::mutex> g(c->apply_lock);
  return apply_signal_locked(c, region, offset, delta);
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

}  // namespace jaxgin::transport::detail
