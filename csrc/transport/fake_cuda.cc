// For CPU tests only: the slice of the CUDA runtime and driver that the host transport calls, with
// host memory standing in for device memory, so that the transport's device-memory paths (pinned
// staging, copy events, the receive double buffer, signals written by the apply stream) run without
// a GPU. jaxgin.transport.build never compiles it; tests/test_transport.py links it in place of
// cudart.
//
// What it keeps of CUDA's semantics, because the transport depends on them: a stream runs its work
// in order, on a thread of its own, after a random pause (JAXGIN_FAKE_CUDA_DELAY_US, default 30),
// so nothing completes at the call that queued it; an event completes when its stream reaches it
// and a query before then says cudaErrorNotReady. A stream atomic add is offered only when
// JAXGIN_FAKE_CUDA_ADDS=1, so that both ways of applying a signal can be tested.
// JAXGIN_FAKE_CUDA_COPY_MS makes every copy take that long (a copy held up on the GPU).
// JAXGIN_FAKE_CUDA_PUSH_FAILS=1 makes cuCtxPushCurrent fail (CUDA torn down under the transport).
// JAXGIN_FAKE_CUDA_OUT_OF_MEMORY=cuCtxCreate,cudaHostAlloc (any of them) makes those calls fail as a
// GPU out of memory does (a GPU shared by 32 emulated ranks ran out in cuCtxCreate).
// jaxgin_fake_cuda_hold_copy(n, ms) holds the stream of the n-th copy out of device memory queued
// after the call (the transport queues those with cudaMemcpyDefault) at that copy: it and what
// follows on that stream run only after `ms` milliseconds (negative: once the stream is
// destroyed). That is a stream in a hardware queue held by work that waits for a spinning kernel.
//
// Contexts: the application's (primary) context is current unless a thread pushed one made by
// cuCtxCreate. Streams and events belong to the context current where they were made, and queueing
// on a stream or recording an event of another context than the current one fails (as a handle
// from another context does on a GPU), so that a transport call made outside its context shows.
// jaxgin_fake_cuda_hold_application_copies(ms) holds every stream of the application's context at
// each copy out of device memory queued there after the call: every hardware queue of that context
// held by work that waits for a spinning kernel (what XLA's queued work did under command buffers).
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace {

int max_delay_us() {
  const char* v = std::getenv("JAXGIN_FAKE_CUDA_DELAY_US");
  return v ? std::atoi(v) : 30;
}

int copy_pause_ms() {
  const char* v = std::getenv("JAXGIN_FAKE_CUDA_COPY_MS");
  return v ? std::atoi(v) : 0;
}

// Whether JAXGIN_FAKE_CUDA_OUT_OF_MEMORY names `call` (read per call: tests set it for one run).
bool out_of_memory(const char* call) {
  const char* v = std::getenv("JAXGIN_FAKE_CUDA_OUT_OF_MEMORY");
  if (v == nullptr) return false;
  const size_t length = std::strlen(call);
  for (const char* at = std::strstr(v, call); at != nullptr; at = std::strstr(at + 1, call))
    if ((at == v || at[-1] == ',') && (at[length] == '\0' || at[length] == ',')) return true;
  return false;
}

// Copies out of device memory still to come before the held one (0: none is held), and for how long.
std::atomic<int> copies_before_hold{0};
std::atomic<int> hold_ms{-1};
// Whether copies out of device memory on the application's context's streams hold them, how long.
std::atomic<bool> hold_application{false};
std::atomic<int> hold_application_ms{-1};

// A context made by cuCtxCreate (only its identity matters); null stands for the application's.
struct FakeContext {};
thread_local std::vector<FakeContext*> pushed_contexts;
FakeContext* current_context() { return pushed_contexts.empty() ? nullptr : pushed_contexts.back(); }

struct FakeStream {
  FakeContext* context = current_context();
  std::mutex lock;
  std::condition_variable changed;
  std::deque<std::function<void()>> work;
  bool busy = false, stop = false;
  std::thread worker;

  FakeStream() : worker([this] { run(); }) {}
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> g(lock);
      stop = true;
    }
    changed.notify_all();
    worker.join();
  }
  void run() {
    std::minstd_rand random(static_cast<unsigned>(reinterpret_cast<uintptr_t>(this)));
    const int delay = max_delay_us();
    std::unique_lock<std::mutex> g(lock);
    while (true) {
      changed.wait(g, [&] { return stop || !work.empty(); });
      if (work.empty()) return;
      std::function<void()> next = std::move(work.front());
      work.pop_front();
      busy = true;
      g.unlock();
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(random() % (delay + 1)));
      next();
      g.lock();
      busy = false;
      changed.notify_all();
    }
  }
  void queue(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> g(lock);
      work.push_back(std::move(f));
    }
    changed.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> g(lock);
    changed.wait(g, [&] { return work.empty() && !busy; });
  }
  // Queues a step that holds the stream for `ms` milliseconds, or until the stream is destroyed
  // when `ms` is negative.
  void hold(int ms) {
    queue([this, ms] {
      std::unique_lock<std::mutex> g(lock);
      if (ms < 0)
        changed.wait(g, [&] { return stop; });
      else
        changed.wait_for(g, std::chrono::milliseconds(ms), [&] { return stop; });
    });
  }
  // Queues a step that holds the stream while the application's copies are held (see
  // jaxgin_fake_cuda_hold_application_copies), at most `ms` milliseconds when not negative.
  void hold_while_application_held(int ms) {
    queue([this, ms] {
      const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
      std::unique_lock<std::mutex> g(lock);
      while (!stop && hold_application && (ms < 0 || std::chrono::steady_clock::now() < end))
        changed.wait_for(g, std::chrono::milliseconds(5));
    });
  }
};

struct FakeEvent {
  FakeContext* context = current_context();
  std::atomic<uint64_t> recorded{0}, reached{0};
};

FakeStream* as_stream(cudaStream_t s) { return reinterpret_cast<FakeStream*>(s); }  // the same type as CUstream
FakeEvent* as_event(cudaEvent_t e) { return reinterpret_cast<FakeEvent*>(e); }

// The driver entry points device_memory.cc asks for. Sharing allocations is not offered (so every
// device region travels staged), writes and adds run on the stream.
CUresult not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult fake_retain(CUmemGenericAllocationHandle*, void*) { return not_supported(); }
CUresult fake_release(CUmemGenericAllocationHandle) { return not_supported(); }
CUresult fake_address_range(CUdeviceptr*, size_t*, CUdeviceptr) { return not_supported(); }
CUresult fake_export(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long) {
  return not_supported();
}
CUresult fake_import(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) { return not_supported(); }
CUresult fake_reserve(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) { return not_supported(); }
CUresult fake_free_address(CUdeviceptr, size_t) { return not_supported(); }
CUresult fake_map(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) {
  return not_supported();
}
CUresult fake_unmap(CUdeviceptr, size_t) { return not_supported(); }
CUresult fake_set_access(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) { return not_supported(); }
CUresult fake_write_value64(CUstream stream, CUdeviceptr address, cuuint64_t value, unsigned int) {
  if (as_stream(stream)->context != current_context()) return CUDA_ERROR_INVALID_CONTEXT;
  auto* word = reinterpret_cast<uint64_t*>(address);
  as_stream(stream)->queue([word, value] { __atomic_store_n(word, value, __ATOMIC_SEQ_CST); });
  return CUDA_SUCCESS;
}
CUresult fake_error_string(CUresult error, const char** text) {
  *text = error == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory" : "fake CUDA driver error";
  return CUDA_SUCCESS;
}
CUresult fake_batch_mem_op(CUstream stream, unsigned int count, CUstreamBatchMemOpParams* ops, unsigned int) {
  if (as_stream(stream)->context != current_context()) return CUDA_ERROR_INVALID_CONTEXT;
  for (unsigned int i = 0; i < count; i++) {
    if (ops[i].operation != CU_STREAM_MEM_OP_ATOMIC_REDUCTION ||
        ops[i].atomicReduction.reductionOp != CU_STREAM_ATOMIC_REDUCTION_OP_ADD)
      return CUDA_ERROR_NOT_SUPPORTED;
    auto* word = reinterpret_cast<uint64_t*>(ops[i].atomicReduction.address);
    const uint64_t value = ops[i].atomicReduction.value;
    as_stream(stream)->queue([word, value] { __atomic_fetch_add(word, value, __ATOMIC_SEQ_CST); });
  }
  return CUDA_SUCCESS;
}
CUresult fake_device_attribute(int* value, CUdevice_attribute attribute, CUdevice) {
  const char* adds = std::getenv("JAXGIN_FAKE_CUDA_ADDS");
  const bool on = adds && std::strcmp(adds, "1") == 0;
  *value = 0;
  if (attribute == CU_DEVICE_ATTRIBUTE_ATOMIC_REDUCTION_SUPPORTED ||
      attribute == CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
    *value = on ? 1 : 0;
  return CUDA_SUCCESS;
}

CUresult fake_device_get(CUdevice* device, int ordinal) {
  *device = ordinal;
  return CUDA_SUCCESS;
}
std::atomic<int> live_contexts{0};
std::atomic<long> copies_done{0};  // cudaMemcpyAsync copies that have run
CUresult fake_context_create(CUcontext* context, CUctxCreateParams*, unsigned int, CUdevice) {
  if (out_of_memory("cuCtxCreate")) return CUDA_ERROR_OUT_OF_MEMORY;
  auto* made = new FakeContext;
  pushed_contexts.push_back(made);  // as CUDA does: the new context is current on return
  live_contexts++;
  *context = reinterpret_cast<CUcontext>(made);
  return CUDA_SUCCESS;
}
CUresult fake_context_destroy(CUcontext context) {
  auto* gone = reinterpret_cast<FakeContext*>(context);
  for (auto it = pushed_contexts.begin(); it != pushed_contexts.end();)
    it = *it == gone ? pushed_contexts.erase(it) : it + 1;
  delete gone;
  live_contexts--;
  return CUDA_SUCCESS;
}
CUresult fake_context_push(CUcontext context) {
  const char* fails = std::getenv("JAXGIN_FAKE_CUDA_PUSH_FAILS");
  if (fails != nullptr && fails[0] == '1') return CUDA_ERROR_UNKNOWN;  // as once CUDA is torn down at exit
  pushed_contexts.push_back(reinterpret_cast<FakeContext*>(context));
  return CUDA_SUCCESS;
}
CUresult fake_context_pop(CUcontext* context) {
  if (pushed_contexts.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (context) *context = reinterpret_cast<CUcontext>(pushed_contexts.back());
  pushed_contexts.pop_back();
  return CUDA_SUCCESS;
}

struct EntryPoint {
  const char* name;
  void* function;
};
const EntryPoint kEntryPoints[] = {
    {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&fake_retain)},
    {"cuMemRelease", reinterpret_cast<void*>(&fake_release)},
    {"cuMemGetAddressRange", reinterpret_cast<void*>(&fake_address_range)},
    {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&fake_export)},
    {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&fake_import)},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&fake_reserve)},
    {"cuMemAddressFree", reinterpret_cast<void*>(&fake_free_address)},
    {"cuMemMap", reinterpret_cast<void*>(&fake_map)},
    {"cuMemUnmap", reinterpret_cast<void*>(&fake_unmap)},
    {"cuMemSetAccess", reinterpret_cast<void*>(&fake_set_access)},
    {"cuStreamWriteValue64", reinterpret_cast<void*>(&fake_write_value64)},
    {"cuGetErrorString", reinterpret_cast<void*>(&fake_error_string)},
    {"cuStreamBatchMemOp", reinterpret_cast<void*>(&fake_batch_mem_op)},
    {"cuDeviceGetAttribute", reinterpret_cast<void*>(&fake_device_attribute)},
    {"cuDeviceGet", reinterpret_cast<void*>(&fake_device_get)},
    {"cuCtxCreate", reinterpret_cast<void*>(&fake_context_create)},
    {"cuCtxDestroy", reinterpret_cast<void*>(&fake_context_destroy)},
    {"cuCtxPushCurrent", reinterpret_cast<void*>(&fake_context_push)},
    {"cuCtxPopCurrent", reinterpret_cast<void*>(&fake_context_pop)},
};

bool in_current_context(cudaStream_t stream) { return as_stream(stream)->context == current_context(); }

}  // namespace

extern "C" {

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaErrorMemoryAllocation ? "out of memory" : "fake CUDA runtime error";
}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode*) { return cudaSuccess; }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = reinterpret_cast<cudaStream_t>(new FakeStream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!in_current_context(stream)) return cudaErrorInvalidResourceHandle;
  delete as_stream(stream);  // runs what was queued first
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  as_stream(stream)->synchronize();
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new FakeEvent);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete as_event(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  FakeEvent* e = as_event(event);
  if (!in_current_context(stream) || e->context != current_context()) return cudaErrorInvalidResourceHandle;
  const uint64_t mark = e->recorded.fetch_add(1) + 1;
  as_stream(stream)->queue([e, mark] {
    uint64_t seen = e->reached.load();
    while (seen < mark && !e->reached.compare_exchange_weak(seen, mark)) {
    }
  });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  FakeEvent* e = as_event(event);
  if (e->context != current_context()) return cudaErrorInvalidResourceHandle;
  return e->reached.load() >= e->recorded.load() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaHostAlloc(void** pointer, size_t size, unsigned int) {
  if (out_of_memory("cudaHostAlloc")) return cudaErrorMemoryAllocation;
  *pointer = std::malloc(size);
  return *pointer ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* to, const void* from, size_t bytes, enum cudaMemcpyKind) {
  std::memcpy(to, from, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (!in_current_context(stream)) return cudaErrorInvalidResourceHandle;
  const int pause_ms = copy_pause_ms();  // read per copy: tests set it for one run
  if (kind == cudaMemcpyDefault && hold_application && as_stream(stream)->context == nullptr)
    as_stream(stream)->hold_while_application_held(hold_application_ms.load());
  if (kind == cudaMemcpyDefault) {
    int left = copies_before_hold.load();
    while (left > 0 && !copies_before_hold.compare_exchange_weak(left, left - 1)) {
    }
    if (left == 1) as_stream(stream)->hold(hold_ms.load());
  }
  as_stream(stream)->queue([to, from, bytes, pause_ms] {
    if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    std::memcpy(to, from, bytes);
    copies_done++;
  });
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int version,
                                             unsigned long long, enum cudaDriverEntryPointQueryResult* status) {
  for (const EntryPoint& e : kEntryPoints)
    // cuCtxCreate's form depends on the version asked for: the fake has only the CUDA 12.5 one.
    if (std::strcmp(e.name, symbol) == 0 && (std::strcmp(symbol, "cuCtxCreate") != 0 || version >= 12050)) {
      *function = e.function;
      if (status) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  *function = nullptr;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

__attribute__((visibility("default"))) void jaxgin_fake_cuda_hold_copy(int n, int ms) {
  hold_ms = ms;
  copies_before_hold = n;
}

// From now on each copy out of device memory queued on a stream of the application's context holds
// that stream at the copy for `ms` milliseconds (negative: until released); 0 releases every hold.
__attribute__((visibility("default"))) void jaxgin_fake_cuda_hold_application_copies(int ms) {
  hold_application_ms = ms;
  hold_application = ms != 0;
}

// cudaMemcpyAsync copies that have run so far (a test waits for a copy instead of sleeping).
__attribute__((visibility("default"))) long jaxgin_fake_cuda_copies_done() { return copies_done.load(); }

// Contexts made by cuCtxCreate and not destroyed yet.
__attribute__((visibility("default"))) int jaxgin_fake_cuda_live_contexts() { return live_contexts.load(); }

}  // extern "C"
