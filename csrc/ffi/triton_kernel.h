// A Triton kernel as the program carries it (a cubin attribute, jaxgin/triton_op.py): loaded once
// per executable, then launched with its parameters filled from the call. jaxgin.triton_call
// (triton_call.cu) and the fused ops' copy-engine exchange computed by Triton (chunked_matmul.cu)
// both launch through it.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"

namespace jaxgin::ffi_support {

// A kernel's code, loaded once per executable; the launch configuration comes with each call.
struct TritonKernel {
  static ffi::TypeId id;
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
  std::string name;
  int64_t shared_bytes = 0;
  std::mutex mutex;
  std::vector<int> shared_configured;  // devices whose dynamic shared-memory limit was raised

  ~TritonKernel() {
    if (library != nullptr) cudaLibraryUnload(library);
  }
};

// Loads `cubin` and finds kernel `name` in it, on every GPU this process drives; `op` names the
// caller in the error.
ffi::ErrorOr<std::unique_ptr<TritonKernel>> load_triton_kernel(ffi::Span<const int8_t> cubin, std::string_view name,
                                                              int64_t shared_bytes, const char* op);

// Fills the kernel's parameters from `params` (pairs (ParamKind, value), jaxgin/ffi/op_table.py)
// and launches it on `stream`; `op` names the caller in errors.
void launch_triton_kernel(TritonKernel& kernel, DeviceState& s, cudaStream_t stream, const ffi::RemainingArgs& args,
                          ffi::RemainingRets& rets, ffi::Span<const int64_t> grid, int64_t num_warps,
                          ffi::Span<const int64_t> params, const char* op);

}  // namespace jaxgin::ffi_support

// What a handler that launches a Triton kernel binds: XLA's stream and device, the loaded kernel,
// its operands and results, then the kernel's attributes (jaxgin/triton_op.py's lowered_call),
// which an instantiate stage binding the same ones loads.
#define JAXGIN_TRITON_KERNEL_BINDING                                    \
  xla::ffi::Ffi::Bind()                                                 \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                    \
      .Ctx<xla::ffi::DeviceOrdinal>()                                   \
      .Ctx<xla::ffi::State<jaxgin::ffi_support::TritonKernel>>()        \
      .RemainingArgs()                                                  \
      .RemainingRets()
#define JAXGIN_TRITON_KERNEL_ATTRS                          \
  .Attr<xla::ffi::Span<const int8_t>>("cubin")              \
      .Attr<std::string_view>("kernel_name")                \
      .Attr<xla::ffi::Span<const int64_t>>("grid")          \
      .Attr<int64_t>("num_warps")                           \
      .Attr<int64_t>("shared_bytes")                        \
      .Attr<xla::ffi::Span<const int64_t>>("params")        \
      .Attr<int64_t>("generation")
