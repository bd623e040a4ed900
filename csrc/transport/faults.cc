// What the host transport keeps for jaxgin's fault handling: the ranks whose process it saw end,
// and the parking of NCCL's GIN proxy threads after a device fault. jaxgin reads and asks for them
// through plugin.cc's jaxgin_transport_lost_peers and jaxgin_transport_park_proxy_threads.
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "transport_internal.h"

namespace jaxgin::transport::detail {

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

// Never destroyed: a thread may leave (and count itself out) while the process exits.
ProxyThreads& proxy_threads() {
  static ProxyThreads* t = new ProxyThreads;
  return *t;
}

namespace {

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

}  // namespace

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

}  // namespace jaxgin::transport::detail
