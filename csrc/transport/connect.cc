// A communicator's connections: listening (the address a rank publishes), connecting every rank to
// every peer with the resources the communicator makes then (the agent thread, the receiving side's
// CUDA resources, staging chunks, its own CUDA context), and closing it all again.
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "transport_internal.h"

namespace jaxgin::transport::detail {

rmaResult_t plugin_listen(void* ctx, int /*dev: there is one*/, void* handle, void** listen_comm) {
  auto* l = new Listener{static_cast<Plugin*>(ctx), {}, -1, -1};
  std::string error;
  if (!listen_on(l->address, l->tcp_fd, l->unix_fd, error)) {
    log_message(l->plugin->log, RMA_LOG_WARN, __FILE__, __LINE__, "listen failed: %s", error.c_str());
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

namespace {

void close_comm_fds(Comm* c) {
  for (int fd : c->out)
    if (fd >= 0) close(fd);
  for (int fd : c->in)
    if (fd >= 0) close(fd);
  for (int fd : c->wake)
    if (fd >= 0) close(fd);
}

}  // namespace

rmaResult_t plugin_connect(void* /*see below*/, void* handles[], int nranks, int rank, void* listen_comm, void** coll_comm) {
  auto* l = static_cast<Listener*>(listen_comm);
  auto* c = new Comm;
  // Not from `ctx`: NCCL 2.32 passes its NET plugin's context here, not the one init() made for
  // this plugin (reading a logger through it crashed a second initialize()). The listener was
  // made from the right one.
  c->log = l->plugin->log;
  c->rank = rank;
  c->nranks = nranks;
  std::string setting_error;
  const std::string copy_context = copy_context_mode(setting_error);
  c->fail_past_lost_peers = peer_loss_mode(setting_error) == "fail";
  if (setting_error.empty()) read_unkind(c->unkind, setting_error);
  if (!setting_error.empty()) {
    WARN(c, "rank %d: %s", rank, setting_error.c_str());
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
    // A peer that stops reading (its process stopped, not ended: no goodbye, no end of stream)
    // must not hold NCCL's proxy thread in a send for good: after the connect timeout the send
    // fails and the peer counts as gone (send.cc, send_to and deliver).
    const int ms = connect_timeout_ms();
    timeval limit{ms / 1000, (ms % 1000) * 1000};
    setsockopt(c->out[p], SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
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
  if (c->unkind.on) {
    std::string names;
    for (int i = 0; i < kUnkindCount; i++)
      if (c->unkind.on & (1u << i)) names += std::string(names.empty() ? "" : ",") + kUnkindNames[i];
    INFO(c, "rank %d: unkind mode %s, seed %lu, delays up to %ld us", rank, names.c_str(),
         (unsigned long)c->unkind.seed, (long)c->unkind.delay.count());
  }
  *coll_comm = c;
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

}  // namespace jaxgin::transport::detail
