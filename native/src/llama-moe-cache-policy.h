#pragma once

// Residency policies of the hot-expert cache: which expert each slot of one layer should hold.
// Plain host logic without ggml, so it can be unit-tested on its own. The cache (llama-moe-cache.cpp)
// executes the plans: it uploads an expert into its slot and publishes the slot only after the copy.

#include <cstdint>
#include <utility>
#include <vector>

enum llama_moe_policy_kind {
    LLAMA_MOE_POLICY_FREQ = 0, // windowed routing counts, rebalance every `interval` tokens, hysteresis
    LLAMA_MOE_POLICY_LRU  = 1, // least recently used, admission after k misses in a window, capped uploads
};

struct llama_moe_policy_config {
    int32_t n_expert     = 0;
    int32_t n_slots      = 0;
    llama_moe_policy_kind kind = LLAMA_MOE_POLICY_FREQ;
    int32_t interval     = 40; // FREQ: tokens between rebalances
    int32_t admit_misses = 2;  // LRU: misses within admit_window tokens before an expert is admitted
    int32_t admit_window = 16; // LRU
    int32_t max_uploads  = 2;  // uploads planned per step (fills of empty slots and pins included)
};

// one planned upload: put `expert` into `slot` (replacing whatever the slot held)
struct llama_moe_upload {
    int32_t slot;
    int32_t expert;
};

class llama_moe_layer_policy {
public:
    explicit llama_moe_layer_policy(const llama_moe_policy_config & cfg);

    // the routed experts of one accepted token
    void observe(const int32_t * ids, int32_t n);

    // plan this step's uploads (at most max_uploads, or every pending change when `force`);
    // the slots of planned uploads are busy until done() is called for them
    // max_uploads > 0: this step's cap instead of cfg.max_uploads (the cache adapts it to the link)
    void plan(std::vector<llama_moe_upload> & out, bool force, int32_t max_uploads = 0);

    // the upload into `slot` finished (or failed: then the slot is emptied)
    void done(int32_t slot, bool ok);

    // plan uploads of `experts` (most wanted first) into the empty slots, without the per-step cap:
    // a warm start from known routing (the prefill-phase swap refills the slots with the prompt's experts)
    void warm(const std::vector<int32_t> & experts, std::vector<llama_moe_upload> & out);

    // plan uploads so that the slots hold the first n_slots of `experts` (most wanted first), into the empty
    // slots first, then over the residents ranked lowest that are not among them (never a pinned or loading
    // one); what is already resident stays. A warm start of a layer that kept its slots (the prefill-phase
    // swap's partial release): only the experts that differ are copied. Drops the decisions made before
    void retarget(const std::vector<int32_t> & experts, std::vector<llama_moe_upload> & out);

    // keep `expert` resident; false when every slot is already pinned to another expert
    bool pin(int32_t expert);

    int32_t slot_of(int32_t expert) const { return expert_slot[expert]; } // assigned slot (loaded or loading), -1
    int32_t expert_in(int32_t slot) const { return slot_expert[slot]; }
    bool    busy(int32_t slot) const { return slot_busy[slot] != 0; }
    bool    is_pinned(int32_t expert) const { return pinned[expert] != 0; }
    int32_t n_rebalances() const { return rebalances; }
    const llama_moe_policy_config & config() const { return cfg; }

private:
    void    assign(int32_t slot, int32_t expert, std::vector<llama_moe_upload> & out);
    int32_t free_slot() const;
    int32_t lru_victim() const;
    void    plan_freq(std::vector<llama_moe_upload> & out, int32_t budget, bool force);
    void    plan_lru (std::vector<llama_moe_upload> & out, int32_t budget);

    llama_moe_policy_config cfg;

    std::vector<int32_t> slot_expert; // slot -> expert it holds or loads, -1 empty
    std::vector<int32_t> expert_slot; // expert -> slot, -1 not assigned
    std::vector<uint8_t> slot_busy;   // an upload into the slot is in flight
    std::vector<uint8_t> pinned;      // per expert

    // FREQ
    std::vector<uint32_t> window_count;       // routed count per expert in the current window
    int32_t               window_tokens = 0;
    std::vector<llama_moe_upload> pending;    // swaps decided by the last rebalance, not yet issued

    // LRU
    uint64_t              clock = 0;          // accepted tokens seen
    std::vector<uint64_t> last_use;           // clock of the last routing to the expert (+1; 0 = never)
    std::vector<uint32_t> miss_count;
    std::vector<uint64_t> miss_first;         // clock of the first miss of the current window
    std::vector<int32_t>  admitted;           // experts that passed the gate, newest last

    // both: experts seen while empty slots remain (filled first, in routing order)
    std::vector<int32_t>  fill;
    std::vector<int32_t>  pin_queue;

    int32_t rebalances = 0;
};
