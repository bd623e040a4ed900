// The exchange channel: flow-controlled streams of chunks between every ordered pair of ranks.
//
// Data from an XLA buffer cannot be addressed by a peer (only the symmetric heap can), so a message
// travels through rings in the receiver's heap: the sender writes chunk n of a lane into ring slot
// n % slots and bumps the lane's data signal there; the receiver copies the slot into its output
// buffer and bumps the lane's credit signal at the sender, which frees the slot. Per-lane chunk
// counters live in device memory on both sides, so no expected value ever comes from the host and
// the protocol stays right under CUDA-graph replay and across ops of any size.
//
// A lane is driven by one CTA on each side, so chunks of a lane arrive in order; many lanes run
// in parallel for bandwidth. Both sides derive the chunking from the message size alone.
#pragma once
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

__device__ __forceinline__ uint32_t channel_data_signal(const jaxgin_context* ctx, int sender, uint32_t lane) {
  return ctx->channel_signal_base + (uint32_t)sender * ctx->channel_lanes + lane;
}

__device__ __forceinline__ uint32_t channel_credit_signal(const jaxgin_context* ctx, int receiver, uint32_t lane) {
  return ctx->channel_signal_base + ((uint32_t)ctx->world_size + (uint32_t)receiver) * ctx->channel_lanes + lane;
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

// Lines: how a message of at most JAXGIN_LINE_MAX_BYTES reaches an LSA peer. Chunk n of lane 0 is
// stored as 16-byte lines {payload[0:4], flag, payload[4:8], flag} into line slot n % slots of the
// receiver, flag = a function of n that is never 0. One vector store makes a line visible whole, so
// a receiver that sees both flag copies of the expected value has the payload: no fence and no
// signal on the critical path, which otherwise cost a round trip over NVLink per message. The
// slots are apart from the rings, so a flag can never match bytes of an ordinary chunk; flow
// control and counters are lane 0's (a line chunk is one chunk of that lane).
struct alignas(16) line {
  uint32_t low, flag, high, flag_again;
};

__device__ __forceinline__ uint32_t line_flag(uint64_t chunk) {
  return (uint32_t)(chunk % 0xFFFFFFFFull) + 1u;  // 1 .. 2^32 - 1, distinct for nearby chunks
}

__device__ __forceinline__ uint64_t channel_line_offset(const jaxgin_context* ctx, int sender, uint64_t slot) {
  return ctx->line_offset + ((uint64_t)sender * ctx->channel_slots + slot) * JAXGIN_LINE_SLOT_BYTES;
}

__device__ __forceinline__ void store_line(line* dst, uint32_t low, uint32_t high, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(low), "r"(flag), "r"(high),
               "r"(flag)
               : "memory");
}

__device__ __forceinline__ line load_line(const line* src) {
  line v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.low), "=r"(v.flag), "=r"(v.high), "=r"(v.flag_again)
               : "l"(src)
               : "memory");
  return v;
}

// The 8 payload bytes of line i of a `bytes`-long message (fewer at the end, zero padded).
__device__ __forceinline__ void read_line_payload(const char* src, uint64_t bytes, uint64_t i, uint32_t& low,
                                                  uint32_t& high) {
  const uint64_t begin = i * 8;
  if (begin + 8 <= bytes && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    const uint2 v = *reinterpret_cast<const uint2*>(src + begin);
    low = v.x;
    high = v.y;
    return;
  }
  uint8_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint64_t k = 0; k < 8 && begin + k < bytes; k++) b[k] = (uint8_t)src[begin + k];
  low = b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24);
  high = b[4] | (b[5] << 8) | (b[6] << 16) | ((uint32_t)b[7] << 24);
}

__device__ __forceinline__ void write_line_payload(char* dst, uint64_t bytes, uint64_t i, uint32_t low,
                                                   uint32_t high) {
  const uint64_t begin = i * 8;
  if (begin + 8 <= bytes && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst + begin) = make_uint2(low, high);
    return;
  }
  for (uint64_t k = 0; k < 8 && begin + k < bytes; k++)
    dst[begin + k] = (char)((k < 4 ? low >> (8 * k) : high >> (8 * (k - 4))) & 0xFF);
}

}  // namespace jaxgin
