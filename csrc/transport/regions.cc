// Symmetric registration: every rank registers the same regions in the same order; ranks on the same
// host map each other's device regions through cuMem IPC (puts into the others travel through their
// owner), and the own CUDA context's reach into each region is checked.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <string>
#include <vector>

#include "transport_internal.h"

namespace jaxgin::transport::detail {
namespace {

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

}  // namespace

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

}  // namespace jaxgin::transport::detail
