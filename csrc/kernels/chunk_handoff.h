// Handing whole chunks between GPUs of one NVLink domain, for ops whose compute is not jaxgin's
// (cuBLAS matmuls) and whose data moves by copy engine: small kernels that order those steps.
//
// Each op configuration owns a block of the symmetric heap: its chunk slots, then these words:
//   ready[s]   chunks rank index s has handed to this GPU (s adds to it remotely after its data)
//   credit[t]  times index t finished with what this GPU handed it (t adds after its last read)
// Counts only grow; call n (counted from 1 by the host, which runs every call: these ops are never
// captured into CUDA graphs, see chunked_matmul.cu) waits for counts n and n - 1. Every wait a
// kernel does here is bounded by the runtime's timeout.
#pragma once
#include <cuda_runtime.h>

#include "exchange.h"

namespace jaxgin {

struct chunk_handoff {
  const jaxgin_context* ctx;                      // for fault reports and the timeout
  uint64_t* words;                                // this GPU's ready[size], credit[size]
  uint64_t* peer_words[kMaxExchangePeers];        // every index's words as this GPU maps them
  int32_t ranks[kMaxExchangePeers];               // global rank of every index (fault reports)
  int32_t size, my_index;
  uint32_t op;                                    // jaxgin_op_tag
};

constexpr size_t chunk_handoff_words(int size) { return 2 * (size_t)size; }

// Index of ready[s] / credit[t] among the words.
__host__ __device__ constexpr int ready_index(int s) { return s; }
__host__ __device__ constexpr int credit_index(int size, int t) { return size + t; }

// Waits until every other index's credit reached call - 1: each has finished reading what this
// GPU gave it in the previous call, so it may be overwritten.
cudaError_t launch_begin_call(const chunk_handoff& h, uint64_t call, cudaStream_t stream);
// Waits until index `source` (every other index when -1) has handed over its chunk of `call`.
cudaError_t launch_await_chunks(const chunk_handoff& h, int source, uint64_t call, cudaStream_t stream);
// Tells index `peer` that this call's chunk for it is complete (its ready[my_index] += 1), after
// every write the stream did before.
cudaError_t launch_hand_over(const chunk_handoff& h, int peer, cudaStream_t stream);
// Tells index `peer` (every other index when -1) that this GPU is done reading its chunk of this
// call (credit[my_index] += 1).
cudaError_t launch_return_credit(const chunk_handoff& h, int peer, cudaStream_t stream);

cudaError_t preload_chunk_handoff_kernels();

}  // namespace jaxgin
