#include "llama-moe-cache-policy.h"

#include "llama-moe.h"

#include <algorithm>
#include <cstdint>
#include <numeric>

llama_moe_layer_policy::llama_moe_layer_policy(const llama_moe_policy_config & cfg) : cfg(cfg) {
    slot_expert .assign(cfg.n_slots, -1);
    slot_busy   .assign(cfg.n_slots, 0);
    expert_slot .assign(cfg.n_expert, -1);
    pinned      .assign(cfg.n_expert, 0);
    window_count.assign(cfg.n_expert, 0);
    last_use    .assign(cfg.n_expert, 0);
    miss_count  .assign(cfg.n_expert, 0);
    miss_first  .assign(cfg.n_expert, 0);
}

void llama_moe_layer_policy::observe(const int32_t * ids, int32_t n) {
    clock++;
    for (int32_t i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (e < 0 || e >= cfg.n_expert) {
            continue;
        }
        window_count[e]++;
        last_use[e] = clock;
        if (expert_slot[e] >= 0) {
            continue;
        }
        // a miss: fill empty slots right away, later admit by the policy's rule
        const bool has_free = std::find(slot_expert.begin(), slot_expert.end(), -1) != slot_expert.end();
        if (has_free) {
            if (std::find(fill.begin(), fill.end(), e) == fill.end()) {
                fill.push_back(e);
            }
            continue;
        }
        if (cfg.kind == LLAMA_MOE_POLICY_LRU) {
            if (clock - miss_first[e] > (uint64_t) cfg.admit_window) {
                miss_count[e] = 0;
                miss_first[e] = clock;
            }
            if (++miss_count[e] >= (uint32_t) cfg.admit_misses) {
                miss_count[e] = 0;
                admitted.erase(std::remove(admitted.begin(), admitted.end(), e), admitted.end());
                admitted.push_back(e);
            }
        }
    }
    window_tokens++;
}

int32_t llama_moe_layer_policy::free_slot() const {
    for (int32_t s = 0; s < cfg.n_slots; ++s) {
        if (slot_expert[s] < 0 && !slot_busy[s]) {
            return s;
        }
    }
    return -1;
}

// the least recently routed resident that may be replaced now
int32_t llama_moe_layer_policy::lru_victim() const {
    int32_t  best = -1;
    uint64_t best_use = UINT64_MAX;
    for (int32_t s = 0; s < cfg.n_slots; ++s) {
        const int32_t e = slot_expert[s];
        if (slot_busy[s] || e < 0 || pinned[e]) {
            continue;
        }
        // an expert of the latest token stays: it is the likeliest to be routed again
        if (last_use[e] < best_use && last_use[e] < clock) {
            best_use = last_use[e];
            best = s;
        }
    }
    return best;
}

void llama_moe_layer_policy::assign(int32_t slot, int32_t expert, std::vector<llama_moe_upload> & out) {
    const int32_t old = slot_expert[slot];
    if (old >= 0) {
        expert_slot[old] = -1;
    }
    slot_expert[slot] = expert;
    expert_slot[expert] = slot;
    slot_busy[slot] = 1;
    out.push_back({slot, expert});
}

void llama_moe_layer_policy::warm(const std::vector<int32_t> & experts, std::vector<llama_moe_upload> & out) {
    for (const int32_t e : experts) {
        if (e < 0 || e >= cfg.n_expert || expert_slot[e] >= 0) {
            continue;
        }
        const int32_t s = free_slot();
        if (s < 0) {
            break;
        }
        assign(s, e, out);
    }
}

void llama_moe_layer_policy::retarget(const std::vector<int32_t> & experts, std::vector<llama_moe_upload> & out) {
    // position of each expert in the ranking (first occurrence), INT32_MAX for one not ranked; the first n_slots
    // distinct ones are the targets
    std::vector<int32_t> pos(cfg.n_expert, INT32_MAX);
    std::vector<int32_t> targets;
    int32_t n_ranked = 0;
    for (const int32_t e : experts) {
        if (e < 0 || e >= cfg.n_expert || pos[e] != INT32_MAX) {
            continue;
        }
        pos[e] = n_ranked++;
        if ((int32_t) targets.size() < cfg.n_slots) {
            targets.push_back(e);
        }
    }
    // decisions made from the routing before the new ranking are stale
    pending.clear();
    fill.clear();
    admitted.clear();
    for (const int32_t e : targets) {
        if (expert_slot[e] >= 0) {
            continue;
        }
        int32_t s = free_slot();
        if (s < 0) {
            // the resident ranked lowest that is not a target, not pinned and not loading
            int32_t worst = -1;
            for (int32_t t = 0; t < cfg.n_slots; ++t) {
                const int32_t r = slot_expert[t];
                if (r < 0 || slot_busy[t] || pinned[r] || pos[r] < (int32_t) targets.size()) {
                    continue;
                }
                if (worst < 0 || pos[r] > pos[slot_expert[worst]]) {
                    worst = t;
                }
            }
            if (worst < 0) {
                break;
            }
            s = worst;
        }
        assign(s, e, out);
    }
}

void llama_moe_layer_policy::done(int32_t slot, bool ok) {
    slot_busy[slot] = 0;
    if (!ok && slot_expert[slot] >= 0) {
        expert_slot[slot_expert[slot]] = -1;
        slot_expert[slot] = -1;
    }
}

bool llama_moe_layer_policy::pin(int32_t expert) {
    if (pinned[expert]) {
        return true;
    }
    int32_t n_pinned = 0;
    for (int32_t e = 0; e < cfg.n_expert; ++e) {
        n_pinned += pinned[e];
    }
    if (n_pinned >= cfg.n_slots) {
        return false;
    }
    pinned[expert] = 1;
    if (expert_slot[expert] < 0) {
        pin_queue.push_back(expert);
    }
    return true;
}

void llama_moe_layer_policy::plan(std::vector<llama_moe_upload> & out, bool force, int32_t max_uploads) {
    if (cfg.n_slots <= 0) {
        return;
    }
    int32_t budget = force ? INT32_MAX : (max_uploads > 0 ? max_uploads : cfg.max_uploads);

    // pins first: into a free slot, else over the least recently used unpinned resident
    while (budget > 0 && !pin_queue.empty()) {
        const int32_t e = pin_queue.front();
        if (expert_slot[e] >= 0) {
            pin_queue.erase(pin_queue.begin());
            continue;
        }
        int32_t s = free_slot();
        if (s < 0) {
            s = lru_victim();
        }
        if (s < 0) {
            // every candidate slot is busy or pinned; try again at the next step
            for (int32_t t = 0; t < cfg.n_slots && s < 0; ++t) {
                if (!slot_busy[t] && (slot_expert[t] < 0 || !pinned[slot_expert[t]])) {
                    s = t;
                }
            }
            if (s < 0) {
                break;
            }
        }
        pin_queue.erase(pin_queue.begin());
        assign(s, e, out);
        budget--;
    }

    // fill empty slots with experts in routing order
    size_t n_used_fill = 0;
    for (; n_used_fill < fill.size() && budget > 0; ++n_used_fill) {
        const int32_t e = fill[n_used_fill];
        if (expert_slot[e] >= 0) {
            continue;
        }
        const int32_t s = free_slot();
        if (s < 0) {
            break;
        }
        assign(s, e, out);
        budget--;
    }
    fill.erase(fill.begin(), fill.begin() + n_used_fill);
    if (free_slot() < 0) {
        fill.clear(); // full: from now on the policy's own rule decides
    }

    if (cfg.kind == LLAMA_MOE_POLICY_FREQ) {
        plan_freq(out, budget, force);
    } else {
        plan_lru(out, budget);
    }
}

void llama_moe_layer_policy::plan_freq(std::vector<llama_moe_upload> & out, int32_t budget, bool force) {
    if (force || window_tokens >= cfg.interval) {
        if (window_tokens > 0) {
            // residents get a bonus so that near-ties do not swap back and forth
            const int32_t bonus = (int32_t) std::clamp<int64_t>((int64_t) cfg.n_slots*cfg.interval/320 + 6, 6, 24);
            std::vector<int64_t> score(cfg.n_expert);
            for (int32_t e = 0; e < cfg.n_expert; ++e) {
                score[e] = (int64_t) window_count[e] + (expert_slot[e] >= 0 ? bonus : 0);
                if (pinned[e]) {
                    score[e] = INT64_MAX / 2;
                }
            }
            std::vector<int32_t> order(cfg.n_expert);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });

            std::vector<uint8_t> wanted(cfg.n_expert, 0);
            for (int32_t i = 0; i < cfg.n_slots && i < cfg.n_expert; ++i) {
                // an expert never routed in the window is not worth an upload
                if (window_count[order[i]] > 0 || expert_slot[order[i]] >= 0 || pinned[order[i]]) {
                    wanted[order[i]] = 1;
                }
            }
            // incoming: wanted but not resident, best first; outgoing: resident, unwanted, worst first
            std::vector<int32_t> incoming;
            for (int32_t i = 0; i < cfg.n_expert; ++i) {
                if (wanted[order[i]] && expert_slot[order[i]] < 0) {
                    incoming.push_back(order[i]);
                }
            }
            std::vector<int32_t> outgoing;
            for (int32_t i = cfg.n_expert - 1; i >= 0; --i) {
                const int32_t e = order[i];
                if (!wanted[e] && expert_slot[e] >= 0 && !pinned[e]) {
                    outgoing.push_back(expert_slot[e]);
                }
            }
            pending.clear();
            for (size_t i = 0; i < incoming.size() && i < outgoing.size(); ++i) {
                pending.push_back({outgoing[i], incoming[i]});
            }
            if (!pending.empty()) {
                rebalances++;
            }
            std::fill(window_count.begin(), window_count.end(), 0);
            window_tokens = 0;
        }
    }

    size_t i = 0;
    for (; i < pending.size() && budget > 0; ++i) {
        const llama_moe_upload & p = pending[i];
        // the plan may be stale: skip swaps whose slot is busy or whose expert arrived another way
        if (slot_busy[p.slot] || expert_slot[p.expert] >= 0 ||
            (slot_expert[p.slot] >= 0 && pinned[slot_expert[p.slot]])) {
            continue;
        }
        assign(p.slot, p.expert, out);
        budget--;
    }
    pending.erase(pending.begin(), pending.begin() + i);
}

void llama_moe_layer_policy::plan_lru(std::vector<llama_moe_upload> & out, int32_t budget) {
    bool changed = false;
    while (budget > 0 && !admitted.empty()) {
        const int32_t e = admitted.back();
        admitted.pop_back();
        if (expert_slot[e] >= 0) {
            continue;
        }
        int32_t s = free_slot();
        if (s < 0) {
            s = lru_victim();
        }
        if (s < 0) {
            admitted.push_back(e);
            break;
        }
        assign(s, e, out);
        budget--;
        changed = true;
    }
    // admissions that waited too long are stale
    if (admitted.size() > (size_t) cfg.n_slots) {
        admitted.erase(admitted.begin(), admitted.end() - cfg.n_slots);
    }
    if (changed) {
        rebalances++;
    }
}

//
// C API (llama-moe.h): the same policies for offline replays
//

struct llama_moe_policy {
    llama_moe_layer_policy impl;
    std::vector<llama_moe_upload> plan;
};

llama_moe_policy * llama_moe_policy_init(const llama_moe_policy_params * p) {
    if (!p || p->n_expert <= 0 || p->n_slots < 0 || p->n_slots > p->n_expert || p->rebalance_interval < 1 ||
        p->admit_misses < 1 || p->admit_window < 1 || p->max_uploads < 1 ||
        (p->policy != LLAMA_MOE_CACHE_POLICY_FREQ && p->policy != LLAMA_MOE_CACHE_POLICY_LRU)) {
        return nullptr;
    }
    llama_moe_policy_config cfg;
    cfg.n_expert     = p->n_expert;
    cfg.n_slots      = p->n_slots;
    cfg.kind         = p->policy == LLAMA_MOE_CACHE_POLICY_LRU ? LLAMA_MOE_POLICY_LRU : LLAMA_MOE_POLICY_FREQ;
    cfg.interval     = p->rebalance_interval;
    cfg.admit_misses = p->admit_misses;
    cfg.admit_window = p->admit_window;
    cfg.max_uploads  = p->max_uploads;
    return new llama_moe_policy{ llama_moe_layer_policy(cfg), {} };
}

void llama_moe_policy_free(llama_moe_policy * policy) {
    delete policy;
}

void llama_moe_policy_observe(llama_moe_policy * policy, const int32_t * ids, int32_t n) {
    if (policy && ids && n > 0) {
        policy->impl.observe(ids, n);
    }
}

int32_t llama_moe_policy_plan(llama_moe_policy * policy, bool force, int32_t * slots, int32_t * experts, int32_t n_max) {
    if (!policy) {
        return 0;
    }
    // a plan that did not fit last time is handed out first
    if (policy->plan.empty()) {
        policy->impl.plan(policy->plan, force);
    }
    const int32_t n = (int32_t) policy->plan.size();
    if (n > n_max || (n > 0 && (!slots || !experts))) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        slots[i]   = policy->plan[i].slot;
        experts[i] = policy->plan[i].expert;
    }
    policy->plan.clear();
    return n;
}

void llama_moe_policy_done(llama_moe_policy * policy, int32_t slot, bool ok) {
    if (policy && slot >= 0 && slot < policy->impl.config().n_slots) {
        policy->impl.done(slot, ok);
    }
}

bool llama_moe_policy_pin(llama_moe_policy * policy, int32_t expert) {
    if (!policy || expert < 0 || expert >= policy->impl.config().n_expert) {
        return false;
    }
    return policy->impl.pin(expert);
}

int32_t llama_moe_policy_slot_of(const llama_moe_policy * policy, int32_t expert) {
    if (!policy || expert < 0 || expert >= policy->impl.config().n_expert) {
        return -2;
    }
    return policy->impl.slot_of(expert);
}

int32_t llama_moe_policy_expert_in(const llama_moe_policy * policy, int32_t slot) {
    if (!policy || slot < 0 || slot >= policy->impl.config().n_slots) {
        return -2;
    }
    return policy->impl.expert_in(slot);
}

bool llama_moe_policy_busy(const llama_moe_policy * policy, int32_t slot) {
    return policy && slot >= 0 && slot < policy->impl.config().n_slots && policy->impl.busy(slot);
}

int32_t llama_moe_policy_n_rebalances(const llama_moe_policy * policy) {
    return policy ? policy->impl.n_rebalances() : 0;
}
