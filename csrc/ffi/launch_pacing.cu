// Launch pacing: XLA's thread never gets more than a few jaxgin calls ahead of the GPU while a CPU
// thread carries the GPU's puts (NCCL's proxy GIN backend).
//
// Why. XLA enqueues a loop whose trip count it knows without waiting for the GPU, so its thread
// runs far ahead of a jaxgin kernel that spins for a peer's put. Once CUDA's queue for the stream
// is full, the launching call (cuLaunchHostFunc, cuLaunchKernel, cuGraphLaunch) waits inside the
// driver for the GPU while holding a driver lock. The thread that must apply the awaited put on
// this GPU (jaxgin's host transport copying a received payload in, cuMemcpyHtoDAsync) then waits
// for that lock: the kernel waits for the copy, the copy for the lock, the lock for the kernel.
// Seen on one H100 with emulated hosts (stacks of both threads, 2026-11-25): the 172nd put of an
// 8 KiB mailbox loop never applied, at worlds 2, 4 and 8.
//
// How. After each jaxgin launch on a stream, an event is recorded; before the handler returns, it
// waits (on the host, holding no CUDA lock) until the launch `depth` calls back has finished. The
// GPU runs a stream's calls in order, so that launch never depends on a later one of this stream
// and the wait adds no cycle. A kernel that failed (a timed-out wait traps) makes the wait end with
// the fault named, so XLA's thread reports it at the next jaxgin call instead of queueing more.
// Streams being captured into a CUDA graph are left alone (their launches do not run yet).
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace jaxgin::ffi_support {
namespace {

// $JAXGIN_MAX_QUEUED_CALLS: how many jaxgin calls XLA's thread may have queued ahead of the GPU
// per stream (0: unpaced). Eight keeps a loop's GPU busy (each call is tens of microseconds of GPU
// time, the host wakes within one) and CUDA's queue far from full.
int queue_depth() {
  static const int depth = [] {
    const char* v = std::getenv("JAXGIN_MAX_QUEUED_CALLS");
    if (v == nullptr || *v == '\0') return kDefaultMaxQueuedCalls;
    long n = 0;
    bool digits = true;
    for (const char* c = v; *c != '\0' && digits; c++) {
      digits = *c >= '0' && *c <= '9';
      n = n * 10 + (*c - '0');
      if (n > kMaxQueuedCallsLimit) digits = false;
    }
    if (!digits)
      throw Error("$JAXGIN_MAX_QUEUED_CALLS must be an integer from 0 to " + std::to_string(kMaxQueuedCallsLimit) +
                  ", got '" + v + "'");
    return static_cast<int>(n);
  }();
  return depth;
}

struct LaunchPacing : OpState {
  struct Ring {
    std::vector<cudaEvent_t> events;  // one per queued call; slot i % size holds call i's
    uint64_t calls = 0;
  };
  std::mutex lock;
  std::map<cudaStream_t, Ring> rings;

  std::string release() override {
    std::string error;
    for (auto& [stream, ring] : rings)
      for (cudaEvent_t e : ring.events)
        if (cudaEventDestroy(e) != cudaSuccess && error.empty()) error = "cudaEventDestroy(launch pacing) failed";
    rings.clear();
    return error;
  }
};

// Returns once `event` completed; throws naming the device fault if the GPU work before it failed.
void wait_for(const DeviceState& s, cudaEvent_t event, const char* op) {
  for (int polls = 0;; polls++) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      const std::string fault = describe_fault(s);
      throw Error(std::string(op) + ": an earlier jaxgin call on this stream failed on CUDA device " +
                  std::to_string(s.device) + " (" + cuda_error_text(e) + ")" +
                  (fault.empty() ? std::string() : ": " + fault));
    }
    // Spin briefly (a call near its end), then sleep: this thread holds nothing the GPU needs.
    if (polls < 256)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

void pace_launches(DeviceState& s, cudaStream_t stream, const char* op) {
  if (s.gin_type != kGinTypeProxy) return;  // no CPU thread between the GPU and its peers
  const int depth = queue_depth();
  if (depth == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_launch(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing", s.device);
  if (capture != cudaStreamCaptureStatusNone) return;
  LaunchPacing& pacing = op_state<LaunchPacing>(s, "launch_pacing");
  // XLA uses one thread per stream at a time; the lock guards the map against other streams.
  std::lock_guard<std::mutex> g(pacing.lock);
  LaunchPacing::Ring& ring = pacing.rings[stream];
  if (ring.events.empty()) {
    ring.events.resize(depth, nullptr);
    for (cudaEvent_t& e : ring.events)
      check_launch(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating a launch-pacing event", s.device);
  }
  cudaEvent_t slot = ring.events[ring.calls % ring.events.size()];
  // The slot last marked the call `depth` back: once it finished, at most depth calls are queued.
  if (ring.calls >= ring.events.size()) wait_for(s, slot, op);
  check_launch(cudaEventRecord(slot, stream), "recording a launch-pacing event", s.device);
  ring.calls++;
}

}  // namespace jaxgin::ffi_support
