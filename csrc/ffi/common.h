// Shared pieces of jaxgin's XLA FFI handlers: finding the runtime of the GPU a handler runs on,
// resolving a mesh axis to global ranks, and turning errors into XLA errors.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "../kernels/exchange.h"
#include "../runtime/errors.h"
#include "../runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxgin::ffi_support {

namespace ffi = xla::ffi;

// Host-side handler invocations, per family (see jaxgin_ffi_calls).
extern std::atomic<uint64_t> exchange_calls, put_calls, wait_calls;

// The ranks along a mesh axis, seen from one rank: which index it has and the global rank of every
// index. Built from attributes that are the same on every device of the SPMD program (the mesh's
// global ranks in mesh order, its shape, and the mesh dimensions the axis name covers), so the
// compiled program carries no per-device value.
struct AxisGroup {
  int my_index = -1;
  std::vector<int32_t> ranks;
};

inline AxisGroup resolve_axis(int my_rank, ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                              ffi::Span<const int64_t> axes) {
  const size_t dims = mesh_shape.size();
  int64_t total = 1;
  for (int64_t d : mesh_shape) total *= d;
  if ((int64_t)mesh_ranks.size() != total) throw Error("mesh_ranks does not match mesh_shape");
  int64_t position = -1;
  for (size_t i = 0; i < mesh_ranks.size(); i++)
    if (mesh_ranks[i] == my_rank) position = (int64_t)i;
  if (position < 0)
    throw Error("rank " + std::to_string(my_rank) + " is not in the mesh this op was traced with");
  // Mesh coordinates of this rank (row-major, as jax.sharding.Mesh orders devices).
  std::vector<int64_t> coord(dims), stride(dims);
  int64_t s = 1;
  for (size_t d = dims; d-- > 0;) {
    stride[d] = s;
    coord[d] = (position / s) % mesh_shape[d];
    s *= mesh_shape[d];
  }
  // The group: vary the coordinates of the named axes (first name most significant, as
  // jax.lax.axis_index does for a tuple of names), keep the others.
  int64_t size = 1;
  for (int64_t a : axes) size *= mesh_shape[a];
  // Exchange plans and mailbox descriptors carry one entry per axis index in kernel parameters.
  if (size > kMaxExchangePeers)
    throw Error("mesh axis of " + std::to_string(size) + " devices; jaxgin ops support at most " +
                std::to_string(kMaxExchangePeers));
  AxisGroup group;
  group.ranks.resize(size);
  int64_t my_index = 0;
  for (int64_t a : axes) my_index = my_index * mesh_shape[a] + coord[a];
  group.my_index = (int)my_index;
  for (int64_t index = 0; index < size; index++) {
    int64_t rest = index, flat = position;
    for (size_t k = axes.size(); k-- > 0;) {
      const int64_t a = axes[k];
      const int64_t c = rest % mesh_shape[a];
      rest /= mesh_shape[a];
      flat += (c - coord[a]) * stride[a];
    }
    group.ranks[index] = mesh_ranks[flat];
  }
  return group;
}

template <typename F>
ffi::Error guarded(F&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string("jaxgin: ") + e.what());
  }
}

inline void check_launch(cudaError_t e, const char* what, int device) {
  if (e != cudaSuccess) throw_cuda(e, what, device);
}

// Called right after a handler launched a kernel that may wait for peers on `stream`: keeps XLA's
// thread at most $JAXGIN_MAX_QUEUED_CALLS such calls ahead of the GPU where a CPU thread carries
// the puts (launch_pacing.cu says why). `op` names the call in the error of a failed earlier call.
void pace_launches(DeviceState& s, cudaStream_t stream, const char* op);

}  // namespace jaxgin::ffi_support

// A handler exported twice, under the names the op table gives a capturable target: `symbol` for
// calls XLA runs as their own step on its stream, and `symbol`_captured with XLA's command-buffer
// trait, which XLA may record into its CUDA graphs (jaxgin/ffi/capture.py picks one per program).
// The handler is the same: it enqueues only work a graph can replay (no host wait, every expected
// value kept on the device); the launch pacing skips a stream that is being captured.
#define JAXGIN_FFI_CAPTURABLE_HANDLER(symbol, impl, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, binding);       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol##_captured, impl, binding, {xla::ffi::Traits::kCmdBufferCompatible})
