// Error plumbing of the backend: internal code throws jaxgin::Error; every C ABI entry point
// catches it, keeps the message in a thread-local string and returns nonzero.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdexcept>
#include <string>

namespace jaxgin {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A kernel failed on the device (a bounded wait timed out, a peer was unreachable): the CUDA
// context of that GPU is unusable afterwards.
struct DeviceFaultError : Error {
  using Error::Error;
};

// Status codes of the C ABI.
constexpr int kStatusError = 1;
constexpr int kStatusDeviceFault = 2;

void set_last_error(const std::string& message);

// How a CUDA runtime error reads in every jaxgin message: its name, then CUDA's description.
inline std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

[[noreturn]] inline void throw_cuda(cudaError_t e, const std::string& what, int device) {
  throw Error(what + " failed on CUDA device " + std::to_string(device) + ": " + cuda_error_text(e));
}

// The one CUDA error check: `what` says what was being done (JAXGIN_CUDA passes the call's text).
inline void check_cuda(cudaError_t e, const std::string& what, int device) {
  if (e != cudaSuccess) throw_cuda(e, what, device);
}

[[noreturn]] inline void throw_nccl(ncclResult_t r, const char* what, ncclComm_t comm, int device) {
  std::string detail = ncclGetLastError(comm);
  throw Error(std::string(what) + " failed on CUDA device " + std::to_string(device) + ": " +
              ncclGetErrorString(r) + (detail.empty() ? "" : " (" + detail + ")"));
}

// Runs `body`, turning exceptions into the C ABI's status code.
template <typename F>
int c_api(F&& body) {
  try {
    body();
    return 0;
  } catch (const DeviceFaultError& e) {
    set_last_error(e.what());
    return kStatusDeviceFault;
  } catch (const std::exception& e) {
    set_last_error(e.what());
  } catch (...) {
    set_last_error("unknown C++ exception in the jaxgin backend");
  }
  return kStatusError;
}

}  // namespace jaxgin

#define JAXGIN_CUDA(call, device) jaxgin::check_cuda((call), #call, device)

#define JAXGIN_NCCL(call, comm, device)                              \
  do {                                                               \
    ncclResult_t jaxgin_r_ = (call);                                 \
    if (jaxgin_r_ != ncclSuccess) jaxgin::throw_nccl(jaxgin_r_, #call, comm, device); \
  } while (0)
