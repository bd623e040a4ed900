// XLA FFI handler behind jaxgin.ppermute and jaxgin.all_to_all: turns the op's attributes into an
// exchange plan for this rank and enqueues the exchange kernel on XLA's stream.
#include "../kernels/exchange.h"
#include "common.h"

namespace jaxgin::ffi_support {

std::atomic<uint64_t> exchange_calls{0}, put_calls{0}, wait_calls{0};

namespace {

// in/out: for all_to_all, [axis_size][chunk] (row i goes to / comes from axis index i); for
// ppermute, the whole buffer goes to perm's destination and comes from its source.
ffi::Error exchange(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                    ffi::Span<const int64_t> axes, int64_t kind, ffi::Span<const int64_t> perm, int64_t generation) {
  return guarded([&] {
    exchange_calls.fetch_add(1, std::memory_order_relaxed);
    DeviceState& s = device_for_ordinal(ordinal, generation);
    const jaxgin_context& c = s.host_context;
    AxisGroup group = resolve_axis(c.rank, mesh_ranks, mesh_shape, axes);
    const int size = (int)group.ranks.size();
    const uint64_t total = in.size_bytes();
    const char* src = static_cast<const char*>(in.untyped_data());
    char* dst = static_cast<char*>(out->untyped_data());
    exchange_plan plan{};
    if (kind == kAllToAll) {
      plan.op = JAXGIN_OP_ALL_TO_ALL;
      plan.bytes = total / size;
      plan.count = size;
      for (int i = 0; i < size; i++)
        plan.peers[i] = exchange_peer{group.ranks[i], kSend | kReceive, src + i * plan.bytes, dst + i * plan.bytes};
    } else {
      plan.op = JAXGIN_OP_PPERMUTE;
      plan.bytes = total;
      int to = -1, from = -1;
      for (size_t k = 0; k + 1 < perm.size(); k += 2) {
        if (perm[k] == group.my_index) to = (int)perm[k + 1];
        if (perm[k + 1] == group.my_index) from = (int)perm[k];
      }
      // jax.lax.ppermute semantics: a device that nobody sends to gets zeros.
      if (from < 0 && total > 0) check_launch(cudaMemsetAsync(dst, 0, total, stream), "cudaMemsetAsync", s.device);
      add_permute_peers(plan, to >= 0 ? group.ranks[to] : -1, from >= 0 ? group.ranks[from] : -1, src, dst);
    }
    check_launch(launch_exchange(s.context, c, s.lsa_heaps, plan, stream), "launching the exchange kernel", s.device);
    pace_launches(s, stream, jaxgin_op_name(plan.op));
  });
}

}  // namespace
}  // namespace jaxgin::ffi_support

// Exported under the names the op table gives it and its captured twin (declared in the generated
// jaxgin_op_table.h).
JAXGIN_FFI_CAPTURABLE_HANDLER(jaxgin_ffi_exchange, jaxgin::ffi_support::exchange,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<xla::ffi::Span<const int32_t>>("mesh_ranks")
                                  .Attr<xla::ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<xla::ffi::Span<const int64_t>>("axes")
                                  .Attr<int64_t>("kind")
                                  .Attr<xla::ffi::Span<const int64_t>>("perm")
                                  .Attr<int64_t>("generation"));

extern "C" JAXGIN_API int jaxgin_ffi_calls(uint64_t* exchange, uint64_t* put, uint64_t* wait) {
  *exchange = jaxgin::ffi_support::exchange_calls.load();
  *put = jaxgin::ffi_support::put_calls.load();
  *wait = jaxgin::ffi_support::wait_calls.load();
  return 0;
}
