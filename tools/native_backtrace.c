/* A diagnostic preload for GPU rounds: on SIGSEGV, SIGBUS, SIGILL or SIGFPE, prints the native
 * stack of the faulting thread (library + offset per frame, so frames in stripped libraries are
 * still placed) to stderr, then lets the signal kill the process as before. Python's faulthandler
 * (PYTHONFAULTHANDLER=1) installs its handler after this one and chains to it, so both stacks print.
 *
 * SIGUSR2 from outside (kill -USR2 PID) prints the native stack of every thread of the process,
 * one after another, and the process goes on: how to see where a hung rank's threads wait on
 * machines without gdb.
 *
 *   gcc -shared -fPIC -O1 -o /tmp/native_backtrace.so tools/native_backtrace.c -ldl
 *   LD_PRELOAD=/tmp/native_backtrace.so python3 ...
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static char alternate_stack[1 << 16];

static void print_frames(int sig, siginfo_t* info) {
  void* frames[64];
  int n = backtrace(frames, 64);
  char line[512];
  int len = snprintf(line, sizeof line, "native backtrace: pid %d tid %ld signal %d (%s) at address %p\n", getpid(),
                     (long)syscall(SYS_gettid), sig, strsignal(sig), info ? info->si_addr : NULL);
  write(2, line, len);
  for (int i = 0; i < n; i++) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname) {
      len = snprintf(line, sizeof line, "  #%d %p %s+0x%lx (%s)\n", i, frames[i], where.dli_fname,
                     (unsigned long)((char*)frames[i] - (char*)where.dli_fbase),
                     where.dli_sname ? where.dli_sname : "?");
    } else {
      len = snprintf(line, sizeof line, "  #%d %p ?\n", i, frames[i]);
    }
    write(2, line, len);
  }
}

static void print_thread_name(void) {
  char path[64], name[64], line[160];
  snprintf(path, sizeof path, "/proc/self/task/%ld/comm", (long)syscall(SYS_gettid));
  int fd = open(path, O_RDONLY);
  ssize_t n = fd >= 0 ? read(fd, name, sizeof name - 1) : 0;
  if (fd >= 0) close(fd);
  name[n > 0 ? n - 1 : 0] = 0;  /* drop the newline */
  int len = snprintf(line, sizeof line, "native stack of thread %ld (%s):\n", (long)syscall(SYS_gettid), name);
  write(2, line, len);
}

/* Each thread prints its own stack (backtrace() unwinds only the calling thread): the thread that
 * got the outside signal forwards it to every other thread, one at a time. */
static void on_dump(int sig, siginfo_t* info, void* context) {
  (void)sig;
  (void)context;
  print_thread_name();
  print_frames(SIGUSR2, NULL);
  if (info == NULL || info->si_pid == getpid()) return; /* a forwarded one */
  char buffer[4096];
  int dir = open("/proc/self/task", O_RDONLY | O_DIRECTORY);
  if (dir < 0) return;
  long self = (long)syscall(SYS_gettid);
  for (;;) {
    long got = syscall(SYS_getdents64, dir, buffer, sizeof buffer);
    if (got <= 0) break;
    for (long at = 0; at < got;) {
      struct dirent64* entry = (struct dirent64*)(buffer + at);
      at += entry->d_reclen;
      long tid = atol(entry->d_name);
      if (tid <= 0 || tid == self) continue;
      syscall(SYS_tgkill, getpid(), tid, SIGUSR2);
      struct timespec pause = {0, 50 * 1000 * 1000}; /* lets that thread finish printing */
      nanosleep(&pause, NULL);
    }
  }
  close(dir);
}

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  print_frames(sig, info);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  stack_t ss = {.ss_sp = alternate_stack, .ss_size = sizeof alternate_stack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  for (unsigned i = 0; i < sizeof fatal / sizeof fatal[0]; i++) sigaction(fatal[i], &action, NULL);
  struct sigaction dump;
  memset(&dump, 0, sizeof dump);
  dump.sa_sigaction = on_dump;
  dump.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&dump.sa_mask);
  sigaction(SIGUSR2, &dump, NULL);
}
