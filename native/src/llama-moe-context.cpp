// moecache: the parts of llama_context that belong to its features, and the C API of llama-moe.h.
// The hot-expert cache's and the prefill-phase swap's member functions (declared in the patched
// llama-context.h) and the functions of the public header (cache, swap, output slots, memory
// breakdown) live here, compiled into libllama; the series only adds their fields and call sites.

#include "llama-context.h"

#include "llama-impl.h"
#include "llama-memory.h"
#include "llama-model.h"
#include "llama-moe.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

//
// moecache: hot-expert cache API (llama-moe.h)
//

void llama_context::moe_cache_flush() {
    if (moe_cache) {
        moe_cache->flush(sched.get(), memory.get());
    }
}

void llama_context::moe_cache_rebalance() {
    if (moe_cache) {
        moe_cache->rebalance(sched.get(), memory.get());
    }
}

std::vector<llama_moe_device_memory> llama_context::moe_memory_breakdown() const {
    const size_t nd = model.devices.size();
    std::vector<llama_moe_device_memory> out(nd + 1);
    for (size_t i = 0; i < nd; ++i) {
        out[i].dev = model.devices[i].dev;
    }
    // a device's row, or the host's: host buffer types (and devices the model does not list) go to the host
    auto row = [&](ggml_backend_dev_t dev) -> llama_moe_device_memory & {
        for (size_t i = 0; i < nd; ++i) {
            if (out[i].dev == dev) {
                return out[i];
            }
        }
        return out[nd];
    };
    auto buft_row = [&](ggml_backend_buffer_type_t buft) -> llama_moe_device_memory & {
        return ggml_backend_buft_is_host(buft) ? out[nd] : row(ggml_backend_buft_get_device(buft));
    };
    for (const auto & [buft, mb] : memory_breakdown()) {
        auto & r = buft_row(buft);
        r.model   += mb.model;
        r.context += mb.context;
        r.compute += mb.compute;
    }
    if (moe_cache) {
        for (const auto & [buft, bytes] : moe_cache->memory_breakdown()) {
            buft_row(buft).moe_banks += bytes;
        }
        for (const auto & [dev, slot] : moe_cache->slot_bytes_by_dev()) {
            auto & r = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU ? out[nd] : row(dev);
            r.moe_slot     += slot.first;
            r.n_moe_layers += slot.second;
        }
    }
    return out;
}

std::map<ggml_backend_dev_t, size_t> llama_context::moe_cache_context_bytes() const {
    std::map<ggml_backend_dev_t, size_t> context_bytes;
    for (const auto & [buft, mb] : memory_breakdown()) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        if (!dev && ggml_backend_buft_is_host(buft)) {
            dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); // the plain CPU buffer type has none
        }
        if (dev) {
            context_bytes[dev] += mb.context + mb.compute;
        }
    }
    return context_bytes;
}

//
// moecache: prefill-phase swap
//

bool llama_context::swap_fail(int32_t step) const {
    return swap_fail_step == step && (swap_fail_at < 0 || swap_fail_at == swap_n);
}

size_t llama_context::swap_compute_bytes() const {
    size_t n = 0;
    for (size_t i = 0; sched && i < backend_ptrs.size(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_get_device(backend_ptrs[i]);
        if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            n += ggml_backend_sched_get_buffer_size(sched.get(), backend_ptrs[i]);
        }
    }
    return n;
}

size_t llama_context::swap_free_compute() {
    synchronize();
    for (auto & res : gf_res_prev) {
        res.reset();
    }
    gf_res_prev_active = nullptr;
    // the scheduler owns the compute buffers; a reset of it (not ggml_backend_sched_reset, which keeps
    // them) frees them, and sched_reserve() makes a new one
    sched.reset();
    size_t scratch = 0;
    for (auto & backend : backends) {
        scratch += ggml_backend_trim(backend.get());
    }
    sched_need_reserve = true;
    return scratch;
}

bool llama_context::swap_restore_decode() {
    bool clean = true;
    cparams.pipeline_parallel = swap_pp_decode;
    // compute buffers at n_ubatch for the stock graphs (the cache is suspended or parked); a second try after
    // trimming again, then the next decode reserves
    for (int attempt = 0; attempt < 2; ++attempt) {
        try {
            sched_need_reserve = true;
            if (attempt == 0 && swap_fail(LLAMA_PREFILL_SWAP_STEP_RESTORE)) {
                throw std::runtime_error("failed to allocate compute buffers (injected: LLAMA_PREFILL_SWAP_FAIL=restore)");
            }
            sched_reserve();
            break;
        } catch (const std::exception & e) {
            swap_stats.n_failed[LLAMA_PREFILL_SWAP_STEP_RESTORE]++;
            clean = false;
            LLAMA_LOG_WARN("%s: prefill swap: restoring the decode compute buffers: %s%s\n", __func__, e.what(),
                attempt == 0 ? ": trying again" : ": the next decode reserves them");
            if (moe_cache && moe_cache->parking()) {
                moe_cache->suspend(false); // the kept banks may be what did not fit: the second try is without them
            }
            if (attempt == 1) {
                sched_need_reserve = true;
                LLAMA_LOG_WARN("%s: prefill swap: the hot-expert cache stays off until the next restore\n", __func__);
                return false; // banks only beside reserved buffers
            }
            swap_free_compute();
        }
    }
    if (!moe_cache || (!moe_cache->suspended() && !moe_cache->parking())) {
        return clean;
    }
    if (moe_cache->parking()) {
        // a partial release: the parked layers' banks again, at their slot count; when they do not fit (or with
        // the injected failure), every layer's banks go and are sized again as after a full release
        const bool inject = swap_fail(SWAP_FAIL_UNPARK);
        if (inject || !moe_cache->unpark(moe_cache_context_bytes(), swap_params.warm_restore, swap_fail(LLAMA_PREFILL_SWAP_STEP_UPLOAD))) {
            swap_stats.n_partial_fallbacks++;
            LLAMA_LOG_INFO("%s: prefill swap: the parked banks could not be allocated again%s: every layer's banks are sized again\n",
                __func__, inject ? " (injected: LLAMA_PREFILL_SWAP_FAIL=unpark)" : "");
            moe_cache->suspend(false);
        }
    }
    const bool inject_banks = swap_fail(LLAMA_PREFILL_SWAP_STEP_BANKS);
    if (inject_banks && !moe_cache->suspended()) {
        moe_cache->suspend(false); // the injected failure of the banks' allocation, after a partial release too
    }
    if (moe_cache->suspended() && (inject_banks || !moe_cache->resume(moe_cache_context_bytes(), swap_params.warm_restore,
            swap_fail(LLAMA_PREFILL_SWAP_STEP_UPLOAD)))) {
        swap_stats.n_failed[LLAMA_PREFILL_SWAP_STEP_BANKS]++;
        LLAMA_LOG_WARN("%s: prefill swap: the hot-expert cache's banks could not be allocated again%s: decode runs without the cache "
            "until the next restore\n", __func__, inject_banks ? " (injected: LLAMA_PREFILL_SWAP_FAIL=banks)" : "");
        return false;
    }
    // the graphs that split the cached layers need their own reservation beside the banks; when it
    // does not fit, the banks come back with half the slots, then not at all (until the next restore)
    for (int attempt = 0; attempt < 2; ++attempt) {
        try {
            sched_need_reserve = true;
            if (attempt == 0 && swap_fail(SWAP_FAIL_GRAPHS)) {
                throw std::runtime_error("failed to allocate compute buffers (injected: LLAMA_PREFILL_SWAP_FAIL=graphs)");
            }
            sched_reserve();
            return clean;
        } catch (const std::exception & e) {
            swap_stats.n_failed[LLAMA_PREFILL_SWAP_STEP_BANKS]++;
            clean = false;
            const int32_t slots = moe_cache->slots();
            moe_cache->suspend(false);
            swap_free_compute();
            // the stock graphs' buffers first: the banks are sized after them
            try {
                sched_reserve();
            } catch (const std::exception & e2) {
                swap_stats.n_failed[LLAMA_PREFILL_SWAP_STEP_RESTORE]++;
                LLAMA_LOG_WARN("%s: prefill swap: %s: the next decode reserves the compute buffers, the cache stays off "
                    "until the next restore\n", __func__, e2.what());
                sched_need_reserve = true;
                return false;
            }
            const bool again = attempt == 0 && slots > 1 &&
                moe_cache->resume(moe_cache_context_bytes(), false, false, slots/2);
            LLAMA_LOG_WARN("%s: prefill swap: %s beside %d slots of the cache's banks: %s\n", __func__, e.what(), slots,
                again ? "trying with half of them" : "decode runs without the cache until the next restore");
            if (!again) {
                return false;
            }
        }
    }
    return false;
}

int32_t llama_context::prefill_swap_begin(int32_t n_tokens, int32_t n_generating) {
    if (swap_active) {
        return 0;
    }
    if (swap_params.n_ubatch == 0) {
        return 1;
    }
    if (n_tokens < (int32_t) swap_params.min_tokens) {
        swap_stats.n_skipped[LLAMA_PREFILL_SWAP_SKIP_SHORT]++;
        return 1;
    }
    if (n_generating > 0) {
        swap_stats.n_skipped[LLAMA_PREFILL_SWAP_SKIP_OTHERS]++;
        return 1;
    }
    if (swap_params.mode == LLAMA_PREFILL_SWAP_BYPASS) {
        swap_stats.n_skipped[LLAMA_PREFILL_SWAP_SKIP_BYPASS]++;
        swap_stats.n_ubatch_last = cparams.n_ubatch;
        return 1;
    }
    swap_n++;
    const int64_t t0 = ggml_time_us();
    synchronize(); // nothing may still run on the banks that are freed next

    // release: the cache first (its uploads finish, nothing reads the banks after this), then the
    // compute buffers, then the backends' scratch and the device graphs that point into it
    if (moe_cache) {
        moe_cache->flush(sched.get(), memory.get());
    }
    // a swap after the first frees only the banks its prompt needs (measured by the swaps before), when it can
    const int64_t max_ubatch = std::min<int64_t>(n_tokens, swap_params.n_ubatch); // the prompt's largest ubatch
    const bool partial = moe_cache && moe_cache->can_park(max_ubatch);
    size_t released = !moe_cache ? 0 : partial ? moe_cache->park(swap_params.warm_restore, max_ubatch) :
        moe_cache->suspend(swap_params.warm_restore);
    released += swap_compute_bytes();
    released += swap_free_compute();
    const int64_t t1 = ggml_time_us();

    swap_n_ubatch_decode = cparams.n_ubatch;
    swap_pp_decode       = cparams.pipeline_parallel;
    cparams.n_ubatch     = swap_params.n_ubatch;
    swap_stats.bytes_kept = partial ? moe_cache->bytes_kept() : 0;
    bool ok = true;
    try {
        if (swap_fail(LLAMA_PREFILL_SWAP_STEP_RESERVE)) {
            throw std::runtime_error("failed to allocate compute buffers (injected: LLAMA_PREFILL_SWAP_FAIL=reserve)");
        }
        try {
            if (partial && swap_fail(SWAP_FAIL_PARTIAL)) {
                throw std::runtime_error("failed to allocate compute buffers (injected: LLAMA_PREFILL_SWAP_FAIL=partial)");
            }
            sched_reserve();
        } catch (const std::exception & e) {
            if (!partial) {
                throw;
            }
            // beside the kept banks it did not fit: they go too, as in the first swap
            LLAMA_LOG_INFO("%s: prefill swap: %s beside %.1f MiB of kept banks: freeing them\n", __func__, e.what(),
                swap_stats.bytes_kept/1048576.0);
            swap_stats.n_partial_fallbacks++;
            swap_stats.bytes_kept = 0;
            released += moe_cache->suspend(swap_params.warm_restore);
            released += swap_free_compute();
            sched_reserve();
        }
    } catch (const std::exception & e) {
        LLAMA_LOG_WARN("%s: prefill swap: %s for ubatch %u: the prompt runs at ubatch %u\n", __func__, e.what(),
            swap_params.n_ubatch, swap_n_ubatch_decode);
        swap_stats.n_failed[LLAMA_PREFILL_SWAP_STEP_RESERVE]++;
        ok = false;
    }
    const int64_t t2 = ggml_time_us();

    swap_stats.ms_release     = (t1 - t0)/1000.0;
    swap_stats.ms_reserve     = (t2 - t1)/1000.0;
    swap_stats.bytes_released = released;
    swap_stats.ms_total      += (t2 - t0)/1000.0;
    if (!ok) {
        // roll back to the decode configuration
        swap_stats.bytes_kept = 0;
        swap_free_compute();
        cparams.n_ubatch = swap_n_ubatch_decode;
        swap_restore_decode();
        if (moe_cache) {
            moe_cache->end_collecting();
        }
        swap_stats.n_ubatch_last = cparams.n_ubatch;
        swap_stats.n_slots = moe_cache ? moe_cache->slots() : 0;
        swap_stats.ms_total += (ggml_time_us() - t2)/1000.0;
        return -1;
    }
    swap_active = true;
    swap_stats.n_swaps++;
    swap_stats.n_partial += moe_cache && moe_cache->parking() && swap_stats.bytes_kept > 0 ? 1 : 0;
    swap_stats.n_ubatch_last = cparams.n_ubatch;
    LLAMA_LOG_DEBUG("%s: prefill swap: %.1f MiB released in %.1f ms, reserved for ubatch %u in %.1f ms\n", __func__,
        released/1048576.0, swap_stats.ms_release, cparams.n_ubatch, swap_stats.ms_reserve);
    return 0;
}

int32_t llama_context::prefill_swap_end() {
    if (!swap_active) {
        return 1;
    }
    const int64_t t0 = ggml_time_us();
    // the prompt's routing (for the warm restore) is committed first: it reads graph outputs; the decode
    // graphs are then reserved without the routing read-back, which would make them larger than at start
    // and leave the banks fewer slots than they had
    if (moe_cache) {
        moe_cache->flush(sched.get(), memory.get());
        moe_cache->stop_collecting();
        // what the prompt's buffers took of the banks' memory, before they are freed: the next swaps free that much
        moe_cache->measure_prompt(moe_cache_context_bytes());
    }
    swap_free_compute();
    cparams.n_ubatch = swap_n_ubatch_decode;
    swap_active = false;
    const bool clean = swap_restore_decode();
    double waited_ms = 0.0;
    if (moe_cache) {
        moe_cache->end_collecting();
        waited_ms = moe_cache->wait_warm((int32_t) std::min<uint32_t>(swap_params.restore_wait_ms, INT32_MAX));
    }
    const double ms = (ggml_time_us() - t0)/1000.0;
    swap_stats.ms_restore     = ms;
    swap_stats.ms_total      += ms;
    swap_stats.bytes_restored = swap_compute_bytes() + (moe_cache ? moe_cache->bytes_banks() : 0);
    swap_stats.n_slots        = moe_cache ? moe_cache->slots() : 0;
    LLAMA_LOG_DEBUG("%s: prefill swap: %.1f MiB restored in %.1f ms (%d slots per cached layer; %.1f ms waiting for the "
        "warm copies)\n", __func__, swap_stats.bytes_restored/1048576.0, ms, swap_stats.n_slots, waited_ms);
    return clean ? 0 : -1;
}

llama_prefill_swap_stats llama_context::prefill_swap_stats() const {
    llama_prefill_swap_stats st = swap_stats;
    if (moe_cache) {
        st.warm_uploads = moe_cache->warm_uploads();
        st.warm_dropped = moe_cache->warm_dropped();
        st.n_failed[LLAMA_PREFILL_SWAP_STEP_UPLOAD] = moe_cache->warm_upload_failures();
        moe_cache->after_resume(st.after_restore_tokens, st.after_restore_hits, st.after_restore_misses);
    }
    return st;
}

struct llama_prefill_swap_params llama_prefill_swap_default_params(void) {
    llama_prefill_swap_params p;
    p.n_ubatch     = 0;
    p.min_tokens   = 1024; // a swap costs 0.15-0.2 s on the H200, a 512-token ubatch streaming the experts 0.37 s
    p.mode         = LLAMA_PREFILL_SWAP_TRANSACTION;
    p.warm_restore = true;
    p.restore_wait_ms = 0; // decode at once; moecache-server plans a wait where the restore copies over the link
    return p;
}

int32_t llama_prefill_swap_begin(struct llama_context * ctx, int32_t n_tokens, int32_t n_generating) {
    return ctx ? ctx->prefill_swap_begin(n_tokens, n_generating) : 1;
}

int32_t llama_prefill_swap_end(struct llama_context * ctx) {
    return ctx ? ctx->prefill_swap_end() : 1;
}

bool llama_prefill_swap_active(const struct llama_context * ctx) {
    return ctx && ctx->prefill_swap_active();
}

bool llama_prefill_swap_get_stats(const struct llama_context * ctx, struct llama_prefill_swap_stats * out) {
    if (!ctx || !out) {
        return false;
    }
    *out = ctx->prefill_swap_stats();
    return true;
}

struct llama_moe_cache_params llama_moe_cache_default_params(void) {
    llama_moe_cache_params p;
    p.n_slots            = 0;
    p.size_mib           = 0;
    p.policy             = LLAMA_MOE_CACHE_POLICY_FREQ;
    p.rebalance_interval = 40;
    p.max_batch          = 8;
    p.admit_misses       = 2;
    p.admit_window       = 16;
    p.max_uploads        = 2;
    p.headroom_mib       = 512;
    p.routing_trace      = nullptr;
    p.miss               = LLAMA_MOE_CACHE_MISS_CPU;
    p.miss_auto_pct      = 25;
    p.miss_split_pct     = 50;
    p.warm_prompts       = false;
    p.profile            = nullptr;
    p.slots_by_layer     = false;
    return p;
}

bool llama_moe_cache_enabled(const struct llama_context * ctx) {
    return ctx && ctx->get_moe_cache() && ctx->get_moe_cache()->enabled();
}

const char * llama_moe_cache_layer_reason(const struct llama_context * ctx, int32_t il) {
    return ctx && ctx->get_moe_cache() ? ctx->get_moe_cache()->layer_reason(il) : nullptr;
}

bool llama_moe_cache_get_stats(const struct llama_context * ctx, int32_t il, struct llama_moe_cache_stats * out) {
    if (!ctx || !out || !ctx->get_moe_cache()) {
        return false;
    }
    return ctx->get_moe_cache()->get_stats(il, *out);
}

void llama_moe_cache_reset_stats(struct llama_context * ctx) {
    if (ctx && ctx->get_moe_cache()) {
        ctx->get_moe_cache()->reset_stats();
    }
}

int32_t llama_output_slots_set(struct llama_context * ctx, int32_t n) {
    return ctx ? ctx->output_slots_set(n) : -1;
}

int32_t llama_output_slot_select(struct llama_context * ctx, int32_t slot) {
    return ctx ? ctx->output_slot_select(slot) : -1;
}

int32_t llama_output_slots(const struct llama_context * ctx) {
    return ctx ? ctx->output_slots() : 0;
}

int32_t llama_moe_memory_breakdown(const struct llama_context * ctx, struct llama_moe_device_memory * out, int32_t n_max) {
    if (!ctx) {
        return -1;
    }
    const auto rows = ctx->moe_memory_breakdown();
    for (int32_t i = 0; i < n_max && i < (int32_t) rows.size(); ++i) {
        out[i] = rows[i];
    }
    return (int32_t) rows.size();
}

void llama_output_slot_synchronize(struct llama_context * ctx) {
    if (ctx) {
        ctx->synchronize_output();
    }
}

void llama_moe_cache_flush(struct llama_context * ctx) {
    if (ctx) {
        ctx->moe_cache_flush();
    }
}

int32_t llama_moe_cache_resident(const struct llama_context * ctx, int32_t il, int32_t * experts, int32_t n_max) {
    return ctx && ctx->get_moe_cache() ? ctx->get_moe_cache()->resident(il, experts, n_max) : -1;
}

int32_t llama_moe_cache_pin(struct llama_context * ctx, int32_t il, int32_t expert) {
    return ctx && ctx->get_moe_cache() ? ctx->get_moe_cache()->pin(il, expert) : -1;
}

void llama_moe_cache_rebalance(struct llama_context * ctx) {
    if (ctx) {
        ctx->moe_cache_rebalance();
    }
}

int32_t llama_moe_cache_stats_json(const struct llama_context * ctx, char * buf, size_t size) {
    const std::string s = ctx && ctx->get_moe_cache() ? ctx->get_moe_cache()->stats_json() : std::string("{\"enabled\":false}");
    if (buf && size > 0) {
        const size_t n = std::min(size - 1, s.size());
        memcpy(buf, s.data(), n);
        buf[n] = 0;
    }
    return (int32_t) s.size();
}

bool llama_moe_routing_trace(struct llama_context * ctx, const char * path) {
    if (!ctx || !ctx->get_moe_cache()) {
        return false;
    }
    // write what is still pending into the old file first; the graphs' outputs depend on the trace,
    // and graph reuse compares moe_observe, so the next graph is rebuilt
    ctx->moe_cache_flush();
    return ctx->get_moe_cache()->set_trace(path);
}
