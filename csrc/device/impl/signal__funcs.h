// Signals: monotonically increasing 64-bit counters, one per id and rank.
//
// A signal can be bumped by LSA peers (system-scope atomics on a counter in the heap's reserved
// area) and by GIN peers (NCCL GIN signals of the same id). Its value is the sum of both, so a
// waiter never needs to know which transport each sender used.
#pragma once
#include <cuda/atomic>
#include "fault__funcs.h"
#include "transport__funcs.h"

namespace jaxgin {

__device__ __forceinline__ uint64_t* local_signal(const jaxgin_context* ctx, uint32_t signal) {
  return reinterpret_cast<uint64_t*>(ctx->heap) + signal;
}

__device__ __forceinline__ void check_signal(const jaxgin_context* ctx, uint32_t signal,
                                             uint32_t limit, jaxgin_op_tag op) {
  if (signal >= limit) fail(ctx, JAXGIN_FAULT_BAD_ARGUMENT, op, -1, signal, limit, signal);
}

__device__ __forceinline__ void check_peer(const jaxgin_context* ctx, int peer, jaxgin_op_tag op) {
  if (peer < 0 || peer >= ctx->world_size)
    fail(ctx, JAXGIN_FAULT_BAD_ARGUMENT, op, peer, 0, (uint64_t)ctx->world_size, (uint64_t)peer);
  if (!is_lsa_peer(ctx, peer) && ctx->gin_contexts == 0)
    fail(ctx, JAXGIN_FAULT_PEER_UNREACHABLE, op, peer, 0, 0, 0);
}

// This heap's own word of a signal at `word` (what LSA peers add to), with acquire semantics. A
// kernel that knows the word's address reads it in one load, without the context; whenever it
// suffices it is enough on its own, since GIN's parts of a signal only add to it.
__device__ __forceinline__ uint64_t load_signal_word(const uint64_t* word) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
  return v;
}

// Current value (acquire): every payload whose signal is counted in it is visible afterwards.
__device__ __forceinline__ uint64_t read_signal(const jaxgin_context* ctx, uint32_t signal) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system> lsa(*local_signal(ctx, signal));
  uint64_t value = lsa.load(cuda::memory_order_acquire);
  // GIN signals are per context (NCCL's proxy backend keeps one word per context and signal), and
  // a sender signals on its CTA's context: the arrivals are the sum over every context.
  for (int context = 0; context < ctx->gin_contexts; context++) {
    ncclGin gin(ctx->comm, context);
    value += gin.readSignal(signal);
  }
  return value;
}

// One thread spins until the signal reaches `expected`; gives up after ctx->timeout_ns (the clock
// is read every kClockPolls polls).

__device__ __forceinline__ uint64_t wait_until(const jaxgin_context* ctx, uint32_t signal,
                                               uint64_t expected, jaxgin_op_tag op, int peer) {
  uint64_t value, deadline = 0;
  for (uint32_t polls = 1; (value = read_signal(ctx, signal)) < expected; polls++) {
    if (polls % kClockPolls != 0) continue;
    const uint64_t now = clock_ns();
    if (deadline == 0) deadline = now + ctx->timeout_ns;
    else if (now > deadline) fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, op, peer, signal, expected, value);
  }
  return value;
}

// One thread waits for `count` arrivals beyond those this rank already consumed. The consumed
// count lives in device memory, so the expected value is right under CUDA-graph replay too.
__device__ __forceinline__ void wait_arrivals(const jaxgin_context* ctx, uint32_t signal,
                                              uint64_t count, jaxgin_op_tag op, int peer) {
  const uint64_t expected = ctx->consumed[signal] + count;
  wait_until(ctx, signal, expected, op, peer);
  ctx->consumed[signal] = expected;
}

// Remote add over NVLink as one fire-and-forget reduction. With `release`, every write this thread
// has observed (callers synchronise the CTA first, so that covers the whole CTA's writes) is visible
// before the add; without, only atomicity is promised (for credits, which follow reads that have
// already completed). One instruction instead of a system fence plus an atomic.
__device__ __forceinline__ void remote_add(uint64_t* remote, uint64_t value, bool release) {
  if (release)
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(remote), "l"(value) : "memory");
  else
    asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(remote), "l"(value) : "memory");
}

// One thread adds `value` to `signal` on `peer`, ordered after every write this thread has
// observed (callers synchronise the CTA first, so that covers the whole CTA's writes), at system
// scope on either path: NVLink stores through peer pointers included, also when the signal goes
// through GIN. `release = false` drops that ordering: use it only where the caller's prior
// accesses are reads whose values were already consumed (a credit returned after a copy-out).
__device__ __forceinline__ void add_signal(const jaxgin_context* ctx, int peer, uint32_t signal,
                                           uint64_t value, bool release = true) {
  if (routes_through_gin(ctx, peer)) {
    ncclGin gin(ctx->comm, gin_context_index(ctx));
    if (!release) {
      gin.signal(ncclTeamWorld(ctx->comm), peer, GinBareSignal{signal, value});
      return;
    }
    // Left to itself NCCL's GDAKI backend releases at GPU scope only before the NIC takes the
    // signal (gin_gdaki.h: system scope only when required), which leaves NVLink stores to the
    // peer free to arrive after it. So a system-scope release here, and NCCL told that one
    // happened: given and required scope both system (2.28's signal() takes the two in the
    // opposite order of 2.32's, and equal values read the same either way).
    cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
    gin.signal(ncclTeamWorld(ctx->comm), peer, GinBareSignal{signal, value}, ncclCoopThread(), ncclGin_None{},
               cuda::thread_scope_system, cuda::thread_scope_system);
    return;
  }
  uint64_t* remote = static_cast<uint64_t*>(
      ncclGetPeerPointer(ctx->window, (size_t)signal * sizeof(uint64_t), peer));
  remote_add(remote, value, release);
}

}  // namespace jaxgin
