// Loading every kernel of the library on the current device ahead of use.
//
// CUDA loads kernels lazily by default (CUDA_MODULE_LOADING=LAZY): a kernel's first launch loads
// it, and loading may synchronize the whole context. A jaxgin kernel that spins until a transport
// thread completes its put (a GIN flush over the host transport) then deadlocks against the launch
// of the next kernel, which waits for the spinning one; measured on 2 x H200 with the mailbox
// kernels. Loading everything at initialize removes that first-launch wait.
#pragma once
#include <cuda_runtime.h>

namespace jaxgin {

// Each loads its file's kernels on the current device (cudaFuncGetAttributes forces the load).
cudaError_t preload_exchange_kernels();
cudaError_t preload_line_exchange_kernels();
cudaError_t preload_mailbox_kernels();
cudaError_t preload_wait_signal_kernel();
cudaError_t preload_chunk_handoff_kernels();

}  // namespace jaxgin
