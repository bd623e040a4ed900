// XLA FFI handler behind jaxgin.triton_call: launches a compiled (and device-library-linked) Triton
// kernel on XLA's stream.
//
// The cubin travels inside the program as an attribute, so a serialized or cached executable
// carries its kernel with it. The instantiate stage loads it once per executable as a
// context-independent CUDA library (usable on every GPU of the process, no reload per device);
// the execute stage only fills the parameters and launches, which CUDA graphs can record.
//
// Parameters are described by the `params` attribute, pairs (kind, value) in the kernel's order
// (ParamKind, from the op table: jaxgin/ffi/op_table.py).
#include <cstring>

#include "triton_kernel.h"

namespace jaxgin::ffi_support {

ffi::TypeId TritonKernel::id = {};

ffi::ErrorOr<std::unique_ptr<TritonKernel>> load_triton_kernel(ffi::Span<const int8_t> cubin, std::string_view name,
                                                              int64_t shared_bytes, const char* op) {
  auto kernel = std::make_unique<TritonKernel>();
  kernel->name = std::string(name);
  kernel->shared_bytes = shared_bytes;
  cudaError_t status = cudaLibraryLoadData(&kernel->library, &cubin.front(), nullptr, nullptr, 0, nullptr,
                                           nullptr, 0);
  if (status == cudaSuccess) status = cudaLibraryGetKernel(&kernel->kernel, kernel->library, kernel->name.c_str());
  // Load it into every GPU this process drives now, when the program is compiled. CUDA loads
  // lazily by default, at a kernel's first launch, and that load may wait for the whole context to
  // go idle: a kernel launched after a communicating one (combine after dispatch) would then wait
  // for it, while it spins on a put that the host transport cannot copy until that wait ends
  // (measured: MoE dispatch over GIN, emulated hosts, hung in the first call). See
  // the op table's preload hooks (jaxgin/ffi/op_table.py) for the library's own kernels.
  int previous = 0;
  if (status == cudaSuccess) status = cudaGetDevice(&previous);
  if (status == cudaSuccess) {
    for (int device : driven_devices()) {
      cudaFuncAttributes attributes;
      status = cudaSetDevice(device);
      if (status == cudaSuccess) status = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel->kernel));
      if (status != cudaSuccess) break;
    }
    // The compiling thread's device is put back on failure too.
    const cudaError_t restored = cudaSetDevice(previous);
    if (status == cudaSuccess) status = restored;
  }
  if (status != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(op) + ": loading Triton kernel " + kernel->name + " (" +
                                                     std::to_string(cubin.size()) +
                                                     "-byte cubin) failed: " + cuda_error_text(status));
  return ffi::ErrorOr<std::unique_ptr<TritonKernel>>(std::move(kernel));
}

namespace {

void configure_shared(TritonKernel& k, int device, const char* op) {
  if (k.shared_bytes <= 48 * 1024) return;  // the default limit covers it
  std::lock_guard<std::mutex> lock(k.mutex);
  for (int d : k.shared_configured)
    if (d == device) return;
  check_cuda(cudaKernelSetAttributeForDevice(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)k.shared_bytes, device),
             std::string(op) + ": allowing " + std::to_string(k.shared_bytes) + " bytes of shared memory for " +
                 k.name,
             device);
  k.shared_configured.push_back(device);
}

}  // namespace

void launch_triton_kernel(TritonKernel& kernel, DeviceState& s, cudaStream_t stream, const ffi::RemainingArgs& args,
                          ffi::RemainingRets& rets, ffi::Span<const int64_t> grid, int64_t num_warps,
                          ffi::Span<const int64_t> params, const char* op) {
  const jaxgin_context& c = s.host_context;
  const size_t count = params.size() / 2;
  // One 8-byte slot per parameter; CUDA reads each at its own size from the slot's start.
  std::vector<uint64_t> values(count, 0);
  std::vector<void*> pointers(count);
  for (size_t i = 0; i < count; i++) {
    const int64_t kind = params[2 * i], value = params[2 * i + 1];
    uint64_t& slot = values[i];
    switch (kind) {
      case kContext: slot = reinterpret_cast<uint64_t>(s.context); break;
      case kOperand: {
        auto buffer = args.get<ffi::AnyBuffer>((size_t)value);
        if (buffer.has_error()) throw Error("operand " + std::to_string(value) + " is missing");
        slot = reinterpret_cast<uint64_t>(buffer->untyped_data());
        break;
      }
      case kResult: {
        auto buffer = rets.get<ffi::AnyBuffer>((size_t)value);
        if (buffer.has_error()) throw Error("result " + std::to_string(value) + " is missing");
        slot = reinterpret_cast<uint64_t>((*buffer)->untyped_data());
        break;
      }
      case kHeap:
        if (value < (int64_t)c.user_offset || value >= (int64_t)c.heap_bytes)
          throw Error("heap offset " + std::to_string(value) + " is outside this runtime's user heap (was the "
                      "program compiled for another jaxgin.initialize()?)");
        slot = reinterpret_cast<uint64_t>(c.heap + value);
        break;
      case kInt32: {
        const int32_t v = (int32_t)value;
        std::memcpy(&slot, &v, sizeof v);
        break;
      }
      case kInt64: slot = (uint64_t)value; break;
      case kFloat32: {
        const uint32_t bits = (uint32_t)value;
        std::memcpy(&slot, &bits, sizeof bits);
        break;
      }
      case kNullPointer: slot = 0; break;
      default: throw Error("unknown parameter kind " + std::to_string(kind));
    }
    pointers[i] = &slot;
  }
  configure_shared(kernel, s.device, op);
  const dim3 blocks((unsigned)grid[0], (unsigned)grid[1], (unsigned)grid[2]);
  const dim3 threads((unsigned)(num_warps * 32));
  check_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(kernel.kernel), blocks, threads, pointers.data(),
                              (size_t)kernel.shared_bytes, stream),
             std::string(op) + ": launching Triton kernel " + kernel.name, s.device);
}

namespace {

ffi::ErrorOr<std::unique_ptr<TritonKernel>> instantiate(ffi::Span<const int8_t> cubin, std::string_view name,
                                                       ffi::Span<const int64_t>, int64_t, int64_t shared_bytes,
                                                       ffi::Span<const int64_t>, int64_t) {
  return load_triton_kernel(cubin, name, shared_bytes, "jaxgin.triton_call");
}

ffi::Error execute(cudaStream_t stream, int32_t ordinal, TritonKernel* kernel, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, ffi::Span<const int8_t>, std::string_view, ffi::Span<const int64_t> grid,
                   int64_t num_warps, int64_t, ffi::Span<const int64_t> params, int64_t generation) {
  return guarded([&] {
    DeviceState& s = device_for_ordinal(ordinal, generation);
    launch_triton_kernel(*kernel, s, stream, args, rets, grid, num_warps, params, "jaxgin.triton_call");
    pace_launches(s, stream, "jaxgin.triton_call");
  });
}

}  // namespace
}  // namespace jaxgin::ffi_support

// Exported under the names the op table gives them (declared in the generated jaxgin_op_table.h).
// For registering the state type with XLA (jax.ffi.register_ffi_type).
extern "C" void* jaxgin_ffi_triton_kernel_type_id(void) { return &jaxgin::ffi_support::TritonKernel::id; }
extern "C" void* jaxgin_ffi_triton_kernel_type_info(void) {
  static XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<jaxgin::ffi_support::TritonKernel>();
  return &info;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxgin_ffi_triton_instantiate, jaxgin::ffi_support::instantiate,
                              xla::ffi::Ffi::BindInstantiate() JAXGIN_TRITON_KERNEL_ATTRS);

JAXGIN_FFI_CAPTURABLE_HANDLER(jaxgin_ffi_triton_execute, jaxgin::ffi_support::execute,
                              JAXGIN_TRITON_KERNEL_BINDING JAXGIN_TRITON_KERNEL_ATTRS);
