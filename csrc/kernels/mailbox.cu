// Mailboxes: one-sided put-with-signal into a named heap region of a peer, and a wait that
// collects what arrived.
//
// Flow control: a sender may put into its slot at a receiver only after that receiver consumed the
// sender's previous put there (the receiver's credit signal), so a slot never holds two puts and a
// put never overwrites data that has not been read. Every count lives in device memory (the
// runtime's per-signal consumed counters), so nothing depends on host-side values and CUDA-graph
// replay is safe.
//
// Two ways a put travels (mailbox.h says which one a pair of ranks uses):
//   - lines (LSA peers, payloads of at most JAXGIN_LINE_MAX_BYTES): one CTA stores the payload as
//     flagged lines into the sender's line slot at the receiver; flag = line_flag(put number), the
//     put number being the sender's credit count (consumed[credit]) and the receiver's data count
//     (consumed[data]), which both sides keep alike. No fence, no signal.
//   - slots: the payload is split over `put_parts` CTAs; each copies its part (LSA stores or a GIN
//     put from a staging slot) and signals once; the receiver counts a put as arrived when all of
//     its parts have.
#include "mailbox.h"
#include "jaxgin_op_table.h"  // generated: the preload hook this file defines

#include "../device/jaxgin_inline.h"

namespace jaxgin {
namespace {

constexpr int kThreads = 512;

struct mailbox_header {
  uint32_t put_done;   // CTAs of the running put that finished (the last one resets it)
  uint32_t wait_done;  // CTAs of the running wait's copy that finished
  uint32_t waits;      // waits finished on this mailbox (the last CTA of each advances it)
  uint32_t decided;    // waits + 1 once the running wait's CTA 0 published `taken`
  uint64_t taken;      // the senders the running wait takes, as a mask
  uint8_t unused[kMailboxHeaderBytes - 24];
};
static_assert(sizeof(mailbox_header) == kMailboxHeaderBytes, "mailbox header layout");
static_assert(kMaxExchangePeers <= 64, "a wait keeps the senders it took in a 64-bit mask");

__device__ __forceinline__ mailbox_header* header(const mailbox_desc& box) {
  return reinterpret_cast<mailbox_header*>(box.heap + box.offset);
}
__device__ __forceinline__ uint64_t slot_offset(const mailbox_desc& box, int index) {
  return box.offset + kMailboxHeaderBytes + (uint64_t)index * box.slot_bytes;
}
__device__ __forceinline__ uint64_t line_slot_offset(const mailbox_desc& box, int sender) {
  return slot_offset(box, box.axis_size + 1) + (uint64_t)sender * box.line_slot_bytes;
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

// The last CTA of a grid to call this gets true (and resets the counter for the next launch). A
// single CTA is last without the fences and the atomic, which sit on a small message's path.
__device__ __forceinline__ bool last_block(uint32_t* counter) {
  if (gridDim.x == 1) return true;
  __threadfence();
  const uint32_t done = atomicAdd(counter, 1u);
  if (done + 1 == gridDim.x) {
    *counter = 0;
    __threadfence();
    return true;
  }
  return false;
}

// One thread waits until `signal` reaches `expected`. This heap's own word of the signal is
// checked first, from the descriptor's address: the common case of a credit that came back long
// ago. Otherwise wait_until sums every part and bounds the wait.
__device__ __forceinline__ void await_signal(const jaxgin_context* ctx, const mailbox_desc& box, uint32_t signal,
                                             uint64_t expected, jaxgin_op_tag op, int peer) {
  if (load_signal_word(reinterpret_cast<const uint64_t*>(box.heap) + signal) >= expected) return;
  wait_until(ctx, signal, expected, op, peer);
}

// Adds 1 to `signal` at axis index `index`: one remote add for an LSA peer, add_signal otherwise.
__device__ __forceinline__ void signal_peer(const jaxgin_context* ctx, const mailbox_desc& box, int index,
                                            uint32_t signal, bool release) {
  if (box.peer_heaps[index] != nullptr)
    remote_add(reinterpret_cast<uint64_t*>(box.peer_heaps[index]) + signal, 1, release);
  else
    add_signal(ctx, box.ranks[index], signal, 1, release);
}

// Thread 0 reads a device-side axis index and fails the program (naming `op`) if it is out of range.
__device__ __forceinline__ int checked_index(const jaxgin_context* ctx, const mailbox_desc& box, const int32_t* index,
                                             jaxgin_op_tag op) {
  const int value = *index;
  if (value < 0 || value >= box.axis_size)
    fail(ctx, JAXGIN_FAULT_BAD_ARGUMENT, op, value, box.signal_base + (uint32_t)box.axis_size, (uint64_t)box.axis_size,
         (uint64_t)(int64_t)value);
  return value;
}

__global__ void __launch_bounds__(kThreads) put_kernel(const jaxgin_context* ctx, const __grid_constant__ mailbox_desc box,
                                                       const char* src, const int32_t* peer_index, int32_t* token) {
  __shared__ int peer;
  __shared__ uint64_t epoch;
  // A line put's payload is read first: it needs no ordering (no peer writes an XLA buffer), so
  // the load overlaps with the peer index, counter and credit loads below.
  const bool line_sized = box.line_slot_bytes > 0;
  uint32_t low = 0, high = 0;
  if (line_sized && linear_thread() < line_count(box.payload_bytes))
    read_line_payload(src, box.payload_bytes, linear_thread(), low, high);
  if (linear_thread() == 0) {
    peer = checked_index(ctx, box, peer_index, JAXGIN_OP_PUT_SIGNAL);
    if (box.peer_heaps[peer] == nullptr) check_peer(ctx, box.ranks[peer], JAXGIN_OP_PUT_SIGNAL);
    // Every earlier put of ours into this mailbox at the peer must have been consumed.
    epoch = box.consumed[credit_signal(box, peer)];
    await_signal(ctx, box, credit_signal(box, peer), epoch, JAXGIN_OP_PUT_SIGNAL, box.ranks[peer]);
  }
  __syncthreads();
  if (puts_as_lines(box, peer)) {  // one CTA: a line-sized payload is one put part
    line* dst = reinterpret_cast<line*>(box.peer_heaps[peer] + line_slot_offset(box, box.my_index));
    const uint32_t flag = line_flag(epoch);
    const uint64_t lines = line_count(box.payload_bytes);
    if (linear_thread() < lines) store_line(dst + linear_thread(), low, high, flag);
    for (uint64_t i = linear_thread() + block_threads(); i < lines; i += block_threads()) {
      read_line_payload(src, box.payload_bytes, i, low, high);
      store_line(dst + i, low, high, flag);
    }
    if (linear_thread() == 0) {
      *token = peer;
      box.consumed[credit_signal(box, peer)] = epoch + 1;
    }
    return;
  }
  uint64_t begin, end;
  part_range(box.payload_bytes, blockIdx.x, gridDim.x, begin, end);
  const uint64_t dst = slot_offset(box, box.my_index) + begin;
  const uint32_t data = data_signal(box, box.my_index);
  if (box.peer_heaps[peer] == nullptr) {  // GIN
    const uint64_t staging = slot_offset(box, box.axis_size) + begin;
    cta_copy(box.heap + staging, src + begin, end - begin);
    __syncthreads();
    if (linear_thread() == 0)  // the staging slot is reused by the next put
      gin_put_and_release_source(ctx, box.ranks[peer], dst, staging, end - begin, data, JAXGIN_OP_PUT_SIGNAL);
  } else {
    cta_copy(box.peer_heaps[peer] + dst, src + begin, end - begin);
    __syncthreads();
    if (linear_thread() == 0) signal_peer(ctx, box, peer, data, /*release=*/true);
  }
  if (linear_thread() == 0) {
    if (blockIdx.x == 0) *token = peer;
    if (last_block(&header(box)->put_done)) box.consumed[credit_signal(box, peer)] = epoch + 1;
  }
}

// CTA-collective: whether sender `s`'s next put is complete in this rank's mailbox (every thread
// gets the same answer), `consumed` being the sender's consumed count. Reads only.
__device__ bool put_complete(const jaxgin_context* ctx, const mailbox_desc& box, int s, uint64_t consumed) {
  const uint32_t signal = data_signal(box, s);
  if (puts_as_lines(box, s)) {
    const line* src = reinterpret_cast<const line*>(box.heap + line_slot_offset(box, s));
    const uint32_t flag = line_flag(consumed);
    bool mine = true;
    for (uint64_t i = linear_thread(); i < line_count(box.payload_bytes); i += block_threads())
      mine &= line_arrived(load_line(src + i), flag);
    return __syncthreads_and(mine);
  }
  return __syncthreads_or(linear_thread() == 0 && read_signal(ctx, signal) - consumed >= box.put_parts);
}

// CTA-collective: waits until puts of at least `count` senders are complete, takes every complete
// one (consumed counts advanced) and returns them as a mask.
__device__ uint64_t decide(const jaxgin_context* ctx, const mailbox_desc& box, int32_t count) {
  // Every sender's consumed count, read once and all at once: only this wait advances them, after
  // it decided, so the polls below need not read them again (one round trip to memory less each).
  __shared__ uint64_t consumed[kMaxExchangePeers];
  for (int s = (int)linear_thread(); s < box.axis_size; s += (int)block_threads())
    consumed[s] = box.consumed[data_signal(box, s)];
  __syncthreads();
  uint64_t taken = 0;  // the same in every thread: put_complete answers alike
  uint64_t deadline = 0;
  while (true) {
    for (int s = 0; s < box.axis_size; s++)
      if (!(taken >> s & 1) && put_complete(ctx, box, s, consumed[s])) taken |= 1ull << s;
    if (__popcll(taken) >= count) break;
    if (linear_thread() == 0) {
      const uint64_t now = clock_ns();
      if (deadline == 0) deadline = now + ctx->timeout_ns;
      else if (now > deadline)
        fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, JAXGIN_OP_WAIT_SIGNAL, -1, box.signal_base, (uint64_t)count,
             (uint64_t)__popcll(taken));
    }
  }
  if (linear_thread() == 0) {
    for (int s = 0; s < box.axis_size; s++)
      if (taken >> s & 1) box.consumed[data_signal(box, s)] = consumed[s] + box.put_parts;  // a line put is one part
  }
  return taken;
}

// Thread 0 of CTA 0, after deciding wait number `wait` + 1: the other CTAs may copy.
__device__ __forceinline__ void publish_decision(mailbox_header* h, uint32_t wait, uint64_t taken) {
  *reinterpret_cast<volatile uint64_t*>(&h->taken) = taken;
  __threadfence();
  *reinterpret_cast<volatile uint32_t*>(&h->decided) = wait + 1;
}

// Thread 0 of any other CTA: CTA 0's decision for wait number `wait` + 1. Bounded at twice the
// timeout, so that a timeout of CTA 0's own wait is the fault reported.
__device__ uint64_t await_decision(const jaxgin_context* ctx, const mailbox_desc& box, const mailbox_header* h,
                                   uint32_t wait, int32_t count) {
  const volatile uint32_t* decided = &h->decided;
  uint64_t deadline = 0;
  while (*decided != wait + 1) {
    const uint64_t now = clock_ns();
    if (deadline == 0) deadline = now + 2 * ctx->timeout_ns;
    else if (now > deadline)
      fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, JAXGIN_OP_WAIT_SIGNAL, -1, box.signal_base, (uint64_t)count, 0);
  }
  __threadfence();
  return *reinterpret_cast<const volatile uint64_t*>(&h->taken);
}

// Part [begin, end) of sender `s`'s taken put, from its slot or its lines, into `row`.
__device__ __forceinline__ void copy_out(const jaxgin_context* ctx, const mailbox_desc& box, int s, char* row,
                                         uint64_t begin, uint64_t end) {
  if (puts_as_lines(box, s)) {
    // begin is a multiple of 16 and end is too unless it is the payload's end: whole lines.
    const line* src = reinterpret_cast<const line*>(box.heap + line_slot_offset(box, s));
    for (uint64_t i = begin / 8 + linear_thread(); i < (end + 7) / 8; i += block_threads()) {
      const line v = load_line(src + i);
      write_line_payload(row, box.payload_bytes, i, v.low, v.high);
    }
  } else {
    cta_copy(row + begin, box.heap + slot_offset(box, s) + begin, end - begin);
  }
}

// Returns the credits of the taken senders once every CTA read its part, and ends wait number
// `wait` + 1 (the last CTA does both).
__device__ __forceinline__ void return_credits(const jaxgin_context* ctx, const mailbox_desc& box, uint64_t taken,
                                               uint32_t wait) {
  __syncthreads();  // every read of the slots precedes the credits that free them
  if (linear_thread() == 0 && last_block(&header(box)->wait_done)) {
    for (int s = 0; s < box.axis_size; s++)
      if (taken >> s & 1) signal_peer(ctx, box, s, credit_signal(box, box.my_index), /*release=*/false);
    header(box)->waits = wait + 1;
  }
}

// Waits for puts of at least `count` senders, copies the taken ones into their rows of `out` and
// marks them in `taken_rows` if given (1 taken, 0 not; the other rows of `out` are left as they
// were: the caller's select zeroes them where it reads them); the last CTA returns the credits.
// CTA 0 decides which senders the wait takes and publishes that in the header for the other CTAs,
// which wait for it there: one launch, not a deciding kernel and a copying one. Every CTA reads the
// wait's number before any can end it.
__global__ void __launch_bounds__(kThreads) collect_kernel(const jaxgin_context* ctx,
                                                           const __grid_constant__ mailbox_desc box, int32_t count,
                                                           char* out, int32_t* taken_rows) {
  __shared__ uint64_t decision;
  mailbox_header* h = header(box);
  const uint32_t wait = *reinterpret_cast<const volatile uint32_t*>(&h->waits);
  if (blockIdx.x == 0) {
    const uint64_t taken = decide(ctx, box, count);
    for (int s = (int)linear_thread(); taken_rows != nullptr && s < box.axis_size; s += (int)block_threads())
      taken_rows[s] = (int32_t)(taken >> s & 1);
    if (linear_thread() == 0) {
      decision = taken;
      if (gridDim.x > 1) publish_decision(h, wait, taken);
    }
  } else if (linear_thread() == 0) {
    decision = await_decision(ctx, box, h, wait, count);
  }
  __syncthreads();
  const uint64_t taken = decision;
  uint64_t begin, end;
  part_range(box.payload_bytes, blockIdx.x, gridDim.x, begin, end);
  for (int s = 0; s < box.axis_size; s++)
    if (taken >> s & 1) copy_out(ctx, box, s, out + (uint64_t)s * box.payload_bytes, begin, end);
  return_credits(ctx, box, taken, wait);
}

// Waits for the next put of the sender at axis index *source and copies it to `out`. Every CTA
// reads the consumed count before any can advance it: the last CTA to finish does, after all
// arrived at last_block.
__global__ void __launch_bounds__(kThreads) wait_from_kernel(const jaxgin_context* ctx,
                                                             const __grid_constant__ mailbox_desc box,
                                                             const int32_t* source, char* out) {
  __shared__ int s;
  if (linear_thread() == 0) s = checked_index(ctx, box, source, JAXGIN_OP_WAIT_SIGNAL_FROM);
  __syncthreads();
  const uint32_t signal = data_signal(box, s);
  uint64_t begin, end;
  part_range(box.payload_bytes, blockIdx.x, gridDim.x, begin, end);
  if (puts_as_lines(box, s)) {  // one CTA: at most 8 KiB of output
    const line* src = reinterpret_cast<const line*>(box.heap + line_slot_offset(box, s));
    const uint64_t expected = box.consumed[signal];
    for (uint64_t i = linear_thread(); i < line_count(box.payload_bytes); i += block_threads()) {
      const line v = await_line(ctx, src + i, line_flag(expected), [&] {
        fail(ctx, JAXGIN_FAULT_WAIT_TIMEOUT, JAXGIN_OP_WAIT_SIGNAL_FROM, box.ranks[s], signal, expected + 1, expected);
      });
      write_line_payload(out, box.payload_bytes, i, v.low, v.high);
    }
  } else {
    if (linear_thread() == 0)
      await_signal(ctx, box, signal, box.consumed[signal] + box.put_parts, JAXGIN_OP_WAIT_SIGNAL_FROM, box.ranks[s]);
    __syncthreads();
    cta_copy(out + begin, box.heap + slot_offset(box, s) + begin, end - begin);
  }
  __syncthreads();  // every read of the slot precedes the credit that frees it
  if (linear_thread() == 0 && last_block(&header(box)->wait_done)) {
    box.consumed[signal] += box.put_parts;
    signal_peer(ctx, box, s, credit_signal(box, box.my_index), /*release=*/false);
  }
}

// About 16 KiB of output per CTA, at most 64 CTAs: a CTA copies tens of GB/s, so a message of
// hundreds of KiB needs tens of them (docs/measurements.md, twenty-second session).
uint32_t copy_parts(uint64_t bytes) {
  const uint64_t wanted = (bytes + (16u << 10) - 1) / (16u << 10);
  return wanted <= 1 ? 1 : wanted > 64 ? 64 : (uint32_t)wanted;
}

}  // namespace

cudaError_t launch_put(const jaxgin_context* device_ctx, const mailbox_desc& box, const void* src,
                       const int32_t* peer_index, int32_t* token, cudaStream_t stream) {
  put_kernel<<<box.put_parts, kThreads, 0, stream>>>(device_ctx, box, static_cast<const char*>(src), peer_index,
                                                     token);
  return cudaGetLastError();
}

cudaError_t launch_wait(const jaxgin_context* device_ctx, const mailbox_desc& box, int32_t count, void* out,
                        int32_t* taken_rows, cudaStream_t stream) {
  const uint32_t parts = copy_parts(box.payload_bytes * (uint64_t)box.axis_size);
  collect_kernel<<<parts, kThreads, 0, stream>>>(device_ctx, box, count, static_cast<char*>(out), taken_rows);
  return cudaGetLastError();
}

cudaError_t launch_wait_from(const jaxgin_context* device_ctx, const mailbox_desc& box, const int32_t* source,
                             void* out, cudaStream_t stream) {
  const uint32_t parts = copy_parts(box.payload_bytes);  // 1 for a line-sized payload
  wait_from_kernel<<<parts, kThreads, 0, stream>>>(device_ctx, box, source, static_cast<char*>(out));
  return cudaGetLastError();
}

cudaError_t preload_mailbox_kernels() {
  cudaFuncAttributes attributes;
  for (cudaError_t e : {cudaFuncGetAttributes(&attributes, put_kernel),
                        cudaFuncGetAttributes(&attributes, collect_kernel),
                        cudaFuncGetAttributes(&attributes, wait_from_kernel)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace jaxgin
