// ggml_top_k_ordered on the CPU: the k largest values of each row, ties at the k-th value taken from
// the lowest indices, the indices in increasing order; and what QSA's block-level top-k builds on it:
// the top k of a subsequence that holds a row's top k, mapped back, is the row's top k. test-backend-ops
// compares other backends with the CPU exactly; this checks the CPU against a plain reference.
//
//   test-top-k-ordered [N_THREADS]

#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

// the definition: a stable sort by value, descending, cut at k, indices sorted
static std::vector<int32_t> reference(const std::vector<float> & row, int k) {
    std::vector<int32_t> idx(row.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    return idx;
}

// the top k of each of `rows` rows of `ncols` values, computed by ggml on the CPU
static std::vector<int32_t> top_k_cpu(const std::vector<float> & data, int64_t ncols, int64_t rows, int k, int n_threads) {
    ggml_init_params ip = { /*.mem_size =*/ (size_t) (ncols*rows*4 + rows*k*4) + 16*ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20),
                            /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ncols, rows);
    std::copy(data.begin(), data.end(), (float *) a->data);
    ggml_tensor * out = ggml_top_k_ordered(ctx, a, k);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    std::vector<int32_t> res((const int32_t *) out->data, (const int32_t *) out->data + rows*k);
    ggml_free(ctx);
    return res;
}

int main(int argc, char ** argv) {
    const int n_threads = argc > 1 ? atoi(argv[1]) : 2;
    std::mt19937 rng(42);
    int passed = 0, failed = 0;

    // rows with few distinct values (long runs of ties, as a QSA row's +1e9 bias makes), -inf among them
    for (int64_t ncols : {1, 7, 64, 1000, 5000}) {
        for (int k : {1, 2, 11, 100, 1000}) {
            if (k > ncols) {
                continue;
            }
            for (int n_distinct : {2, 8, 1 << 20}) {
                const int64_t rows = 6;
                std::vector<float> data(ncols*rows);
                std::uniform_int_distribution<int> v(0, n_distinct - 1);
                for (float & x : data) {
                    const int d = v(rng);
                    x = d == 0 && n_distinct < 1000 ? -INFINITY : (float) d;
                }
                const std::vector<int32_t> got = top_k_cpu(data, ncols, rows, k, n_threads);
                bool ok = true;
                for (int64_t r = 0; r < rows && ok; ++r) {
                    std::vector<float> row(data.begin() + r*ncols, data.begin() + (r + 1)*ncols);
                    ok = reference(row, k) == std::vector<int32_t>(got.begin() + r*k, got.begin() + (r + 1)*k);
                }
                if (ok) {
                    passed++;
                } else {
                    failed++;
                    printf("FAIL rows: ncols=%lld k=%d distinct=%d\n", (long long) ncols, k, n_distinct);
                }
            }
        }
    }

    // a subsequence that keeps the row's top k, in order: its top k, mapped back, is the row's
    for (int rep = 0; rep < 200; ++rep) {
        const int64_t ncols = 50 + rng() % 3000;
        const int     k     = 1 + (int) (rng() % std::min<int64_t>(ncols, 400));
        std::vector<float> row(ncols);
        std::uniform_int_distribution<int> v(0, 5);
        for (float & x : row) {
            x = (float) v(rng);
        }
        const std::vector<int32_t> full = reference(row, k);
        std::vector<char> keep(ncols, 0);
        for (int32_t i : full) {
            keep[i] = 1;
        }
        for (int64_t i = 0; i < ncols; ++i) {
            keep[i] |= rng() % 3 == 0;
        }
        std::vector<float>   sub;
        std::vector<int32_t> where;
        for (int64_t i = 0; i < ncols; ++i) {
            if (keep[i]) {
                sub.push_back(row[i]);
                where.push_back((int32_t) i);
            }
        }
        std::vector<int32_t> got = top_k_cpu(sub, (int64_t) sub.size(), 1, k, n_threads);
        for (int32_t & i : got) {
            i = where[i];
        }
        if (got == full && top_k_cpu(row, ncols, 1, k, n_threads) == full) {
            passed++;
        } else {
            failed++;
            printf("FAIL subsequence: ncols=%lld k=%d kept=%zu\n", (long long) ncols, k, sub.size());
        }
    }

    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
