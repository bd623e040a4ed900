// Data layout of the per-GPU context that every jaxgin kernel receives as one pointer.
//
// The context lives in device memory and is filled by the host runtime (csrc/runtime). It embeds
// the NCCL device communicator by value, so this header must be compiled against the headers of
// the NCCL library that is loaded at run time (the build in jaxgin/build.py guarantees that).
#pragma once

#include <stdint.h>
#include <nccl.h>
#include <nccl_device.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)
#error "jaxgin needs NCCL >= 2.28 (the NCCL Device API)"
#endif

// Why a wait gave up. Written once into jaxgin_fault before the kernel traps.
enum jaxgin_fault_code : uint32_t {
  JAXGIN_FAULT_NONE = 0,
  JAXGIN_FAULT_WAIT_TIMEOUT = 1,       // a signal did not reach the expected value in time
  JAXGIN_FAULT_PEER_UNREACHABLE = 2,   // peer is neither in the LSA team nor reachable through GIN
  JAXGIN_FAULT_BAD_ARGUMENT = 3,       // signal id, peer or barrier slot out of range
};

// Which operation was waiting; kernels pass their own tag so the host can name the op.
enum jaxgin_op_tag : uint32_t {
  JAXGIN_OP_DEVICE_CALL = 0,  // a jaxgin_* device function called from user code (e.g. Triton)
  JAXGIN_OP_BARRIER = 1,
  JAXGIN_OP_SELFTEST = 2,
};

// First fault of a context. Lives in host-mapped pinned memory so the host can still read it after
// the kernel trapped and the CUDA context became unusable.
struct jaxgin_fault {
  uint32_t code;       // jaxgin_fault_code; 0 while no fault happened
  uint32_t op;         // jaxgin_op_tag
  int32_t rank;        // rank that detected the fault
  int32_t peer;        // peer involved, -1 when none
  uint32_t signal;     // signal id waited on
  uint32_t block;      // linear CTA index that detected it
  uint64_t expected;   // value waited for
  uint64_t observed;   // value last read
};

struct jaxgin_context {
  ncclDevComm comm;       // NCCL device communicator (by value: kernels never pass it around)
  ncclWindow_t window;    // symmetric heap window, registered with NCCL_WIN_COLL_SYMMETRIC
  char* heap;             // local base address of the symmetric heap
  uint64_t heap_bytes;    // whole heap, reserved area included
  uint64_t user_offset;   // first byte users may use; below it live the signal counters
  uint64_t* consumed;     // device memory, one counter per signal: arrivals already waited for
  jaxgin_fault* fault;    // host-mapped; see jaxgin_fault
  uint64_t timeout_ns;    // bound on every device-side wait
  uint32_t signal_count;  // user-visible signals [0, signal_count)
  uint32_t barrier_slots; // barrier signals follow the user signals, one per CTA index
  int32_t rank, world_size;
  int32_t lsa_rank, lsa_size;
  int32_t gin_contexts;   // GIN contexts in `comm`; 0 when this communicator has no GIN
  int32_t force_gin;      // route every peer, LSA peers included, through GIN
};

// Signal counters sit at the start of the heap: [signal_count user signals][barrier_slots].
static inline uint64_t jaxgin_reserved_bytes(uint32_t signal_count, uint32_t barrier_slots) {
  uint64_t bytes = (uint64_t)(signal_count + barrier_slots) * sizeof(uint64_t);
  return (bytes + 4095) & ~(uint64_t)4095;
}
