// moecache._core: thin pybind11 bindings over llama.h, llama-moe.h and ggml-backend.h.
//
// The Python wrapper (moecache/api.py) validates arguments and turns the results into Python
// objects; this file only loads models, makes contexts, runs the decode loops with the GIL
// released and reports failures as exceptions that name the cause.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ggml-backend.h"
#include "gguf.h"
#include "llama.h"
#include "llama-moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

// Errors that the module's translator raises as moecache.ModelLoadError / MemoryError subclasses.
struct model_load_error : std::runtime_error { using std::runtime_error::runtime_error; };
struct out_of_memory_error : std::runtime_error { using std::runtime_error::runtime_error; };
// a model this API cannot run (it would abort inside llama_decode): moecache.MoecacheError
struct unsupported_model_error : std::runtime_error { using std::runtime_error::runtime_error; };

//
// llama.cpp log capture: kept quiet by default, the last lines go into error messages
//

static const size_t LOG_RING_LINES = 256;

struct log_ring {
    std::mutex mutex;
    std::deque<std::pair<uint64_t, std::string>> lines; // (sequence number, line)
    std::string partial;                                 // text of a line not ended yet
    uint64_t next_seq = 0;
    ggml_log_level last_level = GGML_LOG_LEVEL_INFO;
};

static log_ring g_log;
static std::atomic<int> g_n_verbose{0}; // echo the log to stderr while a verbose model is alive

static void log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (g_n_verbose.load() > 0) {
        fputs(text, stderr);
        fflush(stderr);
    }
    std::lock_guard<std::mutex> lock(g_log.mutex);
    // a continuation belongs to the level of the line it continues
    if (level == GGML_LOG_LEVEL_CONT) {
        level = g_log.last_level;
    } else {
        g_log.last_level = level;
    }
    if (level == GGML_LOG_LEVEL_DEBUG) {
        return; // too chatty to keep; never the reason for a failure
    }
    g_log.partial += text;
    size_t nl;
    while ((nl = g_log.partial.find('\n')) != std::string::npos) {
        g_log.lines.emplace_back(g_log.next_seq++, g_log.partial.substr(0, nl));
        g_log.partial.erase(0, nl + 1);
        if (g_log.lines.size() > LOG_RING_LINES) {
            g_log.lines.pop_front();
        }
    }
}

static uint64_t log_mark() {
    std::lock_guard<std::mutex> lock(g_log.mutex);
    return g_log.next_seq;
}

// The last max_lines lines logged since mark (plus an unfinished line), oldest first.
static std::vector<std::string> log_lines_since(uint64_t mark, size_t max_lines) {
    std::lock_guard<std::mutex> lock(g_log.mutex);
    std::vector<std::string> out;
    for (const auto & entry : g_log.lines) {
        if (entry.first >= mark) {
            out.push_back(entry.second);
        }
    }
    if (!g_log.partial.empty()) {
        out.push_back(g_log.partial);
    }
    if (out.size() > max_lines) {
        out.erase(out.begin(), out.end() - max_lines);
    }
    return out;
}

static std::string join_log(const std::vector<std::string> & lines) {
    if (lines.empty()) {
        return "  (llama.cpp logged nothing)";
    }
    std::string s;
    for (const auto & line : lines) {
        s += "  " + line + "\n";
    }
    if (!s.empty()) {
        s.pop_back();
    }
    return s;
}

static bool log_mentions(const std::vector<std::string> & lines, const char * needle) {
    for (const auto & line : lines) {
        if (line.find(needle) != std::string::npos) {
            return true;
        }
    }
    return false;
}

// Allocation failures show up in the log under a few phrasings, depending on the backend.
static bool log_mentions_allocation_failure(const std::vector<std::string> & lines) {
    static const char * phrases[] = {
        "failed to allocate", "unable to allocate", "out of memory", "cudaMalloc", "failed to reserve", "bad_alloc",
    };
    for (const char * phrase : phrases) {
        if (log_mentions(lines, phrase)) {
            return true;
        }
    }
    return false;
}

//
// devices and buffer types
//

static const char * dev_type_name(enum ggml_backend_dev_type type) {
    switch (type) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:   return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        case GGML_BACKEND_DEVICE_TYPE_META:  return "meta";
    }
    return "unknown";
}

static bool have_gpu() {
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        auto type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return true;
        }
    }
    return false;
}

// Buffer types a tensor override may name: every device's own type (as llama-server's -ot) and
// its pinned host type ("CUDA_Host"), by name.
static std::map<std::string, ggml_backend_buffer_type_t> buffer_types_by_name() {
    std::map<std::string, ggml_backend_buffer_type_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev)) {
            out[ggml_backend_buft_name(buft)] = buft;
        }
        if (ggml_backend_buffer_type_t host = ggml_backend_dev_host_buffer_type(dev)) {
            out[ggml_backend_buft_name(host)] = host;
        }
    }
    return out;
}

//
// model
//

struct model_handle {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::string path;
    std::string arch;
    bool verbose = false;

    ~model_handle() {
        if (model) {
            llama_model_free(model);
        }
        if (verbose) {
            g_n_verbose--;
        }
    }
};

// general.architecture of a GGUF file, read from its header only (no tensor data).
static std::string read_gguf_arch(const std::string & path) {
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    const uint64_t mark = log_mark();
    gguf_context * gguf = gguf_init_from_file(path.c_str(), params);
    if (!gguf) {
        throw model_load_error("'" + path + "' is not a valid GGUF file: its header could not be read "
                               "(truncated or corrupt download?).\n" + join_log(log_lines_since(mark, 8)));
    }
    std::string arch;
    const int64_t key = gguf_find_key(gguf, "general.architecture");
    if (key >= 0 && gguf_get_kv_type(gguf, key) == GGUF_TYPE_STRING) {
        arch = gguf_get_val_str(gguf, key);
    }
    gguf_free(gguf);
    if (arch.empty()) {
        throw model_load_error("'" + path + "' has no general.architecture key: it is a GGUF file but not a model "
                               "(a vocab-only or adapter file?).");
    }
    return arch;
}

static std::string meta_string(const llama_model * model, const std::string & key) {
    std::vector<char> buf(256);
    int32_t n = llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
    if (n < 0) {
        return "";
    }
    if ((size_t) n >= buf.size()) {
        buf.resize(n + 1);
        n = llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
    }
    return std::string(buf.data(), n);
}

static std::shared_ptr<model_handle> load_model(
        const std::string & path,
        int n_gpu_layers,
        int n_cpu_moe,
        bool cpu_moe,
        const std::vector<std::pair<std::string, std::string>> & tensor_overrides,
        bool use_mmap,
        bool use_mlock,
        bool pinned,
        bool repack,
        bool verbose,
        bool hugepages) {
    if (n_cpu_moe < 0) {
        throw std::invalid_argument("n_cpu_moe must be >= 0 (got " + std::to_string(n_cpu_moe) + ")");
    }

    auto handle = std::make_shared<model_handle>();
    handle->path = path;
    handle->verbose = verbose;
    if (verbose) {
        g_n_verbose++;
    }
    handle->arch = read_gguf_arch(path);

    // Overrides, first match wins: cpu_moe's regex for every layer (upstream's --cpu-moe), the
    // n_cpu_moe block regexes (upstream's --n-cpu-moe), then the caller's. The pattern strings must
    // outlive the load.
    const auto bufts = buffer_types_by_name();
    std::vector<std::string> patterns;
    std::vector<ggml_backend_buffer_type_t> targets;
    if (cpu_moe) {
        patterns.push_back("\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
        targets.push_back(ggml_backend_cpu_buffer_type());
    }
    for (int il = 0; il < n_cpu_moe; il++) {
        patterns.push_back("blk\\." + std::to_string(il) + "\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
        targets.push_back(ggml_backend_cpu_buffer_type());
    }
    for (const auto & ov : tensor_overrides) {
        auto it = bufts.find(ov.second);
        if (it == bufts.end()) {
            std::string names;
            for (const auto & b : bufts) {
                names += (names.empty() ? "" : ", ") + b.first;
            }
            throw std::invalid_argument("tensor_overrides: unknown buffer type '" + ov.second +
                                        "' (available: " + names + ")");
        }
        try {
            std::regex check(ov.first); // the loader compiles it the same way; fail here with a clear message
        } catch (const std::regex_error & e) {
            throw std::invalid_argument("tensor_overrides: invalid regex '" + ov.first + "': " + e.what());
        }
        patterns.push_back(ov.first);
        targets.push_back(it->second);
    }
    std::vector<llama_model_tensor_buft_override> overrides;
    for (size_t i = 0; i < patterns.size(); i++) {
        overrides.push_back({ patterns[i].c_str(), targets[i] });
    }
    overrides.push_back({ nullptr, nullptr });

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = n_gpu_layers;
    mparams.use_extra_bufts = repack; // CPU weight repacking (AMX, interleaved quants): llama-server's --repack
    mparams.tensor_buft_overrides = overrides.size() > 1 ? overrides.data() : nullptr;
    // Pinned host memory for the CPU-resident weights: upstream picks the GPU's host buffer type
    // for them unless the weights are mmapped, so pinned means "no mmap". Unpinned without mmap is
    // upstream's --no-mmap --no-host.
    const bool gpu = have_gpu();
    if (pinned && gpu) {
        use_mmap = false;
    }
    mparams.no_host = gpu && !pinned && !use_mmap;
    mparams.host_hugepages = hugepages; // host-resident weights (pinned or loaded) on huge pages: --host-hugepages
    if (use_mmap) {
        mparams.load_mode = use_mlock ? LLAMA_LOAD_MODE_MMAP_MLOCK : LLAMA_LOAD_MODE_MMAP;
    } else {
        mparams.load_mode = use_mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE;
    }

    const uint64_t mark = log_mark();
    {
        py::gil_scoped_release release;
        handle->model = llama_model_load_from_file(path.c_str(), mparams);
    }
    if (!handle->model) {
        const auto lines = log_lines_since(mark, 20);
        if (log_mentions(lines, "unknown model architecture")) {
            throw model_load_error("unsupported architecture '" + handle->arch + "' in '" + path +
                                   "': this llama.cpp build does not know it. Use a GGUF of an architecture "
                                   "llama.cpp supports (e.g. qwen3moe).");
        }
        std::string msg = "failed to load model '" + path + "'";
        if (log_mentions_allocation_failure(lines)) {
            msg += " (not enough memory for its weights: lower n_gpu_layers, raise n_cpu_moe or free memory)";
        }
        throw model_load_error(msg + ". llama.cpp said:\n" + join_log(lines));
    }
    handle->vocab = llama_model_get_vocab(handle->model);
    return handle;
}

static std::vector<llama_token> tokenize(const model_handle & m, const std::string & text, bool add_special, bool parse_special) {
    std::vector<llama_token> tokens(text.size() + 8);
    int32_t n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), tokens.data(), (int32_t) tokens.size(),
                               add_special, parse_special);
    if (n == INT32_MIN) {
        throw std::overflow_error("tokenize: the text is too long");
    }
    if (n < 0) {
        tokens.resize(-n);
        n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), tokens.data(), (int32_t) tokens.size(),
                           add_special, parse_special);
    }
    tokens.resize(n);
    return tokens;
}

static void check_token(const model_handle & m, llama_token t) {
    const int32_t n_vocab = llama_vocab_n_tokens(m.vocab);
    if (t < 0 || t >= n_vocab) {
        throw std::invalid_argument("token id " + std::to_string(t) + " is out of range [0, " + std::to_string(n_vocab) + ")");
    }
}

static std::string token_piece(const model_handle & m, llama_token t, bool special) {
    char buf[256];
    int32_t n = llama_token_to_piece(m.vocab, t, buf, sizeof(buf), 0, special);
    if (n >= 0) {
        return std::string(buf, n);
    }
    std::string big(-n, '\0');
    n = llama_token_to_piece(m.vocab, t, &big[0], (int32_t) big.size(), 0, special);
    return big.substr(0, std::max(n, 0));
}

static std::string detokenize(const model_handle & m, const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) {
    for (llama_token t : tokens) {
        check_token(m, t);
    }
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(m.vocab, tokens.data(), (int32_t) tokens.size(), &text[0], (int32_t) text.size(),
                                 remove_special, unparse_special);
    if (n < 0) {
        text.resize(-n);
        n = llama_detokenize(m.vocab, tokens.data(), (int32_t) tokens.size(), &text[0], (int32_t) text.size(),
                             remove_special, unparse_special);
    }
    text.resize(std::max(n, 0));
    return text;
}

//
// context
//

// Expert ids that the MoE layers selected, collected by the eval callback of a tracing context.
struct routing_trace {
    std::map<int, std::vector<int32_t>> ids_by_layer; // layer -> ids, n_expert_used per token, in token order
    int64_t n_expert_used = 0;
    std::string error;
};

// "ffn_moe_topk-<il>" is the name build_moe_ffn gives the [n_expert_used, n_tokens] selected ids.
static bool topk_layer(const char * name, int * il) {
    static const char prefix[] = "ffn_moe_topk-";
    const size_t n = sizeof(prefix) - 1;
    if (strncmp(name, prefix, n) != 0 || name[n] == '\0') {
        return false;
    }
    int value = 0;
    for (const char * p = name + n; *p; p++) {
        if (*p < '0' || *p > '9') {
            return false;
        }
        value = value * 10 + (*p - '0');
    }
    *il = value;
    return true;
}

static bool trace_eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * trace = (routing_trace *) user_data;
    int il = -1;
    if (!topk_layer(t->name, &il)) {
        return !ask; // ask: not needed; data: (never asked for) keep going
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_I32 || t->nb[0] != sizeof(int32_t) || t->ne[2] != 1 || t->ne[3] != 1) {
        trace->error = std::string("unexpected layout of ") + t->name;
        return false;
    }
    const int64_t k = t->ne[0];
    const int64_t n_tokens = t->ne[1];
    if (trace->n_expert_used == 0) {
        trace->n_expert_used = k;
    } else if (trace->n_expert_used != k) {
        trace->error = std::string("inconsistent top-k width in ") + t->name;
        return false;
    }
    // The ids are usually a view of the first k columns of the argsort result: fetch the whole
    // strided extent in one copy (a copy per row would be slow on a GPU) and pick the rows.
    const size_t nbytes = ggml_nbytes(t);
    std::vector<char> raw(nbytes);
    ggml_backend_tensor_get(t, raw.data(), 0, nbytes);
    auto & out = trace->ids_by_layer[il];
    for (int64_t i = 0; i < n_tokens; i++) {
        const int32_t * row = (const int32_t *) (raw.data() + i * t->nb[1]);
        out.insert(out.end(), row, row + k);
    }
    return true;
}

struct context_handle {
    std::shared_ptr<model_handle> model;
    llama_context * ctx = nullptr;
    llama_context_params params;
    llama_batch batch;
    std::string moe_cache_profile; // params.moe_cache.profile points here
    std::mutex mutex; // one call at a time: a context is not thread safe

    ~context_handle() {
        if (ctx) {
            llama_batch_free(batch);
            llama_free(ctx);
        }
    }
};

// Called without the GIL (it may take a while: it allocates the KV cache and compute buffers).
static llama_context * new_context(const model_handle & m, const llama_context_params & params) {
    const uint64_t mark = log_mark();
    llama_context * ctx = llama_init_from_model(m.model, params);
    if (!ctx) {
        const auto lines = log_lines_since(mark, 12);
        std::string sizes = "n_ctx=" + std::to_string(params.n_ctx) + ", n_batch=" + std::to_string(params.n_batch) +
                            ", n_ubatch=" + std::to_string(params.n_ubatch);
        const bool cache = params.moe_cache.n_slots > 0 || params.moe_cache.size_mib > 0;
        if (params.moe_cache.n_slots > 0) {
            sizes += ", moe_cache_slots=" + std::to_string(params.moe_cache.n_slots);
        } else if (params.moe_cache.size_mib > 0) {
            sizes += ", moe_cache_size_mib=" + std::to_string(params.moe_cache.size_mib);
        }
        // the library checks the cache's settings itself: its refusal is a bad argument, not a failure
        for (const auto & line : lines) {
            const size_t at = line.find("moe cache: ");
            if (at != std::string::npos) {
                throw std::invalid_argument("invalid hot-expert cache settings: " + line.substr(at + 11));
            }
        }
        if (log_mentions_allocation_failure(lines)) {
            throw out_of_memory_error("not enough memory for a context with " + sizes +
                                      (cache ? " (KV cache, compute buffers and expert cache slots): lower n_ctx, n_ubatch "
                                               "or the expert cache size. llama.cpp said:\n"
                                             : " (KV cache and compute buffers): lower n_ctx or n_ubatch. llama.cpp said:\n") +
                                      join_log(lines));
        }
        throw std::runtime_error("could not create a context with " + sizes + ". llama.cpp said:\n" + join_log(lines));
    }
    return ctx;
}

static enum llama_moe_cache_policy parse_moe_cache_policy(const std::string & name) {
    if (name == "freq") {
        return LLAMA_MOE_CACHE_POLICY_FREQ;
    }
    if (name == "lru") {
        return LLAMA_MOE_CACHE_POLICY_LRU;
    }
    throw std::invalid_argument("moe_cache_policy must be 'freq' or 'lru' (got '" + name + "')");
}

static llama_moe_cache_miss parse_moe_cache_miss(const std::string & name) {
    if (name == "cpu") {
        return LLAMA_MOE_CACHE_MISS_CPU;
    }
    if (name == "gpu") {
        return LLAMA_MOE_CACHE_MISS_DEVICE;
    }
    if (name == "auto") {
        return LLAMA_MOE_CACHE_MISS_AUTO;
    }
    if (name == "split") {
        return LLAMA_MOE_CACHE_MISS_SPLIT;
    }
    throw std::invalid_argument("moe_cache_miss must be 'cpu', 'gpu', 'auto' or 'split' (got '" + name + "')");
}

// The hot-expert cache settings of a context. The library checks them (the wrapper first, naming its
// parameters); a value it refuses fails the context creation with its message.
static llama_moe_cache_params make_moe_cache_params(int slots, int size_mib, const std::string & policy,
                                                    int rebalance_interval, int max_batch, int admit_misses,
                                                    int admit_window, int max_uploads, int headroom_mib,
                                                    const std::string & miss, int miss_auto_pct, int miss_split_pct,
                                                    bool warm_prompts, bool slots_by_layer) {
    llama_moe_cache_params p = llama_moe_cache_default_params();
    p.n_slots = slots;
    p.size_mib = size_mib;
    p.policy = parse_moe_cache_policy(policy);
    p.rebalance_interval = rebalance_interval;
    p.max_batch = max_batch;
    p.admit_misses = admit_misses;
    p.admit_window = admit_window;
    p.max_uploads = max_uploads;
    p.headroom_mib = headroom_mib;
    p.routing_trace = nullptr; // record_routing starts and stops a trace
    p.miss = parse_moe_cache_miss(miss);
    p.miss_auto_pct = miss_auto_pct;
    p.miss_split_pct = miss_split_pct;
    p.warm_prompts = warm_prompts;
    p.slots_by_layer = slots_by_layer;
    p.profile = nullptr; // set by make_context, to a string the context keeps
    return p;
}

static llama_prefill_swap_params make_prefill_swap_params(int n_ubatch, int min_tokens, const std::string & mode,
                                                          bool warm_restore, int restore_wait_ms) {
    if (n_ubatch < 0) {
        throw std::invalid_argument("prefill_ubatch must be >= 0 (got " + std::to_string(n_ubatch) + ")");
    }
    if (min_tokens < 1) {
        throw std::invalid_argument("prefill_min_tokens must be >= 1 (got " + std::to_string(min_tokens) + ")");
    }
    if (restore_wait_ms < 0 || restore_wait_ms > 600000) {
        throw std::invalid_argument("prefill_restore_wait_ms must be in 0..600000 (got " + std::to_string(restore_wait_ms) + ")");
    }
    llama_prefill_swap_params p = llama_prefill_swap_default_params();
    p.n_ubatch = (uint32_t) n_ubatch;
    p.min_tokens = (uint32_t) min_tokens;
    if (mode == "transaction") {
        p.mode = LLAMA_PREFILL_SWAP_TRANSACTION;
    } else if (mode == "bypass") {
        p.mode = LLAMA_PREFILL_SWAP_BYPASS;
    } else {
        throw std::invalid_argument("prefill_swap_mode must be 'transaction' or 'bypass' (got '" + mode + "')");
    }
    p.warm_restore = warm_restore;
    p.restore_wait_ms = (uint32_t) restore_wait_ms;
    return p;
}

static std::shared_ptr<context_handle> make_context(std::shared_ptr<model_handle> m, int n_ctx, int n_batch, int n_ubatch,
                                                    int n_threads, const std::string & flash_attn, int moe_cache_slots,
                                                    int moe_cache_size_mib, const std::string & moe_cache_policy,
                                                    int moe_cache_rebalance_interval, int moe_cache_max_batch,
                                                    int moe_cache_admit_misses, int moe_cache_admit_window,
                                                    int moe_cache_max_uploads, int moe_cache_headroom_mib,
                                                    const std::string & moe_cache_miss, int moe_cache_miss_auto_pct,
                                                    int moe_cache_miss_split_pct,
                                                    bool moe_cache_warm_prompts, const std::string & moe_cache_profile,
                                                    bool moe_cache_slots_by_layer, int prefill_ubatch, int prefill_min_tokens,
                                                    const std::string & prefill_swap_mode, bool prefill_warm_restore,
                                                    int prefill_restore_wait_ms, bool qsa_sparse, bool kq_mask_device, bool qsa_block_topk,
                                                    bool pp_overrides, bool cpu_experts_flat, bool cpu_experts_x4,
                                                    bool cpu_experts_overlap) {
    if (n_ctx <= 0) {
        throw std::invalid_argument("n_ctx must be > 0 (got " + std::to_string(n_ctx) + ")");
    }
    if (n_batch <= 0 || n_ubatch <= 0 || n_ubatch > n_batch) {
        throw std::invalid_argument("need 0 < n_ubatch <= n_batch (got n_batch=" + std::to_string(n_batch) +
                                    ", n_ubatch=" + std::to_string(n_ubatch) + ")");
    }
    if (n_threads <= 0) {
        throw std::invalid_argument("n_threads must be > 0 (got " + std::to_string(n_threads) + ")");
    }
    // what llama_decode cannot run one token after another would abort the process there: say so here
    const llama_model * model = m->model;
    if (llama_model_is_diffusion(model)) {
        throw unsupported_model_error("'" + m->arch + "' is a diffusion model: it refines a whole sequence at once, "
            "which moecache's Context does not do (it generates one token after another). Run it with llama.cpp's "
            "llama-diffusion-cli.");
    }
    if (llama_model_has_encoder(model)) {
        throw unsupported_model_error("'" + m->arch + "' " + (llama_model_has_decoder(model) ?
            "is an encoder-decoder model: its decoder needs the encoder's output first, which moecache's Context "
            "does not compute" : "is an encoder-only model: it embeds text, it does not generate") +
            ". moecache's Context runs decoder-only models.");
    }
    llama_context_params params = llama_context_default_params();
    if (flash_attn == "auto") {
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    } else if (flash_attn == "on") {
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    } else if (flash_attn == "off") {
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    } else {
        throw std::invalid_argument("flash_attn must be one of 'auto', 'on', 'off' (got '" + flash_attn + "')");
    }
    params.n_ctx = n_ctx;
    params.n_batch = n_batch;
    params.n_ubatch = n_ubatch;
    params.n_seq_max = 1;
    // generate asks for one output per decode (the prompt's last token, then each new one); the
    // default (n_batch) would reserve logits for every ubatch token: 1188 MiB of the compute buffer
    // at n_ubatch 2048 with a 151936-token vocabulary, against 594 KiB for one
    params.n_outputs_max = 1;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.no_perf = true; // we time prefill and decode ourselves
    params.moe_cache = make_moe_cache_params(moe_cache_slots, moe_cache_size_mib, moe_cache_policy,
                                             moe_cache_rebalance_interval, moe_cache_max_batch, moe_cache_admit_misses,
                                             moe_cache_admit_window, moe_cache_max_uploads, moe_cache_headroom_mib,
                                             moe_cache_miss, moe_cache_miss_auto_pct, moe_cache_miss_split_pct,
                                             moe_cache_warm_prompts, moe_cache_slots_by_layer);
    params.prefill_swap = make_prefill_swap_params(prefill_ubatch, prefill_min_tokens, prefill_swap_mode, prefill_warm_restore,
                                                   prefill_restore_wait_ms);
    params.qsa_sparse = qsa_sparse;
    params.kq_mask_device = kq_mask_device;
    params.qsa_block_topk = qsa_block_topk;
    params.pp_overrides = pp_overrides;
    params.cpu_experts_flat = cpu_experts_flat;
    params.cpu_experts_x4 = cpu_experts_x4;
    params.cpu_experts_overlap = cpu_experts_overlap;

    auto c = std::make_shared<context_handle>();
    c->model = std::move(m);
    c->moe_cache_profile = moe_cache_profile;
    params.moe_cache.profile = c->moe_cache_profile.empty() ? nullptr : c->moe_cache_profile.c_str();
    c->params = params;
    {
        py::gil_scoped_release release;
        c->ctx = new_context(*c->model, params);
    }
    // llama.cpp may clamp the sizes (n_batch <= n_ctx, n_ubatch <= n_batch): keep what it uses
    c->params.n_ctx = llama_n_ctx(c->ctx);
    c->params.n_batch = llama_n_batch(c->ctx);
    c->params.n_ubatch = llama_n_ubatch(c->ctx);
    c->batch = llama_batch_init(c->params.n_batch, 0, 1);
    return c;
}

// Ctrl-C: the decode loops run without the GIL, so the interpreter's signal handler only sets a flag;
// check it between steps so that a long generation stops promptly with KeyboardInterrupt.
static void raise_if_interrupted() {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) {
        throw py::error_already_set();
    }
}

// Decode tokens[0, n) at positions pos0.. in chunks of `chunk`; outputs for every token
// (all_outputs) or only for the very last one.
static void decode_chunks(llama_context * ctx, llama_batch & batch, const llama_token * tokens, int32_t n,
                          int32_t pos0, int32_t chunk, bool all_outputs) {
    for (int32_t i0 = 0; i0 < n; i0 += chunk) {
        if (i0 > 0) {
            raise_if_interrupted();
        }
        const int32_t n_chunk = std::min(chunk, n - i0);
        batch.n_tokens = n_chunk;
        for (int32_t j = 0; j < n_chunk; j++) {
            batch.token[j] = tokens[i0 + j];
            batch.pos[j] = pos0 + i0 + j;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = all_outputs || (i0 + j == n - 1);
        }
        const int32_t ret = llama_decode(ctx, batch);
        if (ret != 0) {
            throw std::runtime_error(ret == 1 ? "llama_decode: no room in the KV cache (context full)"
                                   : ret == 2 ? "llama_decode: aborted"
                                              : "llama_decode failed with code " + std::to_string(ret) +
                                                    " (see the llama.cpp log; run with verbose=True)");
        }
    }
}

struct generation_result {
    std::vector<llama_token> tokens;
    std::string text;
    std::string finish_reason;
    int32_t prefill_tokens = 0;
    double prefill_s = 0.0;
    int32_t decode_tokens = 0;
    double decode_s = 0.0;
    uint32_t prefill_ubatch = 0;  // the ubatch the prompt ran at
    double prefill_swap_ms = 0.0; // the prefill-phase swap's release + reserve + restore, 0 without one
    // with n_probs > 0: before each generated token, the n_probs most likely tokens and their log-probabilities
    // (of the model's distribution, before any sampler), best first
    std::vector<std::vector<std::pair<llama_token, float>>> top_logprobs;
};

// The n most likely tokens of the last output's logits and their log-probabilities, best first.
static std::vector<std::pair<llama_token, float>> top_logprobs(llama_context * ctx, int32_t n_vocab, int32_t n) {
    const float * logits = llama_get_logits_ith(ctx, -1);
    std::vector<std::pair<llama_token, float>> out;
    if (logits == nullptr || n_vocab <= 0) {
        return out;
    }
    float max_logit = logits[0];
    for (int32_t i = 1; i < n_vocab; i++) {
        max_logit = std::max(max_logit, logits[i]);
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) {
        sum += std::exp((double) logits[i] - max_logit);
    }
    const float log_z = max_logit + (float) std::log(sum);
    std::vector<llama_token> ids(n_vocab);
    for (int32_t i = 0; i < n_vocab; i++) {
        ids[i] = i;
    }
    n = std::min(n, n_vocab);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [logits](llama_token a, llama_token b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int32_t i = 0; i < n; i++) {
        out.emplace_back(ids[i], logits[ids[i]] - log_z);
    }
    return out;
}

// The decode configuration comes back before the first token is sampled, also when the prompt's
// decode throws (an interrupt, a full context)
struct prefill_swap_scope {
    llama_context * ctx;
    bool active;
    prefill_swap_scope(llama_context * ctx, int32_t n_tokens) : ctx(ctx), active(llama_prefill_swap_begin(ctx, n_tokens, 0) == 0) {}
    void end() {
        if (active) {
            llama_prefill_swap_end(ctx);
            active = false;
        }
    }
    ~prefill_swap_scope() { end(); }
};

static llama_sampler * make_sampler(float temperature, uint32_t seed, int32_t top_k, float top_p) {
    llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (temperature == 0.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
        return chain;
    }
    if (top_k > 0) {
        llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k));
    }
    if (top_p < 1.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 1));
    }
    llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature));
    llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    return chain;
}

// A stop string that ends inside text[from_hint..]: where it starts, or npos.
static size_t find_stop(const std::string & text, size_t from_hint, const std::vector<std::string> & stops) {
    size_t best = std::string::npos;
    for (const auto & s : stops) {
        const size_t from = from_hint >= s.size() ? from_hint - s.size() + 1 : 0;
        const size_t pos = text.find(s, from);
        if (pos != std::string::npos && pos < best) {
            best = pos;
        }
    }
    return best;
}

static generation_result generate(context_handle & c, const std::vector<llama_token> & prompt, int32_t max_tokens,
                                  float temperature, uint32_t seed, int32_t top_k, float top_p,
                                  const std::vector<std::string> & stops, int32_t n_probs) {
    const model_handle & m = *c.model;
    const int32_t n_ctx = (int32_t) llama_n_ctx(c.ctx);
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if ((int32_t) prompt.size() >= n_ctx) {
        throw std::invalid_argument("prompt has " + std::to_string(prompt.size()) + " tokens, the context holds " +
                                    std::to_string(n_ctx) + ": make a context with a larger n_ctx");
    }
    for (llama_token t : prompt) {
        check_token(m, t);
    }
    if (max_tokens < 0) {
        throw std::invalid_argument("max_tokens must be >= 0");
    }
    if (temperature < 0.0f) {
        throw std::invalid_argument("temperature must be >= 0");
    }
    if (n_probs < 0) {
        throw std::invalid_argument("top_logprobs must be >= 0");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(m.vocab);

    generation_result r;
    std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)> smpl(make_sampler(temperature, seed, top_k, top_p),
                                                                       &llama_sampler_free);
    using clock = std::chrono::steady_clock;
    // the GIL first, then the lock: a thread waiting for the lock must not hold the GIL
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(c.mutex);

    llama_memory_clear(llama_get_memory(c.ctx), true);

    const auto t0 = clock::now();
    {
        prefill_swap_scope swap(c.ctx, (int32_t) prompt.size());
        r.prefill_ubatch = llama_n_ubatch(c.ctx);
        decode_chunks(c.ctx, c.batch, prompt.data(), (int32_t) prompt.size(), 0, (int32_t) c.params.n_batch, false);
        llama_synchronize(c.ctx);
        if (swap.active) {
            swap.end();
            llama_prefill_swap_stats st{};
            llama_prefill_swap_get_stats(c.ctx, &st);
            r.prefill_swap_ms = st.ms_release + st.ms_reserve + st.ms_restore;
        }
    }
    const auto t1 = clock::now();
    r.prefill_tokens = (int32_t) prompt.size();
    r.prefill_s = std::chrono::duration<double>(t1 - t0).count();

    int32_t n_past = (int32_t) prompt.size();
    r.finish_reason = "length";
    if (max_tokens > 0) {
        if (n_probs > 0) {
            r.top_logprobs.push_back(top_logprobs(c.ctx, n_vocab, n_probs));
        }
        llama_token t = llama_sampler_sample(smpl.get(), c.ctx, -1);
        while (true) {
            if (llama_vocab_is_eog(m.vocab, t)) {
                r.finish_reason = "stop"; // the end-of-generation token itself is not part of the output
                break;
            }
            r.tokens.push_back(t);
            const size_t old_len = r.text.size();
            r.text += token_piece(m, t, false);
            if (!stops.empty()) {
                const size_t pos = find_stop(r.text, old_len, stops);
                if (pos != std::string::npos) {
                    r.text.resize(pos);
                    r.finish_reason = "stop";
                    break;
                }
            }
            if ((int32_t) r.tokens.size() >= max_tokens || n_past >= n_ctx) {
                break;
            }
            raise_if_interrupted();
            decode_chunks(c.ctx, c.batch, &t, 1, n_past, 1, true);
            n_past++;
            r.decode_tokens++;
            if (n_probs > 0) {
                r.top_logprobs.push_back(top_logprobs(c.ctx, n_vocab, n_probs));
            }
            t = llama_sampler_sample(smpl.get(), c.ctx, -1);
        }
    }
    r.decode_s = std::chrono::duration<double>(clock::now() - t1).count();
    // every token of this generation is accepted: commit the last decode's routing now, before the next
    // generation clears the memory (which would make the cache count those tokens as rolled back)
    llama_moe_cache_flush(c.ctx);
    return r;
}

// Run tokens through a context that records the experts each MoE layer selects.
// The eval callback splits graph computation at every recorded tensor (slower, and it stops the
// backends from running ahead), so it lives in a separate context made only for the trace: the
// generation context keeps upstream's speed.
static std::pair<py::array_t<int32_t>, std::vector<int>> trace_routing(context_handle & c, const std::vector<llama_token> & tokens) {
    const model_handle & m = *c.model;
    if (tokens.empty()) {
        throw std::invalid_argument("trace_routing: no tokens");
    }
    if (tokens.size() > c.params.n_ctx) {
        throw std::invalid_argument("trace_routing: " + std::to_string(tokens.size()) + " tokens do not fit in n_ctx=" +
                                    std::to_string(c.params.n_ctx) + ": trace in pieces or use a larger context");
    }
    for (llama_token t : tokens) {
        check_token(m, t);
    }

    routing_trace trace;
    llama_context_params params = c.params;
    params.cb_eval = trace_eval_callback;
    params.cb_eval_user_data = &trace;
    // the tracing context takes the stock path: no expert cache of its own (slot banks, uploads)
    // and no routing trace file (the generation context's record_routing owns that)
    params.moe_cache.n_slots = 0;
    params.moe_cache.size_mib = 0;
    params.moe_cache.routing_trace = nullptr;
    params.prefill_swap.n_ubatch = 0;
    params.n_outputs_max = 0; // every token is an output here (n_batch)
    std::unique_ptr<llama_context, decltype(&llama_free)> tctx(nullptr, &llama_free);
    std::unique_ptr<llama_batch, void (*)(llama_batch *)> batch(new llama_batch(llama_batch_init(params.n_batch, 0, 1)),
                                                               [](llama_batch * b) { llama_batch_free(*b); delete b; });
    {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(c.mutex);
        tctx.reset(new_context(m, params));
        // Every token is an output so that the last layer runs its MoE on all tokens (it skips the
        // rows that are not output). Chunks of one ubatch bound the logits buffer to
        // n_ubatch x n_vocab; with n_batch a multiple of n_ubatch the ubatches, and so the
        // routing, are the same as in generate's prefill.
        decode_chunks(tctx.get(), *batch, tokens.data(), (int32_t) tokens.size(), 0, (int32_t) params.n_ubatch, true);
        llama_synchronize(tctx.get());
    }
    if (!trace.error.empty()) {
        throw std::runtime_error("trace_routing: " + trace.error);
    }
    if (trace.ids_by_layer.empty()) {
        throw std::invalid_argument("trace_routing: the model has no MoE layers (no ffn_moe_topk tensors were computed)");
    }

    const int64_t n_tokens = (int64_t) tokens.size();
    const int64_t k = trace.n_expert_used;
    const int64_t n_layers = (int64_t) trace.ids_by_layer.size();
    std::vector<int> layers;
    for (const auto & it : trace.ids_by_layer) {
        if ((int64_t) it.second.size() != n_tokens * k) {
            throw std::runtime_error("trace_routing: layer " + std::to_string(it.first) + " recorded " +
                                     std::to_string(it.second.size() / k) + " tokens, expected " + std::to_string(n_tokens));
        }
        layers.push_back(it.first);
    }
    py::array_t<int32_t> out({ n_tokens, n_layers, k });
    int32_t * dst = out.mutable_data();
    int64_t il_col = 0;
    for (const auto & it : trace.ids_by_layer) {
        for (int64_t i = 0; i < n_tokens; i++) {
            std::copy_n(it.second.data() + i * k, k, dst + (i * n_layers + il_col) * k);
        }
        il_col++;
    }
    return { out, layers };
}

//
// hot-expert cache (llama-moe.h)
//

// Runs fn with the GIL released and the context locked (the order generate uses: the GIL first,
// then the lock), so a call waits for a generation in another thread instead of racing it.
template <typename F>
static auto with_context_locked(context_handle & c, F && fn) -> decltype(fn()) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(c.mutex);
    return fn();
}

static int32_t model_n_expert(const model_handle & m) {
    const std::string value = meta_string(m.model, m.arch + ".expert_count");
    try {
        return value.empty() ? 0 : (int32_t) std::stol(value);
    } catch (const std::exception &) {
        return 0;
    }
}

static bool moe_cache_configured(const context_handle & c) {
    return c.params.moe_cache.n_slots > 0 || c.params.moe_cache.size_mib > 0;
}

// Why the context has no cache (il == -1) or why layer il has none, as a message that names the
// fix. Called with the context locked.
static std::string moe_cache_why_not(const context_handle & c, int32_t il) {
    const int32_t n_layer = llama_model_n_layer(c.model->model);
    if (il >= 0) {
        const char * reason = llama_moe_cache_layer_reason(c.ctx, il);
        if (!reason) {
            return "layer " + std::to_string(il) + " is out of range [0, " + std::to_string(n_layer) + ")";
        }
        if (!moe_cache_configured(c)) {
            return "layer " + std::to_string(il) + " has no expert cache: this context has none "
                   "(make it with moe_cache_slots=N or moe_cache_size_mib=M)";
        }
        return "layer " + std::to_string(il) + " has no expert cache" + (*reason ? std::string(": ") + reason : std::string());
    }
    if (!moe_cache_configured(c)) {
        return "this context has no expert cache (moe_cache_slots=0 and moe_cache_size_mib=0: make the context "
               "with moe_cache_slots=N or moe_cache_size_mib=M)";
    }
    // group the layers by reason: "layers 0, 1, 2: <reason>; layer 3: <reason>"
    std::vector<std::pair<std::string, std::vector<int32_t>>> groups;
    for (int32_t i = 0; i < n_layer; i++) {
        const char * reason = llama_moe_cache_layer_reason(c.ctx, i);
        const std::string r = reason && *reason ? reason : "(no reason given)";
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto & g) { return g.first == r; });
        if (it == groups.end()) {
            groups.push_back({ r, { i } });
        } else {
            it->second.push_back(i);
        }
    }
    std::string msg = "this context has no expert cache: no layer could be cached";
    for (size_t g = 0; g < groups.size(); g++) {
        msg += g == 0 ? " (" : "; ";
        msg += groups[g].second.size() > 1 ? "layers " : "layer ";
        for (size_t j = 0; j < groups[g].second.size(); j++) {
            msg += (j ? ", " : "") + std::to_string(groups[g].second[j]);
        }
        msg += ": " + groups[g].first;
    }
    return msg + (groups.empty() ? "" : ")");
}

static py::dict moe_cache_stats_dict(const llama_moe_cache_stats & s) {
    py::dict bypassed;
    bypassed["batch"] = s.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_BATCH];
    bypassed["warmup"] = s.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_WARMUP];
    py::dict d;
    d["n_tokens"] = s.n_tokens;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["hit_rate"] = s.hit_rate;
    d["hit_rate_recent"] = s.hit_rate_recent;
    d["uploads"] = s.uploads;
    d["bytes_uploaded"] = s.bytes_uploaded;
    d["evictions"] = s.evictions;
    d["batches_cached"] = s.batches_cached;
    d["batches_bypassed"] = bypassed;
    d["rebalances"] = s.rebalances;
    d["step_ms_max"] = s.step_ms_max;
    d["step_ms_total"] = s.step_ms_total;
    d["n_slots"] = s.n_slots;
    d["n_resident"] = s.n_resident;
    d["n_layers_cached"] = s.n_layers_cached;
    d["bytes_vram"] = s.bytes_vram;
    d["n_miss_device"] = s.n_miss_device;
    d["route_switches"] = s.route_switches;
    return d;
}

static py::dict moe_cache_stats(context_handle & c, int32_t il) {
    if (il < -1) {
        throw std::invalid_argument("moe_cache_stats: layer must be >= 0, or -1 for the total (got " + std::to_string(il) + ")");
    }
    llama_moe_cache_stats s{};
    std::string error;
    with_context_locked(c, [&]() {
        llama_moe_cache_flush(c.ctx); // the last token's routing is committed only at the next decode otherwise
        if (!llama_moe_cache_get_stats(c.ctx, il, &s)) {
            error = moe_cache_why_not(c, il);
        }
    });
    if (!error.empty()) {
        throw std::invalid_argument("moe_cache_stats: " + error);
    }
    return moe_cache_stats_dict(s);
}

// None when layer il has a cache, else why not.
static py::object moe_cache_layer_reason(context_handle & c, int32_t il) {
    bool in_range = false;
    std::string reason;
    with_context_locked(c, [&]() {
        const char * r = llama_moe_cache_layer_reason(c.ctx, il);
        in_range = r != nullptr;
        reason = r ? r : "";
    });
    if (!in_range) {
        throw std::invalid_argument("moe_cache_layer_reason: layer " + std::to_string(il) + " is out of range [0, " +
                                    std::to_string(llama_model_n_layer(c.model->model)) + ")");
    }
    if (reason.empty()) {
        return py::none();
    }
    return py::str(reason);
}

static std::vector<int32_t> moe_cache_resident(context_handle & c, int32_t il) {
    if (il < 0) {
        throw std::invalid_argument("moe_cache_resident: layer must be >= 0 (got " + std::to_string(il) + ")");
    }
    std::vector<int32_t> experts((size_t) std::max<int32_t>(model_n_expert(*c.model), 256));
    std::string error;
    with_context_locked(c, [&]() {
        int32_t n = llama_moe_cache_resident(c.ctx, il, experts.data(), (int32_t) experts.size());
        if (n > (int32_t) experts.size()) { // more than the buffer holds: ask again with room for all
            experts.resize(n);
            n = llama_moe_cache_resident(c.ctx, il, experts.data(), (int32_t) experts.size());
        }
        if (n < 0) {
            error = moe_cache_why_not(c, il);
            n = 0;
        }
        experts.resize(std::min<size_t>((size_t) n, experts.size()));
    });
    if (!error.empty()) {
        throw std::invalid_argument("moe_cache_resident: " + error);
    }
    return experts;
}

static void moe_cache_pin(context_handle & c, int32_t il, int32_t expert) {
    if (il < 0) {
        throw std::invalid_argument("moe_cache_pin: layer must be >= 0 (got " + std::to_string(il) + ")");
    }
    std::string error;
    with_context_locked(c, [&]() {
        const int32_t rc = llama_moe_cache_pin(c.ctx, il, expert);
        if (rc == 0) {
            return;
        }
        if (rc == -1) {
            error = moe_cache_why_not(c, il);
        } else if (rc == -2) {
            const int32_t n_expert = model_n_expert(*c.model);
            error = "expert " + std::to_string(expert) + " is out of range" +
                    (n_expert > 0 ? " [0, " + std::to_string(n_expert) + ")" : std::string()) + " in layer " + std::to_string(il);
        } else if (rc == -3) {
            llama_moe_cache_stats s{};
            const bool have = llama_moe_cache_get_stats(c.ctx, il, &s);
            error = "every slot of layer " + std::to_string(il) + " is pinned" +
                    (have ? " (" + std::to_string(s.n_slots) + " slots)" : std::string()) +
                    ": expert " + std::to_string(expert) + " cannot be pinned too. Pin fewer experts or make the "
                    "context with more moe_cache_slots";
        } else {
            error = "llama_moe_cache_pin failed with code " + std::to_string(rc);
        }
    });
    if (!error.empty()) {
        throw std::invalid_argument("moe_cache_pin: " + error);
    }
}

static std::string moe_cache_stats_json(context_handle & c) {
    std::string out;
    int32_t failed = 0;
    with_context_locked(c, [&]() {
        llama_moe_cache_flush(c.ctx);
        int32_t n = llama_moe_cache_stats_json(c.ctx, nullptr, 0);
        // the stats may grow between the two calls (uploads finish in the background): ask again until it fits
        for (int attempt = 0; n >= 0 && attempt < 8; attempt++) {
            out.assign((size_t) n + 1, '\0');
            const int32_t m = llama_moe_cache_stats_json(c.ctx, &out[0], out.size());
            if (m < 0) {
                n = m;
                break;
            }
            if ((size_t) m < out.size()) {
                out.resize(m);
                return;
            }
            n = m;
        }
        failed = n < 0 ? n : -1;
    });
    if (failed) {
        throw std::runtime_error("llama_moe_cache_stats_json failed (code " + std::to_string(failed) + ")");
    }
    return out;
}

// Start (path) or stop (None) the JSONL routing trace; OSError (with errno's subclass when the C
// library left one, e.g. FileNotFoundError) naming the path when it cannot be opened.
static void record_routing(context_handle & c, const std::optional<std::string> & path) {
    bool ok = true;
    int err = 0;
    with_context_locked(c, [&]() {
        errno = 0;
        ok = llama_moe_routing_trace(c.ctx, path ? path->c_str() : nullptr);
        err = errno;
    });
    if (ok) {
        return;
    }
    const std::string where = path ? *path : std::string("(none)");
    py::object os_error = py::module_::import("builtins").attr("OSError");
    py::object exc = err != 0
        ? os_error(err, "cannot record the routing trace into this file: " + std::string(strerror(err)), where)
        : os_error("cannot record the routing trace into '" + where + "' (the file could not be opened for writing)");
    PyErr_SetObject((PyObject *) Py_TYPE(exc.ptr()), exc.ptr());
    throw py::error_already_set();
}

//
// module
//

static void check_index(const char * what, int32_t i, int32_t n) {
    if (i < 0 || i >= n) {
        throw std::out_of_range(std::string(what) + " " + std::to_string(i) + " is out of range [0, " + std::to_string(n) + ")");
    }
}

// a residency policy of the library (llama-moe.h), owned by Python
struct policy_handle {
    llama_moe_policy * p = nullptr;
    int32_t n_expert = 0;
    int32_t n_slots = 0;
    ~policy_handle() {
        llama_moe_policy_free(p);
    }
};

// Bandwidths for a plan's rate bounds, bytes per second, best of `reps`: a parallel read of host memory by
// `threads` threads (what CPU expert matmuls stream at decode), and for a device: a copy within its memory
// (read and write counted, what its kernels stream) and a copy to it from pinned host memory (what the
// stock path streams per prompt ubatch when the experts are in host memory).
static double best_seconds(int reps, const std::function<void()> & fn) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}

static double host_read_bandwidth(size_t bytes, int reps, int threads) {
    const size_t n = bytes / sizeof(uint64_t);
    std::vector<uint64_t> a(n);
    std::vector<uint64_t> sums(threads);
    auto parallel = [&](const std::function<void(size_t, size_t, int)> & fn) {
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) {
            ts.emplace_back(fn, n*t/threads, n*(t + 1)/threads, t);
        }
        for (auto & t : ts) {
            t.join();
        }
    };
    parallel([&](size_t i0, size_t i1, int) { for (size_t i = i0; i < i1; ++i) { a[i] = i; } });
    const double s = best_seconds(reps, [&] {
        parallel([&](size_t i0, size_t i1, int t) {
            uint64_t x = 0;
            for (size_t i = i0; i < i1; ++i) {
                x += a[i];
            }
            sums[t] = x;
        });
    });
    return n*sizeof(uint64_t)/s;
}

static py::dict measure_bandwidth(const std::string & device, size_t mib, int reps, int threads) {
    if (mib == 0 || reps < 1 || threads < 1) {
        throw std::invalid_argument("measure_bandwidth: need mib > 0, reps >= 1, threads >= 1");
    }
    const size_t bytes = mib << 20;
    py::dict out;
    double host = 0.0, dev_copy = 0.0, h2d = 0.0;
    {
        py::gil_scoped_release release;
        host = host_read_bandwidth(bytes, reps, threads);
        if (!device.empty()) {
            ggml_backend_dev_t dev = ggml_backend_dev_by_name(device.c_str());
            if (!dev) {
                py::gil_scoped_acquire acquire;
                throw std::invalid_argument("measure_bandwidth: no device named '" + device + "'");
            }
            ggml_init_params ip = { 2*ggml_tensor_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            ggml_tensor * a = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
            ggml_tensor * b = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
            ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
            ggml_backend_buffer_t pinned = buf && host_buft ? ggml_backend_buft_alloc_buffer(host_buft, bytes) : nullptr;
            if (buf) {
                ggml_backend_tensor_copy(a, b); // first touch
                dev_copy = 2.0*bytes/best_seconds(reps, [&] { ggml_backend_tensor_copy(a, b); });
                if (pinned) {
                    void * p = ggml_backend_buffer_get_base(pinned);
                    memset(p, 1, bytes);
                    h2d = bytes/best_seconds(reps, [&] { ggml_backend_tensor_set(a, p, 0, bytes); });
                }
            }
            if (pinned) {
                ggml_backend_buffer_free(pinned);
            }
            if (buf) {
                ggml_backend_buffer_free(buf);
            }
            ggml_free(ctx);
        }
    }
    out["host_read"] = host;
    out["device_copy"] = dev_copy;
    out["host_to_device"] = h2d;
    return out;
}

PYBIND11_MODULE(_core, mod) {
    mod.doc() = "moecache native core: bindings over the patched llama.cpp (use the moecache package, not this module)";

    llama_log_set(log_callback, nullptr);
    llama_backend_init();

    // Errors with a Python class of their own live in moecache.api (importable without this module).
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const model_load_error & e) {
            py::object cls = py::module_::import("moecache.api").attr("ModelLoadError");
            PyErr_SetString(cls.ptr(), e.what());
        } catch (const out_of_memory_error & e) {
            py::object cls = py::module_::import("moecache.api").attr("OutOfMemoryError");
            PyErr_SetString(cls.ptr(), e.what());
        } catch (const unsupported_model_error & e) {
            py::object cls = py::module_::import("moecache.api").attr("MoecacheError");
            PyErr_SetString(cls.ptr(), e.what());
        }
    });

    mod.def("system_info", []() { return std::string(llama_print_system_info()); });
    mod.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); });
    mod.def("supports_mmap", []() { return llama_supports_mmap(); });
    mod.def("supports_mlock", []() { return llama_supports_mlock(); });
    mod.def("have_gpu", &have_gpu, "whether a GPU (dedicated or integrated) device is registered");

    mod.def("devices", []() {
        py::list out;
        for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            ggml_backend_dev_props props;
            ggml_backend_dev_get_props(dev, &props);
            py::dict d;
            d["name"] = std::string(props.name ? props.name : "");
            d["description"] = std::string(props.description ? props.description : "");
            d["type"] = std::string(dev_type_name(props.type));
            d["memory_free"] = (uint64_t) props.memory_free;
            d["memory_total"] = (uint64_t) props.memory_total;
            d["device_id"] = props.device_id ? py::object(py::str(props.device_id)) : py::object(py::none());
            d["host_buffer"] = props.caps.host_buffer;
            out.append(d);
        }
        return out;
    });

    mod.def("measure_bandwidth", &measure_bandwidth, py::arg("device") = "", py::arg("mib") = 1024,
            py::arg("reps") = 3, py::arg("threads") = 1,
            "bytes per second: host_read (threads reading host memory), device_copy (a copy within the device's "
            "memory, read and write counted) and host_to_device (from pinned host memory); 0 where not measured");

    mod.def("buffer_types", []() {
        std::vector<std::string> names;
        for (const auto & it : buffer_types_by_name()) {
            names.push_back(it.first);
        }
        return names;
    }, "names a tensor override may use (every device's buffer type and pinned host type)");

    mod.def("log_tail", [](size_t n) { return log_lines_since(0, n); }, py::arg("n") = 40,
            "the last n lines llama.cpp logged (debug lines excluded)");

    mod.def("gguf_arch", &read_gguf_arch, py::arg("path"), "general.architecture of a GGUF file (header only)");

    py::class_<model_handle, std::shared_ptr<model_handle>>(mod, "Model")
        .def(py::init(&load_model), py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("n_cpu_moe") = 0,
             py::arg("cpu_moe") = false, py::arg("tensor_overrides") = std::vector<std::pair<std::string, std::string>>(), py::arg("use_mmap") = true,
             py::arg("use_mlock") = false, py::arg("pinned") = false, py::arg("repack") = true,
             py::arg("verbose") = false, py::arg("hugepages") = false)
        .def_readonly("path", &model_handle::path)
        .def_readonly("arch", &model_handle::arch)
        .def_property_readonly("n_layer", [](const model_handle & m) { return llama_model_n_layer(m.model); })
        .def_property_readonly("n_embd", [](const model_handle & m) { return llama_model_n_embd(m.model); })
        .def_property_readonly("n_ctx_train", [](const model_handle & m) { return llama_model_n_ctx_train(m.model); })
        .def_property_readonly("n_vocab", [](const model_handle & m) { return llama_vocab_n_tokens(m.vocab); })
        .def_property_readonly("n_params", [](const model_handle & m) { return llama_model_n_params(m.model); })
        .def_property_readonly("size", [](const model_handle & m) { return llama_model_size(m.model); })
        .def_property_readonly("desc", [](const model_handle & m) {
            char buf[256];
            const int32_t n = llama_model_desc(m.model, buf, sizeof(buf));
            return std::string(buf, std::max(0, std::min(n, (int32_t) sizeof(buf) - 1)));
        })
        .def_property_readonly("bos", [](const model_handle & m) { return llama_vocab_bos(m.vocab); })
        .def_property_readonly("eos", [](const model_handle & m) { return llama_vocab_eos(m.vocab); })
        .def("is_eog", [](const model_handle & m, llama_token t) { return llama_vocab_is_eog(m.vocab, t); })
        .def("metadata", [](const model_handle & m) {
            py::dict out;
            const int32_t n = llama_model_meta_count(m.model);
            std::vector<char> key(512), val(4096);
            for (int32_t i = 0; i < n; i++) {
                int32_t nk = llama_model_meta_key_by_index(m.model, i, key.data(), key.size());
                if (nk < 0) {
                    continue;
                }
                if ((size_t) nk >= key.size()) {
                    key.resize(nk + 1);
                    nk = llama_model_meta_key_by_index(m.model, i, key.data(), key.size());
                }
                int32_t nv = llama_model_meta_val_str_by_index(m.model, i, val.data(), val.size());
                if (nv < 0) {
                    continue;
                }
                if ((size_t) nv >= val.size()) {
                    val.resize(nv + 1);
                    nv = llama_model_meta_val_str_by_index(m.model, i, val.data(), val.size());
                }
                // values are not always valid UTF-8 (binary strings in some GGUFs): replace, do not fail
                auto k = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(key.data(), nk, "replace"));
                auto v = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(val.data(), nv, "replace"));
                if (!k || !v) {
                    throw py::error_already_set();
                }
                out[k] = v;
            }
            return out;
        })
        .def("meta", [](const model_handle & m, const std::string & key) { return meta_string(m.model, key); }, py::arg("key"), "one metadata value as a string ('' when missing)")
        .def("tokenize", [](const model_handle & m, const std::string & text, bool add_special, bool parse_special) {
            return tokenize(m, text, add_special, parse_special);
        }, py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = true)
        .def("detokenize", [](const model_handle & m, const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) {
            return py::bytes(detokenize(m, tokens, remove_special, unparse_special));
        }, py::arg("tokens"), py::arg("remove_special") = false, py::arg("unparse_special") = false)
        .def("token_to_piece", [](const model_handle & m, llama_token t, bool special) {
            check_token(m, t);
            return py::bytes(token_piece(m, t, special));
        }, py::arg("token"), py::arg("special") = false);

    py::class_<context_handle, std::shared_ptr<context_handle>>(mod, "Context")
        .def(py::init(&make_context), py::arg("model"), py::arg("n_ctx") = 4096, py::arg("n_batch") = 2048,
             py::arg("n_ubatch") = 512, py::arg("n_threads") = 4, py::arg("flash_attn") = "auto",
             py::arg("moe_cache_slots") = 0, py::arg("moe_cache_size_mib") = 0, py::arg("moe_cache_policy") = "freq",
             py::arg("moe_cache_rebalance_interval") = 40, py::arg("moe_cache_max_batch") = 8,
             py::arg("moe_cache_admit_misses") = 2, py::arg("moe_cache_admit_window") = 16,
             py::arg("moe_cache_max_uploads") = 2, py::arg("moe_cache_headroom_mib") = 512,
             py::arg("moe_cache_miss") = "cpu", py::arg("moe_cache_miss_auto_pct") = 25,
             py::arg("moe_cache_miss_split_pct") = 50,
             py::arg("moe_cache_warm_prompts") = false, py::arg("moe_cache_profile") = "",
             py::arg("moe_cache_slots_by_layer") = false, py::arg("prefill_ubatch") = 0, py::arg("prefill_min_tokens") = 1024,
             py::arg("prefill_swap_mode") = "transaction", py::arg("prefill_warm_restore") = true,
             py::arg("prefill_restore_wait_ms") = 0,
             py::arg("qsa_sparse") = false, py::arg("kq_mask_device") = false, py::arg("qsa_block_topk") = false,
             py::arg("pp_overrides") = false, py::arg("cpu_experts_flat") = false, py::arg("cpu_experts_x4") = false,
             py::arg("cpu_experts_overlap") = false)
        .def_property_readonly("n_ctx", [](const context_handle & c) { return llama_n_ctx(c.ctx); })
        .def_property_readonly("n_batch", [](const context_handle & c) { return llama_n_batch(c.ctx); })
        .def_property_readonly("n_ubatch", [](const context_handle & c) { return llama_n_ubatch(c.ctx); })
        .def_property_readonly("n_threads", [](context_handle & c) { return llama_n_threads(c.ctx); })
        .def("reset", [](context_handle & c) {
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(c.mutex);
            llama_memory_clear(llama_get_memory(c.ctx), true);
        })
        .def("generate", [](context_handle & c, const std::vector<llama_token> & prompt, int32_t max_tokens, float temperature,
                            uint32_t seed, int32_t top_k, float top_p, const std::vector<std::string> & stop,
                            int32_t n_probs) {
            generation_result r = generate(c, prompt, max_tokens, temperature, seed, top_k, top_p, stop, n_probs);
            py::dict d;
            d["tokens"] = r.tokens;
            d["text"] = py::bytes(r.text);
            d["finish_reason"] = r.finish_reason;
            d["prefill_tokens"] = r.prefill_tokens;
            d["prefill_s"] = r.prefill_s;
            d["decode_tokens"] = r.decode_tokens;
            d["decode_s"] = r.decode_s;
            d["prefill_ubatch"] = r.prefill_ubatch;
            d["prefill_swap_ms"] = r.prefill_swap_ms;
            d["top_logprobs"] = r.top_logprobs;
            return d;
        }, py::arg("prompt"), py::arg("max_tokens") = 128, py::arg("temperature") = 0.0f, py::arg("seed") = 0,
           py::arg("top_k") = 40, py::arg("top_p") = 0.95f, py::arg("stop") = std::vector<std::string>(),
           py::arg("n_probs") = 0)
        .def("trace_routing", &trace_routing, py::arg("tokens"),
             "(ids [n_tokens, n_moe_layers, n_expert_used] int32, the layer index of each column)")
        .def("moe_cache_enabled", [](const context_handle & c) { return llama_moe_cache_enabled(c.ctx); },
             "whether the context has a hot-expert cache with at least one cached layer")
        .def("moe_cache_stats", &moe_cache_stats, py::arg("layer") = -1,
             "stats of one cached layer, or of all of them with layer=-1 (ValueError when there is no cache there)")
        .def("moe_cache_layer_reason", &moe_cache_layer_reason, py::arg("layer"),
             "why the layer has no cache, or None when it has one")
        .def("moe_cache_resident", &moe_cache_resident, py::arg("layer"), "the experts published in the layer's slots")
        .def("moe_cache_reset_stats", [](context_handle & c) {
            with_context_locked(c, [&]() { llama_moe_cache_reset_stats(c.ctx); });
        })
        .def("moe_cache_pin", &moe_cache_pin, py::arg("layer"), py::arg("expert"),
             "keep an expert resident in a layer (uploaded at the next step, never evicted)")
        .def("moe_cache_rebalance", [](context_handle & c) {
            with_context_locked(c, [&]() { llama_moe_cache_rebalance(c.ctx); });
        }, "run the policy now, wait for the uploads and publish them")
        .def("prefill_swap_stats", [](context_handle & c) {
            llama_prefill_swap_stats st{};
            with_context_locked(c, [&]() { llama_prefill_swap_get_stats(c.ctx, &st); });
            static const char * steps[LLAMA_PREFILL_SWAP_STEP_COUNT] = { "reserve", "restore", "banks", "upload" };
            static const char * skips[LLAMA_PREFILL_SWAP_SKIP_COUNT] = { "short", "others_generating", "bypass" };
            py::dict failed, skipped;
            for (int i = 0; i < LLAMA_PREFILL_SWAP_STEP_COUNT; ++i) {
                failed[steps[i]] = st.n_failed[i];
            }
            for (int i = 0; i < LLAMA_PREFILL_SWAP_SKIP_COUNT; ++i) {
                skipped[skips[i]] = st.n_skipped[i];
            }
            const uint64_t routed = st.after_restore_hits + st.after_restore_misses;
            py::dict d;
            d["n_ubatch"] = st.n_ubatch;
            d["n_ubatch_last"] = st.n_ubatch_last;
            d["swaps"] = st.n_swaps;
            d["skipped"] = skipped;
            d["failed"] = failed;
            d["release_ms"] = st.ms_release;
            d["reserve_ms"] = st.ms_reserve;
            d["restore_ms"] = st.ms_restore;
            d["total_ms"] = st.ms_total;
            d["bytes_released"] = st.bytes_released;
            d["bytes_restored"] = st.bytes_restored;
            d["n_slots"] = st.n_slots;
            d["warm_uploads"] = st.warm_uploads;
            d["warm_dropped"] = st.warm_dropped;
            d["partial"] = st.n_partial;
            d["partial_fallbacks"] = st.n_partial_fallbacks;
            d["bytes_kept"] = st.bytes_kept;
            d["after_restore_tokens"] = st.after_restore_tokens;
            d["after_restore_hits"] = st.after_restore_hits;
            d["after_restore_misses"] = st.after_restore_misses;
            d["after_restore_hit_rate"] = routed > 0 ? (double) st.after_restore_hits / routed : 0.0;
            return d;
        }, "the prefill-phase swap's counters and the parts of the last swap")
        .def("moe_cache_stats_json", &moe_cache_stats_json, "all stats as JSON text (total, per layer, configuration)")
        .def("record_routing", &record_routing, py::arg("path"),
             "write the routed experts of accepted tokens as JSONL into path; None stops");

    // the hot-expert cache's residency policy of one layer (the library's own, through llama-moe.h),
    // for replaying routing traces offline
    py::class_<policy_handle>(mod, "LayerPolicy")
        .def(py::init([](int32_t n_expert, int32_t n_slots, const std::string & kind, int32_t interval,
                         int32_t admit_misses, int32_t admit_window, int32_t max_uploads) {
            if (kind != "freq" && kind != "lru") {
                throw std::invalid_argument("LayerPolicy: kind must be 'freq' or 'lru' (got '" + kind + "')");
            }
            llama_moe_policy_params p;
            p.n_expert = n_expert;
            p.n_slots = n_expert > 0 ? std::min(n_slots, n_expert) : n_slots;
            p.policy = kind == "lru" ? LLAMA_MOE_CACHE_POLICY_LRU : LLAMA_MOE_CACHE_POLICY_FREQ;
            p.rebalance_interval = interval;
            p.admit_misses = admit_misses;
            p.admit_window = admit_window;
            p.max_uploads = max_uploads;
            auto h = std::make_unique<policy_handle>();
            h->p = llama_moe_policy_init(&p);
            if (!h->p) {
                throw std::invalid_argument("LayerPolicy: n_expert > 0, n_slots >= 0, the others >= 1");
            }
            h->n_expert = n_expert;
            h->n_slots = p.n_slots;
            return h;
        }), py::arg("n_expert"), py::arg("n_slots"), py::arg("kind") = "freq", py::arg("interval") = 40,
            py::arg("admit_misses") = 2, py::arg("admit_window") = 16, py::arg("max_uploads") = 2)
        .def("observe", [](policy_handle & h, const std::vector<int32_t> & ids) {
            llama_moe_policy_observe(h.p, ids.data(), (int32_t) ids.size());
        }, py::arg("ids"), "the routed experts of one accepted token")
        .def("plan", [](policy_handle & h, bool force) {
            std::vector<int32_t> slots((size_t) std::max(h.n_slots, 1)), experts(slots.size());
            int32_t n = llama_moe_policy_plan(h.p, force, slots.data(), experts.data(), (int32_t) slots.size());
            while (n < 0) { // more uploads than the buffers hold (a plan never exceeds the slots, but be safe)
                slots.resize(slots.size() * 2);
                experts.resize(slots.size());
                n = llama_moe_policy_plan(h.p, force, slots.data(), experts.data(), (int32_t) slots.size());
            }
            std::vector<std::pair<int32_t, int32_t>> r;
            for (int32_t i = 0; i < n; i++) {
                r.emplace_back(slots[i], experts[i]);
            }
            return r;
        }, py::arg("force") = false, "this step's uploads as (slot, expert); their slots are busy until done()")
        .def("done", [](policy_handle & h, int32_t slot, bool ok) {
            check_index("slot", slot, h.n_slots);
            llama_moe_policy_done(h.p, slot, ok);
        }, py::arg("slot"), py::arg("ok") = true)
        .def("pin", [](policy_handle & h, int32_t expert) {
            check_index("expert", expert, h.n_expert);
            return llama_moe_policy_pin(h.p, expert);
        }, py::arg("expert"))
        .def("slot_of", [](const policy_handle & h, int32_t expert) {
            check_index("expert", expert, h.n_expert);
            return llama_moe_policy_slot_of(h.p, expert);
        }, py::arg("expert"))
        .def("expert_in", [](const policy_handle & h, int32_t slot) {
            check_index("slot", slot, h.n_slots);
            return llama_moe_policy_expert_in(h.p, slot);
        }, py::arg("slot"))
        .def_property_readonly("rebalances", [](const policy_handle & h) { return llama_moe_policy_n_rebalances(h.p); });
}
