// A diagnostic that times the exchange kernel without XLA: every local GPU runs a chain of ring
// exchanges (each op's output is the next op's input) on its own stream, launched directly or as
// one CUDA graph, timed with CUDA events. It separates the kernel's own latency from the host
// overhead of XLA's custom-call dispatch (see benchmarks/collectives.py for the XLA numbers).
// With bytes == 0 the chain is of empty kernels instead: the launch floor any one-kernel op pays.
#include <string>
#include <vector>

#include "../runtime/errors.h"
#include "../runtime/runtime.h"
#include "exchange.h"

namespace {

jaxgin::exchange_plan ring_plan(const jaxgin_context& c, const char* src, char* dst, uint64_t bytes) {
  jaxgin::exchange_plan plan{};
  plan.op = JAXGIN_OP_PPERMUTE;
  plan.bytes = bytes;
  jaxgin::add_permute_peers(plan, (c.rank + 1) % c.world_size, (c.rank + c.world_size - 1) % c.world_size, src,
                            dst);
  return plan;
}

__global__ void empty_kernel() {}

}  // namespace

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
          empty_kernel<<<1, 32, 0, s.stream>>>();
          JAXGIN_CUDA(cudaGetLastError(), s.device);
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
          throw jaxgin::DeviceFaultError(fault.empty() ? std::string("exchange failed: ") + cudaGetErrorString(e) : fault);
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
