// XLA FFI handlers behind jaxgin.fused's chunked implementation: a matmul split into one cuBLAS
// call per peer's chunk, each chunk handed to its peer by the copy engine while the next one is
// computed, so the exchange runs beside the matmul instead of after it and takes no SMs from it.
//
// matmul_all_to_all (pull): this GPU computes the chunk bound for index t into its own heap slot[t]
// and hands it over (t's ready count); t's copy stream for this GPU waits for that count and copies
// the chunk over NVLink straight into t's result, then returns a credit. Chunks are computed in the
// order t = me+1, me+2, ..., so each peer hands this GPU its chunk in the order they are awaited; the
// own chunk comes last, written by cuBLAS straight into the result, and hides the last copy.
//
// matmul_reduce_scatter: the same exchange of this GPU's partial chunks, stacked by source; the
// owner's sum over sources follows in XLA (one fused pass over the stacked partials).
//
// all_gather_matmul (push): one copy stream copies this GPU's shard into every peer's slot[me], the
// next peer first, and hands it over; XLA's stream multiplies the own shard into the result, then
// each peer's shard from its slot as it arrives, and returns a credit once that matmul read it.
//
// The pulls of the exchange run on a copy stream per peer position, so the copies from different
// peers overlap (on different copy engines) instead of queueing behind each other; the pushes of
// all_gather_matmul share one, so that the shard each peer needs first lands first.
//
// Hand-overs and credits are stream memory writes (cuStreamWriteValue64 into the peer's count),
// issued from a signal stream of their own once an event on XLA's stream says the matmul they
// announce is done, so that no write (and the system-scope barrier before it) sits between two
// matmuls on XLA's stream.
// A copy stream waits with a stream memory operation (cuStreamWaitValue64), not a kernel: a
// waiting kernel needs an SM, and while cuBLAS holds every SM it is not scheduled until the matmul
// ends, which serialised the copy after it (2 x H200, 8192 x 4096 x 4096: 84 us over the matmul
// alone). Such a wait has no timeout, so XLA's stream also waits for every chunk with a bounded
// kernel after the last matmul: a peer that never delivers faults the call there, with the error
// naming it, and the fault ends the copy streams' waits with the context.
//
// Slots are reused from call to call: a call of all_gather_matmul waits (begin_call) until every
// peer returned the credit for the previous one; an exchange whose peers pull waits for this call's
// credits at its end instead, with its chunks (end_exchange: one bounded kernel a call, not two,
// and a peer's credit has usually come back by then). The counts a call waits for come from the
// host, which sees every call: the handlers are not offered to XLA's command buffers. XLA adds a
// captured custom call to its graph as a child graph, and on 2 x H200 (driver 580) CUDA refused
// that for one of these calls (CUDA_ERROR_NOT_SUPPORTED: an all_gather_matmul of a float32 100 x 72
// shard); XLA runs them between its graphs instead.
#include <cuda.h>

#include <mutex>
#include <string>

#include "../kernels/chunk_handoff.h"
#include "../runtime/cublas_loader.h"
#include "../runtime/driver_entry.h"
#include "common.h"
#include "triton_kernel.h"

namespace jaxgin {

// What the chunked matmul ops keep per GPU (an OpState of the runtime), made on their first call: a
// cuBLAS handle and its workspace, a copy stream per peer position with the events that fork them
// from XLA's stream and join them back (for the copies that run beside the matmuls; one per peer so
// they overlap), and the calls made so far of each op configuration (by heap offset of its block).
struct ChunkedMatmulState : OpState {
  void* blas = nullptr;
  void* workspace = nullptr;
  cudaStream_t sides[kMaxExchangePeers] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t joins[kMaxExchangePeers] = {};
  // The hand-overs' and credits' writes, each after a mark recorded on XLA's stream. It only writes
  // heap words and never waits for a peer, so XLA's stream does not join it.
  cudaStream_t signals = nullptr;
  cudaEvent_t marks[kMaxExchangePeers] = {};
  int priority = 0;  // the copy streams' and the signal stream's (the highest)
  std::map<int64_t, uint64_t> calls;

  std::string release() override {
    std::string first;
    auto note = [&](bool failed, const char* what) {
      if (failed && first.empty()) first = what;
    };
    if (blas) note(blas::api().destroy(blas) != 0, "cublasDestroy failed");
    if (workspace) note(cudaFree(workspace) != cudaSuccess, "cudaFree(cuBLAS workspace) failed");
    if (fork) note(cudaEventDestroy(fork) != cudaSuccess, "cudaEventDestroy failed");
    for (int i = 0; i < kMaxExchangePeers; i++) {
      if (joins[i]) note(cudaEventDestroy(joins[i]) != cudaSuccess, "cudaEventDestroy failed");
      if (marks[i]) note(cudaEventDestroy(marks[i]) != cudaSuccess, "cudaEventDestroy failed");
      if (sides[i]) note(cudaStreamDestroy(sides[i]) != cudaSuccess, "cudaStreamDestroy(side stream) failed");
      sides[i] = nullptr;
      joins[i] = marks[i] = nullptr;
    }
    if (signals) note(cudaStreamDestroy(signals) != cudaSuccess, "cudaStreamDestroy(signal stream) failed");
    signals = nullptr;
    blas = workspace = nullptr;
    fork = nullptr;
    calls.clear();
    return first;
  }
};

namespace ffi_support {
namespace {

// cuBLAS's recommended workspace for Hopper; without one it would allocate during graph capture.
constexpr size_t kBlasWorkspaceBytes = 32u << 20;

std::mutex make_mutex;

// cuStreamWaitValue64 and cuStreamWriteValue64 share this signature.
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

StreamValueFn stream_memory_op(const char* name) {
  const StreamValueFn fn = driver_entry_point<StreamValueFn>(name);
  if (fn == nullptr) throw Error(std::string("the CUDA driver does not provide ") + name);
  return fn;
}

void check_memory_op(CUresult r, const char* name, int device) {
  if (r != CUDA_SUCCESS)
    throw Error(std::string(name) + " failed with CUresult " + std::to_string((int)r) + " on CUDA device " +
                std::to_string(device));
}

// A copy stream waits until `word` >= value without taking an SM.
void stream_wait_at_least(cudaStream_t stream, const uint64_t* word, uint64_t value, int device) {
  static const StreamValueFn wait = stream_memory_op("cuStreamWaitValue64");
  check_memory_op(wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                       CU_STREAM_WAIT_VALUE_GEQ),
                  "cuStreamWaitValue64", device);
}

// Sets a peer's handoff count to `value` once the stream's earlier work is done, without taking an
// SM, so a hand-over on a copy stream never queues behind cuBLAS for one (and holds back that
// stream's next copy with it). Each count has one writer, this GPU, and the host
// knows its value for every call, so a plain write replaces an atomic add. The write's default
// flags put a system-scope memory barrier before it: what the stream wrote (a copy, a matmul)
// is visible to the peer before the count that announces it.
void stream_set_count(cudaStream_t stream, uint64_t* word, uint64_t value, int device) {
  static const StreamValueFn write = stream_memory_op("cuStreamWriteValue64");
  check_memory_op(write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                        CU_STREAM_WRITE_VALUE_DEFAULT),
                  "cuStreamWriteValue64", device);
}

ChunkedMatmulState& chunked_state(DeviceState& s) {
  std::lock_guard<std::mutex> lock(make_mutex);
  ChunkedMatmulState& c = op_state<ChunkedMatmulState>(s, "chunked_matmul");
  if (c.blas != nullptr) return c;
  // XLA does not capture these calls (see the top of this file); should a caller capture the
  // stream anyway, relaxed mode lets this thread allocate while these objects are made.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check_launch(cudaThreadExchangeStreamCaptureMode(&mode), "entering relaxed capture mode", s.device);
  try {
    const blas::Api& api = blas::api();
    // The highest priority: the few small kernels on it are scheduled before the matmul's next CTAs.
    int least = 0;
    check_launch(cudaDeviceGetStreamPriorityRange(&least, &c.priority), "querying stream priorities", s.device);
    check_launch(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming), "creating an event", s.device);
    check_launch(cudaMalloc(&c.workspace, kBlasWorkspaceBytes), "allocating the cuBLAS workspace", s.device);
    if (api.create(&c.blas) != 0) throw Error("cublasCreate failed on CUDA device " + std::to_string(s.device));
  } catch (...) {
    c.release();
    cudaThreadExchangeStreamCaptureMode(&mode);
    throw;
  }
  check_launch(cudaThreadExchangeStreamCaptureMode(&mode), "leaving relaxed capture mode", s.device);
  return c;
}

// The first `count` copy streams with their join events, the signal stream and its first `count`
// marks, made on first use (an axis of P GPUs uses P - 1 of each).
void make_streams(ChunkedMatmulState& c, int count, int device) {
  std::lock_guard<std::mutex> lock(make_mutex);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;  // as in chunked_state
  check_launch(cudaThreadExchangeStreamCaptureMode(&mode), "entering relaxed capture mode", device);
  cudaError_t failed = cudaSuccess;
  if (c.signals == nullptr) failed = cudaStreamCreateWithPriority(&c.signals, cudaStreamNonBlocking, c.priority);
  for (int i = 0; i < count && failed == cudaSuccess; i++) {
    if (c.sides[i] == nullptr) failed = cudaStreamCreateWithPriority(&c.sides[i], cudaStreamNonBlocking, c.priority);
    if (failed == cudaSuccess && c.joins[i] == nullptr)
      failed = cudaEventCreateWithFlags(&c.joins[i], cudaEventDisableTiming);
    if (failed == cudaSuccess && c.marks[i] == nullptr)
      failed = cudaEventCreateWithFlags(&c.marks[i], cudaEventDisableTiming);
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  check_launch(failed, "creating the chunked ops' streams and events", device);
}

cudaDataType blas_type(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    case ffi::DataType::F32: return CUDA_R_32F;
    default: throw Error("x and w must be bfloat16, float16 or float32");
  }
}

size_t element_bytes(ffi::DataType type) { return type == ffi::DataType::F32 ? 4 : 2; }

// A call's view of its op: the device, its axis, its heap block and the handoff words.
struct ChunkedCall {
  DeviceState& device;
  ChunkedMatmulState& chunked;
  AxisGroup group;
  uint64_t number;                    // this call of the op configuration, from 1
  char* slots;                        // this GPU's slots (slot_bytes each, one per axis index)
  std::vector<char*> peer_slots;      // every index's slots as this GPU maps them
  chunk_handoff handoff{};
  int marks = 0;                      // marks of the signal stream this call recorded (signal_after)
};

const char* const kLaunching = "launching the handoff kernels";

// The signal stream, holding what is enqueued on it next until `stream`'s work so far is done (a
// mark of its own each time in a call, at most P - 1 of them).
cudaStream_t signal_after(ChunkedCall& call, cudaStream_t stream) {
  const ChunkedMatmulState& c = call.chunked;
  const int dev = call.device.device;
  if (call.marks >= call.handoff.size - 1)
    throw Error("chunked matmul: more hand-over marks in a call than peers (an internal error)");
  cudaEvent_t mark = c.marks[call.marks++];
  check_launch(cudaEventRecord(mark, stream), "recording an event", dev);
  check_launch(cudaStreamWaitEvent(c.signals, mark), "ordering the signal stream", dev);
  return c.signals;
}

// Hands this call's chunk to index `to` (its ready[me]); after the stream's earlier work.
void hand_over(const ChunkedCall& call, int to, cudaStream_t stream) {
  const chunk_handoff& h = call.handoff;
  stream_set_count(stream, h.peer_words[to] + ready_index(h.my_index), call.number, call.device.device);
}

// Tells index `from` that this GPU finished reading its chunk of this call (its credit[me]).
void return_credit(const ChunkedCall& call, int from, cudaStream_t stream) {
  const chunk_handoff& h = call.handoff;
  stream_set_count(stream, h.peer_words[from] + credit_index(h.size, h.my_index), call.number, call.device.device);
}

// This GPU's view of the op configuration whose block is at heap `offset`: its axis (every peer an
// NVLink peer), its slots and words and every peer's, and its copy streams. `number` is left 0.
ChunkedCall map_block(const char* op, jaxgin_op_tag tag, int32_t ordinal, int64_t generation,
                      ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                      ffi::Span<const int64_t> axes, int64_t offset, int64_t slot_bytes) {
  DeviceState& s = device_for_ordinal(ordinal, generation);
  AxisGroup group = resolve_axis(s.host_context.rank, mesh_ranks, mesh_shape, axes);
  const jaxgin_context& c = s.host_context;
  const int size = (int)group.ranks.size();
  const int64_t block = slot_bytes * size + (int64_t)(chunk_handoff_words(size) * sizeof(uint64_t));
  if (offset < (int64_t)c.user_offset || offset + block > (int64_t)c.heap_bytes)
    throw Error(std::string(op) + ": heap block at offset " + std::to_string(offset) +
                " does not fit this runtime's heap (was the program compiled for another initialize()?)");
  for (int i = 0; i < size; i++) {
    const int rank = group.ranks[i];
    if (rank != c.rank && (c.force_gin || s.lsa_heaps[(size_t)rank] == nullptr))
      throw Error(std::string(op) + " needs every device of the axis to be an NVLink (LSA) peer, but rank " +
                  std::to_string(rank) + (c.force_gin ? " is reached through GIN (force_gin is set)"
                                                       : " is outside this GPU's NVLink domain"));
  }
  ChunkedMatmulState& chunked = chunked_state(s);
  make_streams(chunked, size - 1, s.device);
  ChunkedCall call{s, chunked, std::move(group), 0, c.heap + offset, {}, {}};
  chunk_handoff& h = call.handoff;
  h.ctx = s.context;
  h.words = reinterpret_cast<uint64_t*>(call.slots + slot_bytes * size);
  h.size = size;
  h.my_index = call.group.my_index;
  h.op = tag;
  call.peer_slots.resize((size_t)size);
  for (int i = 0; i < size; i++) {
    const int rank = call.group.ranks[i];
    char* base = rank == c.rank ? c.heap : s.lsa_heaps[(size_t)rank];
    call.peer_slots[(size_t)i] = base + offset;
    h.peer_words[i] = reinterpret_cast<uint64_t*>(base + offset + slot_bytes * size);
    h.ranks[i] = rank;
  }
  return call;
}

// Opens this call of the op configuration whose block is at heap `offset` (map_block, counted) and
// points cuBLAS at XLA's stream; with `begin`, enqueues begin_call there (the credits of the
// previous call; an exchange whose peers pull waits for them at the end of that call instead).
ChunkedCall start_call(const char* op, jaxgin_op_tag tag, cudaStream_t stream, int32_t ordinal, int64_t generation,
                       ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                       ffi::Span<const int64_t> axes, int64_t offset, int64_t slot_bytes, bool begin) {
  ChunkedCall call = map_block(op, tag, ordinal, generation, mesh_ranks, mesh_shape, axes, offset, slot_bytes);
  call.number = ++call.chunked.calls[offset];
  // cublasSetStream puts the handle back on cuBLAS's default workspace pool, so ours follows it.
  const blas::Api& api = blas::api();
  if (api.set_stream(call.chunked.blas, stream) != 0) throw Error("cublasSetStream failed");
  if (api.set_workspace(call.chunked.blas, call.chunked.workspace, kBlasWorkspaceBytes) != 0)
    throw Error("cublasSetWorkspace failed");
  if (begin) check_launch(launch_begin_call(call.handoff, call.number, stream), kLaunching, call.device.device);
  return call;
}

// XLA's stream waits for everything enqueued so far on the first `count` copy streams (those this
// call used, one per peer).
void join_copy_streams(const ChunkedCall& call, cudaStream_t stream, int count) {
  const int dev = call.device.device;
  for (int i = 0; i < count; i++) {
    check_launch(cudaEventRecord(call.chunked.joins[i], call.chunked.sides[i]), "recording an event", dev);
    check_launch(cudaStreamWaitEvent(stream, call.chunked.joins[i]), "joining a copy stream", dev);
  }
}

int compute_type(ffi::DataType type, int64_t tf32) {
  return type == ffi::DataType::F32 && tf32 ? blas::kCompute32FFastTF32 : blas::kCompute32F;
}

// x [m, k] @ w [k, n] as both handlers hand it to cuBLAS: the sizes, the types, bytes per element.
struct Matmul {
  int64_t m, k, n;
  cudaDataType type;
  int compute;
  size_t elt;
};

Matmul matmul_of(ffi::AnyBuffer x, ffi::AnyBuffer w, int64_t tf32) {
  const auto dims_x = x.dimensions(), dims_w = w.dimensions();
  const ffi::DataType dtype = x.element_type();
  return Matmul{dims_x[0], dims_x[1], dims_w[1], blas_type(dtype), compute_type(dtype, tf32), element_bytes(dtype)};
}

// Where chunk `index` of the result starts and its row stride (elements): the result is the chunks
// stacked by rows (concat_rows) or side by side.
struct Placement {
  char* base;
  int64_t ld;
};

Placement place(char* out, int index, int64_t cm, int64_t cn, int size, int64_t concat_rows, size_t elt) {
  if (concat_rows) return {out + (size_t)(index * cm * cn) * elt, cn};
  return {out + (size_t)(index * cn) * elt, cn * size};
}

// A copy stream per peer, from the fork on: the peer's chunk [cm, cn] copied from its slot into
// the result as soon as this GPU's ready word of that peer reaches `value`, then `after(from,
// side)` (what tells the peer its chunk was read), so the peers' copies
// overlap; XLA's stream then joins them. Enqueued after every kernel of the call: a kernel's first
// launch may load its module, which waits for the whole GPU, and so for a copy stream waiting on a
// peer that is itself waiting in such a load; with the waits enqueued last, every hand-over they
// wait for has been enqueued before them on both sides.
template <typename After>
void copy_peer_chunks(const ChunkedCall& call, cudaStream_t stream, char* result, int64_t cm, int64_t cn,
                      int64_t concat_rows, size_t elt, int64_t slot_bytes, uint64_t value, After after) {
  const chunk_handoff& h = call.handoff;
  const int size = h.size, me = h.my_index, dev = call.device.device;
  const ChunkedMatmulState& c = call.chunked;
  for (int i = 1; i < size; i++) {
    const int from = (me - i + size) % size;
    cudaStream_t side = c.sides[i - 1];
    check_launch(cudaStreamWaitEvent(side, c.fork), "ordering a copy stream", dev);
    stream_wait_at_least(side, h.words + ready_index(from), value, dev);
    const Placement dst = place(result, from, cm, cn, size, concat_rows, elt);
    check_launch(cudaMemcpy2DAsync(dst.base, (size_t)dst.ld * elt, call.peer_slots[(size_t)from] + slot_bytes * me,
                                   (size_t)cn * elt, (size_t)cn * elt, (size_t)cm, cudaMemcpyDefault, side),
                 "copying a peer's chunk", dev);
    after(from, side);
  }
  join_copy_streams(call, stream, size - 1);
}

// The end of a counted exchange of chunks (the cuBLAS layouts), after every kernel of the call is
// enqueued on XLA's stream (the fork recorded before them): the bounded wait for every chunk and
// every peer's credit (see the top of this file), then the copies, each returning its credit.
void pull_peer_chunks(const ChunkedCall& call, cudaStream_t stream, char* result, int64_t cm, int64_t cn,
                      int64_t concat_rows, size_t elt, int64_t slot_bytes) {
  check_launch(launch_end_exchange(call.handoff, call.number, stream), kLaunching, call.device.device);
  copy_peer_chunks(call, stream, result, cm, cn, concat_rows, elt, slot_bytes, call.number,
                   [&](int from, cudaStream_t side) { return_credit(call, from, side); });
}

// Chunk t of x @ w (a block of its rows or columns) computed here and delivered to index t, every
// index's chunk of this call placed in the result by source: the exchange both matmul_all_to_all
// and matmul_reduce_scatter (whose partial chunks the caller then sums) are made of. `tag` names
// the user's op in errors and faults. `layout` (row chunks in slots without padding only; otherwise
// a call per peer) trades fewer, larger matmuls against later hand-overs, for
// benchmarks/fused.py --chunked-layouts-only: kChunkPerPeer, a cuBLAS call per peer's chunk (the
// ops' layout); kPeersMerged, the peers' chunks in at most two calls, the runs of indices after and
// before this GPU's, each run handed over when its call is done; kWhole, one call for every chunk,
// all handed over at its end, the own chunk then copied from its slot into the result.
ffi::Error exchange_chunks(jaxgin_op_tag tag, cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> mesh_ranks,
                           ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                           int64_t slot_bytes, int64_t split_rows, int64_t concat_rows, int64_t tf32,
                           int64_t generation, int64_t layout) {
  return guarded([&] {
    const char* op = jaxgin_op_name(tag);
    ChunkedCall call = start_call(op, tag, stream, ordinal, generation, mesh_ranks, mesh_shape, axes, offset,
                                  slot_bytes, /*begin=*/false);
    const int size = call.handoff.size, me = call.handoff.my_index, dev = call.device.device;
    const Matmul mm = matmul_of(x, w, tf32);
    const size_t elt = mm.elt;
    const int64_t cm = split_rows ? mm.m / size : mm.m, cn = split_rows ? mm.n : mm.n / size;
    if ((int64_t)(cm * cn * elt) > slot_bytes) throw Error(std::string(op) + ": chunk larger than its slot");
    const char* xs = static_cast<const char*>(x.untyped_data());
    const char* ws = static_cast<const char*>(w.untyped_data());
    char* result = static_cast<char*>(out->untyped_data());
    const ChunkedMatmulState& c = call.chunked;
    // Operands of chunks `index` .. `index + count - 1`: a block of x's rows, or (count 1) a block
    // of w's columns (row stride n).
    auto gemm = [&](int index, void* into, int64_t ldc, int count = 1) {
      const char* a = split_rows ? xs + (size_t)(index * cm * mm.k) * elt : xs;
      const char* b = split_rows ? ws : ws + (size_t)(index * cn) * elt;
      blas::gemm_row_major(c.blas, mm.type, mm.compute, (int)(cm * count), (int)cn, (int)mm.k, a, (int)mm.k, b,
                           (int)mm.n, into, (int)ldc, op);
    };
    if (size > 1) check_launch(cudaEventRecord(c.fork, stream), "recording an event", dev);
    const bool slots_are_rows = split_rows && slot_bytes == (int64_t)(cm * cn * elt);
    const Placement own = place(result, me, cm, cn, size, concat_rows, elt);
    if (layout == kWhole && slots_are_rows) {
      gemm(0, call.slots, cn, size);
      const cudaStream_t signals = signal_after(call, stream);
      for (int i = 1; i < size; i++) hand_over(call, (me + i) % size, signals);
      check_launch(cudaMemcpy2DAsync(own.base, (size_t)own.ld * elt, call.slots + slot_bytes * me, (size_t)cn * elt,
                                     (size_t)cn * elt, (size_t)cm, cudaMemcpyDeviceToDevice, stream),
                   "copying this GPU's own chunk", dev);
    } else {
      if (layout == kPeersMerged && slots_are_rows) {
        auto run = [&](int first, int count) {  // indices first .. first + count - 1, one call
          if (count <= 0) return;
          gemm(first, call.slots + slot_bytes * first, cn, count);
          const cudaStream_t signals = signal_after(call, stream);
          for (int t = first; t < first + count; t++) hand_over(call, t, signals);
        };
        run(me + 1, size - 1 - me);
        run(0, me);
      } else {
        for (int i = 1; i < size; i++) {
          const int to = (me + i) % size;
          gemm(to, call.slots + slot_bytes * to, cn);
          hand_over(call, to, signal_after(call, stream));
        }
      }
      gemm(me, own.base, own.ld);
    }
    if (size > 1) pull_peer_chunks(call, stream, result, cm, cn, concat_rows, elt, slot_bytes);
  });
}

ffi::Error matmul_all_to_all(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> mesh_ranks,
                             ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                             int64_t slot_bytes, int64_t split_rows, int64_t concat_rows, int64_t tf32, int64_t generation,
                             int64_t layout) {
  return exchange_chunks(JAXGIN_OP_MATMUL_ALL_TO_ALL, stream, ordinal, x, w, out, mesh_ranks, mesh_shape, axes, offset,
                         slot_bytes, split_rows, concat_rows, tf32, generation, layout);
}

// The partial chunks of a reduce-scatter, stacked by source ([size, cm, cn]); the sum over sources
// follows in the same program (jaxgin/fused/_chunked.py).
ffi::Error matmul_reduce_scatter(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> mesh_ranks,
                                 ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                                 int64_t slot_bytes, int64_t split_rows, int64_t tf32, int64_t generation,
                                 int64_t layout) {
  return exchange_chunks(JAXGIN_OP_MATMUL_REDUCE_SCATTER, stream, ordinal, x, w, out, mesh_ranks, mesh_shape, axes,
                         offset, slot_bytes, split_rows, /*concat_rows=*/1, tf32, generation, layout);
}

// The gathered product, its cuBLAS calls laid out by `layout` (shards of one size stacked in their
// slots only; otherwise a call per shard): kChunkPerPeer, the own shard, then each peer's shard as
// it arrives (the op's layout); kPeersMerged, the own shard, then the peers' shards in at most two
// calls, the run of indices before this GPU's (which arrives first) and the run after it, each
// once all of it arrived; kWhole, the own shard copied into its slot after the pushes, then one
// call for every shard once all arrived (the unfused order, for scale).
ffi::Error all_gather_matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> mesh_ranks,
                             ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                             int64_t slot_bytes, int64_t tf32, int64_t generation, int64_t layout) {
  return guarded([&] {
    const char* op = jaxgin_op_name(JAXGIN_OP_ALL_GATHER_MATMUL);
    ChunkedCall call = start_call(op, JAXGIN_OP_ALL_GATHER_MATMUL, stream, ordinal, generation, mesh_ranks, mesh_shape,
                                  axes, offset, slot_bytes, /*begin=*/true);
    const int size = call.handoff.size, me = call.handoff.my_index, dev = call.device.device;
    const Matmul mm = matmul_of(x, w, tf32);  // mm.m: the rows of one shard
    const size_t shard_bytes = x.size_bytes();
    if ((int64_t)shard_bytes > slot_bytes) throw Error(std::string(op) + ": shard larger than its slot");
    char* result = static_cast<char*>(out->untyped_data());
    const ChunkedMatmulState& c = call.chunked;
    // Shards `index` .. `index + count - 1`, stacked from `shards`, into their rows of the result.
    auto gemm = [&](const void* shards, int index, int count = 1) {
      blas::gemm_row_major(c.blas, mm.type, mm.compute, (int)(mm.m * count), (int)mm.n, (int)mm.k, shards, (int)mm.k,
                           w.untyped_data(), (int)mm.n, result + (size_t)(index * mm.m * mm.n) * mm.elt, (int)mm.n, op);
    };
    const bool stacked = slot_bytes == (int64_t)shard_bytes && size > 1;
    const int chosen = stacked ? (int)layout : kChunkPerPeer;
    const chunk_handoff& h = call.handoff;
    if (size > 1) {
      // Everything for the copy stream is enqueued before the first matmul: its pushes depend on no
      // kernel of this call but begin_call. One stream for every push, in the order the peers need
      // the shard: pushes side by side all land late, and each peer's first matmul waits for its
      // (measured: docs/measurements.md, eighth session).
      cudaStream_t side = c.sides[0];
      check_launch(cudaEventRecord(c.fork, stream), "recording an event", dev);
      check_launch(cudaStreamWaitEvent(side, c.fork), "ordering the copy stream", dev);
      for (int i = 1; i < size; i++) {
        const int to = (me + i) % size;
        check_launch(cudaMemcpyAsync(call.peer_slots[(size_t)to] + slot_bytes * me, x.untyped_data(), shard_bytes,
                                     cudaMemcpyDefault, side),
                     "copying this shard to a peer", dev);
        hand_over(call, to, side);
      }
      if (chosen == kWhole)
        check_launch(cudaMemcpyAsync(call.slots + slot_bytes * me, x.untyped_data(), shard_bytes,
                                     cudaMemcpyDeviceToDevice, side),
                     "copying this shard into its own slot", dev);
    }
    auto give_credits = [&](int first, int count) {
      const cudaStream_t signals = signal_after(call, stream);
      for (int from = first; from < first + count; from++) return_credit(call, from, signals);
    };
    if (chosen == kWhole) {
      join_copy_streams(call, stream, 1);  // the own shard in its slot
      check_launch(launch_await_chunks(h, -1, call.number, stream), kLaunching, dev);
      gemm(call.slots, 0, size);
      const cudaStream_t signals = signal_after(call, stream);
      for (int from = 0; from < size; from++)
        if (from != me) return_credit(call, from, signals);
      return;
    }
    gemm(x.untyped_data(), me);
    if (chosen == kPeersMerged) {
      auto run = [&](int first, int count) {  // indices first .. first + count - 1, one call
        if (count <= 0) return;
        for (int from = first; from < first + count; from++)
          check_launch(launch_await_chunks(h, from, call.number, stream), kLaunching, dev);
        gemm(call.slots + slot_bytes * first, first, count);
        give_credits(first, count);
      };
      run(0, me);
      run(me + 1, size - 1 - me);
    } else {
      for (int i = 1; i < size; i++) {
        const int from = (me - i + size) % size;
        check_launch(launch_await_chunks(h, from, call.number, stream), kLaunching, dev);
        gemm(call.slots + slot_bytes * from, from);
        return_credit(call, from, signal_after(call, stream));
      }
    }
    if (size > 1) join_copy_streams(call, stream, 1);
  });
}

// The exchange of exchange_chunks with one Triton kernel computing every chunk (jaxgin/fused/_chunked.py's
// triton_chunks; its kernel jaxgin/fused/_kernels.py's matmul_chunks_kernel). Nothing here depends
// on the host's count of calls, yet XLA does not record it either: recorded, CUDA refused to update
// the peer copy when XLA updated its graph for the next run (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
// 2 x H200). Its words in the block are flags (0 or 1) instead of counts:
//   ready[s] here: 1 once index s's kernel put this GPU's chunk in s's slot (s sets it remotely
//          from the epilogue of the chunk's last tile); this GPU's copy stream waits for it, and
//          XLA's stream zeroes it after the copy is joined.
//   free[t] here: 1 once index t copied this GPU's previous chunk for it (t sets it, after zeroing
//          its ready word); the kernel's programs for t wait for it (bounded) before they overwrite
//          the slot, except in the configuration's first call, and zero it as they hand over.
// The kernel's program that completes the own chunk also waits (bounded) for every ready word, so
// a peer that never hands over faults the call instead of leaving a copy stream waiting.
// `reduce` says which op the call serves (its faults' name): matmul_reduce_scatter's partials or
// matmul_all_to_all.
ffi::Error triton_chunks(cudaStream_t stream, int32_t ordinal, TritonKernel* kernel, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int8_t>, std::string_view,
                         ffi::Span<const int64_t> grid, int64_t num_warps, int64_t, ffi::Span<const int64_t> params,
                         int64_t generation, ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                         ffi::Span<const int64_t> axes, int64_t offset, int64_t slot_bytes, int64_t chunk_rows,
                         int64_t chunk_cols, int64_t element_bytes, int64_t concat_rows, int64_t reduce) {
  return guarded([&] {
    const jaxgin_op_tag tag = reduce ? JAXGIN_OP_MATMUL_REDUCE_SCATTER : JAXGIN_OP_MATMUL_ALL_TO_ALL;
    const char* op = jaxgin_op_name(tag);
    ChunkedCall call = map_block(op, tag, ordinal, generation, mesh_ranks, mesh_shape, axes, offset, slot_bytes);
    const chunk_handoff& h = call.handoff;
    const int size = h.size, me = h.my_index, dev = call.device.device;
    if (chunk_rows * chunk_cols * element_bytes > slot_bytes) throw Error(std::string(op) + ": chunk larger than its slot");
    auto result = rets.get<ffi::AnyBuffer>(0);
    if (result.has_error()) throw Error(std::string(op) + ": the result is missing");
    if (size > 1) check_launch(cudaEventRecord(call.chunked.fork, stream), "recording an event", dev);
    launch_triton_kernel(*kernel, call.device, stream, args, rets, grid, num_warps, params, op);
    if (size == 1) return;
    copy_peer_chunks(call, stream, static_cast<char*>((*result)->untyped_data()), chunk_rows, chunk_cols, concat_rows,
                     (size_t)element_bytes, slot_bytes, 1, [](int, cudaStream_t) {});
    // The ready words are zeroed on XLA's stream, before the next call's copy streams fork from it
    // to wait for them; the peers learn that (free) from the signal stream, after the zeroes.
    for (int from = 0; from < size; from++)
      if (from != me) stream_set_count(stream, h.words + ready_index(from), 0, dev);
    const cudaStream_t signals = signal_after(call, stream);
    for (int from = 0; from < size; from++)
      if (from != me) stream_set_count(signals, h.peer_words[from] + credit_index(size, me), 1, dev);
  });
}

ffi::ErrorOr<std::unique_ptr<TritonKernel>> triton_chunks_instantiate(
    ffi::Span<const int8_t> cubin, std::string_view name, ffi::Span<const int64_t>, int64_t, int64_t shared_bytes,
    ffi::Span<const int64_t>, int64_t, ffi::Span<const int32_t>, ffi::Span<const int64_t>, ffi::Span<const int64_t>,
    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  return load_triton_kernel(cubin, name, shared_bytes, "jaxgin.fused (Triton chunks)");
}

}  // namespace
}  // namespace ffi_support
}  // namespace jaxgin

// What every handler here binds: XLA's stream and device, x, w, the result, the axis and the heap block.
#define JAXGIN_CHUNKED_BINDING                             \
  xla::ffi::Ffi::Bind()                                    \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()      \
      .Ctx<xla::ffi::DeviceOrdinal>()                      \
      .Arg<xla::ffi::AnyBuffer>()                          \
      .Arg<xla::ffi::AnyBuffer>()                          \
      .Ret<xla::ffi::AnyBuffer>()                          \
      .Attr<xla::ffi::Span<const int32_t>>("mesh_ranks")  \
      .Attr<xla::ffi::Span<const int64_t>>("mesh_shape")  \
      .Attr<xla::ffi::Span<const int64_t>>("axes")        \
      .Attr<int64_t>("offset")                             \
      .Attr<int64_t>("slot_bytes")

// Exported under the names the op table gives them (declared in the generated jaxgin_op_table.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_matmul_all_to_all, jaxgin::ffi_support::matmul_all_to_all,
                              JAXGIN_CHUNKED_BINDING
                                  .Attr<int64_t>("split_rows")
                                  .Attr<int64_t>("concat_rows")
                                  .Attr<int64_t>("tf32")
                                  .Attr<int64_t>("generation")
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_matmul_reduce_scatter, jaxgin::ffi_support::matmul_reduce_scatter,
                              JAXGIN_CHUNKED_BINDING
                                  .Attr<int64_t>("split_rows")
                                  .Attr<int64_t>("tf32")
                                  .Attr<int64_t>("generation")
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_all_gather_matmul, jaxgin::ffi_support::all_gather_matmul,
                              JAXGIN_CHUNKED_BINDING
                                  .Attr<int64_t>("tf32")
                                  .Attr<int64_t>("generation")
                                  .Attr<int64_t>("layout"));

// The Triton kernel's attributes, then the exchange's.
#define JAXGIN_TRITON_CHUNKS_ATTRS                          \
  JAXGIN_TRITON_KERNEL_ATTRS                                \
      .Attr<xla::ffi::Span<const int32_t>>("mesh_ranks")    \
      .Attr<xla::ffi::Span<const int64_t>>("mesh_shape")    \
      .Attr<xla::ffi::Span<const int64_t>>("axes")          \
      .Attr<int64_t>("offset")                              \
      .Attr<int64_t>("slot_bytes")                          \
      .Attr<int64_t>("chunk_rows")                          \
      .Attr<int64_t>("chunk_cols")                          \
      .Attr<int64_t>("element_bytes")                       \
      .Attr<int64_t>("concat_rows")                         \
      .Attr<int64_t>("reduce")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_triton_chunks_instantiate, jaxgin::ffi_support::triton_chunks_instantiate,
                              xla::ffi::Ffi::BindInstantiate() JAXGIN_TRITON_CHUNKS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_triton_chunks, jaxgin::ffi_support::triton_chunks,
                              JAXGIN_TRITON_KERNEL_BINDING JAXGIN_TRITON_CHUNKS_ATTRS);
