#include "chunk_handoff.h"

#include "jaxgin_op_table.h"  // generated: the preload hook this file defines
#include "../device/jaxgin_inline.h"

namespace jaxgin {
namespace {

// Spins (one thread) until *word >= expected; past the runtime's timeout it records a fault naming
// the peer and traps, so a peer that died or runs another program is an error, not a hang.
__device__ void await_count(const chunk_handoff& h, const uint64_t* word, uint64_t expected, int peer, uint32_t what) {
  uint64_t value, deadline = 0;
  for (uint32_t polls = 1; (value = load_signal_word(word)) < expected; polls++) {
    if (polls % kClockPolls != 0) continue;
    const uint64_t now = clock_ns();
    if (deadline == 0) deadline = now + h.ctx->timeout_ns;
    else if (now > deadline)
      fail(h.ctx, JAXGIN_FAULT_FLAG_TIMEOUT, (jaxgin_op_tag)h.op, h.ranks[peer], what, expected, value);
  }
}

// One thread per other index (all of them, or just `only`).
__device__ bool is_mine(const chunk_handoff& h, int t, int only) {
  return t < h.size && t != h.my_index && (only < 0 || t == only);
}

__global__ void begin_call_kernel(const chunk_handoff h, uint64_t call) {
  const int t = threadIdx.x;
  if (is_mine(h, t, -1)) await_count(h, h.words + credit_index(h.size, t), call - 1, t, kWaitedForCredit);
}

__global__ void await_chunks_kernel(const chunk_handoff h, int source, uint64_t call) {
  const int s = threadIdx.x;
  if (is_mine(h, s, source)) await_count(h, h.words + ready_index(s), call, s, kWaitedForChunk);
}

__global__ void end_exchange_kernel(const chunk_handoff h, uint64_t call) {
  const int t = threadIdx.x;
  if (!is_mine(h, t, -1)) return;
  await_count(h, h.words + ready_index(t), call, t, kWaitedForChunk);
  await_count(h, h.words + credit_index(h.size, t), call, t, kWaitedForCredit);
}

}  // namespace

cudaError_t launch_begin_call(const chunk_handoff& h, uint64_t call, cudaStream_t stream) {
  begin_call_kernel<<<1, kMaxExchangePeers, 0, stream>>>(h, call);
  return cudaGetLastError();
}

cudaError_t launch_await_chunks(const chunk_handoff& h, int source, uint64_t call, cudaStream_t stream) {
  await_chunks_kernel<<<1, kMaxExchangePeers, 0, stream>>>(h, source, call);
  return cudaGetLastError();
}

cudaError_t launch_end_exchange(const chunk_handoff& h, uint64_t call, cudaStream_t stream) {
  end_exchange_kernel<<<1, kMaxExchangePeers, 0, stream>>>(h, call);
  return cudaGetLastError();
}

cudaError_t preload_chunk_handoff_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(begin_call_kernel),
                             reinterpret_cast<const void*>(await_chunks_kernel),
                             reinterpret_cast<const void*>(end_exchange_kernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace jaxgin
