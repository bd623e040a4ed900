// The C ABI that frees a heap region (jaxgin_heap_clear), and finalize()'s meeting before the heaps
// are released (jaxgin_runtime_settle). Freeing waits for this process's GPU work, meets
// every rank (kernels/heap_settle.h: every earlier put to this rank, on any GIN context, has
// landed), zeroes the region, and meets every rank again (no rank reuses the region before every
// rank has zeroed its copy). Free heap bytes are zero (jaxgin/heap.py); a put landing after the
// zeroing would break that, so the zeroing waits for the peers. Every rank frees in the same
// order, so the meetings pair up; one that never comes ends in the barrier's bounded wait.
// Beside the FFI handlers, above the runtime and the kernels: it launches kernels on the runtime's GPUs.
#include <algorithm>
#include <string>

#include "../kernels/heap_settle.h"
#include "../runtime/errors.h"
#include "../runtime/runtime.h"

namespace {

// One barrier CTA per GIN context (one without GIN): each settles its own context's puts.
int settle_ctas(const jaxgin_context& c) { return std::max(c.gin_contexts, 1); }

// Enqueues GPU `s`'s part of the meeting of every rank (kernels/heap_settle.h).
cudaError_t launch_meeting(jaxgin::DeviceState& s) {
  return jaxgin::launch_heap_settle(s.context, settle_ctas(s.host_context), s.stream);
}

// What failed on GPU `s`: its fault record, or CUDA's error `e` when it recorded none.
std::string gpu_failure(const char* what, const jaxgin::DeviceState& s, cudaError_t e) {
  std::string fault = jaxgin::describe_fault(s);
  return std::string(what) + " on CUDA device " + std::to_string(s.device) + " failed: " +
         (fault.empty() ? jaxgin::cuda_error_text(e) : fault);
}

// Runs `enqueue` on every GPU of the runtime, then waits for all of them; the first GPU whose
// work failed is named.
template <typename Enqueue>
void on_every_gpu(jaxgin_runtime* rt, const char* what, Enqueue enqueue) {
  for (auto& s : rt->devices) {
    JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
    JAXGIN_CUDA(enqueue(s), s.device);
  }
  std::string failure;
  for (auto& s : rt->devices) {
    JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
    cudaError_t e = cudaStreamSynchronize(s.stream);
    if (e != cudaSuccess && failure.empty()) failure = gpu_failure(what, s, e);
  }
  if (!failure.empty()) throw jaxgin::DeviceFaultError(failure);
}

// The barrier needs one slot per CTA; `what` names the collective that asked for it.
void check_barrier_slots(jaxgin_runtime* rt, const char* what) {
  for (auto& s : rt->devices) {
    const jaxgin_context& c = s.host_context;
    if ((uint32_t)settle_ctas(c) > c.barrier_slots)
      throw jaxgin::Error(std::string(what) + " meets every rank with one barrier CTA per GIN context (" +
                          std::to_string(settle_ctas(c)) + "), but only " + std::to_string(c.barrier_slots) +
                          " barrier slots exist: initialize with barrier_slots >= " + std::to_string(settle_ctas(c)));
  }
}

// Every kernel enqueued by XLA or the user on streams of their own finishes first, then every rank
// meets (kernels/heap_settle.h): what any rank sent to this one before the meeting has landed.
void settle(jaxgin_runtime* rt, const std::string& what, const std::string& meeting) {
  for (auto& s : rt->devices) {
    JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) throw jaxgin::DeviceFaultError(gpu_failure((what + ": the work before it").c_str(), s, e));
  }
  on_every_gpu(rt, meeting.c_str(), launch_meeting);
}

}  // namespace

extern "C" int jaxgin_heap_clear(jaxgin_runtime* rt, uint64_t offset, uint64_t bytes) {
  return jaxgin::c_api([&] {
    for (auto& s : rt->devices) {
      const jaxgin_context& c = s.host_context;
      if (offset < c.user_offset || offset + bytes > c.heap_bytes)
        throw jaxgin::Error("heap range [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                            ") is outside the user heap");
    }
    check_barrier_slots(rt, "freeing a heap region");
    const std::string order = " (every rank frees its heap buffers in the same order)";
    settle(rt, "freeing a heap region", "freeing a heap region: the barrier before zeroing it" + order);
    on_every_gpu(rt, "freeing a heap region: zeroing it", [&](jaxgin::DeviceState& s) {
      return cudaMemsetAsync(static_cast<char*>(s.heap) + offset, 0, bytes, s.stream);
    });
    on_every_gpu(rt, ("freeing a heap region: the barrier after zeroing it" + order).c_str(), launch_meeting);
  });
}

extern "C" int jaxgin_runtime_settle(jaxgin_runtime* rt) {
  return jaxgin::c_api([&] {
    check_barrier_slots(rt, "finalize()");
    settle(rt, "finalize()", "finalize(): the barrier before releasing the heaps (every rank calls finalize())");
  });
}
