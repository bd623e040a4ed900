// thread_settle.h: reads each thread's state from /proc/self/task/<tid>/stat.
#include "thread_settle.h"

#include <dirent.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "backend_api.h"

namespace jaxgin {
namespace {

constexpr int kQuietSamples = 3;                    // consecutive samples with no other thread running
constexpr auto kSampleInterval = std::chrono::milliseconds(5);

// The threads other than the caller that are running or runnable, as "name (tid)"; false where
// /proc/self/task cannot be read.
bool running_threads(std::vector<std::string>& running) {
  running.clear();
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return false;
  const long self = syscall(SYS_gettid);
  while (dirent* entry = readdir(tasks)) {
    const long tid = std::strtol(entry->d_name, nullptr, 10);
    if (tid <= 0 || tid == self) continue;
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/self/task/%ld/stat", tid);
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;  // the thread exited meanwhile
    char line[512] = {0};
    const size_t n = std::fread(line, 1, sizeof(line) - 1, f);
    std::fclose(f);
    line[n] = '\0';
    // "tid (name) S ...": the name may hold spaces and parentheses, the state follows the last ')'.
    const char* open = std::strchr(line, '(');
    const char* close = std::strrchr(line, ')');
    if (open == nullptr || close == nullptr || close[1] == '\0' || close[2] == '\0') continue;
    const std::string name(open + 1, close);
    // NCCL's threads are left out: after ncclCommAbort the only ones left are the GIN progress
    // threads that a broken context does not stop, and they poll host memory, not the context.
    if (close[2] == 'R' && name.rfind("NCCL", 0) != 0) running.push_back(name + " (" + std::to_string(tid) + ")");
  }
  closedir(tasks);
  return true;
}

}  // namespace

bool other_threads_settled(int timeout_ms, std::string& busy) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<std::string> running;
  int quiet = 0;
  while (true) {
    if (!running_threads(running)) return true;
    if (running.empty()) {
      if (++quiet >= kQuietSamples) return true;
    } else {
      quiet = 0;
      busy.clear();
      for (const auto& t : running) busy += (busy.empty() ? "" : ", ") + t;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kSampleInterval);
  }
}

}  // namespace jaxgin

extern "C" JAXGIN_API int jaxgin_other_threads_settled(int32_t timeout_ms, char* out, uint64_t capacity) {
  std::string busy;
  const bool settled = jaxgin::other_threads_settled(timeout_ms, busy);
  if (out != nullptr && capacity > 0) {
    std::strncpy(out, busy.c_str(), capacity - 1);
    out[capacity - 1] = '\0';
  }
  return settled ? 1 : 0;
}
