// Integer codes that Python writes into the custom calls' attributes and the handlers read. Plain
// enums without XLA's headers, so csrc/ffi/constants.cu exports them too and a test holds
// Python's copies equal (tests/test_build.py::test_python_constants_equal_the_backend_ones).
#pragma once
#include <stdint.h>

namespace jaxgin::ffi_support {

// jaxgin_exchange's `kind` (jaxgin.ppermute / jaxgin.all_to_all).
enum ExchangeKind : int64_t { kPpermute = 0, kAllToAll = 1 };

// jaxgin_triton_call's `params`: pairs (kind, value) in the kernel's parameter order.
enum ParamKind : int64_t {
  kContext = 0,      // the jaxgin context of the GPU this runs on
  kOperand = 1,      // the address of XLA operand number `value`
  kResult = 2,       // the address of XLA result number `value`
  kHeap = 3,         // this GPU's address of symmetric-heap offset `value`
  kInt32 = 4,        // a scalar
  kInt64 = 5,        // a scalar
  kFloat32 = 6,      // a scalar, as its bit pattern
  kNullPointer = 7,  // a pointer parameter Triton appends (global / profile scratch) that the kernel
                     // was compiled not to use
};

}  // namespace jaxgin::ffi_support
