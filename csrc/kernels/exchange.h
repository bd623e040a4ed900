// Host interface of the exchange kernel behind jaxgin.ppermute and jaxgin.all_to_all.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "../device/impl/context__types.h"

namespace jaxgin {

// Ranks one exchange may involve (kernel parameters carry the whole plan, within CUDA's 4 KiB).
constexpr int kMaxExchangePeers = 64;

enum exchange_role : int32_t { kSend = 1, kReceive = 2 };

struct exchange_peer {
  int32_t rank;        // global rank of the peer (this rank itself for the local part)
  int32_t roles;       // kSend and/or kReceive
  const char* src;     // what to send to `rank` (XLA buffer)
  char* dst;           // where what `rank` sends lands (XLA buffer)
};

// Every rank sends `bytes` to each peer with kSend and receives `bytes` from each peer with
// kReceive; both sides of a pair must agree (they do: the plan comes from one SPMD program).
struct exchange_plan {
  uint32_t op;         // jaxgin_op_tag, named in fault reports
  int32_t count;       // entries of `peers`
  uint64_t bytes;
  exchange_peer peers[kMaxExchangePeers];
};

// Enqueues the exchange on `stream`. Graph-capturable: no host synchronisation, no host state.
cudaError_t launch_exchange(const jaxgin_context* device_ctx, const jaxgin_context& host_ctx,
                            const exchange_plan& plan, cudaStream_t stream);

}  // namespace jaxgin
