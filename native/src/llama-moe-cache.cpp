#include "llama-moe-cache.h"

#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-memory.h"
#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

static const char * moe_policy_name(llama_moe_cache_policy p) {
    return p == LLAMA_MOE_CACHE_POLICY_LRU ? "lru" : "freq";
}

// the library checks its parameters itself: the C API, the server and the Python module share them
static void check_params(const llama_moe_cache_params & p) {
    auto fail = [](const std::string & what) {
        throw std::invalid_argument("moe cache: " + what);
    };
    auto at_least = [&](const char * name, int32_t v, int32_t lo) {
        if (v < lo) {
            fail(std::string(name) + " must be >= " + std::to_string(lo) + " (got " + std::to_string(v) + ")");
        }
    };
    at_least("n_slots", p.n_slots, 0);
    at_least("size_mib", p.size_mib, 0);
    at_least("rebalance_interval", p.rebalance_interval, 1);
    at_least("admit_misses", p.admit_misses, 1);
    at_least("admit_window", p.admit_window, 1);
    at_least("max_uploads", p.max_uploads, 1);
    at_least("headroom_mib", p.headroom_mib, 0);
    if (p.max_batch < 1 || p.max_batch > LLAMA_MOE_CACHE_MAX_BATCH) {
        fail("max_batch must be in 1.." + std::to_string(LLAMA_MOE_CACHE_MAX_BATCH) + " (got " + std::to_string(p.max_batch) + ")");
    }
    if (p.policy != LLAMA_MOE_CACHE_POLICY_FREQ && p.policy != LLAMA_MOE_CACHE_POLICY_LRU) {
        fail("unknown policy " + std::to_string((int) p.policy) + " (LLAMA_MOE_CACHE_POLICY_FREQ or _LRU)");
    }
    if (p.miss != LLAMA_MOE_CACHE_MISS_CPU && p.miss != LLAMA_MOE_CACHE_MISS_DEVICE && p.miss != LLAMA_MOE_CACHE_MISS_AUTO &&
            p.miss != LLAMA_MOE_CACHE_MISS_SPLIT) {
        fail("unknown miss " + std::to_string((int) p.miss) + " (LLAMA_MOE_CACHE_MISS_CPU, _DEVICE, _AUTO or _SPLIT)");
    }
    if (p.miss_auto_pct < 0 || p.miss_auto_pct > 100) {
        fail("miss_auto_pct must be in 0..100 (got " + std::to_string(p.miss_auto_pct) + ")");
    }
    if (p.miss_split_pct < 0 || p.miss_split_pct > 100) {
        fail("miss_split_pct must be in 0..100 (got " + std::to_string(p.miss_split_pct) + ")");
    }
    // an expert misses at most once per token, so more misses than the window holds never admit it
    if (p.policy == LLAMA_MOE_CACHE_POLICY_LRU && p.admit_misses > p.admit_window) {
        fail("admit_misses (" + std::to_string(p.admit_misses) + ") must not exceed admit_window (" +
             std::to_string(p.admit_window) + "): an expert misses at most once per token, it would never be admitted");
    }
}

// a test or comparison switch: unset gives the default, a number turns it on (non-zero) or off (0)
static bool env_switch(const char * name, bool dflt) {
    const char * v = getenv(name);
    return v ? atoi(v) != 0 : dflt;
}

// a test or comparison amount (ms, MiB): unset or empty gives 0 (or the default), a negative number 0
static int32_t env_count(const char * name) {
    const char * v = getenv(name);
    return v && v[0] ? std::max(0, atoi(v)) : 0;
}

static double env_mib(const char * name, double dflt) {
    const char * v = getenv(name);
    return v && v[0] ? std::max(0.0, std::strtod(v, nullptr)) : dflt;
}

// LLAMA_MOE_CACHE_FAIL=alloc,staging,reserve,upload,map[:N] (test-only): N = the Nth try fails, none = every one
static void parse_fail_env(int64_t & alloc, int64_t & staging, int64_t & reserve, int64_t & upload, int64_t & map,
        bool & profile) {
    const char * env = getenv("LLAMA_MOE_CACHE_FAIL");
    if (!env || !env[0]) {
        return;
    }
    std::string spec(env);
    size_t start = 0;
    while (start <= spec.size()) {
        const size_t end = std::min(spec.find(',', start), spec.size());
        const std::string item = spec.substr(start, end - start);
        const size_t colon = item.find(':');
        const std::string name = item.substr(0, colon);
        const int64_t n = colon == std::string::npos ? -1 : std::atoll(item.c_str() + colon + 1);
        if (name == "alloc") {
            alloc = n;
        } else if (name == "staging") {
            staging = n;
        } else if (name == "reserve") {
            reserve = n;
        } else if (name == "upload") {
            upload = n;
        } else if (name == "map") {
            map = n;
        } else if (name == "profile") {
            profile = true;
        } else if (!name.empty()) {
            LLAMA_LOG_WARN("%s: LLAMA_MOE_CACHE_FAIL: unknown step '%s' (alloc, staging, reserve, upload, map[:N], profile)\n", __func__, name.c_str());
        }
        start = end + 1;
    }
    LLAMA_LOG_WARN("%s: test mode: LLAMA_MOE_CACHE_FAIL=%s\n", __func__, env);
}

llama_moe_cache::llama_moe_cache(const llama_model & model, const llama_moe_cache_params & p) : params(p) {
    check_params(params);
    const auto & hparams = model.hparams;

    n_exp = (int32_t) hparams.n_expert;
    layers.resize(model.layers.size());
    bool any_bias = false;
    for (const auto & ml : model.layers) {
        any_bias = any_bias || ml.ffn_up_exps_b || ml.ffn_gate_exps_b || ml.ffn_down_exps_b || ml.ffn_gate_up_exps_b;
    }
    map_rows = (any_bias ? 4 : 2) * (int32_t) layers.size();
    split_row0 = map_rows;
    if (params.miss == LLAMA_MOE_CACHE_MISS_SPLIT) {
        map_rows += (any_bias ? 2 : 1) * (int32_t) layers.size(); // the device's misses (and their bias ids)
    }
    maps_host.resize((size_t) std::max(n_exp, 1) * map_rows);
    for (size_t il = 0; il < layers.size(); ++il) {
        auto & l = layers[il];
        const auto & ml = model.layers[il];
        l.il     = (int32_t) il;
        l.n_used = il < hparams.n_layer_all ? (int32_t) hparams.n_expert_used((uint32_t) il) : 0;
        l.routed[0] = ml.ffn_up_exps;
        l.routed[1] = ml.ffn_gate_exps;
        l.routed[2] = ml.ffn_down_exps;
        l.routed[3] = ml.ffn_gate_up_exps;
        for (int32_t e = 0; e < n_exp; ++e) {
            maps_host[(2*il + 0)*n_exp + e] = -1;
            maps_host[(2*il + 1)*n_exp + e] = e;
            if (any_bias) {
                maps_host[(2*layers.size() + 2*il + 0)*n_exp + e] = n_exp;
                maps_host[(2*layers.size() + 2*il + 1)*n_exp + e] = e;
            }
            if (params.miss == LLAMA_MOE_CACHE_MISS_SPLIT) {
                maps_host[(split_row0 + il)*n_exp + e] = -1; // every miss on the CPU until the first split
                if (any_bias) {
                    maps_host[(split_row0 + layers.size() + il)*n_exp + e] = n_exp;
                }
            }
        }
        l.miss_dev.assign(std::max(n_exp, 0), 0);
    }

    // test-only switches: banks in host memory when a layer runs on the CPU (CI has no GPU), with an
    // optional size of that test device; a cache that never uploads (every expert a miss: the split
    // must then give the stock result); failures of a chosen step
    host_device = env_switch("LLAMA_MOE_CACHE_HOST_DEVICE", false);
    const char * env_host_mib = getenv("LLAMA_MOE_CACHE_HOST_DEVICE_MIB");
    host_device_mib = env_host_mib && env_host_mib[0] ? std::strtod(env_host_mib, nullptr) : -1.0;
    // LLAMA_MOE_CACHE_HOST_DEVICE_TAKEN_MIB=N: that test device has N MiB less free after the first allocation,
    // as a GPU that keeps what its first long prompt loaded (kernels, workspaces)
    host_device_taken_mib = env_mib("LLAMA_MOE_CACHE_HOST_DEVICE_TAKEN_MIB", 0.0);
    hold_empty = env_switch("LLAMA_MOE_CACHE_HOLD_EMPTY", false);
    // LLAMA_MOE_CACHE_UPLOAD_DELAY_MS=N: each upload takes N ms longer (a slow link, for tests of what waits for uploads)
    upload_delay_ms = env_count("LLAMA_MOE_CACHE_UPLOAD_DELAY_MS");
    // LLAMA_MOE_CACHE_SYNC_UPLOADS=1: a step waits for the uploads in flight, so what a step planned serves from
    // the next step on, however fast the link: on a GPU a hit and a miss round differently, and only then
    // are two runs bit for bit comparable
    sync_uploads = env_switch("LLAMA_MOE_CACHE_SYNC_UPLOADS", false);
    // with an expert profile, a warm restore ranks the experts by the prompt's routing plus what decode routed
    // before (the profile's counts): decode routes other experts than the prompt before it (on the calibrated
    // 30B routing, new prompts: 37% -> 38% hits at 24 of 128 slots, 70% -> 73% at 64; prompts seen before: 41%,
    // 76%). LLAMA_MOE_CACHE_WARM_BLEND=0: the prompt's routing alone, for comparison
    warm_blend = env_switch("LLAMA_MOE_CACHE_WARM_BLEND", true);
    warm_interleave = env_switch("LLAMA_MOE_CACHE_WARM_INTERLEAVE", true);
    // LLAMA_PREFILL_SWAP_PARTIAL=0: every prefill-phase swap frees all the banks (the partial release off)
    park_enabled = env_switch("LLAMA_PREFILL_SWAP_PARTIAL", true);
    // LLAMA_PREFILL_SWAP_RETARGET=0: a partial release's kept layers keep their experts (only empty slots warm)
    retarget_kept = env_switch("LLAMA_PREFILL_SWAP_RETARGET", true);
    // LLAMA_PREFILL_SWAP_PARK_MIB (test-only): a partial release frees at least this much per device (on a GPU
    // whose prompts take nothing of the banks' memory, it parks layers all the same)
    park_min_bytes = (size_t) (env_mib("LLAMA_PREFILL_SWAP_PARK_MIB", 0.0) * 1048576.0);
    assume_skip_ids = env_switch("LLAMA_MOE_CACHE_ASSUME_SKIP_IDS", false);
    // LLAMA_MOE_CACHE_TABLE=0: never one expert FFN (the two-branch graph, for comparison)
    use_tables = env_switch("LLAMA_MOE_CACHE_TABLE", true);
    // LLAMA_MOE_CACHE_READBACK_ALL=0: the routed ids of layers not cached read back per layer (for comparison)
    read_back_all = env_switch("LLAMA_MOE_CACHE_READBACK_ALL", true);
    // LLAMA_MOE_CACHE_DEVICE_MAPS=0: the maps as the graphs' input, as before (for comparison)
    device_maps = env_switch("LLAMA_MOE_CACHE_DEVICE_MAPS", true);
    // LLAMA_MOE_CACHE_MAPS_CHECK=1 (tests): after each flush, the device's maps read back and compared with the host's
    maps_check = env_switch("LLAMA_MOE_CACHE_MAPS_CHECK", false);
    parse_fail_env(fail_alloc_at, fail_staging_at, fail_reserve_at, fail_upload_at, fail_map_at, fail_profile);

    if (params.profile && params.profile[0]) {
        profile_path = params.profile;
        char buf[256];
        snprintf(buf, sizeof(buf), "%s %zu %d %" PRIu64 " %" PRIu64, llm_arch_name(model.arch), layers.size(), n_exp,
            (uint64_t) model.n_elements(), (uint64_t) model.size());
        fingerprint = buf;
        profile_counts.assign(layers.size() * (size_t) std::max(n_exp, 0), 0);
    }

    const bool wanted_any = params.n_slots > 0 || params.size_mib > 0;
    if (n_exp == 0) {
        for (auto & l : layers) {
            l.reason = "not a MoE model";
        }
        if (wanted_any) {
            LLAMA_LOG_WARN("%s: the model has no routed experts, the hot-expert cache is off\n", __func__);
        }
    } else if (!wanted_any) {
        for (auto & l : layers) {
            l.reason = "cache off";
        }
    } else {
        // which layers can be cached, and why the others cannot
        for (size_t il = 0; il < layers.size(); ++il) {
            auto & l = layers[il];
            const auto & ml = model.layers[il];

            ggml_tensor * first = ml.ffn_gate_up_exps ? ml.ffn_gate_up_exps : ml.ffn_up_exps;
            if (!ml.ffn_down_exps || !first) {
                l.reason = "no routed experts";
                continue;
            }
            if (il >= (size_t) hparams.n_layer()) {
                // its graph is the MTP draft's, in a context of its own: slots here would never serve
                l.reason = "an MTP (nextn) block: it runs in the draft's context";
                continue;
            }
            l.bias_src[0] = ml.ffn_up_exps_b; // null where the experts have none (l.biased())
            l.bias_src[1] = ml.ffn_gate_exps_b;
            l.bias_src[2] = ml.ffn_down_exps_b;
            l.bias_src[3] = ml.ffn_gate_up_exps_b;
            l.src[0] = first;
            l.src[1] = ml.ffn_gate_up_exps ? nullptr : ml.ffn_gate_exps;
            l.src[2] = ml.ffn_down_exps;
            l.dev    = model.dev_layer((int) il);

            for (ggml_tensor * t : l.src) {
                if (!t || !l.reason.empty()) {
                    continue;
                }
                if (!t->buffer) {
                    l.reason = "weights not allocated";
                } else if (!ggml_backend_buffer_is_host(t->buffer)) {
                    ggml_backend_dev_t d = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
                    l.reason = d && ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU
                        ? "experts repacked for the CPU (load with --no-repack to cache them)"
                        : "experts already in device memory";
                } else if (!ggml_is_contiguous(t) || t->ne[2] != n_exp) {
                    l.reason = "unexpected expert tensor layout";
                }
            }
            if (!l.reason.empty()) {
                continue;
            }
            if (ggml_backend_dev_type(l.dev) == GGML_BACKEND_DEVICE_TYPE_CPU && !host_device) {
                l.reason = "the layer runs on the CPU (no GPU to cache on)";
                continue;
            }
            // the hits run on the layer's device with skip ids (id < 0: a miss, computed on the CPU).
            // LLAMA_MOE_CACHE_ASSUME_SKIP_IDS=1 (tests): a device that cannot say is taken to (an rpc-server on
            // loopback, whose CPU backend does): several devices on one machine
            if (!ggml_backend_dev_supports_mul_mat_id_skip(l.dev) && !assume_skip_ids) {
                l.reason = std::string("the layer's device ") + ggml_backend_dev_name(l.dev) +
                    " does not implement MUL_MAT_ID skip ids (CPU and CUDA do)";
                continue;
            }
            for (ggml_tensor * t : l.src) {
                if (t) {
                    l.slot_bytes += t->nb[2];
                }
            }
            bytes_all += l.slot_bytes;
        }

        if (bytes_all == 0) {
            LLAMA_LOG_WARN("%s: no layer can use the hot-expert cache (layer 0: %s)\n", __func__, layers.empty() ? "-" : layers[0].reason.c_str());
        } else {
            // slots per layer: asked for, or what the MiB budget buys
            int64_t slots = params.n_slots > 0 ? params.n_slots : (int64_t) (((uint64_t) params.size_mib << 20) / bytes_all);
            if (slots > n_exp) {
                LLAMA_LOG_WARN("%s: %" PRId64 " slots asked for, the layers have %d experts: every expert fits, using %d slots\n",
                    __func__, slots, n_exp, n_exp);
                slots = n_exp;
            }
            wanted_slots = (int32_t) slots;
            if (wanted_slots == 0) {
                LLAMA_LOG_WARN("%s: %d MiB does not hold one slot per cached layer (%.1f MiB per slot over all layers): the hot-expert cache is off\n",
                    __func__, params.size_mib, bytes_all/1048576.0);
                for (auto & l : layers) {
                    if (l.reason.empty()) {
                        l.reason = "budget too small";
                    }
                }
            }
        }
    }

    // last: nothing after this can throw, so the file is never left open by a failed construction
    if (params.routing_trace && params.routing_trace[0]) {
        if (!set_trace(params.routing_trace)) {
            throw std::invalid_argument(std::string("moe cache: cannot open the routing trace file '") + params.routing_trace +
                "' for appending: " + strerror(errno));
        }
    }
}

llama_moe_cache::~llama_moe_cache() {
    stop();
}

void llama_moe_cache::stop(const char * why) {
    if (worker.joinable()) {
        {
            std::lock_guard<std::mutex> lock(mutex);
            stopping = true;
        }
        cv.notify_all();
        worker.join();
    }
    if (n_cached > 0) {
        disable(why);
    }
    staging_buf.reset();
    for (auto & l : layers) {
        free_banks(l);
        l.parked = false;
    }
    is_parking = false;
    bank_bytes.clear();
    for (auto & l : layers) {
        for (auto & t : l.mapped) {
            t = nullptr;
        }
        for (auto & t : l.table) {
            t = nullptr;
        }
        for (auto & t : l.bias_host) {
            t = nullptr;
        }
        l.table_dev    = -1;
        l.table_tokens = 0;
        l.ids_out = nullptr;
        l.readback = -1;
        l.maps = nullptr;
    }
    readbacks.clear();
    maps_dev.clear();
    tables.clear();
    aux_bufs.clear(); // unlocks the host pages of the mapped experts
    aux_ctxs.clear();
    aux_bytes.clear();
    aux_made = false;
}

bool llama_moe_cache::fail_now(int64_t at, int64_t n) {
    return at < 0 || (at > 0 && n == at);
}

bool llama_moe_cache::fail_reserve() {
    return fail_now(fail_reserve_at, 1);
}

void llama_moe_cache::disable(const std::string & why) {
    for (auto & l : layers) {
        if (l.cached()) {
            for (int32_t e = 0; e < n_exp; ++e) {
                if (l.published[e] >= 0) {
                    set_map(l.il, e, -1);
                }
            }
            l.policy.reset();
            l.reason = why;
        } else if (l.reason.empty()) {
            l.reason = why;
        }
        for (auto & b : l.bank) {
            b = nullptr;
        }
        for (auto & b : l.bias) {
            b = nullptr;
        }
    }
    n_cached = 0;
}

void llama_moe_cache::release_banks(const std::string & why) {
    disable(why);
    for (auto & l : layers) {
        free_banks(l);
        l.parked = false;
    }
    is_parking = false;
    bank_bytes.clear();
    n_slots = 0;
}

void llama_moe_cache::disable_layer(llama_moe_cache_layer & l, const std::string & why) {
    if (!l.cached()) {
        return;
    }
    // every expert of the layer a miss again: a graph that still splits the layer computes it all as misses (on
    // the CPU, the device, or both as the split's rows say)
    for (int32_t e = 0; e < n_exp; ++e) {
        if (l.published[e] >= 0) {
            set_map(l.il, e, -1);
        }
    }
    l.policy.reset();
    l.reason = why;
    n_cached--;
    LLAMA_LOG_WARN("%s: layer %d: %s; the layer takes the stock path from now on%s\n", __func__, l.il, why.c_str(),
        n_cached == 0 ? " (no cached layer is left: the hot-expert cache is off)" : "");
}

llama_moe_policy_config llama_moe_cache::policy_config(int32_t slots) const {
    llama_moe_policy_config pc;
    pc.n_expert     = n_exp;
    pc.n_slots      = slots;
    pc.kind         = params.policy == LLAMA_MOE_CACHE_POLICY_LRU ? LLAMA_MOE_POLICY_LRU : LLAMA_MOE_POLICY_FREQ;
    pc.interval     = params.rebalance_interval;
    pc.admit_misses = params.admit_misses;
    pc.admit_window = params.admit_window;
    pc.max_uploads  = params.max_uploads;
    return pc;
}

void llama_moe_cache::free_banks(llama_moe_cache_layer & l) {
    for (auto & b : l.bank) {
        b = nullptr;
    }
    for (auto & b : l.bias) {
        b = nullptr;
    }
    if (l.bank_buf) {
        auto & bytes = bank_bytes[ggml_backend_buffer_get_type(l.bank_buf.get())];
        bytes -= std::min(bytes, ggml_backend_buffer_get_size(l.bank_buf.get()));
    }
    l.bank_buf.reset();
    l.bank_ctx.reset();
}

bool llama_moe_cache::alloc_banks(const std::vector<size_t> & ils, bool inject_fail, const char * then) {
    // one context and buffer per layer: slot banks [ne0, ne1, l.n_slots] of the experts' types, the bias copies
    for (size_t i = 0; i < ils.size(); ++i) {
        auto & l = layers[ils[i]];
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(l.dev);
        ggml_init_params ip = { 7*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        if (!ctx) {
            LLAMA_LOG_ERROR("%s: cannot create the slot banks' tensor context: %s\n", __func__, then);
            for (size_t j = 0; j < i; ++j) {
                free_banks(layers[ils[j]]);
            }
            return false;
        }
        static const char * part[3] = { "up", "gate", "down" };
        for (int k = 0; k < 3; ++k) {
            if (l.src[k]) {
                l.bank[k] = ggml_new_tensor_3d(ctx.get(), l.src[k]->type, l.src[k]->ne[0], l.src[k]->ne[1], l.n_slots);
                ggml_format_name(l.bank[k], "moe_cache.blk.%d.%s", l.il, part[k]);
            }
        }
        static const char * bias_part[4] = { "up", "gate", "down", "gate_up" };
        for (int k = 0; k < 4; ++k) {
            if (l.bias_src[k]) {
                l.bias[k] = ggml_new_tensor_2d(ctx.get(), l.bias_src[k]->type, l.bias_src[k]->ne[0], n_exp + 1);
                ggml_format_name(l.bias[k], "moe_cache.blk.%d.%s.bias", l.il, bias_part[k]);
            }
        }
        const bool inject = inject_fail && i == 0;
        ggml_backend_buffer_t buf = inject ? nullptr : ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (!buf) {
            size_t need = 0;
            for (size_t j = i; j < ils.size(); ++j) {
                need += (size_t) layers[ils[j]].n_slots*layers[ils[j]].slot_bytes;
            }
            LLAMA_LOG_ERROR("%s: failed to allocate %.1f MiB of slot banks in %s%s: %s\n",
                __func__, need/1048576.0, ggml_backend_buft_name(buft), inject ? " (injected: LLAMA_MOE_CACHE_FAIL)" : "", then);
            for (auto & b : l.bank) {
                b = nullptr;
            }
            for (auto & b : l.bias) {
                b = nullptr;
            }
            for (size_t j = 0; j < i; ++j) {
                free_banks(layers[ils[j]]);
            }
            return false;
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0);
        // the biases are small (n_ff x n_expert per tensor): copied whole, once per allocation, in front of the
        // zero column (the buffer was cleared)
        std::vector<uint8_t> bias_data;
        for (int k = 0; k < 4; ++k) {
            if (l.bias[k]) {
                bias_data.resize(ggml_nbytes(l.bias_src[k]));
                ggml_backend_tensor_get(l.bias_src[k], bias_data.data(), 0, bias_data.size());
                ggml_backend_tensor_set(l.bias[k], bias_data.data(), 0, bias_data.size());
            }
        }
        bank_bytes[buft] += ggml_backend_buffer_get_size(buf);
        l.bank_buf.reset(buf);
        l.bank_ctx = std::move(ctx);
    }
    return true;
}

void llama_moe_cache::allocate(bool no_alloc, const std::map<ggml_backend_dev_t, size_t> & context_bytes) {
    if (wanted_slots <= 0 || n_cached > 0) {
        return;
    }
    if (no_alloc) {
        // a dry run (memory fitting): the banks take what is left after the fit, so they change nothing it decides
        LLAMA_LOG_INFO("%s: hot-expert cache: up to %d slots per layer, sized after the context from the memory left\n",
            __func__, wanted_slots);
        return;
    }

    // the profile's counts, before the first banks: they size the layers (slots_by_layer) and warm the slots
    if (!profile_path.empty() && !profile_read) {
        profile_ok = read_profile();
    }

    // slots per layer: the asked-for count, clamped to what each device has left after the model, the
    // context and its compute buffers, minus the headroom
    std::map<ggml_backend_dev_t, size_t> dev_bytes; // bytes per slot, per device
    for (const auto & [dev, per_slot] : slot_bytes_by_dev()) {
        dev_bytes[dev] = per_slot.first;
    }
    const size_t headroom = (size_t) params.headroom_mib << 20;
    int64_t slots = wanted_slots;
    for (const auto & [dev, per_slot] : dev_bytes) {
        size_t free = 0, total = 0;
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            if (host_device_mib < 0.0) {
                continue; // host memory: the experts are there already, the banks are a test device
            }
            const auto it = context_bytes.find(dev);
            size_t used = it == context_bytes.end() ? 0 : it->second;
            free = (size_t) (host_device_mib * 1048576.0);
            if (resuming) {
                used += (size_t) (host_device_taken_mib * 1048576.0);
            }
            free = free > used ? free - used : 0;
        } else {
            ggml_backend_dev_memory(dev, &free, &total);
        }
        // the headroom is there for what the backends allocate on first use and keep (CUDA loads a kernel
        // when it first runs, cuBLAS makes its workspace): a resume counts what the device lost since the
        // first allocation against it, down to half of it, so it gets back the slots a server without the
        // swap keeps
        size_t keep = headroom;
        if (!resuming) {
            free_first.emplace(dev, free);
        } else if (const auto it = free_first.find(dev); it != free_first.end() && it->second > free) {
            const size_t taken = it->second - free;
            keep -= std::min(taken, headroom / 2);
            LLAMA_LOG_DEBUG("%s: %s has %.1f MiB less free than at the cache's first allocation: %.1f MiB of the headroom kept free\n",
                __func__, ggml_backend_dev_name(dev), taken/1048576.0, keep/1048576.0);
        }
        const int64_t fit = free > keep ? (int64_t) ((free - keep) / per_slot) : 0;
        if (fit < slots) {
            // a resume (prefill-phase swap) says it once per prompt: at debug level
            llama_log_internal(resuming ? GGML_LOG_LEVEL_DEBUG : GGML_LOG_LEVEL_WARN, "%s: %" PRId64 " slots per layer need %.1f MiB on %s, which has %.1f MiB free after the model and the context "
                "(%.1f MiB kept free: --moe-cache-headroom): using %" PRId64 " slots\n",
                __func__, slots, slots*per_slot/1048576.0, ggml_backend_dev_name(dev), free/1048576.0, keep/1048576.0, fit);
            slots = fit;
        }
    }
    if (slots <= 0) {
        LLAMA_LOG_WARN("%s: the memory left does not hold one slot per cached layer: the hot-expert cache is off\n", __func__);
        disable("budget too small");
        return;
    }
    n_slots = (int32_t) slots;
    size_layers(slots);

    std::vector<size_t> ils;
    for (size_t il = 0; il < layers.size(); ++il) {
        if (layers[il].reason.empty() && layers[il].slot_bytes > 0) {
            ils.push_back(il);
        }
    }
    if (!alloc_banks(ils, fail_now(fail_alloc_at, ++n_allocs), "the hot-expert cache is off (lower --moe-cache-slots / "
            "--moe-cache-size, or raise --moe-cache-headroom)")) {
        release_banks("allocation failed");
        return;
    }
    for (size_t il : ils) {
        layers[il].parked = false;
    }
    is_parking = false;

    size_t max_tensor = 0;
    for (auto & l : layers) {
        if (!l.reason.empty() || l.slot_bytes == 0) {
            continue;
        }
        l.policy = std::make_unique<llama_moe_layer_policy>(policy_config(l.n_slots));
        l.published.assign(n_exp, -1);
        l.slot_published.assign(l.n_slots, -1);
        l.n_published = 0;
        l.complete    = false;
        if (l.recent_hits.size() != LLAMA_MOE_CACHE_RECENT) {
            l.recent_hits.assign(LLAMA_MOE_CACHE_RECENT, 0); // a resume keeps the window of before
        }
        for (ggml_tensor * t : l.src) {
            if (t) {
                max_tensor = std::max(max_tensor, (size_t) t->nb[2]);
            }
        }
        n_cached++;
    }
    if (!aux_made) {
        aux_made = true;
        make_host_biases();
        make_readbacks();
        if (device_maps) {
            make_device_maps();
        }
        if (params.miss != LLAMA_MOE_CACHE_MISS_CPU) {
            map_host_experts();
            if (use_tables && params.miss != LLAMA_MOE_CACHE_MISS_SPLIT) { // the tables serve every miss on the device
                make_tables();
            }
        }
    }
    // the tables hold the banks' addresses, which every allocation (a resume too) renews
    for (auto & l : layers) {
        if (l.cached() && l.table_dev >= 0) {
            for (int32_t e = 0; e < n_exp; ++e) {
                table_entry(l, e);
            }
        }
    }
    flush_tables();

    // pinned staging for uploads from pageable memory (mmap): the copy engine only overlaps from pinned
    // pages; without it the uploads copy directly, which is slower but still correct
    for (const auto & [dev, per_slot] : dev_bytes) {
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
        if (host_buft && !staging_buf) {
            const bool inject = fail_now(fail_staging_at, 1);
            staging_buf.reset(inject ? nullptr : ggml_backend_buft_alloc_buffer(host_buft, max_tensor));
            if (!staging_buf) {
                LLAMA_LOG_WARN("%s: cannot allocate %.1f MiB of pinned staging memory%s: uploads copy from pageable memory\n",
                    __func__, max_tensor/1048576.0, inject ? " (injected: LLAMA_MOE_CACHE_FAIL)" : "");
            }
        }
    }

    size_t total_bytes = 0;
    for (const auto & [buft, bytes] : bank_bytes) {
        total_bytes += bytes;
        if (!resuming) {
            LLAMA_LOG_INFO("%s: %10s slot banks = %8.2f MiB\n", __func__, ggml_backend_buft_name(buft), bytes/1048576.0);
        }
    }
    if (resuming) {
        LLAMA_LOG_DEBUG("%s: hot-expert cache resumed: %d slots per layer (%.1f MiB)\n", __func__, n_slots, total_bytes/1048576.0);
        if (!worker.joinable()) {
            worker = std::thread([this] { worker_main(); });
        }
        return;
    }
    if (host_device || hold_empty) {
        LLAMA_LOG_WARN("%s: test mode:%s%s\n", __func__, host_device ? " slot banks in host memory (LLAMA_MOE_CACHE_HOST_DEVICE)" : "",
            hold_empty ? " no uploads (LLAMA_MOE_CACHE_HOLD_EMPTY)" : "");
    }
    int32_t lo = INT32_MAX, hi = 0;
    for (const auto & l : layers) {
        if (l.cached()) {
            lo = std::min(lo, l.n_slots);
            hi = std::max(hi, l.n_slots);
        }
    }
    if (lo == hi) {
        LLAMA_LOG_INFO("%s: hot-expert cache: %d of %zu layers, %d slots of %d experts each (%.1f MiB), policy %s, batches up to %d tokens\n",
            __func__, n_cached, layers.size(), n_slots, n_exp, total_bytes/1048576.0, moe_policy_name(params.policy), params.max_batch);
    } else {
        LLAMA_LOG_INFO("%s: hot-expert cache: %d of %zu layers, %d-%d slots of %d experts a layer by the expert profile (%d on "
            "average; %.1f MiB), policy %s, batches up to %d tokens\n", __func__, n_cached, layers.size(), lo, hi, n_exp, n_slots,
            total_bytes/1048576.0, moe_policy_name(params.policy), params.max_batch);
    }
    for (const auto & l : layers) {
        if (!l.cached() && l.reason != "no routed experts") {
            LLAMA_LOG_INFO("%s: layer %d not cached: %s\n", __func__, l.il, l.reason.c_str());
        }
    }

    if (!worker.joinable()) {
        worker = std::thread([this] { worker_main(); });
    }
    if (!profile_path.empty() && n_cached > 0) {
        load_profile();
    }
}

static const char * moe_miss_name(llama_moe_cache_miss m) {
    return m == LLAMA_MOE_CACHE_MISS_DEVICE ? "device" : m == LLAMA_MOE_CACHE_MISS_AUTO ? "auto" :
           m == LLAMA_MOE_CACHE_MISS_SPLIT ? "split" : "cpu";
}

void llama_moe_cache::make_readbacks() {
    // one I32 tensor per device: each routed layer's ids [n_used * max_batch] in it, so one copy after the
    // graph reads them all, into pinned memory, without a wait. Not only the cached layers: a layer whose
    // experts are whole in VRAM, or on the CPU by -ncmoe, is still counted (profile, warm restore), and a
    // copy of its own into pageable memory cost a synchronous read per layer per token
    std::map<ggml_backend_buffer_type_t, std::vector<size_t>> by_buft;
    for (size_t il = 0; il < layers.size(); ++il) {
        const auto & l = layers[il];
        const bool on_device = l.dev && (ggml_backend_dev_type(l.dev) != GGML_BACKEND_DEVICE_TYPE_CPU || host_device);
        if (l.n_used > 0 && l.routed[2] && (l.cached() || (on_device && read_back_all))) {
            by_buft[ggml_backend_dev_buffer_type(l.dev)].push_back(il);
        }
    }
    for (auto & [buft, ils] : by_buft) {
        size_t n = 0;
        for (size_t il : ils) {
            n += (size_t) layers[il].n_used * params.max_batch;
        }
        ggml_init_params ip = { (ils.size() + 1)*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * all = ctx ? ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, (int64_t) n) : nullptr;
        if (!all) {
            continue;
        }
        ggml_set_name(all, "moe_cache.routed_ids");
        size_t off = 0;
        for (size_t il : ils) {
            auto & l = layers[il];
            l.ids_offset = off;
            l.ids_out = ggml_view_1d(ctx.get(), all, (int64_t) l.n_used*params.max_batch, off*sizeof(int32_t));
            off += (size_t) l.n_used*params.max_batch;
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        ggml_backend_buffer_type_t host_buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
        readback rb;
        rb.ids = all;
        if (buf && host_buft) {
            rb.host_buf.reset(ggml_backend_buft_alloc_buffer(host_buft, n*sizeof(int32_t)));
        }
        if (rb.host_buf) {
            rb.host = (int32_t *) ggml_backend_buffer_get_base(rb.host_buf.get());
        } else {
            rb.host_plain.resize(n);
            rb.host = rb.host_plain.data();
        }
        if (!buf) {
            // the graphs then read each layer's ids back on its own, as before
            LLAMA_LOG_WARN("%s: cannot allocate %.1f KiB for the routed ids in %s: they are read back per layer\n",
                __func__, n*sizeof(int32_t)/1024.0, ggml_backend_buft_name(buft));
            for (size_t il : ils) {
                layers[il].ids_out = nullptr;
            }
            continue;
        }
        aux_bytes[buft] += ggml_backend_buffer_get_size(buf);
        int n_cached_here = 0;
        for (size_t il : ils) {
            layers[il].readback = (int32_t) readbacks.size();
            n_cached_here += layers[il].cached() ? 1 : 0;
        }
        LLAMA_LOG_INFO("%s: the routed ids of %zu layers (%d cached) in %s are read back in one copy per step\n",
            __func__, ils.size(), n_cached_here, ggml_backend_buft_name(buft));
        readbacks.push_back(std::move(rb));
        aux_bufs.emplace_back(buf);
        aux_ctxs.push_back(std::move(ctx));
    }
}

void llama_moe_cache::make_host_biases() {
    // the biased layers' biases with the zero column, in host memory: the CPU's misses add them there
    // (the device copies would be copied back to the CPU at every step)
    std::vector<llama_moe_cache_layer *> biased;
    for (auto & l : layers) {
        if (l.cached() && l.biased()) {
            biased.push_back(&l);
        }
    }
    if (biased.empty()) {
        return;
    }
    ggml_init_params ip = { 4*biased.size()*ggml_tensor_overhead(), nullptr, true };
    ggml_context_ptr ctx(ggml_init(ip));
    if (!ctx) {
        return;
    }
    for (auto * l : biased) {
        for (int k = 0; k < 4; ++k) {
            if (l->bias_src[k]) {
                l->bias_host[k] = ggml_new_tensor_2d(ctx.get(), l->bias_src[k]->type, l->bias_src[k]->ne[0], n_exp + 1);
                ggml_format_name(l->bias_host[k], "moe_cache.blk.%d.bias_host.%d", l->il, k);
            }
        }
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
    if (!buf) {
        for (auto * l : biased) {
            for (auto & t : l->bias_host) {
                t = nullptr;
            }
            disable_layer(*l, "expert biases: no host memory for their copies");
        }
        return;
    }
    ggml_backend_buffer_clear(buf, 0);
    for (auto * l : biased) {
        for (int k = 0; k < 4; ++k) {
            if (l->bias_host[k]) {
                ggml_backend_tensor_get(l->bias_src[k], l->bias_host[k]->data, 0, ggml_nbytes(l->bias_src[k]));
            }
        }
    }
    aux_bytes[buft] += ggml_backend_buffer_get_size(buf);
    aux_bufs.emplace_back(buf);
    aux_ctxs.push_back(std::move(ctx));
}

void llama_moe_cache::map_host_experts() {
    const auto t0 = std::chrono::steady_clock::now();
    static const char * part[3] = { "up", "gate", "down" };

    // one mapping per device and host buffer, over the span of the cached layers' experts in it
    struct span {
        char * lo = nullptr;
        char * hi = nullptr;
        std::vector<std::pair<size_t, int>> members; // (layer, tensor)
    };
    std::map<std::pair<ggml_backend_dev_t, ggml_backend_buffer_t>, span> spans;
    int32_t n_rows_odd = 0;
    for (size_t il = 0; il < layers.size(); ++il) {
        auto & l = layers[il];
        if (!l.cached()) {
            continue;
        }
        // GPU kernels read quantized rows in tiles of 256 values: a shorter tail would read past the
        // host range (device buffers pad the last row; a host range cannot)
        const bool gpu = ggml_backend_dev_type(l.dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
        bool rows_ok = true;
        for (ggml_tensor * t : l.src) {
            rows_ok = rows_ok && (!gpu || !t || !ggml_is_quantized(t->type) || t->ne[0] % 256 == 0);
        }
        if (!rows_ok) {
            n_rows_odd++;
            continue;
        }
        for (int k = 0; k < 3; ++k) {
            ggml_tensor * t = l.src[k];
            if (!t) {
                continue;
            }
            auto & s = spans[{l.dev, t->buffer}];
            char * a = (char *) t->data;
            char * b = a + ggml_nbytes(t);
            s.lo = s.lo ? std::min(s.lo, a) : a;
            s.hi = s.hi ? std::max(s.hi, b) : b;
            s.members.push_back({il, k});
        }
    }
    if (n_rows_odd > 0) {
        LLAMA_LOG_WARN("%s: %d layers have expert rows that are not a multiple of 256 values: their misses stay on the CPU\n",
            __func__, n_rows_odd);
    }
    ggml_init_params ip = { 3*layers.size()*ggml_tensor_overhead(), nullptr, true };
    ggml_context_ptr ctx(ggml_init(ip));
    if (!ctx) {
        return;
    }
    size_t bytes = 0;
    for (auto & [key, s] : spans) {
        const bool inject = fail_now(fail_map_at, ++n_maps);
        ggml_backend_buffer_t buf = inject ? nullptr : ggml_backend_dev_host_mapped_buffer(key.first, s.lo, (size_t) (s.hi - s.lo));
        if (!buf) {
            LLAMA_LOG_WARN("%s: %s cannot read %.1f MiB of host experts in place%s: the misses of their layers stay on the CPU\n",
                __func__, ggml_backend_dev_name(key.first), (s.hi - s.lo)/1048576.0, inject ? " (injected: LLAMA_MOE_CACHE_FAIL)" : "");
            continue;
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        char * base = (char *) ggml_backend_buffer_get_base(buf);
        for (const auto & [il, k] : s.members) {
            ggml_tensor * src = layers[il].src[k];
            ggml_tensor * t = ggml_new_tensor(ctx.get(), src->type, GGML_MAX_DIMS, src->ne);
            ggml_format_name(t, "moe_cache.blk.%zu.%s.mapped", il, part[k]);
            // placed by hand: ggml_backend_tensor_alloc would add the device's row padding past the host range
            t->buffer = buf;
            t->data   = base + ((char *) src->data - s.lo);
            layers[il].mapped[k] = t;
        }
        bytes += (size_t) (s.hi - s.lo);
        aux_bufs.emplace_back(buf);
    }
    aux_ctxs.push_back(std::move(ctx));

    int32_t n_mapped = 0;
    for (auto & l : layers) {
        if (!l.cached()) {
            continue;
        }
        bool all = true;
        for (int k = 0; k < 3; ++k) {
            all = all && (!l.src[k] || l.mapped[k]);
        }
        if (!all) {
            for (auto & t : l.mapped) {
                t = nullptr;
            }
            continue;
        }
        l.src_pinned  = ggml_backend_dev_type(l.dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
        l.miss_device = params.miss == LLAMA_MOE_CACHE_MISS_DEVICE;
        n_mapped++;
    }
    routes_ver++;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    LLAMA_LOG_INFO("%s: hot-expert cache: misses %s: %d of %d cached layers can run them on their device "
        "(%.2f GiB of host experts mapped in %.2f s)\n", __func__, moe_miss_name(params.miss), n_mapped, n_cached,
        bytes/1073741824.0, s);
}

void llama_moe_cache::make_tables() {
    // which mapped layers' devices run a table op for 1.. tokens, over each of their expert tensors:
    // asked of the device itself
    std::map<ggml_backend_dev_t, std::vector<size_t>> by_dev;
    for (size_t il = 0; il < layers.size(); ++il) {
        auto & l = layers[il];
        if (!l.cached() || !l.mapped[0] || !l.mapped[2] || !ggml_backend_dev_supports_mul_mat_id_table(l.dev)) {
            continue;
        }
        ggml_init_params pp = { 16*ggml_tensor_overhead(), nullptr, true };
        int32_t tokens = 0;
        for (int32_t n = 1; n <= params.max_batch; ++n) {
            ggml_context_ptr pctx(ggml_init(pp));
            if (!pctx) {
                break;
            }
            bool ok = true;
            for (int k = 0; k < 3; ++k) {
                ggml_tensor * as = l.mapped[k];
                if (!as) {
                    continue;
                }
                ggml_tensor * b     = ggml_new_tensor_3d(pctx.get(), GGML_TYPE_F32, as->ne[0], k == 2 ? l.n_used : 1, n);
                ggml_tensor * ids   = ggml_new_tensor_2d(pctx.get(), GGML_TYPE_I32, l.n_used, n);
                ggml_tensor * table = ggml_new_tensor_1d(pctx.get(), GGML_TYPE_I64, as->ne[2]);
                ok = ok && ggml_backend_dev_supports_op(l.dev, ggml_mul_mat_id_table(pctx.get(), as, b, ids, table));
            }
            if (!ok) {
                break;
            }
            tokens = n;
        }
        if (tokens > 0) {
            l.table_tokens = tokens;
            by_dev[l.dev].push_back(il);
        }
    }
    // one I64 tensor per device: three tables of n_exp addresses per layer
    for (auto & [dev, ils] : by_dev) {
        ggml_init_params ip = { (3*ils.size() + 1)*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * all = ctx ? ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I64, 3*(int64_t) n_exp*ils.size()) : nullptr;
        if (!all) {
            continue;
        }
        ggml_set_name(all, "moe_cache.expert_tables");
        for (size_t i = 0; i < ils.size(); ++i) {
            auto & l = layers[ils[i]];
            l.table_offset = 3*i*(size_t) n_exp;
            for (int k = 0; k < 3; ++k) {
                if (l.mapped[k]) {
                    l.table[k] = ggml_view_1d(ctx.get(), all, n_exp, (l.table_offset + k*(size_t) n_exp)*sizeof(int64_t));
                }
            }
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        int32_t min_tokens = params.max_batch;
        for (size_t il : ils) {
            auto & l = layers[il];
            if (!buf) {
                for (auto & t : l.table) {
                    t = nullptr;
                }
                l.table_tokens = 0;
            } else {
                l.table_dev = (int32_t) tables.size();
                min_tokens = std::min(min_tokens, l.table_tokens);
            }
        }
        if (!buf) {
            LLAMA_LOG_WARN("%s: cannot allocate %.1f KiB for the expert tables in %s: hits and misses stay two branches\n",
                __func__, ggml_nbytes(all)/1024.0, ggml_backend_buft_name(buft));
            continue;
        }
        expert_tables et;
        et.all = all;
        et.host.assign((size_t) ggml_nelements(all), 0);
        tables.push_back(std::move(et));
        aux_bytes[buft] += ggml_backend_buffer_get_size(buf);
        aux_bufs.emplace_back(buf);
        aux_ctxs.push_back(std::move(ctx));
        LLAMA_LOG_INFO("%s: hot-expert cache: %zu layers on %s can run hits and misses in one expert FFN (batches up to %d tokens)\n",
            __func__, ils.size(), ggml_backend_dev_name(dev), min_tokens);
    }
}

void llama_moe_cache::table_entry(llama_moe_cache_layer & l, int32_t expert) {
    if (l.table_dev < 0) {
        return;
    }
    auto & et = tables[l.table_dev];
    const int32_t slot = l.published[expert];
    for (int k = 0; k < 3; ++k) {
        if (!l.table[k]) {
            continue;
        }
        const char * at = slot >= 0 && l.bank[k]
            ? (const char *) l.bank[k]->data + (size_t) slot*l.bank[k]->nb[2]
            : (const char *) l.mapped[k]->data + (size_t) expert*l.mapped[k]->nb[2];
        const size_t i = l.table_offset + k*(size_t) n_exp + expert;
        et.host[i] = (int64_t) (intptr_t) at;
        et.lo = std::min(et.lo, i);
        et.hi = std::max(et.hi, i + 1);
    }
}

void llama_moe_cache::flush_tables() {
    // between graphs (none reads the tables while they are written): one copy of the changed range
    // per device
    for (auto & et : tables) {
        if (et.lo < et.hi) {
            ggml_backend_tensor_set(et.all, et.host.data() + et.lo, et.lo*sizeof(int64_t), (et.hi - et.lo)*sizeof(int64_t));
            et.lo = SIZE_MAX;
            et.hi = 0;
        }
    }
    if (maps_lo < maps_hi) {
        for (ggml_tensor * m : maps_dev) {
            ggml_backend_tensor_set(m, maps_host.data() + maps_lo, maps_lo*sizeof(int32_t), (maps_hi - maps_lo)*sizeof(int32_t));
        }
        maps_lo = SIZE_MAX;
        maps_hi = 0;
    }
    if (maps_check) {
        std::vector<int32_t> dev(maps_host.size());
        for (ggml_tensor * m : maps_dev) {
            ggml_backend_tensor_get(m, dev.data(), 0, ggml_nbytes(m));
            if (dev != maps_host) {
                LLAMA_LOG_ERROR("%s: the maps in %s differ from the host's\n", __func__, ggml_backend_buffer_name(m->buffer));
            } else if (n_maps_checked++ == 0) {
                LLAMA_LOG_INFO("%s: the maps in %s equal the host's (LLAMA_MOE_CACHE_MAPS_CHECK)\n", __func__, ggml_backend_buffer_name(m->buffer));
            }
        }
    }
}

void llama_moe_cache::make_device_maps() {
    // the graphs read each cached layer's rows of the maps on its device: as an input, the scheduler copies
    // them to the device for every split that reads them (two views per layer, after each CPU split), so
    // they are kept there instead and changed between graphs (flush_tables), the few entries that changed
    std::map<ggml_backend_buffer_type_t, std::vector<size_t>> by_buft;
    for (size_t il = 0; il < layers.size(); ++il) {
        if (layers[il].cached() && layers[il].dev) {
            by_buft[ggml_backend_dev_buffer_type(layers[il].dev)].push_back(il);
        }
    }
    for (auto & [buft, ils] : by_buft) {
        ggml_init_params ip = { 2*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * m = ctx ? ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, n_exp, map_rows) : nullptr;
        if (!m) {
            continue;
        }
        ggml_set_name(m, "moe_cache.maps");
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (!buf) {
            LLAMA_LOG_WARN("%s: cannot allocate %.1f KiB for the maps in %s: the graphs take them as an input\n",
                __func__, ggml_nbytes(m)/1024.0, ggml_backend_buft_name(buft));
            continue;
        }
        ggml_backend_tensor_set(m, maps_host.data(), 0, ggml_nbytes(m));
        for (size_t il : ils) {
            layers[il].maps = m;
        }
        LLAMA_LOG_INFO("%s: the maps of %zu cached layers kept in %s\n", __func__, ils.size(), ggml_backend_buft_name(buft));
        maps_dev.push_back(m);
        aux_bytes[buft] += ggml_backend_buffer_get_size(buf);
        aux_bufs.emplace_back(buf);
        aux_ctxs.push_back(std::move(ctx));
    }
}

void llama_moe_cache::take_readbacks() {
    for (auto & ub : pending) {
        for (auto & pl : ub.layers) {
            if (pl.readback < 0) {
                continue;
            }
            const auto & rb = readbacks[pl.readback];
            const int32_t * from = rb.host + layers[pl.il].ids_offset;
            pl.ids.assign(from, from + (size_t) pl.n_used*pl.n_rows);
            pl.readback = -1;
        }
    }
    for (auto & rb : readbacks) {
        rb.busy = false;
    }
}

void llama_moe_cache::update_routes() {
    if (params.miss == LLAMA_MOE_CACHE_MISS_SPLIT) {
        // every 16 steps from the first: only the maps change (the graphs read them), no graph is rebuilt
        if (n_route_steps++ % 16 != 0) {
            return;
        }
        for (auto & l : layers) {
            if (l.cached()) {
                split_misses(l);
            }
        }
        return;
    }
    // every 16 steps: a move rebuilds the graph (and recaptures device graphs)
    if (params.miss != LLAMA_MOE_CACHE_MISS_AUTO || ++n_route_steps % 16 != 0) {
        return;
    }
    for (auto & l : layers) {
        if (!l.cached() || !l.mapped[0] || l.n_used <= 0) {
            continue;
        }
        const size_t n = (size_t) std::min<uint64_t>(l.recent_n, l.recent_hits.size());
        if (n < 16) {
            continue;
        }
        uint64_t hits = 0;
        for (size_t i = 0; i < n; ++i) {
            hits += l.recent_hits[i];
        }
        const double pct = 100.0*(1.0 - (double) hits/((double) n*l.n_used));
        // to the device at miss_auto_pct, back to the CPU 5 points above: a layer near the limit does not
        // move at every look
        const double limit = params.miss_auto_pct + (l.miss_device ? 5.0 : 0.0);
        const bool device = pct <= limit;
        if (device != l.miss_device) {
            l.miss_device = device;
            routes_ver++;
            n_route_switches++;
        }
    }
}

//
// graph side
//

bool llama_moe_cache::active_for(int64_t n_tokens, bool warmup) const {
    // while layers are parked for a swap's prompt, its graphs are the stock ones (as in a full suspension)
    return n_cached > 0 && !is_parking && !warmup && n_tokens <= params.max_batch;
}

bool llama_moe_cache::observing(int64_t n_tokens, bool warmup) const {
    // warm_prompts: a prompt's routing is read back while a slot is still empty
    return !warmup && (trace != nullptr || collecting || active_for(n_tokens, warmup) ||
        (params.warm_prompts && n_cached > 0 && !is_suspended && !is_parking && has_empty_slot()));
}

bool llama_moe_cache::is_routed(int32_t il, const ggml_tensor * up, const ggml_tensor * gate, const ggml_tensor * down,
        const ggml_tensor * gate_up) const {
    if (il < 0 || il >= (int32_t) layers.size()) {
        return false;
    }
    const auto & r = layers[il].routed;
    return down != nullptr && r[0] == up && r[1] == gate && r[2] == down && r[3] == gate_up;
}

ggml_tensor * llama_moe_cache::routed_ids_out(int32_t il, int64_t n_tokens) const {
    if (il < 0 || il >= (int32_t) layers.size() || n_tokens > params.max_batch) {
        return nullptr;
    }
    return layers[il].ids_out;
}

const llama_moe_cache_layer * llama_moe_cache::graph_layer(int32_t il, int64_t n_tokens, const ggml_tensor * up,
        const ggml_tensor * gate, const ggml_tensor * down, const ggml_tensor * gate_up) const {
    if (il < 0 || il >= (int32_t) layers.size() || n_cached == 0 || is_parking || n_tokens > params.max_batch) {
        return nullptr;
    }
    const auto & l = layers[il];
    if (!l.cached()) {
        return nullptr;
    }
    // the same tensors the banks were made for (not, e.g., the shared experts of the layer)
    const ggml_tensor * first = gate_up ? gate_up : up;
    if (l.src[0] != first || l.src[1] != (gate_up ? nullptr : gate) || l.src[2] != down) {
        return nullptr;
    }
    return &l;
}

//
// context side
//

void llama_moe_cache::after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch, bool warmup) {
    const int64_t n_tokens = ubatch.n_tokens;
    if (!warmup && (is_suspended || is_parking)) {
        prompt_max_ubatch = std::max(prompt_max_ubatch, n_tokens); // a swap's prompt (measure_prompt)
    }
    if (n_cached > 0 || is_suspended || is_parking) {
        if (warmup) {
            totals_extra.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_WARMUP]++;
        } else if (active_for(n_tokens, warmup)) {
            totals_extra.batches_cached++;
        } else {
            totals_extra.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_BATCH]++;
        }
    }
    if (!observing(n_tokens, warmup) || res->moe_ids.empty()) {
        return;
    }
    // a host copy that still holds an earlier ubatch's ids (several ubatches in one decode) is emptied
    // before this graph's ids are copied into it
    for (const auto & rb : readbacks) {
        if (rb.busy) {
            ggml_backend_sched_synchronize(sched);
            take_readbacks();
            break;
        }
    }
    pending.emplace_back();
    pending_ubatch & ub = pending.back();
    ub.cache_active = active_for(n_tokens, warmup);
    ub.seq.resize(n_tokens);
    ub.pos.resize(n_tokens);
    ub.out_row.resize(n_tokens);
    for (int64_t i = 0; i < n_tokens; ++i) {
        ub.seq[i] = ubatch.seq_id ? ubatch.seq_id[i][0] : 0;
        ub.pos[i] = ubatch.pos ? ubatch.pos[i] : (int32_t) i;
        ub.out_row[i] = !ubatch.output || ubatch.output[i] ? ub.n_out++ : -1;
    }
    ub.layers.reserve(res->moe_ids.size());
    std::vector<ggml_backend_t> rb_backend(readbacks.size(), nullptr);
    for (const auto & m : res->moe_ids) {
        const int32_t rb = m.readback ? layers[m.il].readback : -1;
        if (rb >= 0) {
            // in the device's routed-ids tensor: read with the others below
            ub.layers.push_back({m.il, (int32_t) m.ids->ne[0], m.split, {}, rb, m.ids->ne[1]});
            rb_backend[rb] = ggml_backend_sched_get_tensor_backend(sched, m.ids);
            continue;
        }
        ub.layers.push_back({m.il, (int32_t) m.ids->ne[0], m.split, std::vector<int32_t>(ggml_nelements(m.ids))});
        ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, m.ids);
        ggml_backend_tensor_get_async(backend, m.ids, ub.layers.back().ids.data(), 0, ggml_nbytes(m.ids));
    }
    // one copy per device (async: the next step synchronizes before it reads them)
    for (size_t r = 0; r < readbacks.size(); ++r) {
        if (rb_backend[r]) {
            auto & rb = readbacks[r];
            ggml_backend_tensor_get_async(rb_backend[r], rb.ids, rb.host, 0, ggml_nbytes(rb.ids));
            rb.busy = true;
        }
    }
}

void llama_moe_cache::count_token(const pending_ubatch & ub, size_t t) {
    if (ub.cache_active) {
        totals_extra.n_tokens++;
    }
    FILE * tf = trace.get();
    if (tf) {
        fprintf(tf, "{\"seq\":%d,\"pos\":%d,\"cached\":%s,\"layers\":{", ub.seq[t], ub.pos[t], ub.cache_active ? "true" : "false");
    }
    bool first = true;
    for (const auto & pl : ub.layers) {
        if (pl.n_used <= 0) {
            continue;
        }
        // the last layer of a graph runs only the output tokens' rows
        const size_t n_rows = pl.ids.size() / pl.n_used;
        const int64_t r = n_rows == ub.seq.size() ? (int64_t) t : (n_rows == (size_t) ub.n_out ? ub.out_row[t] : -1);
        if (r < 0) {
            continue;
        }
        const int32_t * row = pl.ids.data() + r*pl.n_used;
        if (tf) {
            fprintf(tf, "%s\"%d\":[", first ? "" : ",", pl.il);
            for (int32_t k = 0; k < pl.n_used; ++k) {
                fprintf(tf, "%s%d", k ? "," : "", row[k]);
            }
            fputc(']', tf);
            first = false;
        }
        auto & l = layers[pl.il];
        const bool warm_prompt = params.warm_prompts && !is_suspended && !is_parking && n_cached > 0;
        if ((collecting || warm_prompt) && !ub.cache_active && l.reason.empty()) {
            if (prompt_counts.empty()) {
                prompt_counts.assign(layers.size()*(size_t) n_exp, 0);
            }
            for (int32_t k = 0; k < pl.n_used; ++k) {
                if (row[k] >= 0 && row[k] < n_exp) {
                    prompt_counts[(size_t) pl.il*n_exp + row[k]]++;
                }
            }
        }
        if (!ub.cache_active || !l.cached()) {
            continue;
        }
        // hits only where the graph ran the layer's hits on its bank (an expert LoRA keeps the stock path)
        uint16_t hits = 0;
        for (int32_t k = 0; k < pl.n_used && pl.split; ++k) {
            const int32_t e = row[k];
            if (e >= 0 && e < n_exp && l.published[e] >= 0) {
                hits++;
            }
        }
        l.stats.n_tokens++;
        l.stats.hits   += hits;
        l.stats.misses += pl.n_used - hits;
        if (l.heat.size() != (size_t) n_exp) {
            l.heat.assign(n_exp, 0);
        }
        for (int32_t k = 0; k < pl.n_used; ++k) {
            if (row[k] >= 0 && row[k] < n_exp) {
                l.heat[row[k]]++;
            }
        }
        l.recent_hits[l.recent_pos] = hits;
        l.recent_pos = (l.recent_pos + 1) % l.recent_hits.size();
        l.recent_n++;
        l.policy->observe(row, pl.n_used);
        if (!profile_counts.empty()) {
            for (int32_t k = 0; k < pl.n_used; ++k) {
                if (row[k] >= 0 && row[k] < n_exp) {
                    profile_counts[(size_t) pl.il*n_exp + row[k]]++;
                }
            }
        }
        if (after_resume_left > 0) {
            after_resume_hits   += hits;
            after_resume_misses += pl.n_used - hits;
        }
    }
    if (ub.cache_active && after_resume_left > 0) {
        after_resume_left--;
        after_resume_tokens++;
    }
    if (tf) {
        fputs("}}\n", tf);
    }
}

void llama_moe_cache::commit(ggml_backend_sched_t sched, const llama_memory_i * memory) {
    if (pending.empty()) {
        return;
    }
    // the async reads of the routed ids must have landed
    ggml_backend_sched_synchronize(sched);
    take_readbacks();
    for (const auto & ub : pending) {
        for (size_t t = 0; t < ub.seq.size(); ++t) {
            // a token is accepted when the memory still holds its position: rejected draft tokens
            // were removed before this decode
            const bool accepted = memory == nullptr || memory->seq_pos_max(ub.seq[t]) >= ub.pos[t];
            if (accepted) {
                count_token(ub, t);
            }
        }
    }
    pending.clear();
    if (trace) {
        fflush(trace.get());
    }
    // warm_prompts: the prompt's most-routed experts into the empty slots before its tokens decode (a swap's
    // prompt is counted for the swap's own warm restore instead)
    if (params.warm_prompts && !collecting && !is_suspended && !is_parking && n_cached > 0 && !prompt_counts.empty()) {
        n_prompt_warm_uploads += queue_warm(warm_rank());
        prompt_counts.clear();
    }
}

void llama_moe_cache::set_map(int32_t il, int32_t expert, int32_t slot) {
    auto & l = layers[il];
    const int32_t old = l.published[expert];
    if (old >= 0) {
        l.slot_published[old] = -1;
    }
    l.published[expert] = slot;
    if (slot >= 0) {
        l.slot_published[slot] = expert;
    }
    l.n_published += (slot >= 0) - (old >= 0);
    if ((l.n_published == n_exp) != l.complete) {
        l.complete = !l.complete;
        routes_ver++;
    }
    const size_t at = (2*(size_t) il + 0)*n_exp + expert;
    maps_host[at] = slot;
    maps_lo = std::min(maps_lo, at);
    maps_hi = std::max(maps_hi, at + 1);
    if ((size_t) split_row0 > 2*layers.size()) {
        const size_t bat = (2*layers.size() + 2*(size_t) il + 0)*n_exp + expert;
        maps_host[bat] = slot >= 0 ? expert : n_exp;
        maps_hi = std::max(maps_hi, bat + 1);
    }
    set_miss_rows(il, expert);
    if (l.table_dev >= 0) {
        table_entry(l, expert);
    }
}

void llama_moe_cache::set_miss_rows(int32_t il, int32_t expert) {
    const auto & l = layers[il];
    const bool miss = l.published[expert] < 0;
    // split: a miss the device computes is in the split row, not the cold one (and its bias id likewise)
    const bool dev  = miss && params.miss == LLAMA_MOE_CACHE_MISS_SPLIT && l.miss_dev[expert];
    const bool cpu  = miss && !dev;
    const bool bias = (size_t) split_row0 > 2*layers.size();
    auto put = [&](size_t row, int32_t v) {
        const size_t at = row*n_exp + expert;
        maps_host[at] = v;
        maps_lo = std::min(maps_lo, at);
        maps_hi = std::max(maps_hi, at + 1);
    };
    put(2*(size_t) il + 1, cpu ? expert : -1);
    if (bias) {
        put(2*layers.size() + 2*(size_t) il + 1, cpu ? expert : n_exp);
    }
    if (params.miss == LLAMA_MOE_CACHE_MISS_SPLIT) {
        put((size_t) split_map_row(il), dev ? expert : -1);
        if (bias) {
            put((size_t) split_bias_row(il), dev ? expert : n_exp);
        }
    }
}

void llama_moe_cache::split_misses(llama_moe_cache_layer & l) {
    // the device takes the most-routed missed experts until they carry miss_split_pct % of the layer's routed
    // misses (by their heat since the stats were reset); the CPU the others. At 100 every miss goes to the device
    auto heat = [&](int32_t e) -> uint64_t { return e < (int32_t) l.heat.size() ? l.heat[e] : 0; };
    std::vector<int32_t> missed;
    uint64_t total = 0;
    for (int32_t e = 0; e < n_exp; ++e) {
        if (l.published[e] < 0) {
            missed.push_back(e);
            total += heat(e);
        }
    }
    std::stable_sort(missed.begin(), missed.end(), [&](int32_t a, int32_t b) { return heat(a) > heat(b); });
    std::vector<uint8_t> dev(n_exp, 0);
    const int32_t pct = l.mapped[0] ? params.miss_split_pct : 0;
    uint64_t taken = 0;
    for (int32_t e : missed) {
        if (pct >= 100 || (pct > 0 && total > 0 && heat(e) > 0 && 100*taken < (uint64_t) pct*total)) {
            dev[e] = 1;
            taken += heat(e);
        }
    }
    int32_t n_dev = 0;
    for (int32_t e = 0; e < n_exp; ++e) {
        n_dev += dev[e];
        if (dev[e] != l.miss_dev[e]) {
            l.miss_dev[e] = dev[e];
            set_miss_rows(l.il, e);
        }
    }
    l.n_miss_dev = n_dev;
}

void llama_moe_cache::publish_done() {
    std::vector<upload_job> done;
    {
        std::lock_guard<std::mutex> lock(mutex);
        done.swap(finished);
    }
    for (const auto & job : done) {
        auto & l = layers[job.il];
        if (!l.cached()) {
            continue; // the layer was turned off while the job ran
        }
        if (!job.ok) {
            n_warm_failed += job.warm ? 1 : 0;
            disable_layer(l, "upload of expert " + std::to_string(job.expert) + " into slot " + std::to_string(job.slot) +
                " failed (" + job.error + ")");
            continue;
        }
        l.policy->done(job.slot, true);
        if (l.policy->expert_in(job.slot) == job.expert) {
            set_map(job.il, job.expert, job.slot);
            l.stats.uploads++;
            l.stats.bytes_uploaded += l.slot_bytes;
        }
    }
}

void llama_moe_cache::plan_uploads(ggml_backend_sched_t sched, bool force) {
    if (hold_empty) {
        return;
    }
    // the cap follows the link: it doubles (up to 8x max_uploads) while the last step's uploads were
    // done before this step and a layer wanted more than the cap, and halves while uploads are in flight
    int32_t busy = 0;
    {
        std::lock_guard<std::mutex> lock(mutex);
        busy = in_flight;
    }
    if (busy > 0) {
        upload_boost = std::max(1, upload_boost/2);
    } else if (capped_last) {
        upload_boost = std::min(LLAMA_MOE_CACHE_UPLOAD_BOOST, upload_boost*2);
    }
    const int32_t cap = (int32_t) std::min<int64_t>((int64_t) params.max_uploads*upload_boost, INT32_MAX);
    capped_last = false;

    std::vector<upload_job> jobs;
    std::vector<llama_moe_upload> plan;
    for (auto & l : layers) {
        if (!l.cached()) {
            continue;
        }
        plan.clear();
        l.policy->plan(plan, force, cap);
        capped_last = capped_last || (!force && (int32_t) plan.size() >= cap); // a forced plan has no cap
        for (const auto & u : plan) {
            // unpublish what the slot held: the next graph computes that expert on the CPU
            const int32_t old = l.slot_published[u.slot];
            if (old >= 0) {
                set_map(l.il, old, -1);
                l.stats.evictions++;
            }
            jobs.push_back({l.il, u.slot, u.expert, false, {}});
        }
    }
    if (jobs.empty()) {
        return;
    }
    // no graph that still reads these slots may be running while they are overwritten
    ggml_backend_sched_synchronize(sched);
    {
        std::lock_guard<std::mutex> lock(mutex);
        for (auto & j : jobs) {
            queue.push_back(j);
        }
        in_flight += (int32_t) jobs.size();
    }
    cv.notify_all();
}

void llama_moe_cache::step(ggml_backend_sched_t sched, const llama_memory_i * memory) {
    if (n_cached == 0 && pending.empty()) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    commit(sched, memory);
    if (n_cached > 0 && !is_parking) {
        update_routes();
        if (sync_uploads) {
            std::unique_lock<std::mutex> lock(mutex);
            cv.wait(lock, [this] { return in_flight == 0; });
        }
        publish_done();
        plan_uploads(sched, false);
        flush_tables();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    totals_extra.step_ms_total += ms;
    n_steps++;
    totals_extra.step_ms_max = std::max(totals_extra.step_ms_max, ms);
}

void llama_moe_cache::rebalance(ggml_backend_sched_t sched, const llama_memory_i * memory) {
    commit(sched, memory);
    if (n_cached == 0 || is_parking) {
        return;
    }
    publish_done();
    plan_uploads(sched, true);
    {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [this] { return in_flight == 0; });
    }
    publish_done();
    flush_tables();
}

void llama_moe_cache::worker_main() {
    while (true) {
        upload_job job;
        {
            std::unique_lock<std::mutex> lock(mutex);
            cv.wait(lock, [this] { return stopping || !queue.empty(); });
            if (stopping) {
                return;
            }
            job = queue.front();
            queue.pop_front();
            running_il = job.il;
        }
        run_job(job);
        {
            std::lock_guard<std::mutex> lock(mutex);
            finished.push_back(job);
            in_flight--;
            running_il = -1;
        }
        cv.notify_all();
    }
}

void llama_moe_cache::run_job(upload_job & job) {
    job.ok = false;
    if (fail_now(fail_upload_at, ++n_uploads_tried)) {
        job.error = "injected: LLAMA_MOE_CACHE_FAIL";
        return;
    }
    if (fail_next_upload.exchange(false)) {
        job.error = "injected: LLAMA_PREFILL_SWAP_FAIL=upload";
        return;
    }
    if (upload_delay_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(upload_delay_ms));
    }
    const auto & l = layers[job.il];
    try {
        for (int k = 0; k < 3; ++k) {
            ggml_tensor * src = l.src[k];
            if (!src) {
                continue;
            }
            if (!src->data || !l.bank[k] || !l.bank[k]->buffer) {
                job.error = "no source data or bank";
                return;
            }
            const size_t nb = src->nb[2];
            const char * from = (const char *) src->data + (size_t) job.expert*nb;
            ggml_backend_buffer_t stage = staging_buf.get();
            const bool pinned_src = stage && (l.src_pinned || ggml_backend_buffer_get_type(src->buffer) == ggml_backend_buffer_get_type(stage));
            if (stage && !pinned_src && !ggml_backend_buffer_is_host(l.bank[k]->buffer)) {
                void * base = ggml_backend_buffer_get_base(stage);
                memcpy(base, from, nb);
                from = (const char *) base;
            }
            ggml_backend_tensor_set(l.bank[k], from, (size_t) job.slot*nb, nb);
        }
    } catch (const std::exception & e) {
        job.error = e.what();
        return;
    }
    job.ok = true;
}

//
// prefill-phase swap
//

size_t llama_moe_cache::release_layer(llama_moe_cache_layer & l) {
    if (l.cached()) {
        for (int32_t e = 0; e < n_exp; ++e) {
            if (l.published[e] >= 0) {
                set_map(l.il, e, -1);
            }
        }
        l.stats.rebalances += l.policy->n_rebalances(); // its next allocation starts a new policy
        l.pins.clear();
        for (int32_t e = 0; e < n_exp; ++e) {
            if (l.policy->is_pinned(e)) {
                l.pins.push_back(e);
            }
        }
        l.policy.reset(); // the layer stays eligible: its reason stays empty
    }
    if (!l.bank_buf) {
        return 0; // parked before, or never cached (a layer without routed experts has no device here)
    }
    const size_t b = ggml_backend_buffer_get_size(l.bank_buf.get());
    freed_for_prompt[l.dev] += b;
    free_banks(l);
    return b;
}

uint64_t llama_moe_cache::drop_uploads(const std::vector<bool> & drop) {
    std::vector<upload_job> dropped;
    {
        std::unique_lock<std::mutex> lock(mutex);
        std::deque<upload_job> rest;
        for (auto & job : queue) {
            if (drop[job.il]) {
                dropped.push_back(job);
            } else {
                rest.push_back(job);
            }
        }
        queue.swap(rest);
        in_flight -= (int32_t) dropped.size();
        cv.wait(lock, [&] { return running_il < 0 || !drop[running_il]; });
    }
    uint64_t warm = 0;
    for (const auto & job : dropped) {
        warm += job.warm ? 1 : 0;
        auto & l = layers[job.il];
        if (l.cached()) {
            l.policy->done(job.slot, false); // the slot stays empty (it was unpublished when the copy was planned)
        }
    }
    n_warm_dropped += warm;
    if (warm > 0) {
        fail_next_upload = false; // an injected failure meant for a dropped warm upload
    }
    return warm;
}

size_t llama_moe_cache::suspend(bool collect_routing) {
    // only a cache that can come back collects (a cache that is off would keep observing every batch)
    collecting = collect_routing && (n_cached > 0 || is_suspended || is_parking);
    if (collecting) {
        prompt_counts.assign(layers.size()*(size_t) n_exp, 0);
    }
    if (n_cached == 0 && !is_parking) {
        return 0;
    }
    // no copy may still write into a bank that is freed. Copies not started are dropped, not waited for:
    // the banks and the policies that planned them go now. A prompt that comes right after a restore then
    // does not wait for that restore's warm uploads (seconds of copies on a slow link).
    drop_uploads(std::vector<bool>(layers.size(), true));
    // the copies made are published (counted, a failed one turns its layer off) and unpublished below
    publish_done();
    if (!is_parking) {
        freed_for_prompt.clear();
    }
    size_t bytes = 0;
    for (auto & l : layers) {
        l.parked = false; // a parked layer's banks went at park(); it comes back with the others
        bytes += release_layer(l);
    }
    bank_bytes.clear();
    resume_slots = std::max(resume_slots, n_slots);
    n_slots      = 0;
    n_cached     = 0;
    is_suspended = true;
    is_parking   = false;
    kept_bytes   = 0;
    after_resume_left = 0;
    return bytes;
}

bool llama_moe_cache::can_park(int64_t max_ubatch) const {
    // a cache below the slots it had (a restore that did not fit them) is sized again by a full release; a prompt
    // of larger ubatches than the measured ones frees everything (and measures)
    if (!park_enabled || is_suspended || is_parking || n_cached == 0 || prompt_need.empty() || n_slots < resume_slots ||
            max_ubatch > measured_ubatch) {
        return false;
    }
    for (const auto & l : layers) {
        if (l.cached() && prompt_need.find(l.dev) == prompt_need.end()) {
            return false; // a device no swap measured
        }
    }
    return true;
}

size_t llama_moe_cache::n_parked_layers() const {
    size_t n = 0;
    for (const auto & l : layers) {
        n += l.parked ? 1 : 0;
    }
    return n;
}

size_t llama_moe_cache::park(bool collect_routing, int64_t max_ubatch) {
    if (!can_park(max_ubatch)) {
        return 0;
    }
    collecting = collect_routing;
    if (collecting) {
        prompt_counts.assign(layers.size()*(size_t) n_exp, 0);
    }
    // per device: the measured need plus the headroom, from the last layer back
    const size_t headroom = (size_t) params.headroom_mib << 20;
    std::map<ggml_backend_dev_t, size_t> want, got;
    for (const auto & [dev, need] : prompt_need) {
        // the prompt leaves the headroom free, as the banks did: a need below zero is memory it left free
        const int64_t bytes = std::max(need + (int64_t) headroom, (int64_t) park_min_bytes);
        want[dev] = bytes > 0 ? (size_t) bytes : 0;
    }
    std::vector<bool> chosen(layers.size(), false);
    for (size_t i = layers.size(); i-- > 0;) {
        const auto & l = layers[i];
        if (l.cached() && got[l.dev] < want[l.dev]) {
            chosen[i] = true;
            got[l.dev] += l.bank_buf ? ggml_backend_buffer_get_size(l.bank_buf.get()) : 0;
        }
    }
    // the kept layers' queued copies are dropped too: they would share the link with the prompt's weights
    drop_uploads(std::vector<bool>(layers.size(), true));
    publish_done();
    freed_for_prompt.clear();
    size_t bytes = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
        auto & l = layers[i];
        // a layer a failed copy turned off (published just now, or before) loses its buffer and stays off
        if (!l.cached() || chosen[i]) {
            const bool parks = l.cached();
            const size_t b = release_layer(l);
            bytes += b;
            if (parks) {
                l.parked_bytes = b;
                l.parked = true;
                n_cached--;
            }
        }
    }
    for (const auto & [dev, need] : prompt_need) {
        freed_for_prompt[dev] += 0; // a device that parked nothing is measured too
    }
    flush_tables();
    routes_ver++;
    is_parking = true;
    kept_bytes = bytes_banks();
    after_resume_left = 0;
    for (const auto & [dev, w] : want) {
        // wanted: its prompts' need and the headroom, at least LLAMA_PREFILL_SWAP_PARK_MIB
        LLAMA_LOG_DEBUG("%s: prefill swap: %s: %.3f MiB of banks freed of %.3f MiB wanted\n", __func__,
            ggml_backend_dev_name(dev), got[dev]/1048576.0, w/1048576.0);
    }
    LLAMA_LOG_DEBUG("%s: prefill swap: %zu layers' banks freed (%.1f MiB), %.1f MiB kept\n", __func__,
        n_parked_layers(), bytes/1048576.0, kept_bytes/1048576.0);
    return bytes;
}

size_t llama_moe_cache::free_for_banks(ggml_backend_dev_t dev, const std::map<ggml_backend_dev_t, size_t> & context_bytes) const {
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        if (host_device_mib < 0.0) {
            return SIZE_MAX / 2; // host memory: the test device has no budget
        }
        const auto it = context_bytes.find(dev);
        size_t used = it == context_bytes.end() ? 0 : it->second;
        if (resuming || free_first.count(dev)) {
            used += (size_t) (host_device_taken_mib * 1048576.0);
        }
        const size_t budget = (size_t) (host_device_mib * 1048576.0);
        return budget > used ? budget - used : 0;
    }
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    return free;
}

void llama_moe_cache::measure_prompt(const std::map<ggml_backend_dev_t, size_t> & context_bytes) {
    // the measure holds for prompts whose ubatches are no larger than this one's largest (the pools grow with the
    // ubatch): can_park() lets a larger one free everything and measure again
    if (prompt_max_ubatch <= 0) {
        freed_for_prompt.clear();
        return;
    }
    measured_ubatch   = std::max(measured_ubatch, prompt_max_ubatch);
    prompt_max_ubatch = 0;
    // what the prompt's buffers (compute, the backends' pools) took of the memory freed for it: the bank bytes
    // freed minus what is still free at its end. Only grows: a longer prompt may need more than a shorter one
    for (const auto & [dev, freed] : freed_for_prompt) {
        const size_t free = free_for_banks(dev, context_bytes);
        const int64_t need = (int64_t) freed - (int64_t) std::min(free, (size_t) INT64_MAX / 2);
        auto it = prompt_need.find(dev);
        if (it == prompt_need.end()) {
            prompt_need[dev] = need;
        } else {
            it->second = std::max(it->second, need);
        }
        LLAMA_LOG_DEBUG("%s: prefill swap: %s: %.1f MiB of banks freed, %.1f MiB free at the prompt's end: the next swaps free "
            "%.1f MiB and the headroom\n", __func__, ggml_backend_dev_name(dev), freed/1048576.0, free/1048576.0,
            prompt_need[dev]/1048576.0);
    }
    freed_for_prompt.clear();
}

bool llama_moe_cache::unpark(const std::map<ggml_backend_dev_t, size_t> & context_bytes, bool warm, bool fail_upload) {
    if (!is_parking) {
        return true;
    }
    std::vector<size_t> ils;
    std::map<ggml_backend_dev_t, size_t> need;
    for (size_t il = 0; il < layers.size(); ++il) {
        if (layers[il].parked && layers[il].reason.empty()) {
            ils.push_back(il);
            need[layers[il].dev] += layers[il].parked_bytes; // the buffer it had (biases and alignment included)
        }
    }
    // the same slot count beside the headroom's half (what a resume keeps at least); else the caller sizes again
    const size_t headroom = (size_t) params.headroom_mib << 20;
    for (const auto & [dev, bytes] : need) {
        const size_t free = free_for_banks(dev, context_bytes);
        if (free < bytes + headroom/2) {
            LLAMA_LOG_DEBUG("%s: prefill swap: %.1f MiB of banks do not fit %s's %.1f MiB free beside the headroom: "
                "every layer's banks are sized again\n", __func__, bytes/1048576.0, ggml_backend_dev_name(dev), free/1048576.0);
            return false;
        }
    }
    if (!ils.empty() && !alloc_banks(ils, fail_now(fail_alloc_at, ++n_allocs), "every layer's banks are sized again")) {
        return false;
    }
    for (size_t il : ils) {
        auto & l = layers[il];
        l.policy = std::make_unique<llama_moe_layer_policy>(policy_config(l.n_slots)); // the slots it had
        l.published.assign(n_exp, -1);
        l.slot_published.assign(l.n_slots, -1);
        l.n_published = 0;
        l.complete    = false;
        l.parked      = false;
        for (int32_t e : l.pins) {
            l.policy->pin(e);
        }
        if (l.table_dev >= 0) {
            for (int32_t e = 0; e < n_exp; ++e) {
                table_entry(l, e);
            }
        }
        n_cached++;
    }
    flush_tables();
    routes_ver++;
    is_parking = false;
    after_resume_left = LLAMA_PREFILL_SWAP_WARM_TOKENS;
    collecting = false;
    // the parked layers' empty slots, and the kept layers' slots toward the same ranking (only the experts that
    // differ are copied): the same contents a full restore would give
    if (warm && !prompt_counts.empty() && !hold_empty) {
        queue_warm(warm_rank(), fail_upload, retarget_kept);
    }
    prompt_counts.clear();
    return true;
}

bool llama_moe_cache::resume(const std::map<ggml_backend_dev_t, size_t> & context_bytes, bool warm, bool fail_upload,
        int32_t max_slots) {
    if (!is_suspended) {
        return n_cached > 0;
    }
    // allocate() marks every layer when it fails; a failed resume is tried again at the next one
    std::vector<std::string> reasons;
    for (const auto & l : layers) {
        reasons.push_back(l.reason);
    }
    const int32_t wanted = wanted_slots;
    wanted_slots = max_slots > 0 ? std::min(max_slots, resume_slots) : resume_slots;
    resuming     = true;
    allocate(false, context_bytes);
    resuming     = false;
    wanted_slots = wanted;
    collecting   = false;
    if (n_cached == 0) {
        for (size_t il = 0; il < layers.size(); ++il) {
            layers[il].reason = reasons[il];
        }
        return false;
    }
    is_suspended = false;
    after_resume_left = LLAMA_PREFILL_SWAP_WARM_TOKENS;
    // pins survive a suspension: they are uploaded first (by the next step, or by the warm start)
    for (auto & l : layers) {
        for (int32_t e : l.pins) {
            if (l.cached()) {
                l.policy->pin(e);
            }
        }
    }
    if (!warm || prompt_counts.empty() || hold_empty) {
        return true;
    }

    // the experts the prompt routed most, per layer, into the empty slots; the worker copies them and
    // the next steps publish them, so decode starts warm without waiting for the copies
    queue_warm(warm_rank(), fail_upload);
    prompt_counts.clear();
    return true;
}

size_t llama_moe_cache::bytes_banks() const {
    size_t n = 0;
    for (const auto & [buft, bytes] : bank_bytes) {
        n += bytes;
    }
    return n;
}

double llama_moe_cache::wait_warm(int32_t max_ms) {
    // a cache whose worker stopped (its reservation failed) never finishes what it queued: nothing to wait for
    if (max_ms <= 0 || is_suspended || is_parking || n_cached == 0 || !worker.joinable()) {
        return 0.0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait_for(lock, std::chrono::milliseconds(max_ms), [this] { return in_flight == 0; });
    }
    // the copies made are published by the next step, before the first decode graph
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void llama_moe_cache::after_resume(uint64_t & n_tokens, uint64_t & hits, uint64_t & misses) const {
    n_tokens = after_resume_tokens;
    hits     = after_resume_hits;
    misses   = after_resume_misses;
}

//
// API
//

void llama_moe_cache::reset_stats() {
    for (auto & l : layers) {
        l.stats = {};
        std::fill(l.recent_hits.begin(), l.recent_hits.end(), 0);
        std::fill(l.heat.begin(), l.heat.end(), 0);
        l.recent_pos = 0;
        l.recent_n = 0;
    }
    totals_extra = {};
    n_steps = 0;
}

const char * llama_moe_cache::layer_reason(int32_t il) const {
    if (il < 0 || il >= (int32_t) layers.size()) {
        return nullptr;
    }
    return layers[il].reason.c_str();
}

bool llama_moe_cache::get_stats(int32_t il, llama_moe_cache_stats & out) const {
    out = {};
    out.n_slots = n_slots;
    out.n_layers_cached = n_cached;
    for (const auto & [buft, bytes] : bank_bytes) {
        out.bytes_vram += bytes;
    }
    double recent_hits = 0, recent_pairs = 0;
    auto add_layer = [&](const llama_moe_cache_layer & l) {
        out.hits           += l.stats.hits;
        out.misses         += l.stats.misses;
        out.uploads        += l.stats.uploads;
        out.bytes_uploaded += l.stats.bytes_uploaded;
        out.evictions      += l.stats.evictions;
        out.rebalances     += l.stats.rebalances + (l.policy ? l.policy->n_rebalances() : 0);
        out.n_miss_device  += l.mapped[0] && l.miss_device ? 1 : 0;
        for (int32_t s : l.slot_published) {
            out.n_resident += s >= 0;
        }
        const size_t n = (size_t) std::min<uint64_t>(l.recent_n, l.recent_hits.size());
        for (size_t i = 0; i < n; ++i) {
            recent_hits += l.recent_hits[i];
        }
        recent_pairs += (double) n * l.n_used;
    };
    if (il < 0) {
        for (const auto & l : layers) {
            if (l.cached()) {
                add_layer(l);
            }
        }
        out.n_tokens = totals_extra.n_tokens;
        out.batches_cached = totals_extra.batches_cached;
        for (int i = 0; i < LLAMA_MOE_CACHE_BYPASS_COUNT; ++i) {
            out.batches_bypassed[i] = totals_extra.batches_bypassed[i];
        }
        out.step_ms_max   = totals_extra.step_ms_max;
        out.step_ms_total = totals_extra.step_ms_total;
        out.route_switches = n_route_switches;
        if (n_cached == 0) {
            return false;
        }
    } else {
        if (il >= (int32_t) layers.size() || !layers[il].cached()) {
            return false;
        }
        add_layer(layers[il]);
        out.n_tokens = layers[il].stats.n_tokens;
        out.n_slots  = layers[il].n_slots;
        out.n_layers_cached = 1;
        out.bytes_vram = 0;
        for (ggml_tensor * t : layers[il].bank) {
            out.bytes_vram += t ? ggml_nbytes(t) : 0;
        }
    }
    const uint64_t routed = out.hits + out.misses;
    out.hit_rate        = routed ? (double) out.hits / routed : 0.0;
    out.hit_rate_recent = recent_pairs > 0 ? recent_hits / recent_pairs : 0.0;
    return true;
}

int32_t llama_moe_cache::resident(int32_t il, int32_t * experts, int32_t n_max) const {
    if (il < 0 || il >= (int32_t) layers.size() || !layers[il].cached()) {
        return -1;
    }
    int32_t n = 0;
    for (int32_t e = 0; e < n_exp; ++e) {
        if (layers[il].published[e] >= 0) {
            if (experts && n < n_max) {
                experts[n] = e;
            }
            n++;
        }
    }
    return n;
}

int32_t llama_moe_cache::pin(int32_t il, int32_t expert) {
    if (il < 0 || il >= (int32_t) layers.size() || !layers[il].cached()) {
        return -1;
    }
    if (expert < 0 || expert >= n_exp) {
        return -2;
    }
    return layers[il].policy->pin(expert) ? 0 : -3;
}

bool llama_moe_cache::set_trace(const char * path) {
    trace.reset();
    if (path == nullptr || path[0] == 0) {
        return true;
    }
    // appended: a context made again for the same file (the server's sleep and wake) keeps what was written
    trace.reset(fopen(path, "a"));
    return trace != nullptr;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_moe_cache::memory_breakdown() const {
    auto out = bank_bytes;
    for (const auto & [buft, bytes] : aux_bytes) {
        out[buft] += bytes;
    }
    return out;
}

std::map<ggml_backend_dev_t, std::pair<size_t, int32_t>> llama_moe_cache::slot_bytes_by_dev() const {
    std::map<ggml_backend_dev_t, std::pair<size_t, int32_t>> out;
    for (const auto & l : layers) {
        if (l.reason.empty() && l.slot_bytes > 0) {
            out[l.dev].first  += l.slot_bytes;
            out[l.dev].second += 1;
        }
    }
    return out;
}

static void json_stats(std::string & s, const llama_moe_cache_stats & st) {
    char buf[768];
    snprintf(buf, sizeof(buf),
        "\"n_tokens\":%" PRIu64 ",\"hits\":%" PRIu64 ",\"misses\":%" PRIu64 ",\"hit_rate\":%.6f,\"hit_rate_recent\":%.6f,"
        "\"uploads\":%" PRIu64 ",\"bytes_uploaded\":%" PRIu64 ",\"evictions\":%" PRIu64 ",\"rebalances\":%" PRIu64 ","
        "\"n_resident\":%d,\"bytes_vram\":%" PRIu64,
        st.n_tokens, st.hits, st.misses, st.hit_rate, st.hit_rate_recent, st.uploads, st.bytes_uploaded, st.evictions,
        st.rebalances, st.n_resident, st.bytes_vram);
    s += buf;
}

std::string llama_moe_cache::stats_json() const {
    std::string s = "{";
    char buf[512];
    snprintf(buf, sizeof(buf),
        "\"enabled\":%s,\"n_slots\":%d,\"n_expert\":%d,\"n_layers\":%zu,\"n_layers_cached\":%d,\"policy\":\"%s\","
        "\"max_batch\":%d,\"rebalance_interval\":%d,\"admit_misses\":%d,\"admit_window\":%d,\"max_uploads\":%d,"
        "\"routing_trace\":%s,\"miss\":\"%s\",\"miss_auto_pct\":%d,\"miss_split_pct\":%d,\"upload_cap\":%d,",
        enabled() ? "true" : "false", n_slots, n_exp, layers.size(), n_cached, moe_policy_name(params.policy),
        params.max_batch, params.rebalance_interval, params.admit_misses, params.admit_window, params.max_uploads,
        trace ? "true" : "false", moe_miss_name(params.miss), params.miss_auto_pct, params.miss_split_pct,
        (int32_t) std::min<int64_t>((int64_t) params.max_uploads*upload_boost, INT32_MAX));
    s += buf;
    // warm starts: the uploads a prompt's routing and the profile queued into empty slots
    snprintf(buf, sizeof(buf), "\"warm_prompts\":%s,\"warm_prompt_uploads\":%" PRIu64 ",\"profile\":%s,"
        "\"profile_uploads\":%" PRIu64 ",", params.warm_prompts ? "true" : "false", n_prompt_warm_uploads,
        profile_path.empty() ? "false" : "true", n_profile_uploads);
    s += buf;

    llama_moe_cache_stats tot;
    get_stats(-1, tot);
    s += "\"total\":{";
    json_stats(s, tot);
    snprintf(buf, sizeof(buf),
        ",\"batches_cached\":%" PRIu64 ",\"batches_bypassed\":{\"batch\":%" PRIu64 ",\"warmup\":%" PRIu64 "},"
        "\"step_ms_max\":%.4f,\"step_ms_total\":%.4f,\"n_steps\":%" PRIu64 ",\"n_miss_device\":%d,\"route_switches\":%" PRIu64 "}",
        tot.batches_cached, tot.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_BATCH], tot.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_WARMUP],
        tot.step_ms_max, tot.step_ms_total, n_steps, tot.n_miss_device, tot.route_switches);
    s += buf;

    s += ",\"layers\":[";
    for (size_t il = 0; il < layers.size(); ++il) {
        const auto & l = layers[il];
        snprintf(buf, sizeof(buf), "%s{\"layer\":%zu,\"cached\":%s", il ? "," : "", il, l.cached() ? "true" : "false");
        s += buf;
        if (l.dev != nullptr) {
            // the layer's device: with a layer split, each cached layer's slots are on its own device
            s += std::string(",\"device\":\"") + ggml_backend_dev_name(l.dev) + "\"";
        }
        if (l.cached()) {
            llama_moe_cache_stats st;
            get_stats((int32_t) il, st);
            s += ",";
            json_stats(s, st);
            const bool split = l.mapped[0] && params.miss == LLAMA_MOE_CACHE_MISS_SPLIT;
            s += std::string(",\"miss\":\"") + (split ? "split" : l.mapped[0] && l.miss_device ? "device" : "cpu") + "\"";
            if (split) {
                // the missed experts whose misses the device computes now
                s += ",\"split_device\":" + std::to_string(l.n_miss_dev);
            }
            s += ",\"n_slots\":" + std::to_string(l.n_slots);
            s += std::string(",\"mapped\":") + (l.mapped[0] ? "true" : "false");
            s += std::string(",\"complete\":") + (l.complete ? "true" : "false");
            // whether its decode-sized graphs run one expert FFN (not with the misses on the CPU)
            s += std::string(",\"table\":") + (l.table_dev >= 0 && l.mapped[0] && l.miss_device ? "true" : "false");
            s += ",\"resident\":[";
            bool first = true;
            for (int32_t e = 0; e < n_exp; ++e) {
                if (l.published[e] >= 0) {
                    s += (first ? "" : ",") + std::to_string(e);
                    first = false;
                }
            }
            s += "]";
            // each expert's routed tokens since the stats were reset: the heat a dashboard draws
            s += ",\"routed\":[";
            for (int32_t e = 0; e < n_exp; ++e) {
                s += (e ? "," : "") + std::to_string(e < (int32_t) l.heat.size() ? l.heat[e] : 0);
            }
            s += "]";
        } else {
            // reasons are fixed ASCII strings without quotes
            s += ",\"reason\":\"" + l.reason + "\"";
        }
        s += "}";
    }
    s += "]}";
    return s;
}

void llama_moe_cache::print_stats() const {
    llama_moe_cache_stats st;
    if (!get_stats(-1, st)) {
        return;
    }
    LLAMA_LOG_INFO("%s: hot-expert cache: %d layers x %d slots (%.1f MiB), %" PRIu64 " tokens, hit rate %.1f%% (recent %.1f%%)\n",
        __func__, st.n_layers_cached, st.n_slots, st.bytes_vram/1048576.0, st.n_tokens, 100.0*st.hit_rate, 100.0*st.hit_rate_recent);
    LLAMA_LOG_INFO("%s: hot-expert cache: %" PRIu64 " uploads (%.1f MiB), %" PRIu64 " evictions, %" PRIu64 " batches cached, %" PRIu64 " bypassed (%" PRIu64 " over %d tokens, %" PRIu64 " warm-up), step max %.3f ms\n",
        __func__, st.uploads, st.bytes_uploaded/1048576.0, st.evictions, st.batches_cached,
        st.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_BATCH] + st.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_WARMUP],
        st.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_BATCH], params.max_batch, st.batches_bypassed[LLAMA_MOE_CACHE_BYPASS_WARMUP],
        st.step_ms_max);
    if (params.miss != LLAMA_MOE_CACHE_MISS_CPU) {
        LLAMA_LOG_INFO("%s: hot-expert cache: misses %s, on the device in %d layers now (%" PRIu64 " moves)\n",
            __func__, moe_miss_name(params.miss), st.n_miss_device, st.route_switches);
    }
}

//
// warm starts
//

bool llama_moe_cache::has_empty_slot() const {
    for (const auto & l : layers) {
        if (!l.cached()) {
            continue;
        }
        for (int32_t s = 0; s < l.n_slots; ++s) {
            if (l.policy->expert_in(s) < 0) {
                return true;
            }
        }
    }
    return false;
}

std::function<uint64_t(int32_t, int32_t)> llama_moe_cache::warm_rank() const {
    if (!warm_blend || profile_counts.empty()) {
        return [this](int32_t il, int32_t e) { return (uint64_t) prompt_counts[(size_t) il*n_exp + e]; };
    }
    // per layer, each count as a share of its layer's total (the prompt's and the history's weigh the same),
    // in fixed point; an expert neither routed scores 0 and is not queued
    std::vector<double> prompt_total(layers.size(), 0.0), history_total(layers.size(), 0.0);
    for (size_t il = 0; il < layers.size(); ++il) {
        for (int32_t e = 0; e < n_exp; ++e) {
            prompt_total[il]  += prompt_counts[il*n_exp + e];
            history_total[il] += (double) profile_counts[il*n_exp + e];
        }
    }
    return [this, prompt_total, history_total](int32_t il, int32_t e) {
        const size_t i = (size_t) il*n_exp + e;
        const double p = prompt_total[il]  > 0 ? prompt_counts[i] / prompt_total[il] : 0.0;
        const double h = history_total[il] > 0 ? (double) profile_counts[i] / history_total[il] : 0.0;
        return (uint64_t) ((p + h) * 4294967296.0);
    };
}

size_t llama_moe_cache::queue_warm(const std::function<uint64_t(int32_t, int32_t)> & count, bool fail_upload, bool retarget) {
    if (hold_empty) {
        return 0;
    }
    std::vector<llama_moe_upload> plan;
    std::vector<int32_t> order;
    std::vector<uint64_t> cnt(n_exp);
    std::vector<std::vector<upload_job>> by_layer;
    bool unpublished = false;
    for (auto & l : layers) {
        if (!l.cached()) {
            continue;
        }
        order.clear();
        for (int32_t e = 0; e < n_exp; ++e) {
            cnt[e] = count(l.il, e);
            if (cnt[e] > 0) {
                order.push_back(e);
            }
        }
        std::stable_sort(order.begin(), order.end(), [&cnt](int32_t a, int32_t b) { return cnt[a] > cnt[b]; });
        // pinned experts take their slots first (the policy's pins: a kept layer's may be newer than l.pins)
        std::vector<int32_t> pinned;
        for (int32_t e = 0; e < n_exp; ++e) {
            if (l.policy->is_pinned(e)) {
                pinned.push_back(e);
            }
        }
        order.insert(order.begin(), pinned.begin(), pinned.end());
        plan.clear();
        if (retarget) {
            l.policy->retarget(order, plan);
        } else {
            l.policy->warm(order, plan);
        }
        by_layer.emplace_back();
        for (const auto & u : plan) {
            // a retarget replaces residents: the next graph computes the outgoing expert as a miss (no graph runs
            // now: the callers come between graphs, after a synchronize)
            const int32_t old = l.slot_published[u.slot];
            if (old >= 0) {
                set_map(l.il, old, -1);
                l.stats.evictions++;
                unpublished = true;
            }
            by_layer.back().push_back({l.il, u.slot, u.expert, false, {}, true});
        }
    }
    if (unpublished) {
        flush_tables(); // the devices' maps and tables no longer point at the slots about to be overwritten
    }
    // the copies take the link in rank order across the layers (each layer's first expert, then each one's
    // second, ...), not layer after layer: decode starts while they run, and the hits of the top experts of
    // every layer come first (a restore of GiBs takes a few hundred ms; layer after layer, the last layers
    // stayed empty through the first tokens). LLAMA_MOE_CACHE_WARM_INTERLEAVE=0: layer after layer
    std::vector<upload_job> jobs;
    if (warm_interleave) {
        size_t ranks = 0;
        for (const auto & lj : by_layer) {
            ranks = std::max(ranks, lj.size());
        }
        for (size_t rank = 0; rank < ranks; ++rank) {
            for (const auto & lj : by_layer) {
                if (rank < lj.size()) {
                    jobs.push_back(lj[rank]);
                }
            }
        }
    } else {
        for (const auto & lj : by_layer) {
            jobs.insert(jobs.end(), lj.begin(), lj.end());
        }
    }
    if (!jobs.empty()) {
        fail_next_upload = fail_upload; // only with a warm job to fail
        std::lock_guard<std::mutex> lock(mutex);
        for (auto & j : jobs) {
            queue.push_back(j);
        }
        in_flight += (int32_t) jobs.size();
        n_warm_uploads += jobs.size();
    }
    cv.notify_all();
    return jobs.size();
}

// The profile is text: a header line, the model's fingerprint, one line of counts per cached layer, "end"
// (a file cut short has no "end" and is ignored as a whole).
static const char * PROFILE_MAGIC = "moecache-expert-profile 1";

bool llama_moe_cache::read_profile() {
    profile_read = true;
    std::ifstream f(profile_path);
    if (!f) {
        LLAMA_LOG_INFO("%s: expert profile %s: none yet (written at shutdown)\n", __func__, profile_path.c_str());
        return false;
    }
    auto ignore = [this](const std::string & why) {
        LLAMA_LOG_WARN("%s: expert profile %s is ignored: %s; the cache starts cold%s and the file is rewritten "
            "at shutdown\n", __func__, profile_path.c_str(), why.c_str(),
            params.slots_by_layer ? " with the even share of slots a layer" : "");
    };
    std::string line;
    if (!std::getline(f, line) || line != PROFILE_MAGIC) {
        ignore("not an expert profile (its first line is not '" + std::string(PROFILE_MAGIC) + "')");
        return false;
    }
    if (!std::getline(f, line) || line != "model " + fingerprint) {
        ignore("it belongs to another model ('" + line + "', this one is 'model " + fingerprint + "')");
        return false;
    }
    std::vector<uint64_t> counts(profile_counts.size(), 0);
    bool ended = false;
    while (std::getline(f, line)) {
        if (line == "end") {
            ended = true;
            break;
        }
        std::istringstream in(line);
        std::string word;
        long long il = -1;
        if (!(in >> word >> il) || word != "layer" || il < 0 || il >= (long long) layers.size()) {
            ignore("a damaged line ('" + line.substr(0, 60) + "')");
            return false;
        }
        for (int32_t e = 0; e < n_exp; ++e) {
            unsigned long long c = 0;
            if (!(in >> c)) {
                ignore("layer " + std::to_string(il) + " has fewer than " + std::to_string(n_exp) + " counts");
                return false;
            }
            counts[(size_t) il*n_exp + e] = c;
        }
        if (in >> word) {
            ignore("layer " + std::to_string(il) + " has more than " + std::to_string(n_exp) + " counts");
            return false;
        }
    }
    if (!ended) {
        ignore("it is cut short (no 'end' line)");
        return false;
    }
    profile_counts = std::move(counts);
    return true;
}

void llama_moe_cache::load_profile() {
    profile_used = true;
    if (!profile_ok) {
        return;
    }
    n_profile_uploads = queue_warm([this](int32_t il, int32_t e) { return profile_counts[(size_t) il*n_exp + e]; });
    LLAMA_LOG_INFO("%s: expert profile %s: %" PRIu64 " experts queued into the empty slots\n", __func__,
        profile_path.c_str(), n_profile_uploads);
}

void llama_moe_cache::size_layers(int64_t slots) {
    std::map<ggml_backend_dev_t, std::vector<llama_moe_cache_layer *>> by_dev;
    for (auto & l : layers) {
        if (l.reason.empty() && l.slot_bytes > 0) {
            l.n_slots = (int32_t) std::min<int64_t>(slots, n_exp);
            by_dev[l.dev].push_back(&l);
        }
    }
    if (!params.slots_by_layer || !profile_ok || slots >= n_exp) {
        return;
    }
    // per device: each layer starts at half the even share and takes, one slot at a time, its next-hottest expert
    // by the profile while it holds the most routing per byte; a layer the profile never saw routed keeps the even
    // share (nothing says it needs less). Each layer's counts weigh as shares of its own routing.
    const int32_t floor_slots = (int32_t) std::max<int64_t>(1, slots / 2);
    std::vector<uint64_t> cnt(n_exp);
    for (auto & [dev, ls] : by_dev) {
        size_t budget = 0;
        std::vector<std::vector<double>> gain(ls.size()); // per layer: each expert's share of its routing, descending
        for (size_t i = 0; i < ls.size(); ++i) {
            auto & l = *ls[i];
            budget += (size_t) slots*l.slot_bytes;
            uint64_t total = 0;
            for (int32_t e = 0; e < n_exp; ++e) {
                cnt[e] = profile_counts[(size_t) l.il*n_exp + e];
                total += cnt[e];
            }
            if (total == 0) {
                continue; // the even share, below
            }
            std::sort(cnt.begin(), cnt.end(), std::greater<uint64_t>());
            gain[i].resize(n_exp);
            for (int32_t e = 0; e < n_exp; ++e) {
                gain[i][e] = (double) cnt[e] / (double) total;
            }
            l.n_slots = floor_slots;
        }
        for (auto * l : ls) {
            budget -= std::min(budget, (size_t) l->n_slots*l->slot_bytes);
        }
        // each layer's gains only fall as its slots grow, so with the layers' slots of one size (one model's layers on
        // one device) the greedy gives the most routing the budget can hold
        for (;;) {
            size_t best = SIZE_MAX;
            double best_gain = 0.0;
            for (size_t i = 0; i < ls.size(); ++i) {
                const auto & l = *ls[i];
                if (gain[i].empty() || l.n_slots >= n_exp || l.slot_bytes > budget) {
                    continue;
                }
                const double g = gain[i][l.n_slots] / (double) l.slot_bytes;
                // ties (experts the profile never saw routed) go to the layer with the fewest slots
                if (best == SIZE_MAX || g > best_gain || (g == best_gain && l.n_slots < ls[best]->n_slots)) {
                    best = i;
                    best_gain = g;
                }
            }
            if (best == SIZE_MAX) {
                break;
            }
            ls[best]->n_slots++;
            budget -= ls[best]->slot_bytes;
        }
    }
}

void llama_moe_cache::save_profile() {
    if (profile_path.empty() || !profile_used || profile_counts.empty()) {
        return;
    }
    // the counts stay well inside 64 bits however long the server runs: halve them all past 2^40
    uint64_t top = 0;
    for (uint64_t c : profile_counts) {
        top = std::max(top, c);
    }
    if (top > (1ull << 40)) {
        for (uint64_t & c : profile_counts) {
            c >>= 1;
        }
    }
    const std::string tmp = profile_path + ".tmp";
    bool ok = !fail_profile;
    std::string why = fail_profile ? "injected: LLAMA_MOE_CACHE_FAIL=profile" : "";
    if (ok) {
        FILE * f = fopen(tmp.c_str(), "w");
        if (!f) {
            ok  = false;
            why = strerror(errno);
        } else {
            fprintf(f, "%s\nmodel %s\n", PROFILE_MAGIC, fingerprint.c_str());
            for (const auto & l : layers) {
                if (l.reason == "no routed experts") {
                    continue;
                }
                fprintf(f, "layer %d", l.il);
                for (int32_t e = 0; e < n_exp; ++e) {
                    fprintf(f, " %" PRIu64, profile_counts[(size_t) l.il*n_exp + e]);
                }
                fputc('\n', f);
            }
            fputs("end\n", f);
            ok = fflush(f) == 0 && !ferror(f);
            if (!ok) {
                why = strerror(errno);
            }
            ok = (fclose(f) == 0) && ok;
            if (ok && std::rename(tmp.c_str(), profile_path.c_str()) != 0) {
                ok  = false;
                why = strerror(errno);
            }
        }
    }
    if (!ok) {
        std::remove(tmp.c_str());
        LLAMA_LOG_WARN("%s: expert profile %s was not written (%s); the file there, if any, is unchanged\n",
            __func__, profile_path.c_str(), why.c_str());
        return;
    }
    LLAMA_LOG_INFO("%s: expert profile written to %s\n", __func__, profile_path.c_str());
}
