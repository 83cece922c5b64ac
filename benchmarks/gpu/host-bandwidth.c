// Host memory read bandwidth (a STREAM-like sum over a buffer far larger than the caches), per thread
// count: the bound that CPU expert matmuls at decode cannot beat. Printed as one JSON line per count.
//
//   cc -O3 -march=native -fopenmp -o /tmp/host-bandwidth benchmarks/gpu/host-bandwidth.c
//   /tmp/host-bandwidth [GiB] [threads,...] [kinds] [chunk KiB,...]
//
// kinds (comma-separated) say how the buffer is allocated, to tell the page size's share apart:
//   default    posix_memalign, 2 MiB aligned, no advice (the kernel's THP default decides)
//   thp        the same with madvise(MADV_HUGEPAGE)
//   4k         the same with madvise(MADV_NOHUGEPAGE)
//   cuda-host      cudaMallocHost: the pinned host buffers llama.cpp keeps CPU-side weights in
//   cuda-host-thp  mmap + MADV_HUGEPAGE + cudaHostRegister (GGML_CUDA_HOST_HUGEPAGES=1)
// The cuda kinds need -DHOST_BW_CUDA -I<cuda>/include ... -lcudart.
// chunk: 0 = each thread sums one contiguous share; N = threads take N KiB pieces in turn, as CPU
// matmul threads take a few rows of one expert each (a Q4_0 row of 2048 columns is 1152 bytes).
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifdef HOST_BW_CUDA
#include <cuda_runtime_api.h>
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec*1e-9;
}

// kB of anonymous huge pages the process holds (what THP actually gave)
static long anon_huge_kb(void) {
    FILE * f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) {
        return -1;
    }
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof(line), f)) {
        if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) {
            break;
        }
    }
    fclose(f);
    return kb;
}

static uint64_t * alloc_kind(const char * kind, size_t bytes) {
    const size_t huge = 2u << 20;
    if (strcmp(kind, "default") == 0 || strcmp(kind, "thp") == 0 || strcmp(kind, "4k") == 0) {
        void * p = NULL;
        if (posix_memalign(&p, huge, bytes) != 0) {
            return NULL;
        }
        if (strcmp(kind, "thp") == 0) {
            madvise(p, bytes, MADV_HUGEPAGE);
        } else if (strcmp(kind, "4k") == 0) {
            madvise(p, bytes, MADV_NOHUGEPAGE);
        }
        return (uint64_t *) p;
    }
#ifdef HOST_BW_CUDA
    if (strcmp(kind, "cuda-host") == 0) {
        void * p = NULL;
        return cudaMallocHost(&p, bytes) == cudaSuccess ? (uint64_t *) p : NULL;
    }
    if (strcmp(kind, "cuda-host-thp") == 0) {
        char * base = (char *) mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) {
            return NULL;
        }
        char * p = (char *) (((uintptr_t) base + huge - 1) & ~(uintptr_t) (huge - 1));
        madvise(p, bytes, MADV_HUGEPAGE);
        return cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) == cudaSuccess ? (uint64_t *) p : NULL;
    }
#endif
    return NULL;
}

static void free_kind(const char * kind, uint64_t * a, size_t bytes) {
#ifdef HOST_BW_CUDA
    if (strcmp(kind, "cuda-host") == 0) {
        cudaFreeHost(a);
        return;
    }
    if (strcmp(kind, "cuda-host-thp") == 0) {
        cudaHostUnregister(a);
        munmap(a, bytes); // the slack before it stays mapped: this tool exits soon
        return;
    }
#endif
    (void) bytes;
    free(a);
}

int main(int argc, char ** argv) {
    const double gib = argc > 1 ? atof(argv[1]) : 4.0;
    const char * list = argc > 2 ? argv[2] : "1,2,4,8,12,16";
    const char * kinds = argc > 3 ? argv[3] : "default";
    const char * chunks = argc > 4 ? argv[4] : "0";
    const size_t n = (size_t) (gib*1073741824.0) / sizeof(uint64_t);
    char kbuf[256];
    strncpy(kbuf, kinds, sizeof(kbuf) - 1);
    kbuf[sizeof(kbuf) - 1] = 0;
    char * ksave = NULL;
    for (char * kind = strtok_r(kbuf, ",", &ksave); kind; kind = strtok_r(NULL, ",", &ksave)) {
        const long huge0 = anon_huge_kb();
        uint64_t * a = alloc_kind(kind, n*sizeof(uint64_t));
        if (a == NULL) {
            fprintf(stderr, "host-bandwidth: cannot allocate %.1f GiB as %s\n", gib, kind);
            return 1;
        }
        // touched in parallel: pages land near the threads that read them
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; ++i) {
            a[i] = i;
        }
        const long huge1 = anon_huge_kb();
        char tbuf[256];
        strncpy(tbuf, list, sizeof(tbuf) - 1);
        tbuf[sizeof(tbuf) - 1] = 0;
        char * tsave = NULL;
        for (char * tok = strtok_r(tbuf, ",", &tsave); tok; tok = strtok_r(NULL, ",", &tsave)) {
            const int nt = atoi(tok);
            char cbuf[256];
            strncpy(cbuf, chunks, sizeof(cbuf) - 1);
            cbuf[sizeof(cbuf) - 1] = 0;
            char * csave = NULL;
            for (char * ctok = strtok_r(cbuf, ",", &csave); ctok; ctok = strtok_r(NULL, ",", &csave)) {
                const size_t chunk_kib = (size_t) atol(ctok);
                const size_t per = chunk_kib*1024/sizeof(uint64_t);
                double best = 0.0;
                uint64_t sink = 0;
                for (int rep = 0; rep < 5; ++rep) {
                    uint64_t s = 0;
                    const double t0 = now();
                    if (per == 0) {
                        #pragma omp parallel for num_threads(nt) schedule(static) reduction(+:s)
                        for (size_t i = 0; i < n; ++i) {
                            s += a[i];
                        }
                    } else {
                        const size_t nc = (n + per - 1)/per;
                        #pragma omp parallel for num_threads(nt) schedule(static, 1) reduction(+:s)
                        for (size_t c = 0; c < nc; ++c) {
                            const size_t end = (c + 1)*per < n ? (c + 1)*per : n;
                            for (size_t i = c*per; i < end; ++i) {
                                s += a[i];
                            }
                        }
                    }
                    const double dt = now() - t0;
                    sink += s;
                    const double gbs = n*sizeof(uint64_t)/dt/1e9;
                    best = gbs > best ? gbs : best;
                }
                printf("{\"kind\": \"%s\", \"threads\": %d, \"chunk_kib\": %zu, \"read_gb_s\": %.2f, \"gib\": %.1f, "
                       "\"anon_huge_mib\": %ld, \"check\": %llu}\n",
                    kind, nt, chunk_kib, best, gib, huge0 < 0 || huge1 < 0 ? -1 : (huge1 - huge0)/1024,
                    (unsigned long long) (sink & 0xff));
                fflush(stdout);
            }
        }
        free_kind(kind, a, n*sizeof(uint64_t));
    }
    return 0;
}
