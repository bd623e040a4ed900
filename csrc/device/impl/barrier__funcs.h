// Barrier over all ranks, built on signals so that it is bounded like every other wait and runs
// over LSA and GIN alike. CTA b of every rank meets CTA b of every other rank (slot b).
#pragma once
#include "signal__funcs.h"

namespace jaxgin {

// CTA-collective. Orders every memory operation of this CTA before it (its puts included: bare GIN
// signals are strong, and go on the CTA's own GIN context like its puts; its NVLink stores too:
// add_signal releases at system scope) before every memory operation after it of CTA b on all
// ranks. A strong signal settles only its own context's earlier puts, so other CTAs' puts are not
// covered.
__device__ __forceinline__ void barrier(const jaxgin_context* ctx) {
  const uint32_t slot = linear_block();
  const uint32_t signal = ctx->signal_count + slot;
  if (linear_thread() == 0 && slot >= ctx->barrier_slots)
    fail(ctx, JAXGIN_FAULT_BAD_ARGUMENT, JAXGIN_OP_BARRIER, -1, signal, ctx->barrier_slots, slot);
  __syncthreads();
  // One thread per peer announces this rank's arrival.
  for (uint32_t peer = linear_thread(); peer < (uint32_t)ctx->world_size; peer += block_threads())
    if ((int)peer != ctx->rank) add_signal(ctx, (int)peer, signal, 1);
  if (linear_thread() == 0) wait_arrivals(ctx, signal, (uint64_t)(ctx->world_size - 1), JAXGIN_OP_BARRIER, -1);
  __syncthreads();
}

}  // namespace jaxgin
