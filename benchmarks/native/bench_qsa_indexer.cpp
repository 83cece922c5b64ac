// Where a QSA layer's indexer spends its time at depth: the stages of the pin's
// build_qsa_top_k (src/models/qwen4exp.cpp) for one layer, each timed on its own on one backend
// device, at n_kv cached cells and n_tps query tokens:
//   pool    gather every block's r member keys, mean, rms_norm, rope (every block, every ubatch)
//   score   every block against the query's indexer heads: mul_mat, relu, sum of the heads, bias
//   expand  the block scores onto the cells (get_rows), plus the attention mask
//   top_k   the cells' top-k (width top_k + r - 1)
//   top_k_blocks  for comparison: a top-k over the blocks instead (width top_k / r + 1)
//   top_k_ordered the cells' top-k as --qsa-block-topk takes it where the block level cannot
//                 (ggml_top_k_ordered)
//   block_topk    what --qsa-block-topk runs in place of expand + top_k: the best
//                 n_sel = ceil((width - 1)/r) + 2 blocks per token, their cells and values, the
//                 width best of those
// Random data: the times do not depend on the values. One JSON line per (stage, n_kv, n_tps):
//   {"stage": "...", "n_kv": N, "n_tps": T, "ms": median, "ms_min": ..., "reps": R, "device": "..."}
//
//   bench-qsa-indexer [-d DEVICE] [-k N_KV,...] [-t N_TPS,...] [-r REPS]
//   (defaults: the first GPU, else the CPU; 5000,50000,250000; 1,512; 10)

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

// Qwen3.8-Flash-Next's indexer (the qwen3.8-flash-next presets of moecache synth)
static const int64_t IDX_DIM = 128, IDX_HEADS = 16, TOP_K = 2048, RATIO = 4, N_ROT = 64;

static std::vector<int64_t> parse_list(const char * s) {
    std::vector<int64_t> out;
    for (const char * p = s; *p;) {
        char * end = nullptr;
        const long long v = strtoll(p, &end, 10);
        if (end == p || v <= 0) {
            fprintf(stderr, "bench-qsa-indexer: '%s' is not a list of positive integers\n", s);
            exit(2);
        }
        out.push_back(v);
        p = *end == ',' ? end + 1 : end;
    }
    return out;
}

static void fill_random(ggml_tensor * t, std::mt19937 & rng, int64_t int_range) {
    const int64_t n = ggml_nelements(t);
    std::vector<uint8_t> buf(ggml_nbytes(t));
    if (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> f(n);
        for (auto & x : f) {
            x = u(rng);
        }
        if (t->type == GGML_TYPE_F32) {
            memcpy(buf.data(), f.data(), buf.size());
        } else {
            ggml_fp32_to_fp16_row(f.data(), (ggml_fp16_t *) buf.data(), n);
        }
    } else if (t->type == GGML_TYPE_I32) {
        std::uniform_int_distribution<int32_t> u(0, (int32_t) std::max<int64_t>(int_range - 1, 0));
        int32_t * p = (int32_t *) buf.data();
        for (int64_t i = 0; i < n; ++i) {
            p[i] = u(rng);
        }
    }
    ggml_backend_tensor_set(t, buf.data(), 0, buf.size());
}

struct stage_result {
    double ms_median, ms_min;
};

// build(ctx) makes the stage's graph from new input tensors (named "in:<range>" for their integer range);
// the inputs get random data, the graph is run reps times after two warm-ups
static stage_result time_stage(ggml_backend_t backend, int reps,
        const std::function<ggml_tensor *(ggml_context *, std::vector<std::pair<ggml_tensor *, int64_t>> &)> & build) {
    ggml_init_params ip = { /*.mem_size =*/ 256*ggml_tensor_overhead() + ggml_graph_overhead_custom(4096, false),
                            /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    ggml_context * ctx = ggml_init(ip);
    std::vector<std::pair<ggml_tensor *, int64_t>> inputs;
    ggml_tensor * out = build(ctx, inputs);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4096, false);
    ggml_build_forward_expand(gf, out);

    for (auto & in : inputs) {
        ggml_set_input(in.first);
        ggml_set_output(in.first); // kept: the graph runs again on the same inputs
    }
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf)) {
        fprintf(stderr, "bench-qsa-indexer: cannot allocate the graph's memory\n");
        exit(1);
    }
    std::mt19937 rng(42);
    for (auto & in : inputs) {
        fill_random(in.first, rng, in.second);
    }
    std::vector<double> ms;
    for (int i = 0; i < reps + 2; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "bench-qsa-indexer: the graph failed on the device\n");
            exit(1);
        }
        ggml_backend_synchronize(backend);
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (i >= 2) {
            ms.push_back(t);
        }
    }
    ggml_gallocr_free(galloc);
    ggml_free(ctx);
    std::sort(ms.begin(), ms.end());
    return { ms[ms.size()/2], ms[0] };
}

int main(int argc, char ** argv) {
    const char * dev_name = nullptr;
    std::vector<int64_t> kvs = { 5000, 50000, 250000 }, tpss = { 1, 512 };
    int reps = 10;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (i + 1 < argc && a == "-d") {
            dev_name = argv[++i];
        } else if (i + 1 < argc && a == "-k") {
            kvs = parse_list(argv[++i]);
        } else if (i + 1 < argc && a == "-t") {
            tpss = parse_list(argv[++i]);
        } else if (i + 1 < argc && a == "-r") {
            reps = std::max(1, atoi(argv[++i]));
        } else {
            fprintf(stderr, "usage: %s [-d DEVICE] [-k N_KV,...] [-t N_TPS,...] [-r REPS]\n", argv[0]);
            return a == "-h" || a == "--help" ? 0 : 2;
        }
    }
    ggml_backend_load_all();
    ggml_backend_dev_t dev = dev_name ? ggml_backend_dev_by_name(dev_name) : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (dev == nullptr) {
        if (dev_name) {
            fprintf(stderr, "bench-qsa-indexer: no device named '%s'\n", dev_name);
            return 2;
        }
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    if (backend == nullptr) {
        fprintf(stderr, "bench-qsa-indexer: cannot start device '%s'\n", ggml_backend_dev_name(dev));
        return 1;
    }

    for (const int64_t n_kv : kvs) {
        for (const int64_t n_tps : tpss) {
            const int64_t nb = (n_kv + RATIO - 1)/RATIO;
            const int64_t width = std::min<int64_t>(n_kv, TOP_K + RATIO - 1);
            const int64_t width_blocks = std::min<int64_t>(nb, TOP_K/RATIO + 1);
            auto input = [](ggml_context *, std::vector<std::pair<ggml_tensor *, int64_t>> & ins, ggml_tensor * t, int64_t range) {
                ins.push_back({ t, range });
                return t;
            };
            const std::vector<std::pair<const char *, std::function<ggml_tensor *(ggml_context *, std::vector<std::pair<ggml_tensor *, int64_t>> &)>>> stages = {
                { "pool", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * k_all = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, IDX_DIM, n_kv), 0);
                    ggml_tensor * cells = input(ctx, ins, ggml_new_tensor_1d(ctx, GGML_TYPE_I32, RATIO*nb), n_kv);
                    ggml_tensor * pos   = input(ctx, ins, ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 4*nb), n_kv);
                    ggml_tensor * w     = input(ctx, ins, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, IDX_DIM), 0);
                    ggml_tensor * m = ggml_reshape_3d(ctx, ggml_get_rows(ctx, k_all, cells), IDX_DIM, RATIO, nb);
                    ggml_tensor * pooled = nullptr;
                    for (int64_t i = 0; i < RATIO; ++i) {
                        ggml_tensor * s = ggml_cont(ctx, ggml_view_2d(ctx, m, IDX_DIM, nb, m->nb[2], i*m->nb[1]));
                        pooled = pooled ? ggml_add(ctx, pooled, s) : s;
                    }
                    pooled = ggml_mul(ctx, ggml_rms_norm(ctx, ggml_scale(ctx, pooled, 1.0f/RATIO), 1e-6f), w);
                    int sections[4] = { 16, 8, 8, 0 };
                    return ggml_rope_multi(ctx, ggml_reshape_3d(ctx, pooled, IDX_DIM, 1, nb), pos, nullptr, N_ROT, sections,
                            GGML_ROPE_TYPE_MROPE, 262144, 1e7f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
                } },
                { "score", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * pooled = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, IDX_DIM, nb), 0);
                    ggml_tensor * q      = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, IDX_DIM, IDX_HEADS*n_tps), 0);
                    ggml_tensor * bias   = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nb, n_tps), 0);
                    ggml_tensor * sc = ggml_relu(ctx, ggml_reshape_3d(ctx, ggml_mul_mat(ctx, pooled, q), nb, IDX_HEADS, n_tps));
                    ggml_tensor * sum = nullptr;
                    for (int64_t h = 0; h < IDX_HEADS; ++h) {
                        ggml_tensor * s = ggml_view_2d(ctx, sc, nb, n_tps, sc->nb[2], h*sc->nb[1]);
                        sum = sum ? ggml_add(ctx, sum, s) : ggml_cont(ctx, s);
                    }
                    return ggml_add(ctx, sum, bias);
                } },
                { "expand", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * score = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nb, n_tps), 0);
                    ggml_tensor * cblk  = input(ctx, ins, ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_kv), nb);
                    ggml_tensor * mask  = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_tps), 0);
                    ggml_tensor * e = ggml_get_rows(ctx, ggml_cont(ctx, ggml_transpose(ctx, score)), cblk);
                    e = ggml_cont(ctx, ggml_transpose(ctx, e));
                    return ggml_add(ctx, e, ggml_cast(ctx, mask, GGML_TYPE_F32));
                } },
                { "top_k", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * e = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv, n_tps), 0);
                    return ggml_top_k(ctx, e, width);
                } },
                { "top_k_blocks", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * s = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nb, n_tps), 0);
                    return ggml_top_k(ctx, s, width_blocks);
                } },
                { "top_k_ordered", [&](ggml_context * ctx, auto & ins) {
                    ggml_tensor * e = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv, n_tps), 0);
                    return ggml_top_k_ordered(ctx, e, width);
                } },
                { "block_topk", [&](ggml_context * ctx, auto & ins) {
                    const int64_t n_sel = std::min<int64_t>(nb, (width - 1 + RATIO - 1)/RATIO + 2);
                    ggml_tensor * score = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nb, n_tps), 0);
                    ggml_tensor * hide  = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nb, n_tps), 0);
                    ggml_tensor * table = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_I32, RATIO, nb), n_kv);
                    ggml_tensor * mask  = input(ctx, ins, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_tps), 0);
                    ggml_tensor * sel   = ggml_top_k_ordered(ctx, ggml_add(ctx, score, hide), n_sel);
                    ggml_tensor * cells = ggml_get_rows(ctx, table, ggml_reshape_1d(ctx, sel, n_sel*n_tps));
                    ggml_tensor * bs    = ggml_get_rows(ctx, ggml_reshape_3d(ctx, score, 1, nb, n_tps), sel);
                    ggml_tensor * cm    = ggml_get_rows(ctx, ggml_reshape_3d(ctx, mask, 1, n_kv, n_tps),
                            ggml_reshape_2d(ctx, cells, RATIO*n_sel, n_tps));
                    ggml_tensor * v     = ggml_add(ctx, ggml_reshape_3d(ctx, cm, RATIO, n_sel, n_tps), bs);
                    ggml_tensor * pick  = ggml_top_k_ordered(ctx, ggml_reshape_2d(ctx, v, RATIO*n_sel, n_tps),
                            std::min<int64_t>(width, RATIO*n_sel));
                    return ggml_get_rows(ctx, ggml_reshape_3d(ctx, cells, 1, RATIO*n_sel, n_tps), pick);
                } },
            };
            for (const auto & st : stages) {
                const stage_result r = time_stage(backend, reps, st.second);
                printf("{\"stage\": \"%s\", \"n_kv\": %lld, \"n_tps\": %lld, \"ms\": %.4f, \"ms_min\": %.4f, \"reps\": %d, \"device\": \"%s\"}\n",
                        st.first, (long long) n_kv, (long long) n_tps, r.ms_median, r.ms_min, reps, ggml_backend_dev_name(dev));
                fflush(stdout);
            }
        }
    }
    ggml_backend_free(backend);
    return 0;
}
