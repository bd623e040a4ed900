// Definitions of the extern "C" device functions declared in jaxgin_device.h. Built as relocatable
// device code (PTX and cubin) so that Triton kernels and others can link against it.
#include "jaxgin_device.h"
#include "jaxgin_triton.h"
#include "impl/barrier__funcs.h"
#include "impl/put__funcs.h"

namespace {
__device__ __forceinline__ const jaxgin_context* as_context(const void* ctx) {
  return static_cast<const jaxgin_context*>(ctx);
}
}  // namespace

extern "C" {

__device__ int jaxgin_rank(const void* ctx) { return as_context(ctx)->rank; }

__device__ int jaxgin_world_size(const void* ctx) { return as_context(ctx)->world_size; }

__device__ void* jaxgin_local_ptr(const void* ctx, uint64_t offset) {
  return as_context(ctx)->heap + offset;
}

__device__ uint64_t jaxgin_heap_offset(const void* ctx, const void* local_ptr) {
  return static_cast<uint64_t>(static_cast<const char*>(local_ptr) - as_context(ctx)->heap);
}

__device__ void* jaxgin_peer_ptr(const void* ctx, uint64_t offset, int peer) {
  const jaxgin_context* c = as_context(ctx);
  if (peer < 0 || peer >= c->world_size || !jaxgin::is_lsa_peer(c, peer)) return nullptr;
  return ncclGetPeerPointer(c->window, offset, peer);
}

__device__ void jaxgin_put_signal(const void* ctx, uint64_t dst_offset, uint64_t src_offset,
                                  uint64_t bytes, int peer, uint32_t signal) {
  __syncthreads();  // the CTA's own stores to the source (any thread, any layout) precede the copy
  jaxgin::put_signal(as_context(ctx), dst_offset, src_offset, bytes, peer, signal, JAXGIN_OP_DEVICE_CALL);
}

__device__ void jaxgin_signal(const void* ctx, int peer, uint32_t signal, uint64_t value) {
  const jaxgin_context* c = as_context(ctx);
  __syncthreads();
  if (jaxgin::linear_thread() == 0) {
    jaxgin::check_peer(c, peer, JAXGIN_OP_DEVICE_CALL);
    jaxgin::check_signal(c, signal, c->signal_count, JAXGIN_OP_DEVICE_CALL);
    jaxgin::add_signal(c, peer, signal, value);
  }
}

__device__ uint64_t jaxgin_read_signal(const void* ctx, uint32_t signal) {
  return jaxgin::read_signal(as_context(ctx), signal);
}

__device__ void jaxgin_wait_signal(const void* ctx, uint32_t signal, uint64_t value) {
  const jaxgin_context* c = as_context(ctx);
  if (jaxgin::linear_thread() == 0) {
    jaxgin::check_signal(c, signal, c->signal_count, JAXGIN_OP_DEVICE_CALL);
    jaxgin::wait_until(c, signal, value, JAXGIN_OP_DEVICE_CALL, -1);
  }
  __syncthreads();
}

__device__ void jaxgin_wait_signal_arrivals(const void* ctx, uint32_t signal, uint64_t count) {
  const jaxgin_context* c = as_context(ctx);
  if (jaxgin::linear_thread() == 0) {
    jaxgin::check_signal(c, signal, c->signal_count, JAXGIN_OP_DEVICE_CALL);
    jaxgin::wait_arrivals(c, signal, count, JAXGIN_OP_DEVICE_CALL, -1);
  }
  __syncthreads();
}

__device__ void jaxgin_flush(const void* ctx) { jaxgin::flush(as_context(ctx)); }

__device__ void jaxgin_barrier(const void* ctx) { jaxgin::barrier(as_context(ctx)); }

// Triton entry points (jaxgin_triton.h).

__device__ int64_t jaxgin_tt_peer_delta(const void* ctx, int peer) {
  const jaxgin_context* c = as_context(ctx);
  if (peer < 0 || peer >= c->world_size || !jaxgin::is_lsa_peer(c, peer))
    jaxgin::fail(c, JAXGIN_FAULT_NOT_LSA_PEER, JAXGIN_OP_DEVICE_CALL, peer, 0, 0, 0);
  return static_cast<char*>(ncclGetPeerPointer(c->window, 0, peer)) - c->heap;
}

__device__ int32_t jaxgin_tt_gin_peer(const void* ctx, int peer) {
  const jaxgin_context* c = as_context(ctx);
  if (peer < 0 || peer >= c->world_size)
    jaxgin::fail(c, JAXGIN_FAULT_BAD_ARGUMENT, JAXGIN_OP_DEVICE_CALL, peer, 0, (uint64_t)c->world_size, (uint64_t)peer);
  return peer != c->rank && jaxgin::routes_through_gin(c, peer) ? 1 : 0;
}

__device__ int32_t jaxgin_tt_put_signal(const void* ctx, const void* dst, const void* src, uint64_t bytes,
                                        int peer, uint32_t signal) {
  const jaxgin_context* c = as_context(ctx);
  const uint64_t dst_offset = jaxgin_heap_offset(ctx, dst), src_offset = jaxgin_heap_offset(ctx, src);
  // Offsets of addresses below the heap wrap around to huge values, so one bound covers both sides.
  for (uint64_t offset : {dst_offset, src_offset}) {
    if (offset > c->heap_bytes || bytes > c->heap_bytes - offset)
      jaxgin::fail(c, JAXGIN_FAULT_HEAP_RANGE, JAXGIN_OP_DEVICE_CALL, peer, signal, c->heap_bytes, offset + bytes);
  }
  jaxgin_put_signal(ctx, dst_offset, src_offset, bytes, peer, signal);
  return 0;
}

__device__ int32_t jaxgin_tt_signal(const void* ctx, int peer, uint32_t signal, uint64_t value) {
  jaxgin_signal(ctx, peer, signal, value);
  return 0;
}

__device__ uint64_t jaxgin_tt_wait_signal(const void* ctx, uint32_t signal, uint64_t value) {
  jaxgin_wait_signal(ctx, signal, value);
  return jaxgin_read_signal(ctx, signal);
}

__device__ uint64_t jaxgin_tt_wait_arrivals(const void* ctx, uint32_t signal, uint64_t count) {
  jaxgin_wait_signal_arrivals(ctx, signal, count);
  return as_context(ctx)->consumed[signal];
}

namespace {
// Heap offset of a flag word, or a fault: flags must be 8-byte aligned words inside the heap.
__device__ uint64_t flag_offset(const jaxgin_context* c, const void* flag, int peer) {
  const uint64_t offset = jaxgin_heap_offset(c, flag);
  if (offset > c->heap_bytes - 8 || offset % 8 != 0)
    jaxgin::fail(c, JAXGIN_FAULT_HEAP_RANGE, JAXGIN_OP_DEVICE_CALL, peer, 0, c->heap_bytes, offset + 8);
  return offset;
}
}  // namespace

__device__ int32_t jaxgin_tt_set_flag(const void* ctx, const void* flag, uint64_t value, int peer) {
  const jaxgin_context* c = as_context(ctx);
  __syncthreads();  // every thread's stores precede thread 0's release below
  if (jaxgin::linear_thread() == 0) {
    const uint64_t offset = flag_offset(c, flag, peer);
    if (peer < 0 || peer >= c->world_size || !jaxgin::is_lsa_peer(c, peer))
      jaxgin::fail(c, JAXGIN_FAULT_NOT_LSA_PEER, JAXGIN_OP_DEVICE_CALL, peer, 0, 0, 0);
    uint64_t* remote = static_cast<uint64_t*>(ncclGetPeerPointer(c->window, offset, peer));
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*remote).store(value, cuda::memory_order_release);
  }
  return 0;
}

namespace {
// One thread polls `word` until it reaches `value` (acquire), bounded by the runtime's timeout.
__device__ uint64_t poll_flag(const jaxgin_context* c, uint64_t* word, uint64_t value, uint64_t offset, int peer) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system> ref(*word);
  uint64_t seen, deadline = 0;
  for (uint32_t polls = 1; (seen = ref.load(cuda::memory_order_acquire)) < value; polls++) {
    if (polls % jaxgin::kClockPolls != 0) continue;
    const uint64_t now = jaxgin::clock_ns();
    if (deadline == 0) deadline = now + c->timeout_ns;
    else if (now > deadline)
      jaxgin::fail(c, JAXGIN_FAULT_FLAG_TIMEOUT, JAXGIN_OP_DEVICE_CALL, peer, (uint32_t)(offset / 8), value, seen);
  }
  return seen;
}
}  // namespace

__device__ uint64_t jaxgin_tt_wait_flag(const void* ctx, const void* flag, uint64_t value) {
  const jaxgin_context* c = as_context(ctx);
  if (jaxgin::linear_thread() == 0) {
    const uint64_t offset = flag_offset(c, flag, -1);
    poll_flag(c, reinterpret_cast<uint64_t*>(c->heap + offset), value, offset, -1);
  }
  __syncthreads();
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*const_cast<uint64_t*>(
             static_cast<const uint64_t*>(flag))).load(cuda::memory_order_relaxed);
}

__device__ uint64_t jaxgin_tt_wait_peer_flag(const void* ctx, const void* flag, uint64_t value, int peer) {
  const jaxgin_context* c = as_context(ctx);
  // Every thread checks (the first to fail records the fault), since every thread reads the peer below.
  if (peer < 0 || peer >= c->world_size || !jaxgin::is_lsa_peer(c, peer))
    jaxgin::fail(c, JAXGIN_FAULT_NOT_LSA_PEER, JAXGIN_OP_DEVICE_CALL, peer, 0, 0, 0);
  const uint64_t offset = flag_offset(c, flag, peer);
  uint64_t* word = static_cast<uint64_t*>(ncclGetPeerPointer(c->window, offset, peer));
  if (jaxgin::linear_thread() == 0) poll_flag(c, word, value, offset, peer);
  __syncthreads();
  // No shared memory in the library (Triton owns it): every thread reads the value itself.
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*word).load(cuda::memory_order_relaxed);
}

__device__ int32_t jaxgin_tt_flush(const void* ctx) {
  jaxgin_flush(ctx);
  return 0;
}

__device__ int32_t jaxgin_tt_barrier(const void* ctx) {
  jaxgin_barrier(ctx);
  return 0;
}

}  // extern "C"
