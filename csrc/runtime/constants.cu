// Sizes and codes the Python side computes with too: heap layouts it reserves, limits it checks
// before a call, the custom calls' attribute codes. They come from the op table
// (jaxgin/ffi/op_table.py) through the header the build generates from it; jaxgin_constant()
// exports them so that a test sees what a build compiled with
// (tests/test_build.py::test_backend_compiled_the_op_table).
#include <stdint.h>
#include <string.h>

#include "backend_api.h"
#include "jaxgin_op_table.h"
#include "runtime.h"

// The constant called `name` into *value: 0, or -1 when there is none of that name.
extern "C" JAXGIN_API int jaxgin_constant(const char* name, int64_t* value) {
  for (const jaxgin::TableConstant& c : jaxgin::kTableConstants)
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
