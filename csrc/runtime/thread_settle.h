// Waiting, before a broken GPU is reset, until no other thread of this process still runs.
//
// After a device fault finalize() resets the GPU (cudaDeviceReset) to return what its context
// held. The reset destroys the context under every library in the process, and XLA may still be
// finishing the faulted program on a thread of its own when the error reaches Python: measured on
// H100s (2026-11-27, ranks sharing CPU cores), XLA's thread then called cuStreamIsCapturing on the
// destroyed context and the process died of SIGSEGV inside finalize(), in 6 of 7 survivors of a
// dead peer at world 8 and in one of two starved waits on one GPU. Nothing of XLA's can be joined
// from here, but a thread that still works is running or runnable ('R' in /proc), and one that
// finished sleeps: so the reset waits until every other thread has been seen asleep several times
// in a row, and is skipped (the memory then stays until the process exits) if that never happens.
#pragma once
#include <string>

namespace jaxgin {

// True once every thread of this process but the caller (and NCCL's, named "NCCL...", which may
// keep polling host memory after an abort) was seen sleeping in several samples in a row, within
// `timeout_ms`; false at the timeout, with `busy` naming the threads last seen
// running ("name (tid)", comma-separated). True also where /proc cannot be read (nothing to wait on).
bool other_threads_settled(int timeout_ms, std::string& busy);

}  // namespace jaxgin
