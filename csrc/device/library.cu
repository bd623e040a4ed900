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

__device__ int32_t jaxgin_tt_flush(const void* ctx) {
  jaxgin_flush(ctx);
  return 0;
}

__device__ int32_t jaxgin_tt_barrier(const void* ctx) {
  jaxgin_barrier(ctx);
  return 0;
}

}  // extern "C"
