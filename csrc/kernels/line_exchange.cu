// The line exchange (see line_exchange.h): one CTA per task of this rank's part of an exchange
// plan: send a message as lines, receive one, or copy the local part.
#include "line_exchange.h"
#include "jaxgin_op_table.h"  // generated: the preload hook this file defines

#include "../device/jaxgin_inline.h"

namespace jaxgin {
namespace {

constexpr uint32_t kMaxThreads = 512;
constexpr uint64_t kLinesPerSlot = JAXGIN_LINE_SLOT_BYTES / sizeof(line);

enum line_task_kind : int32_t { kSendLines = 0, kReceiveLines = 1, kCopyLocal = 2 };

// Everything one CTA touches, as addresses. A send task owns lane 0 towards `peer`: its chunk
// counter, the credit signal the peer bumps in this heap, the peer's line slots for messages from
// this rank and the data signal there. A receive task is the mirror image.
struct line_task {
  int32_t kind;
  int32_t peer;              // global rank, for fault reports
  uint32_t signal;           // the signal id waited on (send: credit, receive: data), for fault reports
  const char* src;           // send, copy: XLA buffer
  char* dst;                 // receive, copy: XLA buffer
  line* lines;               // send: the peer's slot 0 for this rank; receive: this heap's slot 0 for the peer
  uint64_t* counter;         // lane 0's chunk counter (send: channel_sent, receive: channel_received)
  const uint64_t* credit;    // send: this heap's credit signal from the peer
  uint64_t* peer_signal;     // send: data signal at the peer; receive: credit signal at the peer
};

template <int kCapacity>
struct line_plan_of {
  const jaxgin_context* ctx;  // read only on cold paths: the timeout after many polls, fault reports
  uint64_t bytes;
  uint32_t op;
  uint32_t slots;
  int32_t count;
  line_task tasks[kCapacity];
};

template <class Plan>
__device__ void send_lines(const Plan& plan, const line_task& t) {
  const uint64_t lines = line_count(plan.bytes);
  const uint64_t first = linear_thread();
  // The payload first: no peer writes an XLA buffer, so these loads need no ordering and overlap
  // with the counter and credit loads, which do not depend on each other either.
  uint32_t low = 0, high = 0;
  if (first < lines) read_line_payload(t.src, plan.bytes, first, low, high);
  const uint64_t n = *t.counter;
  const uint64_t credit = load_signal_word(t.credit);  // issued before n is known, not after
  // Slot n % slots is free once the receiver consumed message n - slots. Every thread acquires
  // the credit itself, so each one's stores below are ordered after it without a barrier; a
  // credit not yet back is waited for (bounded) like any signal.
  if (n >= plan.slots && credit < n + 1 - plan.slots)
    wait_until(plan.ctx, t.signal, n + 1 - plan.slots, (jaxgin_op_tag)plan.op, t.peer);
  line* slot = t.lines + (n % plan.slots) * kLinesPerSlot;
  const uint32_t flag = line_flag(n);
  if (first < lines) store_line(slot + first, low, high, flag);
  for (uint64_t i = first + block_threads(); i < lines; i += block_threads()) {
    read_line_payload(t.src, plan.bytes, i, low, high);
    store_line(slot + i, low, high, flag);
  }
  __syncthreads();  // every thread has read the counter before it changes
  if (first == 0) {
    // Lane 0's data signal counts every chunk (ring receivers wait for absolute counts); no one
    // waits on it for a line message, so the add needs no ordering.
    remote_add(t.peer_signal, 1, /*release=*/false);
    *t.counter = n + 1;
  }
}

template <class Plan>
__device__ void receive_lines(const Plan& plan, const line_task& t) {
  const uint64_t lines = line_count(plan.bytes);
  const uint64_t n = *t.counter;
  const line* slot = t.lines + (n % plan.slots) * kLinesPerSlot;
  const uint32_t flag = line_flag(n);
  for (uint64_t i = linear_thread(); i < lines; i += block_threads()) {
    const line v = await_line(plan.ctx, slot + i, flag, [&] {
      fail(plan.ctx, JAXGIN_FAULT_WAIT_TIMEOUT, (jaxgin_op_tag)plan.op, t.peer, t.signal, n + 1,
           read_signal(plan.ctx, t.signal));
    });
    write_line_payload(t.dst, plan.bytes, i, v.low, v.high);
  }
  __syncthreads();  // every line was read (and the counter by every thread) before the credit frees the slot
  if (linear_thread() == 0) {
    remote_add(t.peer_signal, 1, /*release=*/false);
    *t.counter = n + 1;
  }
}

template <int kCapacity>
__global__ void __launch_bounds__(kMaxThreads) line_exchange_kernel(const __grid_constant__ line_plan_of<kCapacity> plan) {
  const line_task& t = plan.tasks[blockIdx.x];
  if (t.kind == kSendLines) send_lines(plan, t);
  else if (t.kind == kReceiveLines) receive_lines(plan, t);
  else cta_copy(t.dst, t.src, plan.bytes);
}

constexpr int kMaxTasks = 2 * kMaxExchangePeers;  // a plan entry makes at most a send and a receive

// This rank's tasks for `plan`; returns how many.
int plan_tasks(const jaxgin_context& c, const std::vector<char*>& lsa_heaps, const exchange_plan& plan,
               line_task (&tasks)[kMaxTasks]) {
  auto signal_at = [](char* heap, uint32_t signal) { return reinterpret_cast<uint64_t*>(heap) + signal; };
  int count = 0;
  for (int e = 0; e < plan.count; e++) {
    const exchange_peer& p = plan.peers[e];
    if (p.rank == c.rank) {
      if (p.roles == (kSend | kReceive)) tasks[count++] = line_task{kCopyLocal, p.rank, 0, p.src, p.dst};
      continue;
    }
    const uint64_t lane0 = (uint64_t)p.rank * c.channel_lanes;
    if (p.roles & kSend) {
      line_task t{kSendLines, p.rank, channel_credit_signal(&c, p.rank, 0), p.src, nullptr};
      t.lines = reinterpret_cast<line*>(lsa_heaps[p.rank] + channel_line_offset(&c, c.rank, 0));
      t.counter = c.channel_sent + lane0;
      t.credit = signal_at(c.heap, t.signal);
      t.peer_signal = signal_at(lsa_heaps[p.rank], channel_data_signal(&c, c.rank, 0));
      tasks[count++] = t;
    }
    if (p.roles & kReceive) {
      line_task t{kReceiveLines, p.rank, channel_data_signal(&c, p.rank, 0), nullptr, p.dst};
      t.lines = reinterpret_cast<line*>(c.heap + channel_line_offset(&c, p.rank, 0));
      t.counter = c.channel_received + lane0;
      t.peer_signal = signal_at(lsa_heaps[p.rank], channel_credit_signal(&c, c.rank, 0));
      tasks[count++] = t;
    }
  }
  return count;
}

// Launches the kernel whose parameter holds kCapacity tasks (>= count): parameters are copied at
// every launch, so a ppermute's two tasks should not carry room for a hundred.
template <int kCapacity>
cudaError_t launch_with_capacity(const jaxgin_context* device_ctx, const exchange_plan& plan, uint32_t slots,
                                 const line_task* tasks, int count, cudaStream_t stream) {
  line_plan_of<kCapacity> lp{};
  lp.ctx = device_ctx;
  lp.bytes = plan.bytes;
  lp.op = plan.op;
  lp.slots = slots;
  lp.count = count;
  for (int i = 0; i < count; i++) lp.tasks[i] = tasks[i];
  // One thread per line, in whole warps; a larger message loops (at most two lines per thread).
  const uint64_t lines = line_count(plan.bytes);
  const uint32_t threads = lines >= kMaxThreads ? kMaxThreads : (uint32_t)((lines + 31) / 32 * 32);
  line_exchange_kernel<kCapacity><<<(uint32_t)count, threads, 0, stream>>>(lp);
  return cudaGetLastError();
}

}  // namespace

bool fits_line_exchange(const jaxgin_context& c, const std::vector<char*>& lsa_heaps, const exchange_plan& plan) {
  if (plan.bytes == 0 || plan.bytes > JAXGIN_LINE_MAX_BYTES || c.force_gin) return false;
  for (int e = 0; e < plan.count; e++) {
    const int rank = plan.peers[e].rank;
    if (rank == c.rank) continue;
    if (rank < 0 || (size_t)rank >= lsa_heaps.size() || lsa_heaps[rank] == nullptr) return false;
  }
  return true;
}

cudaError_t launch_line_exchange(const jaxgin_context* device_ctx, const jaxgin_context& host_ctx,
                                 const std::vector<char*>& lsa_heaps, const exchange_plan& plan, cudaStream_t stream) {
  line_task tasks[kMaxTasks];
  const int count = plan_tasks(host_ctx, lsa_heaps, plan, tasks);
  const uint32_t slots = host_ctx.channel_slots;
  if (count == 0) return cudaSuccess;
  if (count <= 2) return launch_with_capacity<2>(device_ctx, plan, slots, tasks, count, stream);
  if (count <= 8) return launch_with_capacity<8>(device_ctx, plan, slots, tasks, count, stream);
  if (count <= 32) return launch_with_capacity<32>(device_ctx, plan, slots, tasks, count, stream);
  return launch_with_capacity<kMaxTasks>(device_ctx, plan, slots, tasks, count, stream);
}

cudaError_t preload_line_exchange_kernels() {
  cudaFuncAttributes attributes;
  for (cudaError_t e : {cudaFuncGetAttributes(&attributes, line_exchange_kernel<2>),
                        cudaFuncGetAttributes(&attributes, line_exchange_kernel<8>),
                        cudaFuncGetAttributes(&attributes, line_exchange_kernel<32>),
                        cudaFuncGetAttributes(&attributes, line_exchange_kernel<kMaxTasks>)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace jaxgin
