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
// None of them may use shared memory: Triton owns the CTA's shared memory and assumes its dynamic
// part starts at offset 0 (swizzled matmul layouts need that alignment).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// any thread. Bytes from this rank's heap to `peer`'s heap as this GPU maps it over NVLink: the
// peer's copy of local heap address p is p + jaxgin_tt_peer_delta(ctx, peer). A multiple of the
// heap's alignment, so pointer alignment carries over. Faults if `peer` is not an LSA peer.
__device__ int64_t jaxgin_tt_peer_delta(const void* ctx, int peer);

// any thread. 1 when jaxgin_tt_put_signal to `peer` goes through GIN (a GPU of another host, or any
// other GPU when the runtime forces GIN), 0 when it stores over NVLink; 0 for this rank itself.
// Kernels pick a data path per peer with it: NVLink stores through jaxgin_tt_peer_delta, or a
// staged put from the heap. Faults if `peer` is not a rank.
__device__ int32_t jaxgin_tt_gin_peer(const void* ctx, int peer);

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

// Flags: 64-bit words in the symmetric heap that a peer sets to a value (typically a call counter,
// so many programs can wait for the same event and a later value satisfies an earlier wait).
// CTA-collective. After every store the CTA made before the call, sets the word at heap address
// `flag` on LSA peer `peer` to `value` (release, system scope). Faults if `flag` is not a heap
// address or `peer` is not an LSA peer.
__device__ int32_t jaxgin_tt_set_flag(const void* ctx, const void* flag, uint64_t value, int peer);

// CTA-collective. Waits until the word at local heap address `flag` is >= `value` (acquire: what the
// setter stored before setting it is visible to the whole CTA afterwards); returns the value seen.
// Bounded by the runtime's timeout (fault: JAXGIN_FAULT_FLAG_TIMEOUT).
__device__ uint64_t jaxgin_tt_wait_flag(const void* ctx, const void* flag, uint64_t value);

// CTA-collective. As jaxgin_tt_wait_flag, but polls LSA peer `peer`'s copy of the word (over
// NVLink), for consumers that pull data the peer published in its own heap. Faults if `peer` is not
// an LSA peer.
__device__ uint64_t jaxgin_tt_wait_peer_flag(const void* ctx, const void* flag, uint64_t value, int peer);

// CTA-collective. jaxgin_flush and jaxgin_barrier.
__device__ int32_t jaxgin_tt_flush(const void* ctx);
__device__ int32_t jaxgin_tt_barrier(const void* ctx);

#ifdef __cplusplus
}
#endif
