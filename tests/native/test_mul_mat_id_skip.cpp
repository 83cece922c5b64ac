// MUL_MAT_ID skip ids on the CPU: a row whose id is < 0 is zero, and every other row
// equals the same product computed with no id skipped. ggml_mul_mat_id_table: matrices
// read through an address table, half of them from another tensor, give the plain op's result bit
// for bit. test-backend-ops checks other backends against the CPU; this checks the CPU itself, so it
// runs where there is no second backend.

#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

enum skip_pattern {
    SKIP_SOME,        // every third (slot, token) row
    SKIP_WHOLE_TOKEN, // all slots of every other token
    SKIP_ALL,         // every row
    SKIP_DUPLICATES,  // an expert used twice by a token, next to a skipped slot
    SKIP_PATTERN_COUNT,
};

static const char * pattern_name(int p) {
    switch (p) {
        case SKIP_SOME:        return "some";
        case SKIP_WHOLE_TOKEN: return "whole-token";
        case SKIP_ALL:         return "all";
        case SKIP_DUPLICATES:  return "duplicates";
    }
    return "?";
}

static void fill_uniform(float * x, size_t n, std::mt19937 & rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < n; i++) {
        x[i] = u(rng);
    }
}

// n_mats random matrices of k x m values in `type`
static ggml_tensor * new_matrices(ggml_context * ctx, ggml_type type, int64_t k, int64_t m, int n_mats, std::mt19937 & rng) {
    ggml_tensor * as = ggml_new_tensor_3d(ctx, type, k, m, n_mats);
    std::vector<float> w(k * m * n_mats);
    fill_uniform(w.data(), w.size(), rng);
    if (type == GGML_TYPE_F32) {
        memcpy(as->data, w.data(), w.size() * sizeof(float));
    } else {
        ggml_quantize_chunk(type, w.data(), as->data, 0, m * n_mats, k, nullptr);
    }
    return as;
}

// Runs one case; returns the number of failures.
static int run_case(ggml_type type, int n_tokens, int pattern, int n_threads, std::mt19937 & rng) {
    const int64_t k = 256, m = 64;
    const int n_mats = 8, n_used = 4;

    ggml_init_params ip = { /*.mem_size =*/ 64u << 20, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * as = new_matrices(ctx, type, k, m, n_mats, rng);
    ggml_tensor * b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n_used, n_tokens);
    fill_uniform((float *) b->data, ggml_nelements(b), rng);

    ggml_tensor * ids_all  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    ggml_tensor * ids_skip = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    std::vector<int> order(n_mats);
    for (int t = 0; t < n_tokens; t++) {
        for (int i = 0; i < n_mats; i++) {
            order[i] = i;
        }
        std::shuffle(order.begin(), order.end(), rng);
        for (int s = 0; s < n_used; s++) {
            int32_t id = order[s];
            if (pattern == SKIP_DUPLICATES && s == 1) {
                id = order[0];
            }
            bool skip = false;
            switch (pattern) {
                case SKIP_SOME:        skip = (t * n_used + s) % 3 == 0; break;
                case SKIP_WHOLE_TOKEN: skip = t % 2 == 1; break;
                case SKIP_ALL:         skip = true; break;
                case SKIP_DUPLICATES:  skip = s == 2; break;
            }
            ((int32_t *) ids_all->data)[t * n_used + s]  = id;
            ((int32_t *) ids_skip->data)[t * n_used + s] = skip ? -1 - (s % 2) : id; // -1 and -2: any negative id skips
        }
    }

    ggml_tensor * out_all  = ggml_mul_mat_id(ctx, as, b, ids_all);
    ggml_tensor * out_skip = ggml_mul_mat_id(ctx, as, b, ids_skip);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out_all);
    ggml_build_forward_expand(gf, out_skip);

    // poison the result: a skipped row must be written (with zeros), not left as it was
    for (int64_t i = 0; i < ggml_nelements(out_skip); i++) {
        ((float *) out_skip->data)[i] = NAN;
    }
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) {
        printf("FAIL %s n_tokens=%d pattern=%s: graph compute failed\n", ggml_type_name(type), n_tokens, pattern_name(pattern));
        ggml_free(ctx);
        return 1;
    }

    int failures = 0;
    for (int t = 0; t < n_tokens; t++) {
        for (int s = 0; s < n_used; s++) {
            const bool skipped = ((int32_t *) ids_skip->data)[t * n_used + s] < 0;
            const float * got  = (const float *) ((const char *) out_skip->data + s * out_skip->nb[1] + t * out_skip->nb[2]);
            const float * want = (const float *) ((const char *) out_all->data  + s * out_all->nb[1]  + t * out_all->nb[2]);
            for (int64_t i = 0; i < m; i++) {
                const float expect = skipped ? 0.0f : want[i];
                // the same rows through the same kernels: equal up to summation order of a chunk
                if (!(std::fabs(got[i] - expect) <= 1e-5f * (1.0f + std::fabs(expect)))) {
                    if (failures < 3) {
                        printf("FAIL %s n_tokens=%d pattern=%s: token %d slot %d row %lld: got %g, want %g%s\n",
                               ggml_type_name(type), n_tokens, pattern_name(pattern), t, s, (long long) i,
                               got[i], expect, skipped ? " (skipped)" : "");
                    }
                    failures++;
                }
            }
        }
    }
    ggml_free(ctx);
    return failures;
}

// ggml_mul_mat_id_table: the odd matrices are read from a second tensor that holds them in reverse
// order, through the table; the result equals ggml_mul_mat_id over the first tensor exactly
static int run_table_case(ggml_type type, int n_tokens, int n_threads, std::mt19937 & rng) {
    const int64_t k = 256, m = 64;
    const int n_mats = 8, n_used = 4;

    ggml_init_params ip = { /*.mem_size =*/ 64u << 20, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * as    = new_matrices(ctx, type, k, m, n_mats, rng);
    ggml_tensor * other = ggml_new_tensor_3d(ctx, type, k, m, n_mats);
    for (int e = 0; e < n_mats; e++) {
        memcpy((char *) other->data + (n_mats - 1 - e) * other->nb[2], (char *) as->data + e * as->nb[2], as->nb[2]);
    }
    ggml_tensor * table = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_mats);
    for (int e = 0; e < n_mats; e++) {
        const char * at = e % 2 ? (const char *) other->data + (n_mats - 1 - e) * other->nb[2] : (const char *) as->data + e * as->nb[2];
        ((int64_t *) table->data)[e] = (int64_t) (intptr_t) at;
    }
    // poison the matrices the table replaces: the op must not read them
    for (int e = 1; e < n_mats; e += 2) {
        memset((char *) as->data + e * as->nb[2], 0x7f, as->nb[2]);
    }
    ggml_tensor * plain = ggml_new_tensor_3d(ctx, type, k, m, n_mats);
    for (int e = 0; e < n_mats; e++) {
        memcpy((char *) plain->data + e * plain->nb[2], (const char *) (intptr_t) ((int64_t *) table->data)[e], plain->nb[2]);
    }

    ggml_tensor * b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n_used, n_tokens);
    fill_uniform((float *) b->data, ggml_nelements(b), rng);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    std::vector<int> order(n_mats);
    for (int t = 0; t < n_tokens; t++) {
        for (int i = 0; i < n_mats; i++) {
            order[i] = i;
        }
        std::shuffle(order.begin(), order.end(), rng);
        for (int s = 0; s < n_used; s++) {
            ((int32_t *) ids->data)[t * n_used + s] = order[s];
        }
    }

    ggml_tensor * want = ggml_mul_mat_id(ctx, plain, b, ids);
    ggml_tensor * got  = ggml_mul_mat_id_table(ctx, as, b, ids, table);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, want);
    ggml_build_forward_expand(gf, got);
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) {
        printf("FAIL table %s n_tokens=%d: graph compute failed\n", ggml_type_name(type), n_tokens);
        ggml_free(ctx);
        return 1;
    }
    int failures = 0;
    if (memcmp(got->data, want->data, ggml_nbytes(want)) != 0) {
        printf("FAIL table %s n_tokens=%d: the result differs from the plain op's\n", ggml_type_name(type), n_tokens);
        failures++;
    }
    ggml_free(ctx);
    return failures;
}

int main(int argc, char ** argv) {
    const int n_threads = argc > 1 ? atoi(argv[1]) : 2;
    const ggml_type types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K };
    const int token_counts[] = { 1, 2, 5, 8, 16, 33, 64 };

    std::mt19937 rng(1234);
    int n_cases = 0, n_failed = 0;
    for (ggml_type type : types) {
        for (int n_tokens : token_counts) {
            for (int pattern = 0; pattern < SKIP_PATTERN_COUNT; pattern++) {
                n_cases++;
                if (run_case(type, n_tokens, pattern, n_threads, rng) != 0) {
                    n_failed++;
                }
            }
        }
    }
    printf("%d passed, %d failed\n", n_cases - n_failed, n_failed);
    int n_table = 0, n_table_failed = 0;
    for (ggml_type type : types) {
        for (int n_tokens : token_counts) {
            n_table++;
            if (run_table_case(type, n_tokens, n_threads, rng) != 0) {
                n_table_failed++;
            }
        }
    }
    printf("table: %d passed, %d failed\n", n_table - n_table_failed, n_table_failed);
    return n_failed == 0 && n_table_failed == 0 ? 0 : 1;
}
