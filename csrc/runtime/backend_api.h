// The C ABI between jaxgin's Python extension (built at install time, no CUDA or NCCL headers) and
// the CUDA backend library (built on first use by jaxgin/build.py with nvcc, against the headers
// of the NCCL that is loaded in the process). Plain C types only; bump JAXGIN_BACKEND_ABI on any
// change so a stale cached backend is refused instead of misread.
#pragma once
#include <stdint.h>

#define JAXGIN_BACKEND_ABI 7
#define JAXGIN_UNIQUE_ID_BYTES 128

// The backend is linked with hidden visibility; only these entry points are exported.
#define JAXGIN_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

typedef struct jaxgin_runtime jaxgin_runtime;

typedef struct {
  int32_t world_size;
  int32_t local_count;       // GPUs this process drives
  const int32_t* devices;    // CUDA ordinals, local_count of them
  const int32_t* ranks;      // global rank of each, local_count of them
  const char* unique_id;     // JAXGIN_UNIQUE_ID_BYTES bytes from jaxgin_unique_id on one process
  uint64_t heap_bytes;       // symmetric heap per GPU, reserved signal area included
  uint32_t signal_count;     // user-visible signals per GPU
  uint32_t barrier_slots;    // CTAs per kernel that may call the barrier
  int32_t force_gin;         // route every peer through GIN; fails when the comm has no GIN
  uint64_t timeout_ns;       // bound on device-side waits
  uint32_t channel_lanes;    // exchange channel (ppermute / all_to_all): parallel lanes per peer
  uint32_t channel_slots;    // ring slots per lane
  uint64_t channel_slot_bytes;
  int64_t generation;        // identifies this runtime to compiled programs (FFI attribute)
  int32_t record_vmm_calls;  // record NCCL's virtual-memory calls during setup (vmm_ledger.h)
} jaxgin_runtime_config;

typedef struct {
  int32_t device, rank, world_size;
  int32_t lsa_rank, lsa_size;
  int32_t gin_type;          // NCCL GIN type: 0 none, 2 proxy, 3 GDAKI, ...
  int32_t gin_contexts;
  int32_t force_gin;
  uint64_t heap_bytes, user_offset;
  uint64_t heap_base;        // device address of the local heap
  uint64_t context;          // device address of the jaxgin_context kernels receive
  uint64_t timeout_ns;
  uint32_t signal_count, barrier_slots;
  uint32_t channel_lanes, channel_slots;
  uint64_t channel_slot_bytes;
  // "" when NCCL's virtual-memory calls during setup were recorded (a fault's cleanup can return
  // all of NCCL's memory, see vmm_ledger.h); otherwise why not (then only the heaps come back).
  char vmm_ledger_unavailable[256];
} jaxgin_device_info;

// Every function returns 0 on success; otherwise jaxgin_last_error() (thread-local) explains.
// Status 2 means a kernel failed on the device (that GPU's CUDA context is unusable afterwards).
#define JAXGIN_STATUS_DEVICE_FAULT 2
JAXGIN_API int jaxgin_backend_abi(void);
// A constant of the op table (jaxgin/ffi/op_table.py) as this backend compiled it, by name
// (csrc/runtime/constants.cu): 0, or -1 for an unknown name.
JAXGIN_API int jaxgin_constant(const char* name, int64_t* value);
// The heap bytes jaxgin reserves for itself (csrc/runtime/constants.cu), for the test that holds
// Python's runtime.reserved_bytes equal.
JAXGIN_API uint64_t jaxgin_reserved_heap_bytes(uint32_t signal_count, uint32_t barrier_slots, int32_t world,
                                               uint32_t lanes, uint32_t slots, uint64_t slot_bytes);
JAXGIN_API int jaxgin_nccl_versions(int32_t* loaded, int32_t* compiled_against);
JAXGIN_API const char* jaxgin_last_error(void);
JAXGIN_API int jaxgin_unique_id(char* out);
JAXGIN_API int jaxgin_device_memory(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes);
JAXGIN_API int jaxgin_runtime_create(const jaxgin_runtime_config* config, jaxgin_runtime** out);
JAXGIN_API int jaxgin_runtime_device_info(const jaxgin_runtime* rt, int32_t local_index, jaxgin_device_info* out);
JAXGIN_API int jaxgin_runtime_destroy(jaxgin_runtime* rt);
// Every rank sends a stamped block to every rank (itself included) and checks what it received,
// `iterations` times, through the device library (puts with signals, and direct peer stores).
// mismatches[local_index * world_size + sender] receives the count of wrong 32-bit words.
// The heap range [heap_offset, +2 * world_size * block_bytes) and signals [signal_base, +2 * world_size)
// are the caller's (allocated from the user area), the same on every rank.
JAXGIN_API int jaxgin_selftest_exchange(jaxgin_runtime* rt, int32_t iterations, uint64_t block_bytes,
                             uint32_t seed, uint64_t heap_offset, uint32_t signal_base, uint64_t* mismatches);

// Blocks until this process's local GPU `local_index` sees `signal` >= `value`, by running a
// one-CTA kernel that waits with the device-side timeout (a timeout becomes an error here).
JAXGIN_API int jaxgin_wait_signal_on_device(jaxgin_runtime* rt, int32_t local_index, uint32_t signal,
                                            uint64_t value);

// XLA FFI handlers (see csrc/ffi/): the addresses of jaxgin_ffi_exchange, jaxgin_ffi_put and
// jaxgin_ffi_wait are registered with XLA as CUDA custom-call targets. They find the runtime of the
// GPU they run on through the process-wide runtime set by jaxgin_runtime_create.
// Host-side calls of each handler so far (a CUDA-graph replay runs kernels without calling them).
JAXGIN_API int jaxgin_ffi_calls(uint64_t* exchange, uint64_t* put, uint64_t* wait);
// Descriptions of device faults recorded on this process's GPUs since the runtime started
// ("" when none), separated by newlines; `out` receives at most `capacity` bytes, NUL-terminated.
// Times a chain of `iterations` ring exchanges of `bytes` on every local GPU, launched directly or
// as one CUDA graph, through the kernel jaxgin.ppermute picks or (generic_kernel != 0) the generic
// exchange kernel; us_per_op[local_index] receives the time per exchange (a diagnostic).
JAXGIN_API int jaxgin_exchange_latency(jaxgin_runtime* rt, uint64_t bytes, int32_t iterations, int32_t use_graph,
                                       int32_t generic_kernel, double* us_per_op);
// Frees heap bytes [offset, offset + bytes): a collective that zeroes them on every local GPU once
// every rank's earlier puts to this rank landed (csrc/ffi/heap_free.cu).
JAXGIN_API int jaxgin_heap_clear(jaxgin_runtime* rt, uint64_t offset, uint64_t bytes);
// Meets every rank once this process's GPU work is done, after which nothing any rank sent earlier
// is still on its way to this one (csrc/ffi/heap_free.cu); finalize() calls it before releasing
// what peers' puts and signals may still reach. A collective.
JAXGIN_API int jaxgin_runtime_settle(jaxgin_runtime* rt);
JAXGIN_API int jaxgin_device_faults(const jaxgin_runtime* rt, char* out, uint64_t capacity);
// One line per local GPU whose NCCL communicator reports an asynchronous error ('' when none): a
// GIN backend that stopped (NCCL's progress thread ends at its first error) no longer drains the
// GPU's descriptor queues, and a kernel posting into a full one spins inside NCCL, never reaching
// jaxgin's bounded waits. jaxgin/fault_watch.py ends a rank left waiting behind such a kernel.
JAXGIN_API int jaxgin_communicator_errors(const jaxgin_runtime* rt, char* out, uint64_t capacity);
// The wait before a broken GPU is reset (thread_settle.h), for tests through ctypes; the extension
// does not call it. 1: every other thread of the process was seen asleep; 0: the timeout came,
// with the threads last seen running in `out`.
JAXGIN_API int jaxgin_other_threads_settled(int32_t timeout_ms, char* out, uint64_t capacity);

#ifdef __cplusplus
}
#endif
