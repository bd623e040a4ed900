// Handing whole chunks between GPUs of one NVLink domain, for ops whose compute is not jaxgin's
// (cuBLAS matmuls) and whose data moves by copy engine: the bounded waits that order those steps.
//
// Each op configuration owns a block of the symmetric heap: its chunk slots, then these words:
//   ready[s]   the last call whose chunk index s has handed to this GPU (s sets it remotely, after
//              its data)
//   credit[t]  the last call in which index t finished with what this GPU handed it (t sets it
//              after its last read)
// Each word has one writer, which sets it with a stream memory operation (chunked_matmul.cu).
// Counts only grow; call n (counted from 1 by the host, which runs every call: these ops are never
// captured into CUDA graphs, see chunked_matmul.cu) waits for counts n and n - 1. Every wait a
// kernel does here is bounded by the runtime's timeout. (The layout whose chunks one Triton kernel
// computes keeps the same two words per index as flags, in a block of its own: chunked_matmul.cu's
// triton_chunks.)
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
// The end of a call of an exchange whose peers pull (matmul_all_to_all, matmul_reduce_scatter):
// waits until every other index has handed over its chunk of `call` and has read this GPU's (its
// credit), so the next call may overwrite the slots without a begin_call of its own. A peer's
// credit follows its copy of the chunk this GPU handed over mid-call, so it is rarely waited for.
cudaError_t launch_end_exchange(const chunk_handoff& h, uint64_t call, cudaStream_t stream);

}  // namespace jaxgin
