// Entry points of the device library for Triton kernels (tritongin).
//
// Triton reaches external device functions through `extern_elementwise`, which needs every
// function to return a value and passes pointers as 64-bit integers. These wrappers adapt the
// functions of jaxgin_device.h to that: pointers are this rank's heap addresses (Triton holds
// pointers, not heap offsets), void functions return 0, and every argument is range-checked, since
// a kernel author's mistake should become a named fault, not a corrupted peer.
//
// Thread semantics are those of the wrapped functions (see jaxgin_device.h). Triton executes a
// scalar call on every thread of the program (CTA), which is what CTA-collective functions need.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// any thread. Bytes from this rank's heap to `peer`'s heap as this GPU maps it over NVLink: the
// peer's copy of local heap address p is p + jaxgin_tt_peer_delta(ctx, peer). A multiple of the
// heap's alignment, so pointer alignment carries over. Faults if `peer` is not an LSA peer.
__device__ int64_t jaxgin_tt_peer_delta(const void* ctx, int peer);

// CTA-collective. jaxgin_put_signal with local heap addresses: `bytes` from `src` go to `dst`'s
// offset on `peer`. Faults if either range leaves the heap.
__device__ int32_t jaxgin_tt_put_signal(const void* ctx, const void* dst, const void* src, uint64_t bytes,
                                        int peer, uint32_t signal);

// CTA-collective. jaxgin_signal.
__device__ int32_t jaxgin_tt_signal(const void* ctx, int peer, uint32_t signal, uint64_t value);

// CTA-collective. jaxgin_wait_signal; returns the signal's value once it is >= `value`.
__device__ uint64_t jaxgin_tt_wait_signal(const void* ctx, uint32_t signal, uint64_t value);

// CTA-collective. jaxgin_wait_signal_arrivals; returns the total consumed afterwards.
__device__ uint64_t jaxgin_tt_wait_arrivals(const void* ctx, uint32_t signal, uint64_t count);

// CTA-collective. jaxgin_flush and jaxgin_barrier.
__device__ int32_t jaxgin_tt_flush(const void* ctx);
__device__ int32_t jaxgin_tt_barrier(const void* ctx);

#ifdef __cplusplus
}
#endif
