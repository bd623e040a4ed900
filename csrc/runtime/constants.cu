// Sizes the Python side computes with too (heap layouts it reserves, limits it checks before a
// call). Each is defined here in C; jaxgin_constant() exports it so that a test holds Python's
// copy equal (tests/test_build.py::test_python_constants_equal_the_backend_ones).
#include <stdint.h>
#include <string.h>

#include "backend_api.h"
#include "../kernels/exchange.h"
#include "../kernels/mailbox.h"
#include "runtime.h"

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
