#pragma once

// moecache patch series: the C API of its features (one header for bindings, server and tests).
//
// Hot-expert cache: for MoE layers whose routed experts live in host memory, a bank of slots on the
// layer's own device holds the most-routed experts. Batches of up to max_batch tokens run the cached
// experts on the device and the others on the CPU and add the two results; larger batches take the
// stock path. Configure it with llama_context_params.moe_cache (llama.h).

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

    // why a batch did not use the cache
    enum llama_moe_cache_bypass {
        LLAMA_MOE_CACHE_BYPASS_BATCH  = 0, // more tokens than max_batch (prompt processing)
        LLAMA_MOE_CACHE_BYPASS_WARMUP = 1, // the warm-up graph, which routes to every expert
        LLAMA_MOE_CACHE_BYPASS_COUNT  = 2,
    };

    struct llama_moe_cache_stats {
        uint64_t n_tokens;        // accepted tokens whose routing was counted
        uint64_t hits;            // routed (token, expert) pairs served by a slot
        uint64_t misses;          // routed pairs served by the CPU
        double   hit_rate;        // hits / (hits + misses), 0 when nothing was routed
        double   hit_rate_recent; // the same over the last LLAMA_MOE_CACHE_RECENT tokens
        uint64_t uploads;         // experts copied into a slot
        uint64_t bytes_uploaded;
        uint64_t evictions;       // uploads that replaced a resident expert
        uint64_t batches_cached;  // batches that ran with the cache
        uint64_t batches_bypassed[LLAMA_MOE_CACHE_BYPASS_COUNT];
        uint64_t rebalances;      // policy steps that changed the residency
        double   step_ms_max;     // longest time decode spent in the cache's step (publish + plan)
        double   step_ms_total;
        int32_t  n_slots;         // slots per cached layer
        int32_t  n_resident;      // published experts (per layer, or summed over layers for the total)
        int32_t  n_layers_cached;
        uint64_t bytes_vram;      // bytes of the slot banks
        int32_t  n_miss_device;   // layers whose misses run on their device now (llama_moe_cache_params.miss)
        uint64_t route_switches;  // AUTO: times a layer's misses moved between the CPU and the device
    };

#define LLAMA_MOE_CACHE_RECENT 256
#define LLAMA_MOE_CACHE_MAX_BATCH 64 // the largest max_batch (the split's kernels are tested up to it)
#define LLAMA_MOE_CACHE_UPLOAD_BOOST 8 // the upload cap grows up to this many times max_uploads while the link is idle

    LLAMA_API struct llama_moe_cache_params llama_moe_cache_default_params(void);

    // true when the context has a cache with at least one cached layer
    LLAMA_API bool llama_moe_cache_enabled(const struct llama_context * ctx);

    // why layer il has no cache ("" when it has one, or NULL when il is out of range)
    LLAMA_API const char * llama_moe_cache_layer_reason(const struct llama_context * ctx, int32_t il);

    // stats of layer il, or of all layers with il = -1; false if there is no cache or il is not cached
    LLAMA_API bool llama_moe_cache_get_stats(const struct llama_context * ctx, int32_t il, struct llama_moe_cache_stats * out);

    LLAMA_API void llama_moe_cache_reset_stats(struct llama_context * ctx);

    // commit the routing of the last decode (stats, trace): the stats functions report what was
    // committed, which is otherwise done at the start of the next decode
    LLAMA_API void llama_moe_cache_flush(struct llama_context * ctx);

    // the experts published in layer il's slots (up to n_max written); returns their count, -1 if il is not cached
    LLAMA_API int32_t llama_moe_cache_resident(const struct llama_context * ctx, int32_t il, int32_t * experts, int32_t n_max);

    // keep an expert resident in layer il (uploaded at the next step, never evicted);
    // 0 on success, -1 il not cached, -2 expert out of range, -3 every slot is pinned
    LLAMA_API int32_t llama_moe_cache_pin(struct llama_context * ctx, int32_t il, int32_t expert);

    // run the policy now, wait for the uploads and publish them (blocks; for tests and tools)
    LLAMA_API void llama_moe_cache_rebalance(struct llama_context * ctx);

    // all stats as JSON (total, per layer, configuration); returns the length needed without the
    // terminating zero, writes at most size bytes (snprintf semantics)
    LLAMA_API int32_t llama_moe_cache_stats_json(const struct llama_context * ctx, char * buf, size_t size);

    // record the routed experts of accepted tokens as JSONL ({"seq","pos","layers":{il:[ids]}})
    // into path; NULL stops recording. Works with or without the cache. false if path cannot be opened.
    LLAMA_API bool llama_moe_routing_trace(struct llama_context * ctx, const char * path);

    //
    // Prefill-phase swap: a prompt of at least min_tokens runs at a larger ubatch (llama_context_params.prefill_swap).
    // begin() waits for the cache's uploads, frees its slot banks (the first swap all of them; later ones only
    // what the earlier prompts took, plus the headroom, from the last layer back: the other layers stay warm;
    // LLAMA_PREFILL_SWAP_PARTIAL=0 always frees all), the compute buffers and the backends'
    // scratch (pools, captured device graphs), and reserves the compute buffers for the prefill ubatch;
    // end() frees those and restores the decode configuration: compute buffers at n_ubatch, the banks
    // (warm: filled with the prompt's most-routed experts, published after their copies). Every failed
    // step leaves a working context: the prompt runs at n_ubatch, or decode runs without the cache
    // until the next restore. Call end() before sampling the prompt's first token.
    //

    enum llama_prefill_swap_step {
        LLAMA_PREFILL_SWAP_STEP_RESERVE = 0, // compute buffers at the prefill ubatch (the prompt runs at n_ubatch)
        LLAMA_PREFILL_SWAP_STEP_RESTORE = 1, // compute buffers at n_ubatch again (retried once, then at the next decode)
        LLAMA_PREFILL_SWAP_STEP_BANKS   = 2, // the cache's banks, or the graphs beside them (no cache until the next restore)
        LLAMA_PREFILL_SWAP_STEP_UPLOAD  = 3, // an upload of the warm restore (that layer takes the stock path)
        LLAMA_PREFILL_SWAP_STEP_COUNT   = 4,
    };

    enum llama_prefill_swap_skip {
        LLAMA_PREFILL_SWAP_SKIP_SHORT  = 0, // fewer than min_tokens prompt tokens
        LLAMA_PREFILL_SWAP_SKIP_OTHERS = 1, // other sequences are generating: they would wait for the transitions
        LLAMA_PREFILL_SWAP_SKIP_BYPASS = 2, // mode bypass
        LLAMA_PREFILL_SWAP_SKIP_COUNT  = 3,
    };

#define LLAMA_PREFILL_SWAP_WARM_TOKENS 64 // tokens after a restore whose hits are counted apart

    struct llama_prefill_swap_stats {
        uint32_t n_ubatch;       // the prefill ubatch in use (min of the parameter and n_batch), 0 when off
        uint32_t n_ubatch_last;  // the ubatch the last long prompt ran at
        uint64_t n_swaps;        // prompts that ran at the prefill ubatch
        uint64_t n_skipped[LLAMA_PREFILL_SWAP_SKIP_COUNT];
        uint64_t n_failed[LLAMA_PREFILL_SWAP_STEP_COUNT];
        // the last swap: milliseconds of each part, bytes of device memory freed and allocated again
        double   ms_release;     // wait for uploads, free the banks, the compute buffers and the scratch
        double   ms_reserve;     // reserve at the prefill ubatch
        double   ms_restore;     // free the prefill buffers, reserve at n_ubatch, allocate the banks, queue the warm uploads
        double   ms_total;       // over all swaps: release + reserve + restore
        uint64_t bytes_released; // slot banks + compute buffers + scratch, device memory only
        uint64_t bytes_restored; // slot banks + compute buffers
        int32_t  n_slots;        // slots per cached layer after the last restore
        uint64_t warm_uploads;   // experts queued by warm restores
        uint64_t warm_dropped;   // of them, dropped by the next swap before they were copied (their banks went)
        // the first LLAMA_PREFILL_SWAP_WARM_TOKENS decoded tokens after each restore
        uint64_t after_restore_tokens;
        uint64_t after_restore_hits;
        uint64_t after_restore_misses;
        // partial release: a swap after the first frees only the banks its prompt needs (what the swaps before
        // measured, plus the headroom, from the last layer back) and keeps the other layers warm
        uint64_t n_partial;           // swaps that kept some banks
        uint64_t n_partial_fallbacks; // partial releases that freed every bank after all (the prompt's buffers or the
                                      // parked banks did not fit beside the kept ones)
        uint64_t bytes_kept;          // the last swap: bank bytes kept beside the prompt's buffers
    };

    LLAMA_API struct llama_prefill_swap_params llama_prefill_swap_default_params(void);

    // before a prompt of n_tokens (what is left of it), with n_generating other sequences generating in
    // the same batches: 0 the swap is active, 1 not needed or not wanted (counted in n_skipped when
    // configured), -1 a step failed and was rolled back (the prompt runs at n_ubatch)
    LLAMA_API int32_t llama_prefill_swap_begin(struct llama_context * ctx, int32_t n_tokens, int32_t n_generating);

    // after the prompt, before its first token is sampled: 0 restored, 1 no swap was active, -1 restored
    // with a failed step (counted in n_failed; the context works, possibly without the cache)
    LLAMA_API int32_t llama_prefill_swap_end(struct llama_context * ctx);

    LLAMA_API bool llama_prefill_swap_active(const struct llama_context * ctx);

    // false without a context
    LLAMA_API bool llama_prefill_swap_get_stats(const struct llama_context * ctx, struct llama_prefill_swap_stats * out);

    //
    // The residency policies on their own, for offline replays of routing traces (moecache cache-sim)
    //

    struct llama_moe_policy_params {
        int32_t n_expert;
        int32_t n_slots;
        enum llama_moe_cache_policy policy;
        int32_t rebalance_interval; // FREQ
        int32_t admit_misses;       // LRU
        int32_t admit_window;       // LRU
        int32_t max_uploads;        // uploads planned per step
    };

    struct llama_moe_policy;

    // NULL when the parameters are invalid (n_expert > 0, n_slots in 0..n_expert, the others >= 1)
    LLAMA_API struct llama_moe_policy * llama_moe_policy_init(const struct llama_moe_policy_params * params);
    LLAMA_API void llama_moe_policy_free(struct llama_moe_policy * policy);

    // the routed experts of one accepted token
    LLAMA_API void llama_moe_policy_observe(struct llama_moe_policy * policy, const int32_t * ids, int32_t n);

    // plan this step's uploads (every pending change when force); writes up to n_max (slot, expert) pairs and
    // returns how many were planned (-1 if more than n_max); the planned slots are busy until done()
    LLAMA_API int32_t llama_moe_policy_plan(struct llama_moe_policy * policy, bool force, int32_t * slots, int32_t * experts, int32_t n_max);

    // the upload into slot finished (ok) or failed (the slot is emptied)
    LLAMA_API void llama_moe_policy_done(struct llama_moe_policy * policy, int32_t slot, bool ok);

    // keep expert resident; false when every slot is pinned to another expert or expert is out of range
    LLAMA_API bool llama_moe_policy_pin(struct llama_moe_policy * policy, int32_t expert);

    // the slot assigned to expert (loaded or loading) or -1; the expert a slot holds or loads or -1;
    // -2 when the argument is out of range
    LLAMA_API int32_t llama_moe_policy_slot_of(const struct llama_moe_policy * policy, int32_t expert);
    LLAMA_API int32_t llama_moe_policy_expert_in(const struct llama_moe_policy * policy, int32_t slot);
    LLAMA_API bool    llama_moe_policy_busy(const struct llama_moe_policy * policy, int32_t slot);
    LLAMA_API int32_t llama_moe_policy_n_rebalances(const struct llama_moe_policy * policy);

    //
    // Output slots: several decodes in flight
    //

    // With n > 1 output slots a decode writes its outputs (logits) into the selected slot, and llama_get_logits
    // and llama_get_logits_ith read the selected slot, waiting only for that slot's read-back copies where the
    // device records events (else for everything, as upstream). A server can then submit one group of
    // sequences while it samples another's tokens, so that over a pipelined layer split each device works
    // on another group's batch. 1: upstream's one output buffer. Logits only: not with embeddings or backend
    // samplers. Returns 0, or -1 (n < 1, or not with those).
    LLAMA_API int32_t llama_output_slots_set(struct llama_context * ctx, int32_t n);

    // the slot the next decodes write and the reads read (0 .. n-1); -1 when out of range
    LLAMA_API int32_t llama_output_slot_select(struct llama_context * ctx, int32_t slot);

    LLAMA_API int32_t llama_output_slots(const struct llama_context * ctx);

    // wait for the selected slot's outputs (llama_synchronize without output slots): what a caller that
    // reads the outputs itself calls instead of llama_synchronize, which waits for every decode in flight
    LLAMA_API void llama_output_slot_synchronize(struct llama_context * ctx);

    //
    // Memory planning
    //

    // The memory a context takes on each of its model's devices and on the host, or would take: the context of
    // a model loaded with no_alloc allocates nothing but reports the same figures, so that a planner can ask the
    // library instead of re-deriving tensor sizes. The hot-expert cache's banks, sized from the memory left
    // when a context is made, are absent from a no_alloc context: moe_slot says what each slot would cost.
    struct llama_moe_device_memory {
        ggml_backend_dev_t dev;       // nullptr: host memory (every host buffer type)
        size_t             model;     // weights
        size_t             context;   // KV cache and other state, the cache's banks included
        size_t             compute;   // compute buffers
        size_t             moe_banks; // the hot-expert cache's banks and tables (part of context)
        size_t             moe_slot;  // one slot of every cached layer whose device this is
        int32_t            n_moe_layers; // the cached layers whose device this is
    };

    // fills out[0 .. n_max) with the model's devices in order, then the host; returns how many there are
    // (which may exceed n_max), or -1 without a context
    LLAMA_API int32_t llama_moe_memory_breakdown(const struct llama_context * ctx, struct llama_moe_device_memory * out, int32_t n_max);

#ifdef __cplusplus
}
#endif
