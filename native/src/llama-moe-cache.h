#pragma once

// Hot-expert cache (moecache): slot banks on each layer's device for the routed experts of MoE
// layers whose experts live in host memory. The graph (build_moe_ffn) splits the experts of a
// small batch into hits (slot bank, on the device) and misses (host tensor, on the CPU) with two
// maps per layer, expert -> slot (or -1) and expert -> expert (or -1), given to the graph as one
// input. Uploads run on a worker thread; a slot is published in the maps only after its copy
// finished, and unpublished before it is overwritten, so no graph reads a slot being written.
//
// Lifetime: the context makes the cache (checks the parameters, decides which layers can be
// cached) before the scheduler's first reservation, allocates the banks after it from the memory
// that is then left, and stops the cache before it frees its backends. Every failure after the
// parameter check (allocation, staging, upload) turns the cache, or the failed layer, off with a
// log line: the context keeps the stock path and its output.

#include "llama.h"
#include "llama-moe.h"
#include "llama-moe-cache-policy.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct llama_model;
struct llama_ubatch;
class llama_memory_i;
class llm_graph_result;

struct llama_moe_cache_layer {
    int32_t il = -1;
    int32_t n_used = 0;        // experts routed per token in this layer
    std::string reason;        // why the layer is not cached ("" when it is)

    // the layer's routed expert tensors (any layer with experts), to recognise them in the graph
    const ggml_tensor * routed[4] = {}; // up, gate, down, gate_up

    // host expert tensors and their slot banks: (gate_up) or (up, gate), then down
    ggml_tensor * src[3]  = {};
    ggml_tensor * bank[3] = {};
    // the layer's own context and buffer of its banks (and bias copies): a prefill-phase swap can free some
    // layers' banks and keep the others
    ggml_context_ptr        bank_ctx;
    ggml_backend_buffer_ptr bank_buf;
    bool                    parked = false; // banks freed for a swap's prompt, allocated again at its end
    size_t                  parked_bytes = 0; // the size of the buffer it had
    size_t        slot_bytes = 0; // bytes of one expert over the layer's tensors
    int32_t       n_slots    = 0; // the layer's slots: the even share, or its own by the profile (slots_by_layer)
    ggml_backend_dev_t dev = nullptr;

    // misses on the device: the host expert tensors as seen by the layer's device (zero-copy), null when
    // they are not mapped; whether the graphs run the misses on them now
    ggml_tensor * mapped[3] = {};
    bool          miss_device = false;
    // misses split per expert (LLAMA_MOE_CACHE_MISS_SPLIT): expert -> whether its misses run on the device (the
    // layer's most-routed missed experts), chosen every 16 steps
    std::vector<uint8_t> miss_dev;
    int32_t              n_miss_dev = 0;

    // expert biases (gpt-oss), as the model's tensors (up, gate, down, gate_up), and copies with one more
    // column, of zeros, past the last expert: on the layer's device (made with the banks) and in host memory
    // (for misses on the CPU). One expert FFN adds them with the routed ids as the stock path does; each of
    // the two branches adds them with its own ids, the zero column for the rows the other branch computes
    ggml_tensor * bias_src[4]  = {};
    ggml_tensor * bias[4]      = {};
    ggml_tensor * bias_host[4] = {};
    bool biased() const { return bias_src[0] || bias_src[1] || bias_src[2] || bias_src[3]; }
    bool          src_pinned  = false; // the host tensors are page-locked: uploads need no staging

    // hits and device misses in one expert FFN (ggml_mul_mat_id_table): per tensor, each expert's
    // address (its slot in the bank, or its mapped host matrix), on the layer's device; null when the
    // device cannot read such a table. table_tokens: the largest batch its device runs them for
    ggml_tensor * table[3]     = {};
    int32_t       table_dev    = -1; // index in llama_moe_cache::tables
    size_t        table_offset = 0;  // the layer's first entry in that device's tables
    int32_t       table_tokens = 0;

    // the routed ids of graphs of at most max_batch tokens, [n_used * max_batch] I32 on the layer's device
    // (a view of one tensor per device, read back in one copy); cached layers and the other routed layers
    // on a GPU
    ggml_tensor * ids_out = nullptr;
    int32_t       readback = -1;     // index in llama_moe_cache::readbacks
    size_t        ids_offset = 0;    // elements of ids_out into the readback's tensor

    // the maps (all rows) on the layer's device, kept there between graphs; null: the graphs take them as an
    // input, copied to the device for every split that reads them
    ggml_tensor * maps = nullptr;

    std::unique_ptr<llama_moe_layer_policy> policy;
    std::vector<int32_t> pins;           // pinned experts, kept while the banks are suspended
    std::vector<int32_t> published;      // expert -> published slot, -1
    std::vector<int32_t> slot_published; // slot -> published expert, -1
    int32_t              n_published = 0;
    bool                 complete    = false; // every expert in a published slot: no misses to run

    llama_moe_cache_stats stats = {};
    std::vector<uint16_t> recent_hits;   // per token of the recent window: hits of that token
    std::vector<uint32_t> heat;          // expert -> tokens routed to it since the stats were reset (its heat)
    size_t                recent_pos = 0;
    uint64_t              recent_n   = 0;

    bool cached() const { return reason.empty() && policy != nullptr; }
};

struct llama_moe_cache {
    // checks the parameters (std::invalid_argument names the bad one) and which layers can be
    // cached; allocates nothing
    llama_moe_cache(const llama_model & model, const llama_moe_cache_params & params);
    ~llama_moe_cache();

    // sizes and allocates the slot banks after the scheduler's reservation, from what is free on each
    // device minus the headroom (`context_bytes`: what the context holds per device, for the host
    // test device); a dry run (no_alloc) reserves nothing, the banks take what the fit leaves
    void allocate(bool no_alloc, const std::map<ggml_backend_dev_t, size_t> & context_bytes);

    // stops the upload worker and frees the banks (the layers keep `why` as their reason); the context
    // calls it before it frees its backends, and when the banks leave too little for the compute buffers
    void stop(const char * why = "the context is being freed");

    // --- graph side (const: the graph build must not change the cache)

    // whether these are layer il's routed experts (not, e.g., GroveMoE's chunk experts)
    bool is_routed(int32_t il, const ggml_tensor * up, const ggml_tensor * gate, const ggml_tensor * down,
            const ggml_tensor * gate_up) const;

    // where a batch of n_tokens writes layer il's routed ids for the one readback per device, else null
    // (the graph then reads them back on their own)
    ggml_tensor * routed_ids_out(int32_t il, int64_t n_tokens) const;

    // the layer's banks when batches of n_tokens use the cache for this layer and these tensors, else null
    const llama_moe_cache_layer * graph_layer(int32_t il, int64_t n_tokens, const ggml_tensor * up,
            const ggml_tensor * gate, const ggml_tensor * down, const ggml_tensor * gate_up) const;

    // whether the layer's misses run on its device in the graph being built (reservations: whenever
    // they can, the larger graph on the device)
    bool miss_on_device(const llama_moe_cache_layer & l) const {
        return l.mapped[0] && params.miss != LLAMA_MOE_CACHE_MISS_SPLIT && (reserving || l.miss_device);
    }
    // whether the layer's misses are split per expert between its device and the CPU (a third branch, reading
    // the map row split_map_row(il): expert -> expert on the device, else -1; the cold row then holds the CPU's)
    // (not at a share of 0: every miss is the CPU's, no device branch)
    bool miss_split(const llama_moe_cache_layer & l) const {
        return l.mapped[0] && params.miss == LLAMA_MOE_CACHE_MISS_SPLIT && params.miss_split_pct > 0;
    }
    int64_t split_map_row (int32_t il) const { return split_row0 + il; }
    // a biased layer's: expert if its misses run on the device, else n_expert (the zero column)
    int64_t split_bias_row(int32_t il) const { return split_row0 + (int64_t) layers.size() + il; }
    // whether the graphs run the layer's miss branch: not while every expert is in a slot (reservations
    // keep it, so the compute buffers fit either graph)
    bool runs_misses(const llama_moe_cache_layer & l) const { return reserving || !l.complete; }
    // whether batches of n_tokens run the layer's hits and misses in one expert FFN over its tables;
    // reservations build the two branches, the larger graph, so the compute buffers fit either
    bool runs_table(const llama_moe_cache_layer & l, int64_t n_tokens) const {
        return l.table[0] && !reserving && l.miss_device && n_tokens <= l.table_tokens;
    }
    // changes whenever a layer's misses move or it becomes complete (graph topology depends on both)
    uint64_t routes_version() const { return routes_ver; }
    // set by the context while it builds the graphs it reserves
    mutable bool reserving = false;

    // whether a batch of n_tokens uses the cache (graph topology depends on it)
    bool active_for(int64_t n_tokens, bool warmup) const;
    // whether graphs must output the routed ids of MoE layers (cache active or routing trace on)
    bool observing(int64_t n_tokens, bool warmup) const;

    int32_t n_expert() const { return n_exp; }
    int32_t n_layer () const { return (int32_t) layers.size(); }
    // host copy of the maps: [n_expert, n_map_rows()] I32, row 2*il = expert -> slot, row 2*il+1 = expert or -1;
    // for a model with expert biases also row 2*n_layer + 2*il = expert if in a slot, else n_expert (the
    // biases' zero column), and row 2*n_layer + 2*il + 1 = expert if not, else n_expert; with the misses split,
    // rows split_map_row(il) and split_bias_row(il) for the device's misses (the cold rows: the CPU's)
    const std::vector<int32_t> & maps() const { return maps_host; }
    int32_t n_map_rows() const { return map_rows; }

    // --- context side

    // start of every decode and before each later ubatch of it: commit the routing of accepted tokens
    // (those the memory holds: a decode's earlier ubatches count as accepted), publish finished uploads,
    // plan new ones
    void step(ggml_backend_sched_t sched, const llama_memory_i * memory);
    // after each ubatch's graph: read back the routed ids (async; consumed by the next step)
    void after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch, bool warmup);

    bool wanted () const { return wanted_slots > 0; }
    bool fail_reserve(); // test-only (LLAMA_MOE_CACHE_FAIL=reserve): the reservation with the banks fails
    bool enabled() const { return n_cached > 0; }
    void reset_stats();
    bool get_stats(int32_t il, llama_moe_cache_stats & out) const;
    int32_t resident(int32_t il, int32_t * experts, int32_t n_max) const;
    int32_t pin(int32_t il, int32_t expert);
    void rebalance(ggml_backend_sched_t sched, const llama_memory_i * memory);
    void flush(ggml_backend_sched_t sched, const llama_memory_i * memory) { commit(sched, memory); }
    std::string stats_json() const;
    bool set_trace(const char * path);
    void print_stats() const;
    const char * layer_reason(int32_t il) const;

    // --- expert profile across restarts (params.profile)

    // writes every cached layer's routing counts (the profile read at start plus this run's) to the profile
    // file, through a temporary file renamed over it, so a failure leaves the old file whole; the context
    // calls it when it is freed
    void save_profile();

    // --- prefill-phase swap (llama_context::prefill_swap_begin/end)

    // waits for the uploads in flight, unpublishes every slot and frees the banks; the layers stay
    // eligible for resume(). With collect_routing the prompt's routed experts are counted per layer
    // for a warm resume. Returns the bytes freed.
    size_t suspend(bool collect_routing);
    // allocates the banks again (at most the slots they had, from what is free minus the headroom)
    // and, with warm, queues uploads of the experts the prompt routed most (published only after their
    // copies, as every upload); fail_upload fails the first of them (LLAMA_PREFILL_SWAP_FAIL=upload).
    // false when no bank could be allocated: the cache stays suspended (stock path) until the next resume
    bool resume(const std::map<ggml_backend_dev_t, size_t> & context_bytes, bool warm, bool fail_upload, int32_t max_slots = 0);
    // the prompt's routing is no longer counted (every end of a swap, whether the cache came back or not)
    void end_collecting() { collecting = false; prompt_counts.clear(); }
    // the prompt's counts are kept for the warm restore, but no more graphs read the routing back
    void stop_collecting() { collecting = false; }
    // partial release: the banks of some layers only, from the last layer back, so that each device frees what
    // the last swaps' prompts measured they needed beyond what stayed free (plus the headroom); the other
    // layers keep their banks and experts. While parked, no graph uses the cache (the prompt's graphs are the
    // stock ones, as in a full suspension). can_park(): a swap of ubatches at least max_ubatch (the coming
    // prompt's largest) has measured the need (the first swap of a context suspends everything) and
    // LLAMA_PREFILL_SWAP_PARTIAL is not 0. Returns the bytes freed.
    bool   can_park(int64_t max_ubatch) const;
    size_t park(bool collect_routing, int64_t max_ubatch);
    // the end of a swap's prompt: per device, what the prompt's buffers took of the memory freed for it
    // (bank bytes freed minus what is free now); the next swaps park that much
    // (for prompts of ubatches up to this one's largest)
    void   measure_prompt(const std::map<ggml_backend_dev_t, size_t> & context_bytes);
    // the parked layers' banks again, at the same slot count, warm (as resume()); false when they do not fit
    // beside the headroom or an allocation fails (the caller suspends everything and resumes: the slots are
    // then sized again)
    bool   unpark(const std::map<ggml_backend_dev_t, size_t> & context_bytes, bool warm, bool fail_upload);
    bool   parking()  const { return is_parking; }   // between park() and unpark() (or a suspension)
    size_t bytes_kept() const { return kept_bytes; } // bank bytes the last park() kept
    size_t n_parked_layers() const;
    bool    suspended() const { return is_suspended; }
    int32_t slots() const { return n_slots; } // the even share per cached layer (layers may differ: slots_by_layer)
    size_t  bytes_banks() const;
    // uploads queued by warm resumes; routing of the first tokens decoded after each resume
    uint64_t warm_uploads() const { return n_warm_uploads; }
    uint64_t warm_dropped() const { return n_warm_dropped; }
    uint64_t warm_upload_failures() const { return n_warm_failed; }
    void after_resume(uint64_t & n_tokens, uint64_t & hits, uint64_t & misses) const;
    // after a warm resume or unpark: waits until its copies are made, at most max_ms (the swap's restore_wait_ms;
    // 0: no wait, the first tokens decode while the copies run); the ms waited
    double wait_warm(int32_t max_ms);

    // bytes of the slot banks per buffer type
    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const;
    // bytes of one slot of every layer the cache takes (or took), and how many layers, per device
    std::map<ggml_backend_dev_t, std::pair<size_t, int32_t>> slot_bytes_by_dev() const;

    llama_moe_cache_params params;

private:
    struct upload_job {
        int32_t il;
        int32_t slot;
        int32_t expert;
        bool    ok = false;
        std::string error;
        bool    warm = false; // queued by a warm resume
    };
    struct pending_layer {
        int32_t il;
        int32_t n_used;
        bool    split;              // the graph ran this layer's hits on its slot bank
        std::vector<int32_t> ids;   // [n_rows * n_used], filled async
        int32_t readback = -1;      // >= 0: ids are still in that readback's host copy (n_rows rows)
        int64_t n_rows   = 0;
    };
    struct pending_ubatch {
        std::vector<pending_layer> layers;
        std::vector<int32_t> seq, pos;
        std::vector<int32_t> out_row; // per token: its row among the output tokens, -1 (the last layer only sees those)
        int32_t n_out = 0;
        bool    cache_active = false;
    };

    // test-only fault injection (LLAMA_MOE_CACHE_FAIL): whether the n-th try of a step fails
    static bool fail_now(int64_t at, int64_t n);

    void disable(const std::string & why);                 // the whole cache: stock path from now on
    void release_banks(const std::string & why);           // disable() and free the banks (before any graph used them)
    void disable_layer(llama_moe_cache_layer & l, const std::string & why);
    void commit(ggml_backend_sched_t sched, const llama_memory_i * memory);
    void count_token(const pending_ubatch & ub, size_t t);
    void publish_done();
    void plan_uploads(ggml_backend_sched_t sched, bool force);
    void worker_main();
    void run_job(upload_job & job);
    void set_map(int32_t il, int32_t expert, int32_t slot);
    void set_miss_rows(int32_t il, int32_t expert); // the cold (and split) rows of a missed expert, from miss_dev
    void split_misses(llama_moe_cache_layer & l);   // SPLIT: which missed experts the device computes
    void make_host_biases();
    void map_host_experts();       // mapped[] of the layers whose device reads host memory in place
    void make_tables();            // table[] of the mapped layers whose device reads address tables
    void table_entry(llama_moe_cache_layer & l, int32_t expert); // from published[] into the host copy
    void flush_tables();           // the changed entries (tables, maps) to the devices (between graphs)
    void make_device_maps();       // maps of the cached layers kept on their devices
    // the banks of these layers, each in its own buffer, at each one's n_slots; false (nothing of this call kept) when one
    // allocation fails: that error is logged and the caller decides what follows
    bool alloc_banks(const std::vector<size_t> & ils, bool inject_fail, const char * then);
    void free_banks(llama_moe_cache_layer & l); // the layer's buffer, its bank and bias tensors
    // a swap's release of one layer: unpublished, its pins kept, its policy dropped (it stays eligible), its
    // buffer freed (also a layer a failed copy turned off); returns the bytes freed (counted in freed_for_prompt)
    size_t release_layer(llama_moe_cache_layer & l);
    llama_moe_policy_config policy_config(int32_t slots) const; // a new layer policy's
    // each cacheable layer's slot count for an even share of `slots`: that share, or with slots_by_layer and a
    // profile read, the counts that hold most of the profile's routing in the same bytes per device (a greedy over
    // each layer's next-hottest expert, at least half the even share a layer, at most every expert)
    void size_layers(int64_t slots);
    // reads the profile's counts into profile_counts (false, with a warning, when it is missing, damaged or another
    // model's: the counts stay zero)
    bool read_profile();
    bool profile_read = false; // read_profile() ran (at the first allocation)
    bool profile_ok   = false; // ... and its counts are the profile's
    // the free memory of a device for the banks: the host test device's budget minus what the context holds
    // there (context_bytes, the banks included), or what the device reports
    size_t free_for_banks(ggml_backend_dev_t dev, const std::map<ggml_backend_dev_t, size_t> & context_bytes) const;
    // drops queued uploads of the layers `drop` marks (their policies are told the slots stayed empty) and waits
    // for a running one of those; returns the warm uploads dropped
    uint64_t drop_uploads(const std::vector<bool> & drop);

    // one I64 tensor per device holding its layers' tables, a host copy, and the range written since
    // the last flush
    struct expert_tables {
        ggml_tensor *        all = nullptr;
        std::vector<int64_t> host;
        size_t               lo = SIZE_MAX, hi = 0;
    };
    std::vector<expert_tables> tables;
    // queue uploads of each cached layer's most-counted experts (count(il, expert)) into its empty slots;
    // the next steps publish them. Returns the uploads queued
    // retarget: the slots toward the ranking, replacing residents ranked lower (a partial release's kept layers)
    size_t queue_warm(const std::function<uint64_t(int32_t, int32_t)> & count, bool fail_upload = false, bool retarget = false);
    // the order a warm restore fills the slots in: the prompt's routing, or with warm_blend its share plus the
    // share of each expert in the profile's decode history (this run's and earlier ones')
    std::function<uint64_t(int32_t, int32_t)> warm_rank() const;
    bool   has_empty_slot() const; // a cached layer has a slot no expert is assigned to
    void   load_profile();         // at the first allocation: the profile's counts warm the slots

    void make_readbacks();         // ids_out and the readbacks
    void take_readbacks();         // pending layers' ids out of the host copies (after a synchronize)
    void update_routes();          // AUTO: each layer's misses on the CPU or the device; SPLIT: per expert

    // prefill-phase swap
    bool     is_suspended = false;
    bool     is_parking   = false;   // some layers parked, the others kept: no graph uses the cache
    bool     park_enabled = true;    // LLAMA_PREFILL_SWAP_PARTIAL=0: every swap suspends everything
    bool     retarget_kept = true;    // LLAMA_PREFILL_SWAP_RETARGET=0: kept layers keep their experts at a restore
    size_t   park_min_bytes = 0;     // LLAMA_PREFILL_SWAP_PARK_MIB (test-only): the least a partial release frees
    size_t   kept_bytes   = 0;
    int64_t  prompt_max_ubatch = 0;  // the largest ubatch of the swap's prompt so far
    int64_t  measured_ubatch   = 0;  // the largest ubatch a measured prompt ran
    std::map<ggml_backend_dev_t, size_t> freed_for_prompt; // bank bytes the current swap freed, per device
    std::map<ggml_backend_dev_t, int64_t> prompt_need;     // the most a swap's prompt took of them, per device (-1: not measured)
    bool     resuming     = false;   // allocate() logs its summary at debug level
    int32_t  resume_slots = 0;       // the most slots the banks had: what a resume asks for
    bool     collecting   = false;   // count the routing of uncached batches (the prompt) per layer
    std::vector<uint32_t> prompt_counts; // [n_layer * n_expert]
    // warm starts: from a prompt's routing (params.warm_prompts), from the profile (params.profile)
    std::string           profile_path;
    std::string           fingerprint;    // the model the profile belongs to (arch, layers, experts, parameters, bytes)
    std::vector<uint64_t> profile_counts; // [n_layer * n_expert]: the profile read at start plus this run's routing
    bool                  profile_used = false; // banks were made for real: only then is the profile written
    uint64_t n_profile_uploads = 0;
    uint64_t n_prompt_warm_uploads = 0;
    bool    fail_profile = false; // test-only (LLAMA_MOE_CACHE_FAIL=profile): writing the profile fails
    uint64_t n_warm_uploads = 0;
    uint64_t n_warm_dropped = 0;     // queued warm uploads that a following suspension dropped before they ran
    uint64_t n_warm_failed  = 0;
    int32_t  after_resume_left = 0;  // tokens still counted in the after-resume stats
    uint64_t after_resume_tokens = 0, after_resume_hits = 0, after_resume_misses = 0;
    std::atomic<bool> fail_next_upload { false };

    int32_t n_exp  = 0;
    int32_t n_cached = 0;
    int32_t n_slots  = 0;
    int32_t wanted_slots = 0; // slots asked for (or bought by size_mib), before the memory clamp
    size_t  bytes_all = 0;    // bytes of one slot over every cacheable layer
    bool    host_device = false; // test-only: banks in host memory when the layer runs on the CPU
    bool    hold_empty  = false; // test-only: never upload
    int32_t upload_delay_ms = 0; // test-only: each upload takes this much longer
    bool    assume_skip_ids = false; // test-only: devices that cannot say implement MUL_MAT_ID skip ids (rpc-servers)
    bool    sync_uploads = false; // test-only: a step waits for the uploads in flight (deterministic hits)
    bool    warm_blend   = true;  // warm_rank() blends in the profile's counts (LLAMA_MOE_CACHE_WARM_BLEND=0: not)
    double  host_device_mib = -1.0; // test-only: memory of the host test device in MiB, < 0 = unlimited
    double  host_device_taken_mib = 0.0; // test-only: what that device loses after the first allocation
    std::map<ggml_backend_dev_t, size_t> free_first; // free memory per device at the first allocation

    // LLAMA_MOE_CACHE_FAIL: fail the Nth bank allocation / staging allocation / upload (0 = never, -1 = every one)
    int64_t fail_alloc_at   = 0;
    int64_t fail_staging_at = 0;
    int64_t fail_reserve_at = 0;
    int64_t fail_upload_at  = 0;
    int64_t n_allocs  = 0;
    int64_t n_uploads_tried = 0; // counted on the worker thread

    std::vector<llama_moe_cache_layer> layers;
    std::vector<int32_t>               maps_host;
    int32_t                            map_rows = 0;
    // the maps on each device that holds cached layers, and the range of maps_host written since the last flush
    std::vector<ggml_tensor *>         maps_dev;
    size_t                             maps_lo = SIZE_MAX, maps_hi = 0;
    bool                               device_maps = true; // LLAMA_MOE_CACHE_DEVICE_MAPS=0: the graphs' input
    bool                               maps_check  = false; // LLAMA_MOE_CACHE_MAPS_CHECK=1 (tests): read back, compare
    int64_t                            n_maps_checked = 0;

    // misses on the device; routed ids read back once per device and ubatch
    struct readback {
        ggml_tensor *           ids = nullptr;  // on the device
        ggml_backend_buffer_ptr host_buf;       // pinned copy target, or null (host_plain)
        std::vector<int32_t>    host_plain;
        int32_t *               host = nullptr;
        bool                    busy = false;   // holds ids of a pending ubatch
    };
    std::vector<readback>                readbacks;
    std::vector<ggml_context_ptr>        aux_ctxs;  // mapped views, ids tensors: kept across suspensions
    std::vector<ggml_backend_buffer_ptr> aux_bufs;
    std::map<ggml_backend_buffer_type_t, size_t> aux_bytes; // device memory of the ids tensors
    bool     aux_made   = false;
    uint64_t routes_ver = 0;
    int64_t  split_row0 = 0; // the first map row of the split's device misses (LLAMA_MOE_CACHE_MISS_SPLIT)
    uint64_t n_steps    = 0; // step() calls: one per decode and per later ubatch of it; step_ms_total / n_steps is the mean
    bool     use_tables = true;  // LLAMA_MOE_CACHE_TABLE=0 turns the one expert FFN off
    bool     warm_interleave = true; // LLAMA_MOE_CACHE_WARM_INTERLEAVE=0: warm copies layer after layer
    bool     read_back_all = true; // LLAMA_MOE_CACHE_READBACK_ALL=0: only cached layers' ids in the one readback
    int32_t  upload_boost = 1;      // this step's upload cap = max_uploads * upload_boost
    bool     capped_last  = false;  // a layer's last plan was cut by the cap
    uint64_t n_route_switches = 0;
    uint64_t n_route_steps    = 0;
    int64_t  fail_map_at = 0; // LLAMA_MOE_CACHE_FAIL=map
    int64_t  n_maps      = 0;

    std::map<ggml_backend_buffer_type_t, size_t> bank_bytes; // allocated, per buffer type

    // uploads
    std::thread             worker;
    std::mutex              mutex;
    std::condition_variable cv;
    std::deque<upload_job>  queue;
    int32_t                 running_il = -1; // the layer of the upload the worker is copying, -1
    std::vector<upload_job> finished;
    bool                    stopping = false;
    int32_t                 in_flight = 0;
    ggml_backend_buffer_ptr staging_buf; // pinned; null when the device has no host buffer type (direct copies)

    std::deque<pending_ubatch> pending; // a deque: async reads target its elements, which must not move
    llama_moe_cache_stats totals_extra = {}; // batch counters and step timings (not per layer)

    struct file_closer { void operator()(FILE * f) const { fclose(f); } };
    std::unique_ptr<FILE, file_closer> trace;
};
