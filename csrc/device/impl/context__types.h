// Data layout of the per-GPU context that every jaxgin kernel receives as one pointer.
//
// The context lives in device memory and is filled by the host runtime (csrc/runtime). It embeds
// the NCCL device communicator by value, so this header must be compiled against the headers of
// the NCCL library that is loaded at run time (the build in jaxgin/build.py guarantees that).
#pragma once

#include <stdint.h>
#include <nccl.h>
// NCCL's device communicator type and host API without NCCL's device functions, so that host code
// including the context compiles none of them (transport__funcs.h brings them to the device
// library): nccl_device/host.h in NCCL 2.32, impl/comm__types.h and the core.h it includes before.
// core.h declares inline device functions that it leaves to the device headers: nvcc warns (#821).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 821
#if __has_include(<nccl_device/host.h>)
#include <nccl_device/host.h>
#else
#include <nccl_device/impl/comm__types.h>
#endif
#pragma nv_diagnostic pop

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)
#error "jaxgin needs NCCL >= 2.28 (the NCCL Device API)"
#endif

// Why a wait gave up. Written once into jaxgin_fault before the kernel traps.
enum jaxgin_fault_code : uint32_t {
  JAXGIN_FAULT_NONE = 0,
  JAXGIN_FAULT_WAIT_TIMEOUT = 1,       // a signal did not reach the expected value in time
  JAXGIN_FAULT_PEER_UNREACHABLE = 2,   // peer is neither in the LSA team nor reachable through GIN
  JAXGIN_FAULT_BAD_ARGUMENT = 3,       // signal id, peer or barrier slot out of range
  JAXGIN_FAULT_HEAP_RANGE = 4,         // a put's source or destination is not inside the heap
  JAXGIN_FAULT_NOT_LSA_PEER = 5,       // a peer pointer was asked for a peer outside the LSA team
  JAXGIN_FAULT_FLAG_TIMEOUT = 6,       // a heap flag did not reach the expected value in time
  JAXGIN_FAULT_FLUSH_TIMEOUT = 7,      // NCCL's GIN backend did not take this rank's puts in time
};

// Which operation was waiting; kernels pass their own tag so the host can name the op.
enum jaxgin_op_tag : uint32_t {
  JAXGIN_OP_DEVICE_CALL = 0,  // a jaxgin_* device function called from user code (e.g. Triton)
  JAXGIN_OP_BARRIER = 1,
  JAXGIN_OP_SELFTEST = 2,
  JAXGIN_OP_PPERMUTE = 3,
  JAXGIN_OP_ALL_TO_ALL = 4,
  JAXGIN_OP_PUT_SIGNAL = 5,
  JAXGIN_OP_WAIT_SIGNAL = 6,
  JAXGIN_OP_WAIT_SIGNAL_FROM = 7,
  JAXGIN_OP_MATMUL_ALL_TO_ALL = 8,   // jaxgin.fused, cuBLAS chunks handed over by the copy engine
  JAXGIN_OP_ALL_GATHER_MATMUL = 9,
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

namespace jaxgin {
// jaxgin_fault::signal of a JAXGIN_FAULT_FLAG_TIMEOUT in a chunk hand-off (kernels/chunk_handoff.h):
// which count the wait was about. Here because the runtime's fault report reads it too.
constexpr uint32_t kWaitedForChunk = 0, kWaitedForCredit = 1;
}  // namespace jaxgin

struct jaxgin_context {
  ncclDevComm comm;       // NCCL device communicator (by value: kernels never pass it around)
  ncclWindow_t window;    // symmetric heap window, registered with NCCL_WIN_COLL_SYMMETRIC
  char* heap;             // local base address of the symmetric heap
  uint64_t heap_bytes;    // whole heap, reserved area included
  uint64_t user_offset;   // first byte users may use; below it live the signal counters
  uint64_t* consumed;     // device memory, one counter per signal: arrivals already waited for
  jaxgin_fault* fault;    // host-mapped; see jaxgin_fault
  uint64_t timeout_ns;    // bound on every device-side wait
  uint64_t timeout_cycles;  // the same bound in SM clock cycles (at most the GPU's top clock), for NCCL's timed calls
  uint32_t signal_count;  // user-visible signals [0, signal_count)
  uint32_t barrier_slots; // barrier signals follow the user signals, one per CTA index
  int32_t rank, world_size;
  int32_t lsa_rank, lsa_size;
  int32_t gin_contexts;   // GIN contexts in `comm`; 0 when this communicator has no GIN
  int32_t force_gin;      // route every peer, LSA peers included, through GIN
  // The exchange channel behind ppermute / all_to_all (see channel__funcs.h): for every ordered
  // pair of ranks, `channel_lanes` independent streams of chunks, each with `channel_slots` ring
  // slots of `channel_slot_bytes` in the receiver's heap and two signals (data, credit).
  uint32_t channel_lanes, channel_slots;
  uint64_t channel_slot_bytes;
  uint64_t channel_offset;        // heap offset of the rings: [sender][lane][slot]
  uint64_t staging_offset;        // heap offset of GIN send staging: [receiver][lane]
  uint64_t line_offset;           // heap offset of the line slots: [sender][slot]
  uint32_t channel_signal_base;   // data signals [sender][lane], then credit signals [receiver][lane]
  uint64_t* channel_sent;         // device memory [peer][lane]: chunks sent to peer on lane
  uint64_t* channel_received;     // device memory [peer][lane]: chunks received from peer on lane
};

// Shape of the exchange channel; every rank must use the same one.
struct jaxgin_channel_shape {
  uint32_t lanes, slots;
  uint64_t slot_bytes;
};

// Signals per rank: [signal_count user][barrier_slots][channel data world*lanes][channel credit].
static inline uint32_t jaxgin_total_signals(uint32_t signal_count, uint32_t barrier_slots, int world,
                                            jaxgin_channel_shape ch) {
  return signal_count + barrier_slots + 2u * (uint32_t)world * ch.lanes;
}

static inline uint64_t jaxgin_round_up(uint64_t bytes, uint64_t to) { return (bytes + to - 1) / to * to; }

// Messages up to this size between LSA peers travel as "lines" (see channel__funcs.h): 8 payload
// bytes and two copies of a flag per 16-byte store, so the data is its own signal. It is also the
// smallest chunk of the ring protocol, so such a message is always one chunk on one lane.
#define JAXGIN_LINE_MAX_BYTES 8192u
// One line slot holds a whole line message: twice its payload.
#define JAXGIN_LINE_SLOT_BYTES (2u * JAXGIN_LINE_MAX_BYTES)

// Heap layout: [signal counters][channel rings][GIN send staging][line slots][user area]. Returns
// the offset of the user area; the other offsets follow from it (see the runtime's setup).
static inline uint64_t jaxgin_signal_area_bytes(uint32_t total_signals) {
  return jaxgin_round_up((uint64_t)total_signals * sizeof(uint64_t), 4096);
}
static inline uint64_t jaxgin_ring_bytes(int world, jaxgin_channel_shape ch) {
  return (uint64_t)world * ch.lanes * ch.slots * ch.slot_bytes;
}
static inline uint64_t jaxgin_staging_bytes(int world, jaxgin_channel_shape ch) {
  return (uint64_t)world * ch.lanes * ch.slot_bytes;
}
// Line slots: [sender][slot], the ring's slot count.
static inline uint64_t jaxgin_line_bytes(int world, jaxgin_channel_shape ch) {
  return (uint64_t)world * ch.slots * JAXGIN_LINE_SLOT_BYTES;
}
static inline uint64_t jaxgin_reserved_bytes(uint32_t signal_count, uint32_t barrier_slots, int world,
                                             jaxgin_channel_shape ch) {
  return jaxgin_signal_area_bytes(jaxgin_total_signals(signal_count, barrier_slots, world, ch)) +
         jaxgin_ring_bytes(world, ch) + jaxgin_staging_bytes(world, ch) + jaxgin_line_bytes(world, ch);
}
