// Layout of a line (see line__funcs.h), apart from the functions that store and await lines: host
// code sizes line slots with it (a mailbox's heap block, kernels/mailbox.h).
#pragma once
#include <stdint.h>

namespace jaxgin {

struct alignas(16) line {
  uint32_t low, flag, high, flag_again;
};

// Lines a message of `bytes` takes (an empty message still takes one, to carry its flag).
__host__ __device__ inline uint64_t line_count(uint64_t bytes) { return bytes == 0 ? 1 : (bytes + 7) / 8; }

}  // namespace jaxgin
