// One-sided put with signal: bytes from the local heap to the same kind of place on a peer's heap,
// then +1 on a signal there, the payload visible before the signal.
#pragma once
#include "signal__funcs.h"

namespace jaxgin {

// Whole-CTA copy, 16-byte vectors when both ends allow it, four loads in flight per thread.
__device__ __forceinline__ void cta_copy(char* dst, const char* src, uint64_t bytes) {
  const uint64_t t = linear_thread(), n = block_threads();
  uint64_t copied = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const uint64_t vecs = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    uint64_t i = t;
    for (; i + 3 * n < vecs; i += 4 * n) {
      uint4 a = s[i], b = s[i + n], c = s[i + 2 * n], e = s[i + 3 * n];
      d[i] = a; d[i + n] = b; d[i + 2 * n] = c; d[i + 3 * n] = e;
    }
    for (; i < vecs; i += n) d[i] = s[i];
    copied = vecs * 16;
  }
  for (uint64_t i = copied + t; i < bytes; i += n) dst[i] = src[i];
}

// CTA-collective: every thread of the CTA must call it with the same arguments.
__device__ __forceinline__ void put_signal(const jaxgin_context* ctx, uint64_t dst_offset,
                                           uint64_t src_offset, uint64_t bytes, int peer,
                                           uint32_t signal, jaxgin_op_tag op) {
  if (linear_thread() == 0) {
    check_peer(ctx, peer, op);
    check_signal(ctx, signal, ctx->signal_count, op);
  }
  if (routes_through_gin(ctx, peer)) {
    __syncthreads();  // the whole CTA's writes to the source are done before the NIC reads it
    if (linear_thread() == 0) {
      ncclGin gin(ctx->comm, gin_context_index(ctx));
      gin.put(ncclTeamWorld(ctx->comm), peer, ctx->window, dst_offset, ctx->window, src_offset, bytes,
              GinPutSignal{signal, 1});
    }
    return;
  }
  char* dst = static_cast<char*>(ncclGetPeerPointer(ctx->window, dst_offset, peer));
  cta_copy(dst, ctx->heap + src_offset, bytes);
  __syncthreads();  // every thread's stores precede thread 0's release below
  if (linear_thread() == 0) add_signal(ctx, peer, signal, 1);
}

}  // namespace jaxgin

namespace jaxgin {

// One thread: waits until NCCL's GIN backend took every put this thread issued on `gin` (their
// sources may then be reused), bounded by the runtime's timeout. NCCL's untimed flush spins for
// good when the proxy thread below it stalls or stops after an error (it stops silently), so the
// rank would hang instead of reporting; NCCL >= 2.32 has a timed flush. Older NCCLs only have the
// untimed one: there a stalled backend still hangs the kernel.
__device__ __forceinline__ void bounded_flush(const jaxgin_context* ctx, const ncclGin& gin, jaxgin_op_tag op,
                                              int peer) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 32, 0)
  if (gin.flush(ncclCoopThread(), cuda::memory_order_acquire, ncclGin_None{}, ctx->timeout_cycles) != ncclSuccess)
    fail(ctx, JAXGIN_FAULT_FLUSH_TIMEOUT, op, peer, 0, 0, 0);
#else
  (void)ctx, (void)op, (void)peer;
  gin.flush(ncclCoopThread());
#endif
}

// One thread: a GIN put of `bytes` from heap offset `src_offset` to heap offset `dst_offset` on
// `peer`, +1 on `signal` there, then a bounded wait until NCCL took it, so the source (a staging
// slot the caller reuses for its next put) may be rewritten afterwards. Kernels put through this
// helper rather than through NCCL's device API: this library is the only code that touches it.
__device__ __forceinline__ void gin_put_and_release_source(const jaxgin_context* ctx, int peer, uint64_t dst_offset,
                                                           uint64_t src_offset, uint64_t bytes, uint32_t signal,
                                                           jaxgin_op_tag op) {
  ncclGin gin(ctx->comm, gin_context_index(ctx));
  gin.put(ncclTeamWorld(ctx->comm), peer, ctx->window, dst_offset, ctx->window, src_offset, bytes,
          GinPutSignal{signal, 1});
  bounded_flush(ctx, gin, op, peer);
}

// One thread: as gin_put_and_release_source, for one put of a stream whose receiver counts its
// signal as landings ("`signal` reached n + 1, so put n landed"). The put goes on GIN context
// `context`, which the caller keeps the same for every put of the stream, with a strong signal:
// its arrival settles every earlier put of that context to `peer` (gin.h), so whichever n + 1 of
// the stream's signals arrived, puts 0 .. n landed. A weak signal (gin_put_and_release_source's,
// NCCL >= 2.31) settles only its own put, and another context's puts are not ordered at all.
__device__ __forceinline__ void gin_put_in_stream_and_release_source(const jaxgin_context* ctx, int context,
                                                                     int peer, uint64_t dst_offset,
                                                                     uint64_t src_offset, uint64_t bytes,
                                                                     uint32_t signal, jaxgin_op_tag op) {
  ncclGin gin(ctx->comm, context);
  gin.put(ncclTeamWorld(ctx->comm), peer, ctx->window, dst_offset, ctx->window, src_offset, bytes,
          GinBareSignal{signal, 1});
  bounded_flush(ctx, gin, op, peer);
}

// Any thread: where this GPU loads and stores heap byte `offset` of LSA (NVLink) peer `peer`.
__device__ __forceinline__ char* lsa_peer_heap(const jaxgin_context* ctx, uint64_t offset, int peer) {
  return static_cast<char*>(ncclGetPeerPointer(ctx->window, offset, peer));
}

// CTA-collective. Afterwards the sources of this CTA's earlier puts may be overwritten. It does
// not mean the data arrived: a signal says that.
__device__ __forceinline__ void flush(const jaxgin_context* ctx) {
  __syncthreads();
  if (linear_thread() == 0) {
    if (ctx->gin_contexts > 0) {
      ncclGin gin(ctx->comm, gin_context_index(ctx));
      bounded_flush(ctx, gin, JAXGIN_OP_DEVICE_CALL, -1);
    }
    __threadfence_system();
  }
  __syncthreads();
}

}  // namespace jaxgin
