// Host memory read bandwidth (a STREAM-like sum over a buffer far larger than the caches), per thread
// count: the bound that CPU expert matmuls at decode cannot beat. Printed as one JSON line per count.
//
//   cc -O3 -march=native -fopenmp -o /tmp/host-bandwidth benchmarks/gpu/host-bandwidth.c
//   /tmp/host-bandwidth [GiB] [threads,...]
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec*1e-9;
}

int main(int argc, char ** argv) {
    const double gib = argc > 1 ? atof(argv[1]) : 4.0;
    const char * list = argc > 2 ? argv[2] : "1,2,4,8,12,16";
    const size_t n = (size_t) (gib*1073741824.0) / sizeof(uint64_t);
    uint64_t * a = NULL;
    if (posix_memalign((void **) &a, 2u << 20, n*sizeof(uint64_t)) != 0) {
        fprintf(stderr, "host-bandwidth: cannot allocate %.1f GiB\n", gib);
        return 1;
    }
    // touched in parallel: pages land near the threads that read them
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) {
        a[i] = i;
    }
    char buf[256];
    strncpy(buf, list, sizeof(buf) - 1);
    buf[sizeof(buf) - 1] = 0;
    for (char * tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        const int nt = atoi(tok);
        double best = 0.0;
        uint64_t sink = 0;
        for (int rep = 0; rep < 5; ++rep) {
            uint64_t s = 0;
            const double t0 = now();
            #pragma omp parallel for num_threads(nt) schedule(static) reduction(+:s)
            for (size_t i = 0; i < n; ++i) {
                s += a[i];
            }
            const double dt = now() - t0;
            sink += s;
            const double gbs = n*sizeof(uint64_t)/dt/1e9;
            best = gbs > best ? gbs : best;
        }
        printf("{\"threads\": %d, \"read_gb_s\": %.2f, \"gib\": %.1f, \"check\": %llu}\n", nt, best, gib,
            (unsigned long long) (sink & 0xff));
        fflush(stdout);
    }
    free(a);
    return 0;
}
