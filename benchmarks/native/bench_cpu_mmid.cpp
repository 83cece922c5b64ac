// The CPU's expert reads at decode (issue 11, goal 2): where the time of the CPU's part of a decode step
// goes when every routed expert is in host memory. One token per step; each of L layers runs the MoE
// FFN's three MUL_MAT_IDs (gate, up, down) over n_used experts drawn at random anew for every token (so
// the weights stream from DRAM, as in a real decode), on the CPU backend with a threadpool as llama.cpp
// attaches one (poll 50). Modes:
//   graph  all layers in one graph: the kernels' streaming rate, without the per-layer hand-overs
//   split  one graph per layer, computed one after the other with --gap-us of idle time between them
//          (the GPU's part of a layer in a real decode, while the CPU's threads poll and then sleep):
//          what the hand-overs add; only the graphs' own compute time counts
// Random weights of --type (default Q4_0; a small fixed scale, random quants): the time does not depend on the values.
// One JSON line per (mode, threads):
//   {"mode": "...", "threads": T, "layers": L, "tokens": N, "ms_per_token": median, "ms_min": ...,
//    "gb_per_token": expert bytes read, "gb_s": at the median, "hugepages": 0|1, "mmid_flat": 0|1,
//    "dot_x4": 0|1, "repack": 0|1, "type": "q4_0", "checksum": FNV-1a of the last token's outputs}
// The checksum is the same for a seed whatever the split of the rows among threads: a check that
// GGML_CPU_MMID_FLAT=1 computes what the stock split does, and GGML_CPU_DOT_X4=1 what the one-row kernel
// does, bit for bit (not across -t, which can change how the activations are quantized).
// GGML_CPU_MMID_FLAT=1 (the flat split) and GGML_CPU_DOT_X4=1 (the four-row dots) apply as in the
// server; --flat and --x4 turn them on for this tool's CPU backend alone, through the per-context setters
// (ggml_backend_cpu_set_mmid_flat, ggml_backend_cpu_set_dot_x4, found by name as llama.cpp finds them);
// --flat-both times each mode without and then with the flat split on the same weights (a line each: a
// choice between them without filling the experts twice);
// --hugepages asks the CPU buffer for transparent huge pages (the switch behind --host-hugepages); --repack puts the
// weights in the CPU's repack buffer (the layout and kernels the CPU takes by default, which the hot-expert
// cache cannot upload from); exit status 3 where this CPU has no repacked layout for the type.
//
//   bench-cpu-mmid [-l LAYERS] [-t THREADS,...] [-n TOKENS] [-m graph,split] [--gap-us US]
//                  [-e N_EXPERT] [-u N_USED] [-f N_FF] [-d N_EMBD] [--hugepages] [--repack] [--flat | --flat-both] [--x4]
//                  [--type q4_0|q8_0|q4_K|q5_K|q6_K|iq4_xs|mxfp4] [--seed S]
//   (defaults: the Qwen3-30B-A3B shape: 48 layers, 128 experts, 8 used, 768 x 2048; 32 tokens; the
//   machine's hardware threads; both modes; a gap of 60 us)

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

static std::vector<int64_t> parse_list(const char * s, const char * what) {
    std::vector<int64_t> out;
    for (const char * p = s; *p;) {
        char * end = nullptr;
        const long long v = strtoll(p, &end, 10);
        if (end == p || v <= 0) {
            fprintf(stderr, "bench-cpu-mmid: %s: '%s' is not a list of positive integers\n", what, s);
            exit(2);
        }
        out.push_back(v);
        p = *end == ',' ? end + 1 : end;
    }
    return out;
}

static int64_t parse_positive(const char * s, const char * what) {
    const std::vector<int64_t> v = parse_list(s, what);
    if (v.size() != 1) {
        fprintf(stderr, "bench-cpu-mmid: %s takes one positive integer, not '%s'\n", what, s);
        exit(2);
    }
    return v[0];
}

// The fp16 scales of a block (byte offsets), set to a small fixed value; every other byte is random (the
// quants and the K-quants' and IQ4_XS's sub-block scales): finite weights in the type's own layout
static std::vector<size_t> block_scales(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_IQ4_XS: return { 0 };
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:   return { 0, 2 };             // d, dmin
        case GGML_TYPE_Q6_K:   return { 128 + 64 + 16 };    // after ql, qh, scales
        default:               return {};
    }
}

// Random blocks of `type`, a part of the tensors per hardware thread: written straight into a CPU buffer,
// or set through the repack buffer (which takes a whole tensor at once)
static void fill_blocks(const std::vector<ggml_tensor *> & tensors, ggml_type type, uint64_t seed, bool repacked) {
    const ggml_fp16_t scale = ggml_fp32_to_fp16(1.0f/64.0f);
    const size_t block = ggml_type_size(type);
    const std::vector<size_t> scales = block_scales(type);
    const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < n_threads; ++w) {
        workers.emplace_back([&, w] {
            std::vector<uint8_t> staging;
            for (size_t i = w; i < tensors.size(); i += n_threads) {
                if (repacked) {
                    staging.resize(ggml_nbytes(tensors[i]));
                }
                uint8_t * p = repacked ? staging.data() : (uint8_t *) tensors[i]->data;
                const size_t n_blocks = ggml_nbytes(tensors[i]) / block;
                uint64_t x = seed + 0x9e3779b97f4a7c15ull * (i + 1);
                for (size_t b = 0; b < n_blocks; ++b, p += block) {
                    for (size_t q = 0; q < block; q += 8) {
                        x ^= x << 13; x ^= x >> 7; x ^= x << 17; // xorshift64
                        memcpy(p + q, &x, std::min<size_t>(8, block - q));
                    }
                    for (size_t off : scales) {
                        memcpy(p + off, &scale, sizeof(scale));
                    }
                    if (type == GGML_TYPE_MXFP4) {
                        p[0] = 121; // its E8M0 scale: 2^-6
                    }
                }
                if (repacked) {
                    ggml_backend_tensor_set(tensors[i], staging.data(), 0, staging.size());
                }
            }
        });
    }
    for (auto & t : workers) {
        t.join();
    }
}

int main(int argc, char ** argv) {
    int64_t n_layer = 48, n_tokens = 32, n_expert = 128, n_used = 8, n_ff = 768, n_embd = 2048, gap_us = 60;
    uint64_t seed = 1;
    bool hugepages = false, repacked = false, flat = false, x4 = false, flat_both = false;
    ggml_type wtype = GGML_TYPE_Q4_0;
    std::vector<int64_t> threads = { (int64_t) std::max(1u, std::thread::hardware_concurrency()) };
    std::vector<std::string> modes = { "graph", "split" };
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : nullptr;
        auto need = [&]() { if (!v) { fprintf(stderr, "bench-cpu-mmid: %s needs a value\n", a.c_str()); exit(2); } ++i; return v; };
        if (a == "-l") { n_layer = parse_positive(need(), "-l"); }
        else if (a == "-t") { threads = parse_list(need(), "-t"); }
        else if (a == "-n") { n_tokens = parse_positive(need(), "-n"); }
        else if (a == "-e") { n_expert = parse_positive(need(), "-e"); }
        else if (a == "-u") { n_used = parse_positive(need(), "-u"); }
        else if (a == "-f") { n_ff = parse_positive(need(), "-f"); }
        else if (a == "-d") { n_embd = parse_positive(need(), "-d"); }
        else if (a == "--gap-us") { gap_us = atoll(need()); }
        else if (a == "--seed") { seed = (uint64_t) atoll(need()); }
        else if (a == "--hugepages") { hugepages = true; }
        else if (a == "--repack") { repacked = true; }
        else if (a == "--flat") { flat = true; }
        else if (a == "--flat-both") { flat_both = true; }
        else if (a == "--x4") { x4 = true; }
        else if (a == "--type") {
            const std::string t = need();
            wtype = GGML_TYPE_COUNT;
            for (ggml_type k : { GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
                                 GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4 }) {
                if (t == ggml_type_name(k)) {
                    wtype = k;
                }
            }
            if (wtype == GGML_TYPE_COUNT) {
                fprintf(stderr, "bench-cpu-mmid: --type: '%s' is not one of q4_0, q8_0, q4_K, q5_K, q6_K, iq4_xs, mxfp4\n", t.c_str());
                return 2;
            }
        }
        else if (a == "-m") {
            modes.clear();
            std::string s = need();
            for (size_t p = 0; p <= s.size();) {
                const size_t q = std::min(s.find(',', p), s.size());
                modes.push_back(s.substr(p, q - p));
                if (modes.back() != "graph" && modes.back() != "split") {
                    fprintf(stderr, "bench-cpu-mmid: -m: '%s' is not a mode (graph, split)\n", modes.back().c_str());
                    return 2;
                }
                p = q + 1;
            }
        } else {
            fprintf(stderr, "usage: bench-cpu-mmid [-l LAYERS] [-t THREADS,...] [-n TOKENS] [-m graph,split] [--gap-us US]\n"
                            "                      [-e N_EXPERT] [-u N_USED] [-f N_FF] [-d N_EMBD] [--hugepages] [--repack] [--flat | --flat-both] [--x4]\n"
                            "                      [--type q4_0|q8_0|q4_K|q5_K|q6_K|iq4_xs|mxfp4] [--seed S]\n");
            return a == "-h" || a == "--help" ? 0 : 2;
        }
    }
    if (n_used > n_expert || n_embd % ggml_blck_size(wtype) != 0 || n_ff % ggml_blck_size(wtype) != 0 || gap_us < 0) {
        fprintf(stderr, "bench-cpu-mmid: need n_used <= n_expert, N_EMBD and N_FF multiples of %lld (the type's block), "
                        "a gap >= 0\n", (long long) ggml_blck_size(wtype));
        return 2;
    }

    // ggml's debug lines (one per repacked tensor) would drown what this prints
    ggml_log_set([](ggml_log_level level, const char * text, void *) {
        if (level != GGML_LOG_LEVEL_DEBUG) {
            fputs(text, stderr);
        }
    }, nullptr);
    ggml_backend_load_all();
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    ggml_backend_t backend = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    auto * tp_new  = reg ? (decltype(ggml_threadpool_new) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new") : nullptr;
    auto * tp_free = reg ? (decltype(ggml_threadpool_free) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free") : nullptr;
    auto * tp_set  = reg ? (decltype(ggml_backend_cpu_set_threadpool) *) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_threadpool") : nullptr;
    auto * set_n_threads = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : nullptr;
    if (!backend || !tp_new || !tp_free || !tp_set || !set_n_threads) {
        fprintf(stderr, "bench-cpu-mmid: no CPU backend with threadpools\n");
        return 1;
    }
    if (hugepages) {
        auto * set_huge = (ggml_backend_set_host_hugepages_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_host_hugepages");
        if (!set_huge) {
            fprintf(stderr, "bench-cpu-mmid: --hugepages: this build's CPU backend has no huge-page switch\n");
            return 1;
        }
        set_huge(1);
    }
    auto * set_flat = (void (*)(ggml_backend_t, bool)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_mmid_flat");
    if (flat_both && !set_flat) {
        fprintf(stderr, "bench-cpu-mmid: --flat-both: this build's CPU backend has no ggml_backend_cpu_set_mmid_flat\n");
        return 1;
    }
    for (const auto & [on, name] : { std::pair<bool, const char *>{ flat, "ggml_backend_cpu_set_mmid_flat" },
                                     std::pair<bool, const char *>{ x4,   "ggml_backend_cpu_set_dot_x4" } }) {
        auto * set = on ? (void (*)(ggml_backend_t, bool)) ggml_backend_reg_get_proc_address(reg, name) : nullptr;
        if (on && !set) {
            fprintf(stderr, "bench-cpu-mmid: this build's CPU backend has no %s\n", name);
            return 1;
        }
        if (set) {
            set(backend, true);
        }
    }
    // what the backend's plans take: the environment's default, or'ed with this backend's own switch
    const char * flat_env = getenv("GGML_CPU_MMID_FLAT");
    const int mmid_flat = flat || (flat_env && atoi(flat_env) != 0);
    // the flat split's settings to time: as set, or off and then on (--flat-both; the environment's default
    // stays or'ed with the switch, so GGML_CPU_MMID_FLAT=1 makes both flat)
    std::vector<int> flats = flat_both ? std::vector<int>{ flat_env && atoi(flat_env) != 0, 1 } : std::vector<int>{ mmid_flat };
    const char * x4_env = getenv("GGML_CPU_DOT_X4");
    const int dot_x4 = x4 || (x4_env && atoi(x4_env) != 0);

    // the weights: gate and up [n_embd, n_ff, n_expert], down [n_ff, n_embd, n_expert] per layer
    ggml_init_params wp = { (size_t) (3*n_layer + 1)*ggml_tensor_overhead(), nullptr, true };
    ggml_context * wctx = ggml_init(wp);
    std::vector<ggml_tensor *> gate(n_layer), up(n_layer), down(n_layer), all;
    for (int64_t il = 0; il < n_layer; ++il) {
        gate[il] = ggml_new_tensor_3d(wctx, wtype, n_embd, n_ff, n_expert);
        up[il]   = ggml_new_tensor_3d(wctx, wtype, n_embd, n_ff, n_expert);
        down[il] = ggml_new_tensor_3d(wctx, wtype, n_ff, n_embd, n_expert);
        all.insert(all.end(), { gate[il], up[il], down[il] });
    }
    ggml_backend_buffer_type_t wbuft = ggml_backend_dev_buffer_type(dev);
    if (repacked) {
        auto * extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        wbuft = nullptr;
        for (ggml_backend_buffer_type_t * b = extra ? extra(dev) : nullptr; b && *b; ++b) {
            if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
                wbuft = *b;
            }
        }
        if (!wbuft) {
            fprintf(stderr, "bench-cpu-mmid: --repack: this build's CPU backend has no repack buffer\n");
            return 1;
        }
    }
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, wbuft);
    if (!wbuf) {
        fprintf(stderr, "bench-cpu-mmid: cannot allocate %.2f GiB of weights (lower -l)\n",
            (double) n_layer*3*ggml_nbytes(gate[0])/(1u << 30));
        return 1;
    }
    // the repack buffer gives a tensor its repacked layout (tensor->extra) only where this CPU has one for the
    // type; llama-server keeps the others in the GGUF layout, and setting them through the buffer would crash
    if (repacked && all[0]->extra == nullptr) {
        fprintf(stderr, "bench-cpu-mmid: --repack: this CPU has no repacked layout for %s (llama-server keeps it in the GGUF layout)\n",
            ggml_type_name(wtype));
        ggml_backend_buffer_free(wbuf);
        return 3;
    }
    fill_blocks(all, wtype, seed, repacked);
    // the bytes a token reads: n_used experts' rows of the three matrices in every layer
    const double gb_per_token = (double) n_layer*n_used*3*(ggml_nbytes(gate[0])/n_expert)/1e9;

    // the token's inputs: its hidden state and each layer's experts
    ggml_init_params ip = { 4*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ictx = ggml_init(ip);
    ggml_tensor * x   = ggml_new_tensor_3d(ictx, GGML_TYPE_F32, n_embd, 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ictx, GGML_TYPE_I32, n_used, n_layer);
    ggml_backend_buffer_t ibuf = ggml_backend_alloc_ctx_tensors(ictx, backend);
    std::vector<float> xv(n_embd);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float & v : xv) {
        v = u(rng);
    }
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    std::vector<int32_t> experts(n_expert);
    std::iota(experts.begin(), experts.end(), 0);
    // every timed run (each mode, each flat setting) routes the same tokens: its checksum compares
    const std::mt19937_64 rng_start = rng;
    const std::vector<int32_t> experts_start = experts;
    auto route = [&]() { // n_used distinct experts per layer, anew for every token
        int32_t * p = (int32_t *) ids->data;
        for (int64_t il = 0; il < n_layer; ++il) {
            for (int64_t k = 0; k < n_used; ++k) {
                std::swap(experts[k], experts[k + rng() % (n_expert - k)]);
            }
            memcpy(p + il*n_used, experts.data(), n_used*sizeof(int32_t));
        }
    };

    // one graph per layer group: [first, last) layers; the MoE FFN of each with its own ids row
    const size_t graph_mem = ggml_tensor_overhead()*(8*n_layer + 16) + ggml_graph_overhead_custom(8*n_layer + 16, false);
    auto build = [&](ggml_context * ctx, int64_t first, int64_t last) {
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, 8*n_layer + 16, false);
        for (int64_t il = first; il < last; ++il) {
            ggml_tensor * sel = ggml_view_2d(ctx, ids, n_used, 1, ids->nb[1], il*ids->nb[1]);
            ggml_tensor * g = ggml_mul_mat_id(ctx, gate[il], x, sel);   // [n_ff, n_used, 1]
            ggml_tensor * v = ggml_mul_mat_id(ctx, up[il], x, sel);
            ggml_tensor * h = ggml_swiglu_split(ctx, g, v);
            ggml_tensor * out = ggml_mul_mat_id(ctx, down[il], h, sel); // [n_embd, n_used, 1]
            ggml_set_output(out);
            ggml_build_forward_expand(gf, out);
        }
        return gf;
    };
    auto checksum = [](const std::vector<ggml_cgraph *> & graphs) { // FNV-1a over every graph's outputs
        uint64_t hash = 0xcbf29ce484222325ull;
        std::vector<uint8_t> bytes;
        for (ggml_cgraph * gf : graphs) {
            for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
                ggml_tensor * t = ggml_graph_node(gf, i);
                if (!(t->flags & GGML_TENSOR_FLAG_OUTPUT)) {
                    continue;
                }
                bytes.resize(ggml_nbytes(t));
                ggml_backend_tensor_get(t, bytes.data(), 0, bytes.size());
                for (uint8_t b : bytes) {
                    hash = (hash ^ b) * 0x100000001b3ull;
                }
            }
        }
        return hash;
    };

    for (int64_t nt : threads) {
        ggml_threadpool_params tpp;
        ggml_threadpool_params_init(&tpp, (int) nt); // poll 50, as llama.cpp's default
        ggml_threadpool_t tp = tp_new(&tpp);
        if (!tp) {
            fprintf(stderr, "bench-cpu-mmid: cannot start a threadpool of %lld threads\n", (long long) nt);
            return 1;
        }
        set_n_threads(backend, (int) nt); // the graph's plan and the pool agree, as llama.cpp sets them
        tp_set(backend, tp);
        for (const std::string & mode : modes) for (const int f : flats) {
            if (flat_both) {
                set_flat(backend, f != 0);
            }
            rng = rng_start;
            experts = experts_start;
            const int64_t per_graph = mode == "graph" ? n_layer : 1;
            std::vector<ggml_context *> ctxs;
            std::vector<ggml_cgraph *> graphs;
            std::vector<ggml_gallocr_t> allocs;
            for (int64_t first = 0; first < n_layer; first += per_graph) {
                ggml_init_params gp = { graph_mem, nullptr, true };
                ctxs.push_back(ggml_init(gp));
                graphs.push_back(build(ctxs.back(), first, std::min(first + per_graph, n_layer)));
                allocs.push_back(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)));
                if (!ggml_gallocr_alloc_graph(allocs.back(), graphs.back())) {
                    fprintf(stderr, "bench-cpu-mmid: cannot allocate the compute buffer\n");
                    return 1;
                }
            }
            std::vector<double> ms;
            for (int64_t t = -2; t < n_tokens; ++t) { // two warm-up tokens
                route();
                double total = 0.0;
                for (ggml_cgraph * gf : graphs) {
                    if (mode == "split" && gap_us > 0) {
                        std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
                    }
                    const auto t0 = std::chrono::steady_clock::now();
                    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                        fprintf(stderr, "bench-cpu-mmid: the graph failed\n");
                        return 1;
                    }
                    total += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
                }
                if (t >= 0) {
                    ms.push_back(total);
                }
            }
            const uint64_t sum = checksum(graphs);
            std::sort(ms.begin(), ms.end());
            const double med = ms[ms.size()/2];
            printf("{\"mode\": \"%s\", \"threads\": %lld, \"layers\": %lld, \"tokens\": %lld, \"gap_us\": %lld, "
                   "\"ms_per_token\": %.4f, \"ms_min\": %.4f, \"gb_per_token\": %.6f, \"gb_s\": %.4g, "
                   "\"hugepages\": %d, \"mmid_flat\": %d, \"dot_x4\": %d, \"repack\": %d, \"type\": \"%s\", \"checksum\": \"%016llx\"}\n",
                mode.c_str(), (long long) nt, (long long) n_layer, (long long) n_tokens,
                (long long) (mode == "split" ? gap_us : 0), med, ms.front(), gb_per_token, gb_per_token/(med/1e3),
                hugepages ? 1 : 0, f, dot_x4, repacked ? 1 : 0, ggml_type_name(wtype), (unsigned long long) sum);
            fflush(stdout);
            for (size_t i = 0; i < graphs.size(); ++i) {
                ggml_gallocr_free(allocs[i]);
                ggml_free(ctxs[i]);
            }
        }
        tp_set(backend, nullptr);
        tp_free(tp);
    }
    ggml_backend_buffer_free(ibuf);
    ggml_backend_buffer_free(wbuf);
    ggml_free(ictx);
    ggml_free(wctx);
    ggml_backend_free(backend);
    return 0;
}
