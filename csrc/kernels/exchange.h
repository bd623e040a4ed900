// Host interface of the exchange kernel behind jaxgin.ppermute and jaxgin.all_to_all.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <vector>

#include "../device/jaxgin_types.h"

namespace jaxgin {

// Ranks one exchange may involve (kernel parameters carry the whole plan, within CUDA's 4 KiB).
constexpr int kMaxExchangePeers = JAXGIN_MAX_EXCHANGE_PEERS;  // from the op table

enum exchange_role : int32_t { kSend = 1, kReceive = 2 };

struct exchange_peer {
  int32_t rank;        // global rank of the peer (this rank itself for the local part)
  int32_t roles;       // kSend and/or kReceive
  const char* src;     // what to send to `rank` (XLA buffer)
  char* dst;           // where what `rank` sends lands (XLA buffer)
};

// Every rank sends `bytes` to each peer with kSend and receives `bytes` from each peer with
// kReceive; both sides of a pair must agree (they do: the plan comes from one SPMD program).
// Kernels take the plan by value as a parameter; launch_exchange passes the smallest capacity that
// holds it, since copying parameters is part of every launch (a ppermute has at most 2 entries).
template <int kCapacity>
struct exchange_plan_of {
  uint32_t op;         // jaxgin_op_tag, named in fault reports
  int32_t count;       // entries of `peers`
  uint64_t bytes;
  exchange_peer peers[kCapacity];
};
using exchange_plan = exchange_plan_of<kMaxExchangePeers>;

// Adds the entries of a permutation step: send `src` to rank `to`, receive into `dst` from rank
// `from` (either may be -1 for none); one entry when both are the same rank.
inline void add_permute_peers(exchange_plan& plan, int to, int from, const char* src, char* dst) {
  if (to >= 0 && to == from) {
    plan.peers[plan.count++] = exchange_peer{to, kSend | kReceive, src, dst};
    return;
  }
  if (to >= 0) plan.peers[plan.count++] = exchange_peer{to, kSend, src, nullptr};
  if (from >= 0) plan.peers[plan.count++] = exchange_peer{from, kReceive, nullptr, dst};
}

// Which kernel carries an exchange: kAuto takes the line exchange (line_exchange.h) for small
// messages between LSA peers and the generic kernel otherwise; kGeneric always takes the generic
// one (diagnostics time both).
enum class exchange_route { kAuto, kGeneric };

// Enqueues the exchange on `stream`. Graph-capturable: no host synchronisation, no host state.
// `lsa_heaps[r]` is rank r's heap base as this GPU addresses it (nullptr outside the LSA team).
cudaError_t launch_exchange(const jaxgin_context* device_ctx, const jaxgin_context& host_ctx,
                            const std::vector<char*>& lsa_heaps, const exchange_plan& plan, cudaStream_t stream,
                            exchange_route route = exchange_route::kAuto);

}  // namespace jaxgin
