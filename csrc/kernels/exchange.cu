// The exchange kernel: point-to-point messages between XLA buffers on different GPUs through the
// channel rings (see device/impl/channel__funcs.h).
//
// Grid: for each plan entry, `lanes` CTAs that send and `lanes` CTAs that receive. Senders and
// receivers are separate CTAs so that a receiver's copy-out never delays the next chunk on the wire;
// every CTA waits only on remote progress, never on another CTA of this grid.
//
// Copies: a chunk is stored straight from the sender's XLA buffer into the receiver's ring over
// NVLink (GIN: staged in the sender's heap first, since the NIC reads only registered memory), and
// copied once more from the ring into the receiver's XLA output. That last copy remains because
// XLA's output buffers are not registered with NCCL, so no peer can address them; it is pipelined
// with the transfer, lane by lane. The local part (a rank's message to itself) is one copy.
#include "exchange.h"
#include "line_exchange.h"
#include "jaxgin_op_table.h"  // generated: the preload hook this file defines

#include "../device/jaxgin_inline.h"

namespace jaxgin {
namespace {

constexpr int kThreads = 512;

template <class Plan>
__device__ void send_lane(const jaxgin_context* ctx, const Plan& plan, const exchange_peer& p,
                          chunking ch, uint32_t lane) {
  const uint64_t chunks = lane_chunks(ch.count, ch.lanes, lane);
  const uint64_t slot_index = (uint64_t)p.rank * ctx->channel_lanes + lane;
  // Every thread reads the counter before the loop's first barrier; thread 0 updates it after the
  // last one (with no chunks it writes back the same value).
  const uint64_t first_sent = ctx->channel_sent[slot_index];
  const bool gin = routes_through_gin(ctx, p.rank);
  const uint32_t credit = channel_credit_signal(ctx, p.rank, lane);
  const uint32_t data = channel_data_signal(ctx, ctx->rank, lane);
  for (uint64_t k = 0; k < chunks; k++) {
    const uint64_t n = first_sent + k;  // this lane's chunk number since the runtime started
    uint64_t begin, bytes;
    lane_chunk_span(ch, lane, k, plan.bytes, begin, bytes);
    // Ring slot n % slots is free once the receiver has consumed chunk n - slots.
    if (linear_thread() == 0 && n >= ctx->channel_slots)
      wait_until(ctx, credit, n + 1 - ctx->channel_slots, (jaxgin_op_tag)plan.op, p.rank);
    __syncthreads();
    const uint64_t ring = channel_ring_offset(ctx, ctx->rank, lane, n % ctx->channel_slots);
    if (gin) {
      const uint64_t staging = channel_staging_offset(ctx, p.rank, lane);
      cta_copy(ctx->heap + staging, p.src + begin, bytes);
      __syncthreads();
      if (linear_thread() == 0)  // the staging slot is reused by the next chunk
        gin_put_in_stream_and_release_source(ctx, channel_gin_context(ctx, p.rank, lane), p.rank, ring, staging,
                                             bytes, data, (jaxgin_op_tag)plan.op);
      __syncthreads();
    } else {
      char* dst = lsa_peer_heap(ctx, ring, p.rank);
      cta_copy(dst, p.src + begin, bytes);
      __syncthreads();
      if (linear_thread() == 0) add_signal(ctx, p.rank, data, 1);
    }
  }
  if (linear_thread() == 0) ctx->channel_sent[slot_index] = first_sent + chunks;
}

template <class Plan>
__device__ void receive_lane(const jaxgin_context* ctx, const Plan& plan, const exchange_peer& p,
                             chunking ch, uint32_t lane) {
  const uint64_t chunks = lane_chunks(ch.count, ch.lanes, lane);
  const uint64_t slot_index = (uint64_t)p.rank * ctx->channel_lanes + lane;
  const uint64_t first = ctx->channel_received[slot_index];  // as in send_lane
  const uint32_t data = channel_data_signal(ctx, p.rank, lane);
  const uint32_t credit = channel_credit_signal(ctx, ctx->rank, lane);
  for (uint64_t k = 0; k < chunks; k++) {
    const uint64_t n = first + k;
    uint64_t begin, bytes;
    lane_chunk_span(ch, lane, k, plan.bytes, begin, bytes);
    // n + 1 arrivals: chunks 0 .. n of the lane landed (LSA: the lane's adds come in order, each
    // releasing its chunk; GIN: strong signals on the lane's one context, channel_gin_context).
    if (linear_thread() == 0) wait_until(ctx, data, n + 1, (jaxgin_op_tag)plan.op, p.rank);
    __syncthreads();
    const uint64_t ring = channel_ring_offset(ctx, p.rank, lane, n % ctx->channel_slots);
    cta_copy(p.dst + begin, ctx->heap + ring, bytes);
    __syncthreads();  // every thread's reads of the slot completed (their values are stored) ...
    if (linear_thread() == 0) add_signal(ctx, p.rank, credit, 1, /*release=*/false);  // ... before the credit
  }
  if (linear_thread() == 0) ctx->channel_received[slot_index] = first + chunks;
}

// A message of at most JAXGIN_LINE_MAX_BYTES to an LSA peer: one chunk of lane 0, as lines (see
// line__funcs.h). Every thread stores its lines and is done; nothing waits for them to land.
template <class Plan>
__device__ void send_lines(const jaxgin_context* ctx, const Plan& plan, const exchange_peer& p) {
  const uint64_t slot_index = (uint64_t)p.rank * ctx->channel_lanes;  // lane 0
  const uint64_t n = ctx->channel_sent[slot_index];                   // as in send_lane
  if (linear_thread() == 0 && n >= ctx->channel_slots)
    wait_until(ctx, channel_credit_signal(ctx, p.rank, 0), n + 1 - ctx->channel_slots, (jaxgin_op_tag)plan.op,
               p.rank);
  __syncthreads();
  line* dst = reinterpret_cast<line*>(
      lsa_peer_heap(ctx, channel_line_offset(ctx, ctx->rank, n % ctx->channel_slots), p.rank));
  const uint32_t flag = line_flag(n);
  const uint64_t lines = line_count(plan.bytes);
  for (uint64_t i = linear_thread(); i < lines; i += block_threads()) {
    uint32_t low, high;
    read_line_payload(p.src, plan.bytes, i, low, high);
    store_line(dst + i, low, high, flag);
  }
  if (linear_thread() == 0) {
    // Lane 0's data signal counts every chunk, since ring receivers wait for absolute counts. No
    // one waits on it for this chunk, so the add needs no ordering.
    add_signal(ctx, p.rank, channel_data_signal(ctx, ctx->rank, 0), 1, /*release=*/false);
    ctx->channel_sent[slot_index] = n + 1;
  }
}

template <class Plan>
__device__ void receive_lines(const jaxgin_context* ctx, const Plan& plan, const exchange_peer& p) {
  const uint64_t slot_index = (uint64_t)p.rank * ctx->channel_lanes;
  const uint64_t n = ctx->channel_received[slot_index];
  const line* src = reinterpret_cast<const line*>(ctx->heap + channel_line_offset(ctx, p.rank, n % ctx->channel_slots));
  const uint32_t flag = line_flag(n);
  const uint64_t lines = line_count(plan.bytes);
  for (uint64_t i = linear_thread(); i < lines; i += block_threads()) {
    const line v = await_line(ctx, src + i, flag, [&] {
      const uint32_t data = channel_data_signal(ctx, p.rank, 0);
      fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, (jaxgin_op_tag)plan.op, p.rank, data, n + 1, read_signal(ctx, data));
    });
    write_line_payload(p.dst, plan.bytes, i, v.low, v.high);
  }
  __syncthreads();  // every line was read before the credit frees the slot
  if (linear_thread() == 0) {
    add_signal(ctx, p.rank, channel_credit_signal(ctx, ctx->rank, 0), 1, /*release=*/false);
    ctx->channel_received[slot_index] = n + 1;
  }
}

template <int kCapacity>
__global__ void __launch_bounds__(kThreads) exchange_kernel(const jaxgin_context* ctx,
                                                            const __grid_constant__ exchange_plan_of<kCapacity> plan,
                                                            uint32_t lanes) {
  const uint32_t entry = blockIdx.x / (2 * lanes);
  const uint32_t within = blockIdx.x % (2 * lanes);
  const bool sender = within < lanes;
  const uint32_t lane = within % lanes;
  const exchange_peer& p = plan.peers[entry];
  const chunking ch = chunk_message(plan.bytes, ctx->channel_lanes, ctx->channel_slot_bytes);
  if (p.rank == ctx->rank) {
    // The local part: the sender CTAs of this entry copy it directly, split by lane.
    if (!sender || (p.roles & (kSend | kReceive)) != (kSend | kReceive)) return;
    const uint64_t per = ((plan.bytes + lanes - 1) / lanes + 15) / 16 * 16;
    const uint64_t begin = min(plan.bytes, (uint64_t)lane * per);
    const uint64_t end = min(plan.bytes, begin + per);
    cta_copy(p.dst + begin, p.src + begin, end - begin);
    return;
  }
  if (linear_thread() == 0) check_peer(ctx, p.rank, (jaxgin_op_tag)plan.op);
  // A line message is one chunk (JAXGIN_LINE_MAX_BYTES is the smallest chunk), so lane is 0 here.
  if (travels_as_lines(ctx, plan.bytes, p.rank)) {
    if (sender && (p.roles & kSend)) send_lines(ctx, plan, p);
    if (!sender && (p.roles & kReceive)) receive_lines(ctx, plan, p);
    return;
  }
  if (sender && (p.roles & kSend)) send_lane(ctx, plan, p, ch, lane);
  if (!sender && (p.roles & kReceive)) receive_lane(ctx, plan, p, ch, lane);
}

// Launches the kernel whose plan parameter holds kCapacity entries (>= plan.count).
template <int kCapacity>
cudaError_t launch_with_capacity(const jaxgin_context* device_ctx, const exchange_plan& plan, uint32_t lanes,
                                 cudaStream_t stream) {
  exchange_plan_of<kCapacity> small{};
  small.op = plan.op;
  small.count = plan.count;
  small.bytes = plan.bytes;
  for (int i = 0; i < plan.count; i++) small.peers[i] = plan.peers[i];
  exchange_kernel<kCapacity><<<2 * lanes * (uint32_t)plan.count, kThreads, 0, stream>>>(device_ctx, small, lanes);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_exchange(const jaxgin_context* device_ctx, const jaxgin_context& host_ctx,
                            const std::vector<char*>& lsa_heaps, const exchange_plan& plan, cudaStream_t stream,
                            exchange_route route) {
  if (plan.count == 0 || plan.bytes == 0) return cudaSuccess;
  if (route == exchange_route::kAuto && fits_line_exchange(host_ctx, lsa_heaps, plan))
    return launch_line_exchange(device_ctx, host_ctx, lsa_heaps, plan, stream);
  // Remote messages use as many lanes as they have chunks (up to the channel's lanes); the local
  // copy gets the same number of CTAs, at least enough to keep a large copy fast.
  chunking ch = chunk_message(plan.bytes, host_ctx.channel_lanes, host_ctx.channel_slot_bytes);
  const uint32_t lanes = ch.lanes;
  if (plan.count <= 2) return launch_with_capacity<2>(device_ctx, plan, lanes, stream);
  if (plan.count <= 8) return launch_with_capacity<8>(device_ctx, plan, lanes, stream);
  return launch_with_capacity<kMaxExchangePeers>(device_ctx, plan, lanes, stream);
}

cudaError_t preload_exchange_kernels() {
  cudaFuncAttributes attributes;
  for (cudaError_t e : {cudaFuncGetAttributes(&attributes, exchange_kernel<2>),
                        cudaFuncGetAttributes(&attributes, exchange_kernel<8>),
                        cudaFuncGetAttributes(&attributes, exchange_kernel<kMaxExchangePeers>)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace jaxgin
