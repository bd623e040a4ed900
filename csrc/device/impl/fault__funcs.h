// Bounded waiting: a device clock deadline, and what happens when it passes.
//
// NCCL 2.28 has no timed waits, so every jaxgin wait spins on %globaltimer (nanoseconds, shared by
// all SMs). When the deadline passes the first fault is recorded in host-mapped memory and the
// kernel traps: the host turns the record into an exception instead of hanging forever.
#pragma once
#include "context__types.h"

namespace jaxgin {

// Spin loops read the clock once every kClockPolls polls only: reading %globaltimer on every poll
// lengthens the loop and delays noticing the awaited value, which is all a small message's
// latency is made of.
constexpr uint32_t kClockPolls = 256;

__device__ __forceinline__ uint64_t clock_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t linear_block() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

__device__ __forceinline__ uint32_t linear_thread() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ uint32_t block_threads() { return blockDim.x * blockDim.y * blockDim.z; }

// Records the first fault of this context (later ones lose the race and are dropped) and traps.
// Not inlined (cold path); static, so each translation unit that includes it has its own copy.
static __device__ __noinline__ void fail(const jaxgin_context* ctx, jaxgin_fault_code code, jaxgin_op_tag op,
                                  int peer, uint32_t signal, uint64_t expected, uint64_t observed) {
  jaxgin_fault* f = ctx->fault;
  if (atomicCAS(&f->code, 0u, (uint32_t)code) == 0u) {
    f->op = op;
    f->rank = ctx->rank;
    f->peer = peer;
    f->signal = signal;
    f->block = linear_block();
    f->expected = expected;
    f->observed = observed;
    __threadfence_system();
  }
  __trap();
}

}  // namespace jaxgin
