// Launchers of the diagnostic kernels behind jaxgin.selftest(), the exchange-latency tool and the
// host-callable signal wait. Their C ABI (argument checks, synchronization, fault reports) is in
// ffi/diagnostics.cu; these only enqueue on `stream`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../device/jaxgin_types.h"

namespace jaxgin {

// The all-pairs exchange of jaxgin.selftest(): `world` CTAs, CTA p exchanging a stamped block with
// rank p for `rounds` rounds; `mismatches[p]` counts the words received from p that were wrong.
// Heap range [heap_offset, +2*world*block_bytes) and signals [signal_base, +2*world) are the
// caller's.
cudaError_t launch_selftest_exchange(const jaxgin_context* ctx, int world, int rounds, uint64_t block_bytes,
                                     uint32_t seed, uint64_t heap_offset, uint32_t signal_base,
                                     unsigned long long* mismatches, cudaStream_t stream);

// One CTA waiting, through the device library's bounded wait, until `signal` reaches `value`.
cudaError_t launch_wait_signal(const jaxgin_context* ctx, uint32_t signal, uint64_t value, cudaStream_t stream);

// An empty kernel: the launch floor any one-kernel op pays.
cudaError_t launch_empty(cudaStream_t stream);

}  // namespace jaxgin
