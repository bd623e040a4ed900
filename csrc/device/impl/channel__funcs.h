// The exchange channel: flow-controlled streams of chunks between every ordered pair of ranks.
//
// Data from an XLA buffer cannot be addressed by a peer (only the symmetric heap can), so a message
// travels through rings in the receiver's heap: the sender writes chunk n of a lane into ring slot
// n % slots and bumps the lane's data signal there; the receiver copies the slot into its output
// buffer and bumps the lane's credit signal at the sender, which frees the slot. Per-lane chunk
// counters live in device memory on both sides, so no expected value ever comes from the host and
// the protocol stays right under CUDA-graph replay and across ops of any size.
//
// A lane is driven by one CTA on each side, so chunks of a lane are sent in order, and its data
// signal counts them as landed in order (over GIN: on one context with strong signals,
// channel_gin_context); many lanes run in parallel for bandwidth. Both sides derive the chunking
// from the message size alone.
#pragma once
#include "line__funcs.h"
#include "signal__funcs.h"

namespace jaxgin {

// Smallest chunk worth its own lane: below it, one CTA's copy is faster than the extra signal.
constexpr uint64_t kMinChunkBytes = 8192;
static_assert(JAXGIN_LINE_MAX_BYTES <= kMinChunkBytes, "a line message must be a single chunk");

struct chunking {
  uint64_t chunk;   // bytes per chunk (the last one may be shorter); 0 for an empty message
  uint64_t count;   // chunks in the message
  uint32_t lanes;   // lanes that carry at least one chunk
};

__host__ __device__ inline chunking chunk_message(uint64_t bytes, uint32_t lanes, uint64_t slot_bytes) {
  chunking c{0, 0, 0};
  if (bytes == 0) return c;
  uint64_t per_lane = (bytes + lanes - 1) / lanes;
  per_lane = (per_lane + 15) / 16 * 16;  // keep chunk starts 16-byte aligned for vector copies
  c.chunk = per_lane < kMinChunkBytes ? kMinChunkBytes : per_lane;
  if (c.chunk > slot_bytes) c.chunk = slot_bytes;
  c.count = (bytes + c.chunk - 1) / c.chunk;
  c.lanes = c.count < lanes ? (uint32_t)c.count : lanes;
  return c;
}

// Chunks of a `count`-chunk message that lane `lane` carries (chunk i goes to lane i % lanes).
__host__ __device__ inline uint64_t lane_chunks(uint64_t count, uint32_t lanes, uint32_t lane) {
  return count / lanes + (lane < count % lanes ? 1 : 0);
}

// Byte range of the k-th chunk that lane `lane` carries, in a message of `bytes`.
__host__ __device__ inline void lane_chunk_span(chunking c, uint32_t lane, uint64_t k, uint64_t bytes,
                                                uint64_t& begin, uint64_t& length) {
  begin = (lane + k * c.lanes) * c.chunk;
  length = bytes - begin < c.chunk ? bytes - begin : c.chunk;
}

__host__ __device__ inline uint32_t channel_data_signal(const jaxgin_context* ctx, int sender, uint32_t lane) {
  return ctx->channel_signal_base + (uint32_t)sender * ctx->channel_lanes + lane;
}

__host__ __device__ inline uint32_t channel_credit_signal(const jaxgin_context* ctx, int receiver, uint32_t lane) {
  return ctx->channel_signal_base + ((uint32_t)ctx->world_size + (uint32_t)receiver) * ctx->channel_lanes + lane;
}

// The GIN context that carries every chunk of the stream to `receiver` on `lane`, in every call:
// the receiver counts the lane's data signal as landings, which holds only while one context (in
// order, strong signals) carries the whole stream. A CTA's own context (linear_block() % contexts)
// would change between calls with the plan's lanes and peer order. A peer's lanes still spread
// over every context, and each context has its own queue per peer.
__device__ __forceinline__ int channel_gin_context(const jaxgin_context* ctx, int receiver, uint32_t lane) {
  return (int)(((uint64_t)receiver * ctx->channel_lanes + lane) % (uint64_t)ctx->gin_contexts);
}

// Heap offset (same on every rank) of ring slot `slot` of `lane` for messages from `sender`.
__device__ __forceinline__ uint64_t channel_ring_offset(const jaxgin_context* ctx, int sender, uint32_t lane,
                                                        uint64_t slot) {
  return ctx->channel_offset +
         (((uint64_t)sender * ctx->channel_lanes + lane) * ctx->channel_slots + slot) * ctx->channel_slot_bytes;
}

__device__ __forceinline__ uint64_t channel_staging_offset(const jaxgin_context* ctx, int receiver, uint32_t lane) {
  return ctx->staging_offset + ((uint64_t)receiver * ctx->channel_lanes + lane) * ctx->channel_slot_bytes;
}

// Line slots of the channel: [sender][slot] (see line__funcs.h for what a line is). A line chunk
// is chunk n of lane 0 and goes to slot n % slots; flow control and counters are lane 0's.
__host__ __device__ inline uint64_t channel_line_offset(const jaxgin_context* ctx, int sender, uint64_t slot) {
  return ctx->line_offset + ((uint64_t)sender * ctx->channel_slots + slot) * JAXGIN_LINE_SLOT_BYTES;
}

}  // namespace jaxgin
