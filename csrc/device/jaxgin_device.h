// jaxgin's device library: the only code that touches NCCL's GIN and LSA device APIs.
//
// Every function takes the context pointer that jaxgin's runtime hands to kernels (an opaque
// `const void*` here, so callers such as Triton need no NCCL types) and scalars. Offsets are byte
// offsets into the symmetric heap, the same on every rank; signal ids are < the runtime's
// signal_count.
//
// Thread semantics, stated per function:
//   any thread      - may be called by any subset of threads; no synchronisation inside.
//   CTA-collective  - every thread of the CTA must call it, with the same arguments. One thread
//                     is elected inside; the CTA is synchronised on entry and/or exit as stated.
//
// Every wait is bounded by the runtime's timeout: on expiry the fault is recorded for the host
// (which raises an exception naming op, rank, peer, signal and values) and the kernel traps.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// any thread. This GPU's rank and the number of ranks (JAX's global device order).
__device__ int jaxgin_rank(const void* ctx);
__device__ int jaxgin_world_size(const void* ctx);

// any thread. Address of heap byte `offset` on this rank.
__device__ void* jaxgin_local_ptr(const void* ctx, uint64_t offset);
// any thread. Heap offset of a local heap address (inverse of jaxgin_local_ptr).
__device__ uint64_t jaxgin_heap_offset(const void* ctx, const void* local_ptr);
// any thread. Address through which this GPU loads/stores heap byte `offset` of `peer` (NVLink),
// or NULL when `peer` is not in this rank's LSA team.
__device__ void* jaxgin_peer_ptr(const void* ctx, uint64_t offset, int peer);

// CTA-collective (synchronises on entry). Copies `bytes` from local heap offset `src_offset` to `dst_offset` on `peer`,
// then adds 1 to `signal` on `peer`. The payload is visible to whoever observes the increment.
// LSA peers: the CTA's threads store through NVLink; GIN peers: one thread posts a put.
__device__ void jaxgin_put_signal(const void* ctx, uint64_t dst_offset, uint64_t src_offset,
                                  uint64_t bytes, int peer, uint32_t signal);

// CTA-collective (synchronises on entry). Adds `value` to `signal` on `peer`, ordered after every
// write the CTA made before the call (a system-scope release over NVLink and GIN alike, so stores
// through jaxgin_peer_ptr are visible to whoever observes the add), and after this CTA's earlier
// puts to `peer` (a strong GIN
// signal settles the earlier puts of its own GIN context only, and a CTA's puts and signals share
// one context; other CTAs' puts, this kernel's or earlier ones', are ordered by their own signals).
__device__ void jaxgin_signal(const void* ctx, int peer, uint32_t signal, uint64_t value);

// any thread. Current value of this rank's `signal` (acquire).
__device__ uint64_t jaxgin_read_signal(const void* ctx, uint32_t signal);

// CTA-collective (synchronises on exit). Waits until this rank's `signal` is >= `value`; after it
// returns every thread of the CTA sees the payloads of the puts counted in it.
__device__ void jaxgin_wait_signal(const void* ctx, uint32_t signal, uint64_t value);

// CTA-collective (synchronises on exit). Waits for `count` more arrivals on `signal` than this rank
// has consumed through this function so far, then counts them as consumed. Needs no expected
// value from the host, so it stays right under CUDA-graph replay. One CTA per signal at a time.
__device__ void jaxgin_wait_signal_arrivals(const void* ctx, uint32_t signal, uint64_t count);

// CTA-collective. After it returns the sources of this CTA's earlier puts may be reused.
__device__ void jaxgin_flush(const void* ctx);

// CTA-collective, on every rank: CTA b waits for CTA b of every rank (b < the runtime's barrier
// slots). Everything the CTA did before it, its puts and stores through jaxgin_peer_ptr included,
// happens before everything CTA b of every rank does after it (other CTAs' puts: as for
// jaxgin_signal).
__device__ void jaxgin_barrier(const void* ctx);

#ifdef __cplusplus
}
#endif
