// XLA FFI handlers behind jaxgin.put_signal, jaxgin.wait_signal and jaxgin.wait_signal_from.
#include "../kernels/mailbox.h"
#include "common.h"

namespace jaxgin::ffi_support {
namespace {

mailbox_desc describe(const DeviceState& state, const AxisGroup& group, int64_t offset, int64_t payload_bytes,
                      int64_t signal_base) {
  const jaxgin_context& c = state.host_context;
  const int size = (int)group.ranks.size();
  if (offset < (int64_t)c.user_offset || offset + (int64_t)mailbox_bytes(payload_bytes, size) > (int64_t)c.heap_bytes ||
      signal_base < 0 || signal_base + 2 * size > (int64_t)c.signal_count)
    throw Error("mailbox at heap offset " + std::to_string(offset) + " / signal " + std::to_string(signal_base) +
                " does not fit this runtime's heap or signals (was the program compiled for another initialize()?)");
  mailbox_desc box{};
  box.offset = (uint64_t)offset;
  box.payload_bytes = (uint64_t)payload_bytes;
  box.slot_bytes = mailbox_slot_bytes((uint64_t)payload_bytes);
  box.line_slot_bytes = mailbox_line_slot_bytes((uint64_t)payload_bytes);
  box.signal_base = (uint32_t)signal_base;
  box.axis_size = size;
  box.my_index = group.my_index;
  box.put_parts = mailbox_put_parts((uint64_t)payload_bytes);
  box.heap = c.heap;
  box.consumed = c.consumed;
  for (int i = 0; i < size; i++) {
    box.ranks[i] = group.ranks[i];
    box.peer_heaps[i] = c.force_gin ? nullptr : state.lsa_heaps[(size_t)group.ranks[i]];
  }
  return box;
}

// What every mailbox handler starts with: the device running the call and the mailbox its
// attributes name. `buffer_bytes` is the payload, or for wait (one slot per sender) the whole output.
struct MailboxCall {
  DeviceState& device;
  mailbox_desc box;
};

MailboxCall open_mailbox(int32_t ordinal, int64_t generation, ffi::Span<const int32_t> mesh_ranks,
                         ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                         int64_t signal_base, size_t buffer_bytes, bool slot_per_sender) {
  DeviceState& s = device_for_ordinal(ordinal, generation);
  AxisGroup group = resolve_axis(s.host_context.rank, mesh_ranks, mesh_shape, axes);
  const size_t payload = slot_per_sender ? buffer_bytes / group.ranks.size() : buffer_bytes;
  return MailboxCall{s, describe(s, group, offset, (int64_t)payload, signal_base)};
}

ffi::Error put(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> peer,
               ffi::Result<ffi::Buffer<ffi::S32>> token, ffi::Span<const int32_t> mesh_ranks,
               ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
               int64_t signal_base, int64_t generation) {
  return guarded([&] {
    put_calls.fetch_add(1, std::memory_order_relaxed);
    MailboxCall m = open_mailbox(ordinal, generation, mesh_ranks, mesh_shape, axes, offset, signal_base,
                                 x.size_bytes(), /*slot_per_sender=*/false);
    check_launch(launch_put(m.device.context, m.box, x.untyped_data(), peer.typed_data(), token->typed_data(), stream),
                 "launching the put kernel", m.device.device);
    pace_launches(m.device, stream, jaxgin_op_name(JAXGIN_OP_PUT_SIGNAL));
  });
}

// `taken`: the int32 mask of the rows the wait took, absent for an empty payload (jaxgin/mailbox.py
// says why).
ffi::Error wait(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out,
                ffi::RemainingRets taken, ffi::Span<const int32_t> mesh_ranks, ffi::Span<const int64_t> mesh_shape,
                ffi::Span<const int64_t> axes, int64_t offset, int64_t signal_base, int64_t count,
                int64_t generation) {
  return guarded([&] {
    wait_calls.fetch_add(1, std::memory_order_relaxed);
    MailboxCall m = open_mailbox(ordinal, generation, mesh_ranks, mesh_shape, axes, offset, signal_base,
                                 out->size_bytes(), /*slot_per_sender=*/true);
    int32_t* taken_rows = nullptr;
    if (!taken.empty()) {
      auto mask = taken.get<ffi::Buffer<ffi::S32>>(0);
      if (mask.has_error()) throw Error("jaxgin.wait_signal: its second result is not the int32 mask of taken rows");
      taken_rows = (*mask)->typed_data();
    }
    check_launch(launch_wait(m.device.context, m.box, (int32_t)count, out->untyped_data(), taken_rows, stream),
                 "launching the wait kernels", m.device.device);
    pace_launches(m.device, stream, jaxgin_op_name(JAXGIN_OP_WAIT_SIGNAL));
  });
}

ffi::Error wait_from(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> source, ffi::RemainingArgs,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> mesh_ranks,
                     ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> axes, int64_t offset,
                     int64_t signal_base, int64_t generation) {
  return guarded([&] {
    wait_calls.fetch_add(1, std::memory_order_relaxed);
    MailboxCall m = open_mailbox(ordinal, generation, mesh_ranks, mesh_shape, axes, offset, signal_base,
                                 out->size_bytes(), /*slot_per_sender=*/false);
    check_launch(launch_wait_from(m.device.context, m.box, source.typed_data(), out->untyped_data(), stream),
                 "launching the wait_from kernel", m.device.device);
    pace_launches(m.device, stream, jaxgin_op_name(JAXGIN_OP_WAIT_SIGNAL_FROM));
  });
}

}  // namespace
}  // namespace jaxgin::ffi_support

// The attributes that name a mailbox, in the order the handlers above take them.
#define JAXGIN_MAILBOX_ATTRS                             \
  .Attr<xla::ffi::Span<const int32_t>>("mesh_ranks")     \
      .Attr<xla::ffi::Span<const int64_t>>("mesh_shape") \
      .Attr<xla::ffi::Span<const int64_t>>("axes")       \
      .Attr<int64_t>("offset")                           \
      .Attr<int64_t>("signal_base")

// Exported under the names the op table gives them (declared in the generated jaxgin_op_table.h).
JAXGIN_FFI_CAPTURABLE_HANDLER(jaxgin_ffi_put, jaxgin::ffi_support::put,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  JAXGIN_MAILBOX_ATTRS
                                  .Attr<int64_t>("generation"));

JAXGIN_FFI_CAPTURABLE_HANDLER(jaxgin_ffi_wait, jaxgin::ffi_support::wait,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .RemainingRets()
                                  JAXGIN_MAILBOX_ATTRS
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("generation"));

JAXGIN_FFI_CAPTURABLE_HANDLER(jaxgin_ffi_wait_from, jaxgin::ffi_support::wait_from,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  JAXGIN_MAILBOX_ATTRS
                                  .Attr<int64_t>("generation"));
