// A diagnostic exchange through the device library, used by jaxgin.selftest() and the GPU tests:
// every rank sends a stamped block to every rank (itself included), each receiver checks every
// word, acknowledges, and the next round starts. Even rounds use jaxgin_put_signal, odd rounds
// direct NVLink stores through jaxgin_peer_ptr followed by jaxgin_signal (for LSA peers; peers
// reached through GIN get put_signal in every round).
#include "../device/jaxgin_device.h"
#include "diagnostics.h"

namespace {

// Heap layout (from heap_offset): send blocks [world][block], then receive blocks [world][block].
// Signals (from signal_base): [0, world) "data from sender s arrived", [world, 2 world) "receiver r
// consumed mine". The caller allocates both; the kernel leaves every signal it used paired with its
// consumed count, so they can be handed to other users afterwards.
__device__ __forceinline__ uint32_t stamp(uint32_t seed, int round, int sender, int receiver, uint64_t word) {
  uint32_t x = seed ^ (uint32_t)round * 0x9E3779B1u ^ (uint32_t)sender * 0x85EBCA77u ^
               (uint32_t)receiver * 0xC2B2AE3Du ^ (uint32_t)word * 0x27D4EB2Fu;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 12);
}

__global__ void exchange_kernel(const jaxgin_context* ctx, int rounds, uint64_t block_bytes, uint32_t seed,
                                uint64_t heap_offset, uint32_t signal_base, unsigned long long* mismatches) {
  const int me = jaxgin_rank(ctx);
  const int world = jaxgin_world_size(ctx);
  const int peer = blockIdx.x;  // CTA p sends to rank p and receives from rank p
  const uint64_t words = block_bytes / 4;
  const uint64_t base = heap_offset;
  const uint64_t send_offset = base + (uint64_t)peer * block_bytes;
  const uint64_t recv_offset = base + (uint64_t)(world + me) * block_bytes;  // my slot at the peer
  const uint64_t my_recv_from_peer = base + (uint64_t)(world + peer) * block_bytes;
  uint32_t* send = static_cast<uint32_t*>(jaxgin_local_ptr(ctx, send_offset));
  const uint32_t* recv = static_cast<const uint32_t*>(jaxgin_local_ptr(ctx, my_recv_from_peer));
  unsigned long long bad = 0;

  for (int round = 0; round < rounds; round++) {
    // The peer must have checked the previous round's block before we overwrite it.
    if (round > 0) jaxgin_wait_signal_arrivals(ctx, signal_base + (uint32_t)(world + peer), 1);
    // NULL for a peer outside this rank's LSA team: such a peer gets every round by put_signal.
    uint32_t* remote = static_cast<uint32_t*>(jaxgin_peer_ptr(ctx, recv_offset, peer));
    if (round % 2 == 0 || remote == nullptr) {
      for (uint64_t w = threadIdx.x; w < words; w += blockDim.x) send[w] = stamp(seed, round, me, peer, w);
      jaxgin_put_signal(ctx, recv_offset, send_offset, block_bytes, peer, signal_base + (uint32_t)me);
    } else {
      for (uint64_t w = threadIdx.x; w < words; w += blockDim.x) remote[w] = stamp(seed, round, me, peer, w);
      jaxgin_signal(ctx, peer, signal_base + (uint32_t)me, 1);
    }
    jaxgin_wait_signal_arrivals(ctx, signal_base + (uint32_t)peer, 1);
    for (uint64_t w = threadIdx.x; w < words; w += blockDim.x)
      bad += recv[w] != stamp(seed, round, peer, me, w);
    jaxgin_signal(ctx, peer, signal_base + (uint32_t)(world + me), 1);
  }
  // Consume the last acknowledgement so the consumed counters stay paired for the next call.
  jaxgin_wait_signal_arrivals(ctx, signal_base + (uint32_t)(world + peer), 1);
  jaxgin_barrier(ctx);
  if (bad) atomicAdd(&mismatches[peer], bad);
}

}  // namespace

cudaError_t jaxgin::launch_selftest_exchange(const jaxgin_context* ctx, int world, int rounds, uint64_t block_bytes,
                                             uint32_t seed, uint64_t heap_offset, uint32_t signal_base,
                                             unsigned long long* mismatches, cudaStream_t stream) {
  exchange_kernel<<<world, 256, 0, stream>>>(ctx, rounds, block_bytes, seed, heap_offset, signal_base, mismatches);
  return cudaGetLastError();
}
