// Mailboxes: one-sided put-with-signal into a named heap region of a peer, and a wait that
// collects what arrived.
//
// Flow control: a sender may put into its slot at a receiver only after that receiver consumed the
// sender's previous put there (the receiver's credit signal), so a slot never holds two puts and a
// put never overwrites data that has not been read. Every count lives in device memory (the
// runtime's per-signal consumed counters), so nothing depends on host-side values and CUDA-graph
// replay is safe. A put is split over `put_parts` CTAs; each signals once, and the receiver counts
// a put as arrived when all of its parts have.
#include "mailbox.h"
#include "preload.h"

#include "../device/impl/put__funcs.h"

namespace jaxgin {
namespace {

constexpr int kThreads = 512;

struct mailbox_header {
  uint32_t put_done;   // CTAs of the running put that finished (the last one resets it)
  uint32_t wait_done;  // CTAs of the running wait's copy that finished
  uint8_t arrived[kMailboxHeaderBytes - 8];  // per sender: taken by the last wait
};
static_assert(sizeof(mailbox_header) == kMailboxHeaderBytes, "mailbox header layout");

__device__ __forceinline__ mailbox_header* header(const jaxgin_context* ctx, const mailbox_desc& box) {
  return reinterpret_cast<mailbox_header*>(ctx->heap + box.offset);
}
__device__ __forceinline__ uint64_t slot_offset(const mailbox_desc& box, int index) {
  return box.offset + kMailboxHeaderBytes + (uint64_t)index * box.slot_bytes;
}
__device__ __forceinline__ uint32_t data_signal(const mailbox_desc& box, int sender) {
  return box.signal_base + (uint32_t)sender;
}
__device__ __forceinline__ uint32_t credit_signal(const mailbox_desc& box, int receiver) {
  return box.signal_base + (uint32_t)(box.axis_size + receiver);
}

// [begin, end) of `bytes` that part `part` of `parts` handles, 16-byte aligned starts.
__device__ __forceinline__ void part_range(uint64_t bytes, uint32_t part, uint32_t parts, uint64_t& begin,
                                           uint64_t& end) {
  const uint64_t per = ((bytes + parts - 1) / parts + 15) / 16 * 16;
  begin = min(bytes, (uint64_t)part * per);
  end = min(bytes, begin + per);
}

// The last CTA of a grid to call this gets true (and resets the counter for the next launch).
__device__ __forceinline__ bool last_block(uint32_t* counter) {
  __threadfence();
  const uint32_t done = atomicAdd(counter, 1u);
  if (done + 1 == gridDim.x) {
    *counter = 0;
    __threadfence();
    return true;
  }
  return false;
}

__global__ void __launch_bounds__(kThreads) put_kernel(const jaxgin_context* ctx, const __grid_constant__ mailbox_desc box,
                                                       const char* src, const int32_t* peer_index, int32_t* token) {
  __shared__ int peer, rank;
  __shared__ uint64_t epoch;
  const uint32_t credit_base = box.signal_base + (uint32_t)box.axis_size;
  if (linear_thread() == 0) {
    peer = *peer_index;
    if (peer < 0 || peer >= box.axis_size)
      fail(ctx, JAXGIN_FAULT_BAD_ARGUMENT, JAXGIN_OP_PUT_SIGNAL, peer, credit_base, (uint64_t)box.axis_size,
           (uint64_t)(int64_t)peer);
    rank = box.ranks[peer];
    check_peer(ctx, rank, JAXGIN_OP_PUT_SIGNAL);
    // Every earlier put of ours into this mailbox at `rank` must have been consumed.
    epoch = ctx->consumed[credit_signal(box, peer)];
    wait_until(ctx, credit_signal(box, peer), epoch, JAXGIN_OP_PUT_SIGNAL, rank);
  }
  __syncthreads();
  uint64_t begin, end;
  part_range(box.payload_bytes, blockIdx.x, gridDim.x, begin, end);
  const uint64_t dst = slot_offset(box, box.my_index) + begin;
  const uint32_t data = data_signal(box, box.my_index);
  if (routes_through_gin(ctx, rank)) {
    const uint64_t staging = slot_offset(box, box.axis_size) + begin;
    cta_copy(ctx->heap + staging, src + begin, end - begin);
    __syncthreads();
    if (linear_thread() == 0) {
      ncclGin g(ctx->comm, gin_context_index(ctx));
      g.put(ncclTeamWorld(ctx->comm), rank, ctx->window, dst, ctx->window, staging, end - begin,
            GinPutSignal{data, 1});
      g.flush(ncclCoopThread());  // src may be reused by XLA once the kernel ends
    }
  } else {
    cta_copy(static_cast<char*>(ncclGetPeerPointer(ctx->window, dst, rank)), src + begin, end - begin);
    __syncthreads();
    if (linear_thread() == 0) add_signal(ctx, rank, data, 1);
  }
  if (linear_thread() == 0) {
    if (blockIdx.x == 0) *token = peer;
    if (last_block(&header(ctx, box)->put_done)) ctx->consumed[credit_signal(box, peer)] = epoch + 1;
  }
}

// One thread: waits until `count` senders' puts are complete, records which ones it takes.
__device__ void decide(const jaxgin_context* ctx, const mailbox_desc& box, int32_t count) {
  mailbox_header* h = header(ctx, box);
  const uint64_t deadline = clock_ns() + ctx->timeout_ns;
  int complete = 0;
  while (true) {
    complete = 0;
    for (int s = 0; s < box.axis_size; s++) {
      const uint32_t signal = data_signal(box, s);
      const bool done = read_signal(ctx, signal) - ctx->consumed[signal] >= box.put_parts;
      h->arrived[s] = done;
      complete += done;
    }
    if (complete >= count) break;
    if (clock_ns() > deadline)
      fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, JAXGIN_OP_WAIT_SIGNAL, -1, box.signal_base, (uint64_t)count,
           (uint64_t)complete);
  }
  for (int s = 0; s < box.axis_size; s++)
    if (h->arrived[s]) ctx->consumed[data_signal(box, s)] += box.put_parts;
}

__global__ void decide_kernel(const jaxgin_context* ctx, const __grid_constant__ mailbox_desc box, int32_t count) {
  if (linear_thread() == 0) decide(ctx, box, count);
}

// Copies the taken slots into `out` (zeros elsewhere), then the last CTA returns the credits.
// With `also_decide` (single-CTA launches) it first makes the decision itself.
template <bool also_decide>
__global__ void __launch_bounds__(kThreads) collect_kernel(const jaxgin_context* ctx,
                                                           const __grid_constant__ mailbox_desc box, int32_t count,
                                                           char* out) {
  mailbox_header* h = header(ctx, box);
  if (also_decide) {
    if (linear_thread() == 0) decide(ctx, box, count);
    __syncthreads();
  }
  uint64_t begin, end;
  part_range(box.payload_bytes, blockIdx.x, gridDim.x, begin, end);
  for (int s = 0; s < box.axis_size; s++) {
    char* row = out + (uint64_t)s * box.payload_bytes;
    if (h->arrived[s]) {
      cta_copy(row + begin, ctx->heap + slot_offset(box, s) + begin, end - begin);
    } else {
      for (uint64_t i = begin + linear_thread(); i < end; i += block_threads()) row[i] = 0;
    }
  }
  __syncthreads();  // every read of the slots precedes the credits that free them
  if (linear_thread() == 0 && last_block(&h->wait_done)) {
    for (int s = 0; s < box.axis_size; s++)
      if (h->arrived[s]) add_signal(ctx, box.ranks[s], credit_signal(box, box.my_index), 1, /*release=*/false);
  }
}

}  // namespace

cudaError_t launch_put(const jaxgin_context* device_ctx, const mailbox_desc& box, const void* src,
                       const int32_t* peer_index, int32_t* token, cudaStream_t stream) {
  put_kernel<<<box.put_parts, kThreads, 0, stream>>>(device_ctx, box, static_cast<const char*>(src), peer_index,
                                                     token);
  return cudaGetLastError();
}

cudaError_t launch_wait(const jaxgin_context* device_ctx, const mailbox_desc& box, int32_t count, void* out,
                        cudaStream_t stream) {
  // About 256 KiB of output per CTA, at most 64 CTAs.
  const uint64_t total = box.payload_bytes * (uint64_t)box.axis_size;
  const uint64_t wanted = (total + (256u << 10) - 1) / (256u << 10);
  const uint32_t parts = wanted <= 1 ? 1 : wanted > 64 ? 64 : (uint32_t)wanted;
  if (parts == 1) {
    collect_kernel<true><<<1, kThreads, 0, stream>>>(device_ctx, box, count, static_cast<char*>(out));
  } else {
    decide_kernel<<<1, 32, 0, stream>>>(device_ctx, box, count);
    collect_kernel<false><<<parts, kThreads, 0, stream>>>(device_ctx, box, count, static_cast<char*>(out));
  }
  return cudaGetLastError();
}

cudaError_t preload_mailbox_kernels() {
  cudaFuncAttributes attributes;
  for (cudaError_t e : {cudaFuncGetAttributes(&attributes, put_kernel), cudaFuncGetAttributes(&attributes, decide_kernel),
                        cudaFuncGetAttributes(&attributes, collect_kernel<true>),
                        cudaFuncGetAttributes(&attributes, collect_kernel<false>)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace jaxgin
