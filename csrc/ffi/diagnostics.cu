// The C ABI of the diagnostics: jaxgin.selftest()'s all-pairs exchange, the exchange-latency tool
// (benchmarks/tools time the exchange kernel without XLA: a chain of ring exchanges per GPU, each
// op's output the next one's input, launched directly or as one CUDA graph, timed with CUDA events;
// with bytes == 0 a chain of empty kernels, the launch floor) and a host-callable signal wait.
// Each checks its arguments, launches through kernels/diagnostics.h and reports a device fault
// by what the fault record says.
// Beside the FFI handlers, above the runtime and the kernels: it launches kernels on the runtime's GPUs.
#include <string>
#include <vector>

#include "../kernels/diagnostics.h"
#include "../kernels/exchange.h"
#include "../runtime/errors.h"
#include "../runtime/runtime.h"

namespace {

jaxgin::exchange_plan ring_plan(const jaxgin_context& c, const char* src, char* dst, uint64_t bytes) {
  jaxgin::exchange_plan plan{};
  plan.op = JAXGIN_OP_PPERMUTE;
  plan.bytes = bytes;
  jaxgin::add_permute_peers(plan, (c.rank + 1) % c.world_size, (c.rank + c.world_size - 1) % c.world_size, src,
                            dst);
  return plan;
}

}  // namespace

extern "C" int jaxgin_selftest_exchange(jaxgin_runtime* rt, int32_t rounds, uint64_t block_bytes, uint32_t seed,
                                        uint64_t heap_offset, uint32_t signal_base, uint64_t* mismatches) {
  return jaxgin::c_api([&] {
    const int world = rt->config.world_size;
    const uint64_t needed = 2ull * world * block_bytes;
    if (block_bytes == 0 || block_bytes % 16 != 0)
      throw jaxgin::Error("block_bytes=" + std::to_string(block_bytes) + " must be a positive multiple of 16");
    if (rounds < 1) throw jaxgin::Error("rounds must be >= 1");
    for (auto& s : rt->devices) {
      if (heap_offset < s.host_context.user_offset || heap_offset % 16 != 0 ||
          heap_offset + needed > s.host_context.heap_bytes)
        throw jaxgin::Error("selftest heap range [" + std::to_string(heap_offset) + ", +" + std::to_string(needed) +
                            ") is not 16-byte aligned inside the user heap [" +
                            std::to_string(s.host_context.user_offset) + ", " + std::to_string(s.host_context.heap_bytes) + ")");
      if ((uint64_t)signal_base + 2 * world > s.host_context.signal_count)
        throw jaxgin::Error("selftest signals [" + std::to_string(signal_base) + ", +" + std::to_string(2 * world) +
                            ") exceed the " + std::to_string(s.host_context.signal_count) + " user signals");
      if ((uint32_t)world > s.host_context.barrier_slots)
        throw jaxgin::Error("the selftest runs world_size CTAs that each call the barrier, but only " +
                            std::to_string(s.host_context.barrier_slots) + " barrier slots exist");
    }
    std::vector<unsigned long long*> counts(rt->devices.size(), nullptr);
    for (size_t i = 0; i < rt->devices.size(); i++) {
      auto& s = rt->devices[i];
      JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
      JAXGIN_CUDA(cudaMalloc(&counts[i], world * sizeof(unsigned long long)), s.device);
      JAXGIN_CUDA(cudaMemsetAsync(counts[i], 0, world * sizeof(unsigned long long), s.stream), s.device);
      JAXGIN_CUDA(jaxgin::launch_selftest_exchange(s.context, world, rounds, block_bytes, seed, heap_offset,
                                                   signal_base, counts[i], s.stream),
                  s.device);
    }
    std::string failure;
    for (size_t i = 0; i < rt->devices.size(); i++) {
      auto& s = rt->devices[i];
      JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
      cudaError_t e = cudaStreamSynchronize(s.stream);
      if (e != cudaSuccess) {
        std::string fault = jaxgin::describe_fault(s);
        if (failure.empty())
          failure = fault.empty() ? std::string("selftest kernel failed on CUDA device ") + std::to_string(s.device) +
                                        ": " + jaxgin::cuda_error_text(e)
                                  : fault;
        continue;
      }
      JAXGIN_CUDA(cudaMemcpy(mismatches + i * world, counts[i], world * sizeof(uint64_t), cudaMemcpyDeviceToHost),
                  s.device);
      JAXGIN_CUDA(cudaFree(counts[i]), s.device);
    }
    if (!failure.empty()) throw jaxgin::DeviceFaultError(failure);
  });
}

extern "C" JAXGIN_API int jaxgin_exchange_latency(jaxgin_runtime* rt, uint64_t bytes, int32_t iterations,
                                                  int32_t use_graph, int32_t generic_kernel, double* us_per_op) {
  return jaxgin::c_api([&] {
    if (iterations < 1) throw jaxgin::Error("iterations must be >= 1");
    const size_t n = rt->devices.size();
    const auto route = generic_kernel ? jaxgin::exchange_route::kGeneric : jaxgin::exchange_route::kAuto;
    std::vector<char*> buffers(n, nullptr);
    std::vector<cudaGraphExec_t> graphs(n, nullptr);
    std::vector<cudaEvent_t> start(n), stop(n);
    auto enqueue = [&](size_t i) {
      auto& s = rt->devices[i];
      for (int k = 0; k < iterations; k++) {
        char* a = buffers[i] + (k % 2) * bytes;
        char* b = buffers[i] + ((k + 1) % 2) * bytes;
        if (bytes == 0) {
          JAXGIN_CUDA(jaxgin::launch_empty(s.stream), s.device);
        } else {
          JAXGIN_CUDA(jaxgin::launch_exchange(s.context, s.host_context, s.lsa_heaps,
                                              ring_plan(s.host_context, a, b, bytes), s.stream, route),
                      s.device);
        }
      }
    };
    for (size_t i = 0; i < n; i++) {
      auto& s = rt->devices[i];
      JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
      JAXGIN_CUDA(cudaMalloc(&buffers[i], 2 * bytes + 16), s.device);
      JAXGIN_CUDA(cudaEventCreate(&start[i]), s.device);
      JAXGIN_CUDA(cudaEventCreate(&stop[i]), s.device);
      if (use_graph) {
        cudaGraph_t graph;
        JAXGIN_CUDA(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), s.device);
        enqueue(i);
        JAXGIN_CUDA(cudaStreamEndCapture(s.stream, &graph), s.device);
        JAXGIN_CUDA(cudaGraphInstantiate(&graphs[i], graph, 0), s.device);
        JAXGIN_CUDA(cudaGraphDestroy(graph), s.device);
      }
    }
    for (int round = 0; round < 2; round++) {  // the first round warms up
      for (size_t i = 0; i < n; i++) {
        auto& s = rt->devices[i];
        JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
        JAXGIN_CUDA(cudaEventRecord(start[i], s.stream), s.device);
        if (use_graph) {
          JAXGIN_CUDA(cudaGraphLaunch(graphs[i], s.stream), s.device);
        } else {
          enqueue(i);
        }
        JAXGIN_CUDA(cudaEventRecord(stop[i], s.stream), s.device);
      }
      for (size_t i = 0; i < n; i++) {
        auto& s = rt->devices[i];
        JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
        cudaError_t e = cudaStreamSynchronize(s.stream);
        if (e != cudaSuccess) {
          std::string fault = jaxgin::describe_fault(s);
          throw jaxgin::DeviceFaultError(fault.empty() ? std::string("exchange failed: ") + jaxgin::cuda_error_text(e) : fault);
        }
        float ms = 0;
        JAXGIN_CUDA(cudaEventElapsedTime(&ms, start[i], stop[i]), s.device);
        us_per_op[i] = 1000.0 * ms / iterations;
      }
    }
    for (size_t i = 0; i < n; i++) {
      auto& s = rt->devices[i];
      cudaSetDevice(s.device);
      if (graphs[i]) cudaGraphExecDestroy(graphs[i]);
      cudaEventDestroy(start[i]);
      cudaEventDestroy(stop[i]);
      cudaFree(buffers[i]);
    }
  });
}

extern "C" int jaxgin_wait_signal_on_device(jaxgin_runtime* rt, int32_t local_index, uint32_t signal,
                                            uint64_t value) {
  return jaxgin::c_api([&] {
    if (local_index < 0 || local_index >= (int)rt->devices.size())
      throw jaxgin::Error("local GPU index " + std::to_string(local_index) + " out of range");
    jaxgin::DeviceState& s = rt->devices[local_index];
    if (signal >= s.host_context.signal_count)
      throw jaxgin::Error("signal " + std::to_string(signal) + " is out of range: this runtime has " +
                          std::to_string(s.host_context.signal_count) + " signals");
    JAXGIN_CUDA(cudaSetDevice(s.device), s.device);
    JAXGIN_CUDA(jaxgin::launch_wait_signal(s.context, signal, value, s.stream), s.device);
    cudaError_t e = cudaStreamSynchronize(s.stream);
    if (e != cudaSuccess) {
      std::string fault = jaxgin::describe_fault(s);
      throw jaxgin::DeviceFaultError(fault.empty() ? std::string("wait kernel failed: ") + jaxgin::cuda_error_text(e) : fault);
    }
  });
}
