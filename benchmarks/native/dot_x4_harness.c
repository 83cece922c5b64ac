// The CPU's Q4_0 dot products one kernel at a time, outside ggml's graph (issue 11, goal 2):
// ggml_vec_dot_q4_0_q8_0 row by row against ggml_vec_dot_q4_0_q8_0_x4 (four rows at once, the kernel
// prefetching two groups ahead, and without that prefetch), over R rows of 2048 columns, and the one-row kernels of Q8_0, Q4_K and
// Q6_K for comparison. Random quants, random signed y in [-127, 127], sane scales (the time of the float
// unit depends on them: subnormal products are slow). dot-x4-harness.sh builds it against the tree's
// arch/x86/quants.c compiled with chosen instruction-set flags, so that the AVX2 path can be timed and
// checked on an AVX512 machine. One JSON line per kernel: GB/s of x rows (best of 3) and, for x4, whether
// its results equal the one-row kernel's bit for bit.
//
//   dot-x4-harness ROWS ITERS   (4096 rows: 4.7 MB of Q4_0, in L3; 300000: 346 MB, from DRAM)

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*vec_dot_t)(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by, int nrc);
void ggml_vec_dot_q4_0_q8_0(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q8_0_q8_0(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q4_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q6_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q4_0_q8_0_x4(int n, float * s, const void * vx, size_t bx, const void * vy, const char * pf);
void ggml_cpu_init(void);

enum { N = 2048 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

static void put16(uint8_t * p, uint16_t v) { memcpy(p, &v, 2); }

int main(int argc, char ** argv) {
    if (argc != 3 || atoi(argv[1]) <= 0 || atoi(argv[1]) % 4 != 0 || atoi(argv[2]) <= 0) {
        fprintf(stderr, "usage: dot-x4-harness ROWS ITERS (ROWS a positive multiple of 4)\n");
        return 2;
    }
    const int rows = atoi(argv[1]), iters = atoi(argv[2]);
    ggml_cpu_init();
    srand(1);

    // type, one-row kernel, bytes per row, bytes of y, where a block's fp16 scale(s) sit (block size, offsets)
    struct { const char * name; vec_dot_t f; size_t xb, yb, blk; int d0, d1; } k[] = {
        { "q4_0", ggml_vec_dot_q4_0_q8_0, N/32*18,  N/32*34,   18,  0, -1  },
        { "q8_0", ggml_vec_dot_q8_0_q8_0, N/32*34,  N/32*34,   34,  0, -1  },
        { "q4_K", ggml_vec_dot_q4_K_q8_K, N/256*144, N/256*292, 144, 0, 2   },
        { "q6_K", ggml_vec_dot_q6_K_q8_K, N/256*210, N/256*292, 210, 208, -1 },
    };
    for (size_t t = 0; t < sizeof(k)/sizeof(k[0]); ++t) {
        const size_t rb = k[t].xb;
        uint8_t * x = malloc(rb*rows);
        uint8_t * y = malloc(k[t].yb);
        float * s1 = malloc(rows*sizeof(float)), * s4 = malloc(rows*sizeof(float));
        for (size_t i = 0; i < rb*rows; ++i) x[i] = (uint8_t) rand();
        for (size_t i = 0; i < k[t].yb; ++i) y[i] = (uint8_t) (int8_t) (rand()%255 - 127);
        for (size_t o = 0; o < rb*rows; o += k[t].blk) {
            put16(x + o + k[t].d0, (uint16_t) (0x2000 + rand()%0x2000)); // 2^-7 .. 2^-1
            if (k[t].d1 >= 0) put16(x + o + k[t].d1, (uint16_t) (0x2000 + rand()%0x2000));
        }
        if (t < 2) {
            for (size_t o = 0; o < k[t].yb; o += 34) put16(y + o, (uint16_t) (0x2800 + rand()%0x1000));
        } else {
            const float one = 1.0f;
            for (size_t o = 0; o < k[t].yb; o += 292) memcpy(y + o, &one, 4);
        }
        double best1 = 0, best4 = 0, best4np = 0;
        for (int rep = 0; rep < 3; ++rep) {
            double t0 = now();
            for (int it = 0; it < iters; ++it) {
                for (int r = 0; r < rows; ++r) k[t].f(N, s1 + r, 0, x + r*rb, 0, y, 0, 1);
            }
            double g = (double) iters*rows*rb/(now() - t0)/1e9;
            best1 = g > best1 ? g : best1;
            if (t == 0) {
                t0 = now();
                for (int it = 0; it < iters; ++it) {
                    for (int r = 0; r < rows; r += 4) {
                        const char * pf = r + 12 <= rows ? (const char *) x + (r + 8)*rb : NULL;
                        ggml_vec_dot_q4_0_q8_0_x4(N, s4 + r, x + r*rb, rb, y, pf);
                    }
                }
                g = (double) iters*rows*rb/(now() - t0)/1e9;
                best4 = g > best4 ? g : best4;
                // without the prefetch: four streams the hardware prefetcher does not follow
                t0 = now();
                for (int it = 0; it < iters; ++it) {
                    for (int r = 0; r < rows; r += 4) ggml_vec_dot_q4_0_q8_0_x4(N, s4 + r, x + r*rb, rb, y, NULL);
                }
                g = (double) iters*rows*rb/(now() - t0)/1e9;
                best4np = g > best4np ? g : best4np;
            }
        }
        printf("{\"kernel\": \"%s\", \"rows\": %d, \"gb_s\": %.2f}\n", k[t].name, rows, best1);
        if (t == 0) {
            printf("{\"kernel\": \"q4_0 x4\", \"rows\": %d, \"gb_s\": %.2f, \"gb_s_no_prefetch\": %.2f, \"same_as_one_row\": %s}\n",
                   rows, best4, best4np, memcmp(s1, s4, rows*sizeof(float)) == 0 ? "true" : "false");
        }
        free(x); free(y); free(s1); free(s4);
    }
    return 0;
}
