// Sizes and codes the Python side computes with too: heap layouts it reserves, limits it checks
// before a call, the custom calls' attribute codes. Each is defined in C; jaxgin_constant() exports
// it so that a test holds Python's copy equal
// (tests/test_build.py::test_python_constants_equal_the_backend_ones).
// Beside the FFI handlers, above the runtime: the constants are the ops', and the runtime knows no op.
#include <stdint.h>
#include <string.h>

#include "attribute_codes.h"
#include "../kernels/exchange.h"
#include "../kernels/mailbox.h"
#include "../runtime/backend_api.h"
#include "../runtime/runtime.h"

namespace {
struct Constant {
  const char* name;
  int64_t value;
};
constexpr Constant kConstants[] = {
    {"mailbox_header_bytes", static_cast<int64_t>(jaxgin::kMailboxHeaderBytes)},
    {"max_exchange_peers", jaxgin::kMaxExchangePeers},
    {"line_max_bytes", JAXGIN_LINE_MAX_BYTES},
    {"default_max_queued_calls", jaxgin::kDefaultMaxQueuedCalls},
    {"max_queued_calls_limit", jaxgin::kMaxQueuedCallsLimit},
    {"exchange_kind_ppermute", jaxgin::ffi_support::kPpermute},
    {"exchange_kind_all_to_all", jaxgin::ffi_support::kAllToAll},
    {"triton_param_context", jaxgin::ffi_support::kContext},
    {"triton_param_operand", jaxgin::ffi_support::kOperand},
    {"triton_param_result", jaxgin::ffi_support::kResult},
    {"triton_param_heap", jaxgin::ffi_support::kHeap},
    {"triton_param_int32", jaxgin::ffi_support::kInt32},
    {"triton_param_int64", jaxgin::ffi_support::kInt64},
    {"triton_param_float32", jaxgin::ffi_support::kFloat32},
    {"triton_param_null_pointer", jaxgin::ffi_support::kNullPointer},
};
}  // namespace

// The constant called `name` into *value: 0, or -1 when there is none of that name.
extern "C" JAXGIN_API int jaxgin_constant(const char* name, int64_t* value) {
  for (const Constant& c : kConstants)
    if (strcmp(c.name, name) == 0) {
      *value = c.value;
      return 0;
    }
  return -1;
}

// The heap bytes jaxgin reserves for itself with this configuration (signals, the exchange
// channel's rings and staging, line slots): what runtime.reserved_bytes computes in Python.
extern "C" JAXGIN_API uint64_t jaxgin_reserved_heap_bytes(uint32_t signal_count, uint32_t barrier_slots, int32_t world,
                                                          uint32_t lanes, uint32_t slots, uint64_t slot_bytes) {
  return jaxgin_reserved_bytes(signal_count, barrier_slots, world, jaxgin_channel_shape{lanes, slots, slot_bytes});
}
