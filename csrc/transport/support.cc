// What every part of the host transport uses: the counters' storage, logging and tracing, recording
// a communicator's failure, the calling thread's CUDA device and capture mode, and the settings read
// from the environment when a communicator is made.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport_internal.h"

namespace jaxgin::transport::detail {

std::atomic<uint64_t> counters[kCounterCount];

void log_message(rmaLogger_t log, rmaLogLevel_t level, const char* file, int line, const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  if (log) log(level, RMA_LOG_SUBSYS_NET, file, line, "jaxgin transport: %s", text);
  // A warning is on stderr whatever NCCL_DEBUG says: NCCL's logger prints nothing by default, and
  // an error returned to NCCL's GIN progress thread ends that thread silently (every later put of
  // the communicator is then never read), so the warning is the only trace of why.
  if (level == RMA_LOG_WARN || (!log && std::getenv("JAXGIN_TRANSPORT_DEBUG")))
    std::fprintf(stderr, "jaxgin transport: %s\n", text);
}
// JAXGIN_TRANSPORT_TRACE=1: one stderr line per request and per delivery (debugging only).
bool tracing() {
  static const bool on = std::getenv("JAXGIN_TRANSPORT_TRACE") != nullptr;
  return on;
}

// CUDA calls from NCCL's proxy thread must not be refused while another thread captures a graph.
void relax_capture_mode() {
  thread_local bool done = false;
  if (done) return;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  done = true;
}

// $JAXGIN_TRANSPORT_STALL_REPORT_S (default 10): how long a put may wait for its copy out of GPU
// memory before report_stalled_copy says so. Read when a communicator is made.
std::chrono::milliseconds read_stall_report_after() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_STALL_REPORT_S");
  const double seconds = v && *v ? std::atof(v) : 10.0;
  return std::chrono::milliseconds(static_cast<int64_t>((seconds > 0 ? seconds : 10.0) * 1000));
}

// $JAXGIN_TRANSPORT_REQUEUE_MS (default 200; 0: never): how long a staged put's copy out of GPU
// memory may sit on its stream before requeue_copy queues it again on another one. A copy that
// finishes normally takes well under a millisecond, or a few time slices where many processes
// share the GPU. Read when a communicator is made.
std::chrono::milliseconds read_requeue_after() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_REQUEUE_MS");
  const long ms = v && *v ? std::atol(v) : 200;
  return std::chrono::milliseconds(ms > 0 ? ms : 0);
}

// A setting that takes one of two words: `v` (its getenv) or `fallback` where unset or empty. An unknown
// value gives "" and, unless an earlier setting already did, an error naming the setting and both words.
static std::string two_way_setting(const char* name, const char* v, const char* fallback, const char* other,
                                   std::string& error) {
  const std::string value = v && *v ? v : fallback;
  if (value == fallback || value == other) return value;
  if (error.empty())
    error = std::string(name) + "=" + value + ": expected " + fallback + " (the default) or " + other;
  return std::string();
}

// Where the copies out of GPU memory run (JAXGIN_TRANSPORT_COPY_CONTEXT): "own" (the default), a
// CUDA context of this transport's own; "shared", the application's context (CUDA's primary
// context, where XLA's streams live). A context's streams share its few hardware queues, and XLA
// queues work that waits for a kernel spinning on a put: under XLA command buffers at world 8 that
// held a staged copy on every stream of the shared context, fifty spares included (measured on
// emulated hosts, 2026-11-26). A NIC reads GPU memory outside the application's queues; the own
// context is the closest a copy engine gets.
std::string copy_context_mode(std::string& error) {
  return two_way_setting("JAXGIN_TRANSPORT_COPY_CONTEXT", std::getenv("JAXGIN_TRANSPORT_COPY_CONTEXT"), "own", "shared",
                         error);
}

// What becomes of a put to a peer whose connection is gone (JAXGIN_TRANSPORT_PEER_LOSS): "drop"
// (the default) completes it, so NCCL's GIN progress thread runs on; "fail" completes it with an
// error, as a NIC's plugin reports a broken connection: NCCL's progress thread then ends, nothing
// this GPU posts is taken again, and a kernel that fills its GPU-to-proxy queue spins inside NCCL
// (how jaxgin still ends such a rank: jaxgin/fault_watch.py).
std::string peer_loss_mode(std::string& error) {
  return two_way_setting("JAXGIN_TRANSPORT_PEER_LOSS", std::getenv("JAXGIN_TRANSPORT_PEER_LOSS"), "drop", "fail", error);
}

// CUDA spreads a context's streams over this many hardware queues (CUDA_DEVICE_MAX_CONNECTIONS,
// default 8): the spare streams a context rotates through, so that one of them sits in each.
int hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int n = v && *v ? std::atoi(v) : 8;
  return std::min(std::max(n, 1), 32);
}

// $JAXGIN_TRANSPORT_UNKIND: none (the default, also when empty), all, or a comma list of
// kUnkindNames; $JAXGIN_TRANSPORT_SEED (default 1): the random choices' seed; and
// $JAXGIN_TRANSPORT_UNKIND_DELAY_US (default 2000): the longest delay of a late read, a late
// delivery or a held completion. Read when a communicator is made.
bool read_unkind(Unkind& unkind, std::string& error) {
  unkind = Unkind{};
  const char* v = std::getenv("JAXGIN_TRANSPORT_UNKIND");
  const std::string list = v ? v : "";
  if (list == "all") {
    unkind.on = (1u << kUnkindCount) - 1;
  } else if (!list.empty() && list != "none") {
    for (size_t start = 0; start <= list.size();) {
      size_t end = list.find(',', start);
      if (end == std::string::npos) end = list.size();
      const std::string name = list.substr(start, end - start);
      int found = -1;
      for (int i = 0; i < kUnkindCount; i++)
        if (name == kUnkindNames[i]) found = i;
      if (found < 0) {
        error = "JAXGIN_TRANSPORT_UNKIND=" + list + ": '" + name + "' is no behaviour; expected none, all or a comma "
                "list of late_read, reread, early_completion, weak_overtake, pieces, backpressure, starve";
        return false;
      }
      unkind.on |= 1u << found;
      start = end + 1;
    }
  }
  const char* seed = std::getenv("JAXGIN_TRANSPORT_SEED");
  char* rest = nullptr;
  unkind.seed = seed && *seed ? std::strtoull(seed, &rest, 10) : 1;
  if (seed && *seed && (*rest || *seed == '-')) {
    error = std::string("JAXGIN_TRANSPORT_SEED=") + seed + ": expected a non-negative integer";
    return false;
  }
  const char* delay = std::getenv("JAXGIN_TRANSPORT_UNKIND_DELAY_US");
  const long us = delay && *delay ? std::strtol(delay, &rest, 10) : 2000;
  if (delay && *delay && (*rest || us < 0)) {
    error = std::string("JAXGIN_TRANSPORT_UNKIND_DELAY_US=") + delay + ": expected a non-negative integer";
    return false;
  }
  unkind.delay = std::chrono::microseconds(us);
  return true;
}

// Every later call of a failed communicator fails again, for the same few reasons (once CUDA was
// gone at process exit, each of NCCL's calls printed the same two lines, thousands of them, which
// hid the cause): each reason is printed once. The set stays small: its reasons are fixed texts.
void fail(Comm* c, const std::string& why) {
  bool repeat;
  {
    std::lock_guard<std::mutex> g(c->lock);
    if (c->failure.empty()) c->failure = why;
    c->failed = true;
    repeat = !c->warned.insert(why).second;
  }
  c->changed.notify_all();
  if (!repeat) WARN(c, "rank %d: %s", c->rank, why.c_str());
}

bool cuda_ok(Comm* c, cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  fail(c, std::string(what) + " failed: " + cudaGetErrorString(e));
  return false;
}

// The calling thread's current device, set once per thread (NCCL's proxy thread serves one device).
void use_device(int device) {
  thread_local int current = -1;
  if (device < 0 || device == current) return;
  cudaSetDevice(device);
  current = device;
}

}  // namespace jaxgin::transport::detail
