// LD_PRELOAD helper for benchmarks/gpu/run.sh diag: print the native frames of a SIGSEGV to stderr
// (the machine has no gdb, and Python's faulthandler shows only Python frames), then die as usual.
//
//   cc -shared -fPIC -o /tmp/segv-backtrace.so benchmarks/gpu/segv-backtrace.c
//   LD_PRELOAD=/tmp/segv-backtrace.so python3 -c '...'
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_segv(int sig, siginfo_t * info, void * ctx) {
    (void) ctx;
    char head[96];
    int len = snprintf(head, sizeof(head), "segv-backtrace: native frames of the crash (address %p):\n", info->si_addr);
    write(STDERR_FILENO, head, (size_t) len);
    void * frames[64];
    int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);
}
