// Per-peer transport choice (LSA stores over NVLink, or GIN) and the NCCL-version differences of
// the GIN signal actions.
#pragma once
#include <nccl_device.h>  // NCCL's device functions, for every impl/*__funcs.h

#include "context__types.h"

namespace jaxgin {

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0)
// A put's own signal only has to cover that put's payload.
using GinPutSignal = ncclGin_WeakSignalAdd;
// A bare signal, and a put whose signal is counted as a landing of every earlier put of its
// stream, must cover every earlier put to that peer on its context (barriers rely on it).
using GinBareSignal = ncclGin_StrongSignalAdd;
#else
// Before 2.31 the only add action has the strong semantics, which covers both uses.
using GinPutSignal = ncclGin_SignalAdd;
using GinBareSignal = ncclGin_SignalAdd;
#endif

__device__ __forceinline__ bool is_lsa_peer(const jaxgin_context* ctx, int peer) {
  int lsa_index = ctx->lsa_rank + (peer - ctx->rank);
  return 0 <= lsa_index && lsa_index < ctx->lsa_size;
}

__device__ __forceinline__ bool routes_through_gin(const jaxgin_context* ctx, int peer) {
  return ctx->gin_contexts > 0 && (ctx->force_gin || !is_lsa_peer(ctx, peer));
}

__device__ __forceinline__ int gin_context_index(const jaxgin_context* ctx) {
  return (int)(linear_block() % (uint32_t)ctx->gin_contexts);
}

}  // namespace jaxgin
