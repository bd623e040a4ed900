/* A diagnostic preload for GPU rounds: on SIGSEGV, SIGBUS, SIGILL or SIGFPE, prints the native
 * stack of the faulting thread (library + offset per frame, so frames in stripped libraries are
 * still placed) to stderr, then lets the signal kill the process as before. Python's faulthandler
 * (PYTHONFAULTHANDLER=1) installs its handler after this one and chains to it, so both stacks print.
 *
 *   gcc -shared -fPIC -O1 -o /tmp/native_backtrace.so tools/native_backtrace.c -ldl
 *   LD_PRELOAD=/tmp/native_backtrace.so python3 ...
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
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
}
