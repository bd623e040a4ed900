// The launcher of the barrier that freeing a heap region meets every rank with (see heap_settle.cu).
#pragma once
#include <cuda_runtime.h>

#include "../device/jaxgin_types.h"

namespace jaxgin {

// `ctas` CTAs, CTA b in the device library's barrier slot b (so ctas <= the runtime's barrier
// slots); one per GIN context covers every context's earlier puts to this rank.
cudaError_t launch_heap_settle(const jaxgin_context* ctx, int ctas, cudaStream_t stream);

}  // namespace jaxgin
