// Lines: how a message of at most JAXGIN_LINE_MAX_BYTES reaches an LSA peer without a fence or a
// signal. Message n of a sender into a slot is stored as 16-byte lines {payload[0:4], flag,
// payload[4:8], flag}, flag = a function of n that is never 0. One vector store makes a line
// visible whole, so a receiver that sees both flag copies of the expected value has the payload:
// the data is its own signal, which saves the round trip over NVLink a fence and a signal cost.
//
// What a user of lines must guarantee: the slot holds only lines (or zeros: the heap starts
// cleared and is cleared when a region is released), so no other bytes can pass for a flag; and
// the sender writes message n + 1 only after the receiver read message n (a credit).
#pragma once
#include "fault__funcs.h"
#include "line__types.h"
#include "transport__funcs.h"

namespace jaxgin {

__device__ __forceinline__ uint32_t line_flag(uint64_t chunk) {
  return (uint32_t)(chunk % 0xFFFFFFFFull) + 1u;  // 1 .. 2^32 - 1, distinct for nearby chunks
}

__device__ __forceinline__ bool line_arrived(const line& v, uint32_t flag) {
  return v.flag == flag && v.flag_again == flag;
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

// Spins until line `src` carries `flag` and returns it. Once ctx->timeout_ns has passed,
// `on_timeout()` runs; it must record a fault and trap (see fail()).
template <class OnTimeout>
__device__ __forceinline__ line await_line(const jaxgin_context* ctx, const line* src, uint32_t flag,
                                           OnTimeout on_timeout) {
  uint64_t deadline = 0;
  for (uint32_t polls = 1;; polls++) {
    const line v = load_line(src);
    if (line_arrived(v, flag)) return v;
    if (polls % kClockPolls != 0) continue;
    const uint64_t now = clock_ns();
    if (deadline == 0) deadline = now + ctx->timeout_ns;
    else if (now > deadline) on_timeout();
  }
}

// Whether a message of `bytes` between this rank and `peer` travels as lines: small enough, and to
// an LSA (NVLink) peer rather than through GIN. Both ends decide alike: both know the size, and
// the route is symmetric.
__device__ __forceinline__ bool travels_as_lines(const jaxgin_context* ctx, uint64_t bytes, int peer) {
  return bytes <= JAXGIN_LINE_MAX_BYTES && !routes_through_gin(ctx, peer);
}

}  // namespace jaxgin
