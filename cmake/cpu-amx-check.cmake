# A native build (GGML_NATIVE, the default) compiles ggml's AMX kernels when the CPU reports AMX.
# Tile code can fault at run time although the CPU has AMX: GCC 12 at -O2 drops the stores that
# fill the tile config before ldtilecfg (seen with ggml's own kernels: SIGILL at the first
# tilezero, on every model load), and some sandboxes grant the tile state to one thread only.
# Build the same pattern the way the release build does and run it on two threads; if it
# faults, build without AMX and say so.
if (NOT DEFINED GGML_NATIVE OR GGML_NATIVE)
    if (CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64" AND NOT CMAKE_CROSSCOMPILING
        AND CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
        include(CheckCSourceRuns)
        find_package(Threads REQUIRED)
        set(CMAKE_REQUIRED_FLAGS "-march=native -O2")
        set(CMAKE_REQUIRED_LIBRARIES Threads::Threads)
        check_c_source_runs([[
#include <immintrin.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void * run_tiles(void * arg) {
    (void) arg;
#if defined(__AMX_TILE__)
    struct { unsigned char palette, start; unsigned char reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; }
        __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(4);
    _tile_release();
#endif
    return 0;
}
int main(void) {
#if defined(__AMX_TILE__)
    /* ask the kernel for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;
#endif
    run_tiles(0);
    /* ggml runs its kernels on worker threads: some sandboxes grant the tile state to the
       asking thread only */
    pthread_t worker;
    if (pthread_create(&worker, 0, run_tiles, 0) != 0) return 1;
    pthread_join(worker, 0);
    return 0;
}
]] MOECACHE_NATIVE_AMX_RUNS)
        unset(CMAKE_REQUIRED_FLAGS)
        unset(CMAKE_REQUIRED_LIBRARIES)
        if (NOT MOECACHE_NATIVE_AMX_RUNS)
            message(STATUS "moecache: AMX tile code built by this compiler faults on this machine; building ggml without AMX kernels")
            add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-mno-amx-tile>
                                $<$<COMPILE_LANGUAGE:C,CXX>:-mno-amx-int8>
                                $<$<COMPILE_LANGUAGE:C,CXX>:-mno-amx-bf16>)
        endif()
    endif()
endif()
