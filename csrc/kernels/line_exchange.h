// Host interface of the line exchange: the exchange kernel for small messages between LSA peers,
// with every address it needs computed on the host and passed by value.
//
// A small message's time is a chain of dependent memory accesses: the generic exchange kernel
// reads the context to find the counters, the window to find the peer's heap, then the counters and
// signals themselves, each a round trip to L2 before the first line is stored. Here the host,
// which knows all of those addresses (they never change after initialize), puts them in the kernel
// parameters: a sender issues its loads of the chunk counter, the credit and the payload at once.
// The protocol (lines in lane 0's line slots, lane 0's counters, data and credit signals) is the
// generic kernel's, so ops taking either kernel interleave freely.
#pragma once
#include <cuda_runtime.h>
#include <vector>

#include "exchange.h"

namespace jaxgin {

// Whether `plan` can take the line exchange: it is small enough for lines, and every peer other
// than this rank is an LSA peer reached by stores (not forced through GIN). `lsa_heaps[r]` is
// rank r's heap base as this GPU addresses it, nullptr for ranks outside the LSA team.
bool fits_line_exchange(const jaxgin_context& host_ctx, const std::vector<char*>& lsa_heaps,
                        const exchange_plan& plan);

// Enqueues the line exchange of `plan` (which must fit it). Graph-capturable, like launch_exchange.
cudaError_t launch_line_exchange(const jaxgin_context* device_ctx, const jaxgin_context& host_ctx,
                                 const std::vector<char*>& lsa_heaps, const exchange_plan& plan, cudaStream_t stream);

}  // namespace jaxgin
