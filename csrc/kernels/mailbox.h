// Host interface of the mailbox kernels behind jaxgin.put_signal / jaxgin.wait_signal.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "../device/jaxgin_types.h"
#include "exchange.h"

namespace jaxgin {

// A mailbox lives at the same heap offset on every rank of a mesh axis of size `axis_size`:
//   [header: counters and the running wait's decision][slot per sender][GIN staging slot]
//   [line slot per sender, for payloads of at most JAXGIN_LINE_MAX_BYTES]
// with signals [data from sender s][credit from receiver r], 2 * axis_size of them. A put to an
// LSA peer of a payload that fits a line slot travels as lines (no data signal); any other put
// goes through the sender's slot and bumps the data signal. Both sides pick alike: the size is the
// mailbox's and the route is symmetric.
//
// The descriptor also carries the addresses the kernels need (this heap, the consumed counters,
// every LSA peer's heap as mapped here), computed once by the host: a small put's time is a chain
// of dependent loads, and reading them from the context and NCCL's window would add a round trip
// to memory per link.
struct mailbox_desc {
  uint64_t offset;          // heap offset of the header
  uint64_t slot_bytes;      // payload rounded up to 16
  uint64_t line_slot_bytes; // 16 per 8 payload bytes; 0 if the payload is too large for lines
  uint64_t payload_bytes;
  uint32_t signal_base;
  int32_t axis_size;
  int32_t my_index;         // this rank's index along the axis
  uint32_t put_parts;       // CTAs per put; each adds 1 to the data signal
  char* heap;               // this rank's heap
  uint64_t* consumed;       // the runtime's consumed counters (jaxgin_context::consumed)
  int32_t ranks[kMaxExchangePeers];  // global rank of each axis index
  // Heap of each axis index as mapped here; nullptr unless it is an LSA peer reached by stores
  // (so nullptr for every peer when GIN is forced).
  char* peer_heaps[kMaxExchangePeers];
};

// Whether puts between this rank and axis index `index` travel as lines (see above).
__host__ __device__ inline bool puts_as_lines(const mailbox_desc& box, int index) {
  return box.line_slot_bytes > 0 && box.peer_heaps[index] != nullptr;
}

constexpr uint64_t kMailboxHeaderBytes = JAXGIN_MAILBOX_HEADER_BYTES;  // counters and the running wait's decision

__host__ __device__ inline uint64_t mailbox_slot_bytes(uint64_t payload_bytes) {
  return payload_bytes == 0 ? 16 : (payload_bytes + 15) / 16 * 16;
}

__host__ __device__ inline uint64_t mailbox_line_slot_bytes(uint64_t payload_bytes) {
  return payload_bytes > JAXGIN_LINE_MAX_BYTES ? 0 : sizeof(line) * line_count(payload_bytes);
}

__host__ __device__ inline uint64_t mailbox_bytes(uint64_t payload_bytes, int axis_size) {
  return kMailboxHeaderBytes + mailbox_slot_bytes(payload_bytes) * (uint64_t)(axis_size + 1) +
         mailbox_line_slot_bytes(payload_bytes) * (uint64_t)axis_size;
}

// 16 KiB per CTA, at most 64: the SMs a put stores from set its rate to an LSA peer.
__host__ __device__ inline uint32_t mailbox_put_parts(uint64_t payload_bytes) {
  const uint64_t parts = (payload_bytes + (16u << 10) - 1) / (16u << 10);
  return parts < 1 ? 1 : parts > 64 ? 64 : (uint32_t)parts;
}
static_assert(JAXGIN_LINE_MAX_BYTES <= (16u << 10), "a line-sized put must be one CTA");

// `peer_index` is a device int32 (the destination's index along the axis, possibly data
// dependent); `token` receives it.
cudaError_t launch_put(const jaxgin_context* device_ctx, const mailbox_desc& box, const void* src, const int32_t* peer_index, int32_t* token, cudaStream_t stream);

// Waits until `count` puts arrived, then writes every arrived payload to its sender's row of `out`
// ([axis_size][payload]) and, unless `taken_rows` is null, 1 to its entry of `taken_rows`
// ([axis_size]) and 0 to the others' (whose rows of `out` it leaves unwritten).
cudaError_t launch_wait(const jaxgin_context* device_ctx, const mailbox_desc& box, int32_t count, void* out,
                        int32_t* taken_rows, cudaStream_t stream);

// Waits for the put of the sender at axis index `*source` (a device int32, possibly data
// dependent) and writes its payload to `out` ([payload]); other senders' puts stay for later waits.
cudaError_t launch_wait_from(const jaxgin_context* device_ctx, const mailbox_desc& box, const int32_t* source,
                             void* out, cudaStream_t stream);

}  // namespace jaxgin
