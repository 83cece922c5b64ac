// Unit tests of the hot-expert cache's residency policies (native/src/llama-moe-cache-policy.cpp):
// plain host logic, no ggml; the class and the C API of llama-moe.h, both from libllama. Each failed
// check prints a line; the last line counts the passes and the failures.

#include "llama-moe-cache-policy.h"
#include "llama-moe.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

static int n_pass = 0;
static int n_fail = 0;

#define CHECK(cond, ...) do { \
    if (cond) { n_pass++; } else { n_fail++; printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); printf(__VA_ARGS__); printf("\n"); } \
} while (0)

// plan one step and finish its uploads at once (as if the copies completed before the next step)
static std::vector<llama_moe_upload> step(llama_moe_layer_policy & p, bool force = false) {
    std::vector<llama_moe_upload> out;
    p.plan(out, force);
    for (const auto & u : out) {
        p.done(u.slot, true);
    }
    return out;
}

static std::set<int> resident(const llama_moe_layer_policy & p) {
    std::set<int> r;
    for (int s = 0; s < p.config().n_slots; ++s) {
        if (p.expert_in(s) >= 0) {
            r.insert(p.expert_in(s));
        }
    }
    return r;
}

// slot -> expert and expert -> slot agree, no expert in two slots
static bool consistent(const llama_moe_layer_policy & p) {
    std::set<int> seen;
    for (int s = 0; s < p.config().n_slots; ++s) {
        const int e = p.expert_in(s);
        if (e < 0) {
            continue;
        }
        if (seen.count(e) || p.slot_of(e) != s) {
            return false;
        }
        seen.insert(e);
    }
    for (int e = 0; e < p.config().n_expert; ++e) {
        const int s = p.slot_of(e);
        if (s >= 0 && p.expert_in(s) != e) {
            return false;
        }
    }
    return true;
}

static llama_moe_policy_config config(llama_moe_policy_kind kind, int n_expert, int n_slots) {
    llama_moe_policy_config c;
    c.kind = kind;
    c.n_expert = n_expert;
    c.n_slots = n_slots;
    c.interval = 8;
    c.admit_misses = 2;
    c.admit_window = 16;
    c.max_uploads = 2;
    return c;
}

static void test_fill(llama_moe_policy_kind kind, const char * name) {
    llama_moe_layer_policy p(config(kind, 16, 4));
    const int32_t t0[2] = {3, 7};
    p.observe(t0, 2);
    auto up = step(p);
    CHECK(up.size() == 2, "%s: fill uploads %zu", name, up.size());
    CHECK(resident(p) == std::set<int>({3, 7}), "%s: fill keeps routing order", name);
    const int32_t t1[2] = {1, 2};
    const int32_t t2[2] = {5, 9};
    p.observe(t1, 2);
    p.observe(t2, 2);
    up = step(p);
    CHECK(up.size() == 2, "%s: fill is capped at max_uploads (%zu)", name, up.size());
    CHECK(resident(p).size() == 4, "%s: all slots full", name);
    CHECK(consistent(p), "%s: maps consistent after fill", name);
    // once full, the leftover fill candidates are dropped
    up = step(p);
    CHECK(up.empty() || kind == LLAMA_MOE_POLICY_FREQ, "%s: no uploads without a reason", name);
}

static void test_freq_rebalance() {
    llama_moe_layer_policy p(config(LLAMA_MOE_POLICY_FREQ, 16, 4));
    // fill with 0..3
    for (int e = 0; e < 4; ++e) {
        const int32_t id = e;
        p.observe(&id, 1);
    }
    step(p, false);
    step(p, false);
    CHECK(resident(p) == std::set<int>({0, 1, 2, 3}), "filled with the first experts");

    // the window now routes 8..11 much more than the residents
    for (int t = 0; t < 8; ++t) {
        const int32_t ids[4] = {8, 9, 10, 11};
        p.observe(ids, 4);
    }
    auto up = step(p);
    CHECK(up.size() == 2, "a rebalance issues at most max_uploads per step (%zu)", up.size());
    step(p);
    CHECK(resident(p) == std::set<int>({8, 9, 10, 11}), "rebalance moved to the hot experts");
    CHECK(p.n_rebalances() == 1, "one rebalance (%d)", p.n_rebalances());
    CHECK(consistent(p), "consistent after rebalance");

    // hysteresis: a challenger slightly more frequent than a resident does not displace it
    for (int t = 0; t < 8; ++t) {
        const int32_t ids[4] = {8, 9, 10, t < 2 ? 11 : 12};
        p.observe(ids, 4);
    }
    up = step(p);
    CHECK(up.empty(), "near-tie does not swap (hysteresis), got %zu uploads", up.size());
}

static void test_lru_admission() {
    llama_moe_layer_policy p(config(LLAMA_MOE_POLICY_LRU, 16, 2));
    const int32_t a[2] = {0, 1};
    p.observe(a, 2);
    step(p);
    CHECK(resident(p) == std::set<int>({0, 1}), "lru filled");

    // one miss of expert 5 is not enough to be admitted
    const int32_t b[2] = {0, 5};
    p.observe(b, 2);
    auto up = step(p);
    CHECK(up.empty(), "one miss does not admit (%zu uploads)", up.size());
    // a second miss inside the window admits it; the victim is the least recently used (1)
    p.observe(b, 2);
    up = step(p);
    CHECK(up.size() == 1 && up[0].expert == 5, "second miss admits expert 5");
    CHECK(resident(p) == std::set<int>({0, 5}), "expert 1 (least recently used) was evicted");
    CHECK(consistent(p), "lru consistent");

    // misses spread wider than the window do not admit
    llama_moe_policy_config c = config(LLAMA_MOE_POLICY_LRU, 16, 2);
    c.admit_window = 2;
    llama_moe_layer_policy q(c);
    q.observe(a, 2);
    step(q);
    const int32_t miss[2] = {0, 7};
    const int32_t hit[2] = {0, 1};
    q.observe(miss, 2);
    for (int t = 0; t < 4; ++t) {
        q.observe(hit, 2);
    }
    q.observe(miss, 2);
    up = step(q);
    CHECK(up.empty(), "misses further apart than the window do not admit (%zu)", up.size());
}

static void test_upload_cap_and_busy() {
    llama_moe_policy_config c = config(LLAMA_MOE_POLICY_LRU, 32, 8);
    c.max_uploads = 3;
    llama_moe_layer_policy p(c);
    std::vector<int32_t> ids(8);
    for (int i = 0; i < 8; ++i) {
        ids[i] = i;
    }
    p.observe(ids.data(), 8);
    std::vector<llama_moe_upload> out;
    p.plan(out, false);
    CHECK(out.size() == 3, "cap of 3 uploads per step (%zu)", out.size());
    for (const auto & u : out) {
        CHECK(p.busy(u.slot), "a planned slot is busy until done");
    }
    // a failed upload empties its slot
    p.done(out[0].slot, false);
    CHECK(p.expert_in(out[0].slot) == -1 && p.slot_of(out[0].expert) == -1, "failed upload empties the slot");
    p.done(out[1].slot, true);
    p.done(out[2].slot, true);
    CHECK(consistent(p), "consistent after a failure");
    // force plans everything that is pending
    out.clear();
    p.plan(out, true);
    CHECK(out.size() == 5, "force issues all pending fills (%zu)", out.size());
}

static void test_pin(llama_moe_policy_kind kind, const char * name) {
    llama_moe_layer_policy p(config(kind, 16, 2));
    const int32_t a[2] = {0, 1};
    p.observe(a, 2);
    step(p);
    CHECK(p.pin(9), "%s: pin accepted", name);
    step(p);
    CHECK(resident(p).count(9) == 1, "%s: pinned expert resident", name);
    // heavy traffic elsewhere never evicts the pinned expert
    for (int t = 0; t < 64; ++t) {
        const int32_t ids[2] = {(int32_t) (t % 5), (int32_t) (5 + t % 3)};
        p.observe(ids, 2);
        p.observe(ids, 2);
        step(p);
    }
    CHECK(resident(p).count(9) == 1, "%s: pinned expert survives", name);
    CHECK(p.pin(3), "%s: second pin fits (2 slots)", name);
    CHECK(!p.pin(4), "%s: a third pin is refused when every slot is pinned", name);
    step(p, true);
    CHECK(resident(p) == std::set<int>({9, 3}), "%s: both pins resident", name);
    CHECK(consistent(p), "%s: consistent with pins", name);
}

// a warm start of a layer that kept its slots: only the experts not resident are copied, over the residents
// ranked lowest; pinned and loading residents stay
static void test_retarget(llama_moe_policy_kind kind, const char * name) {
    llama_moe_layer_policy p(config(kind, 16, 4));
    std::vector<llama_moe_upload> out;
    p.warm({0, 1, 2, 3}, out);
    for (const auto & u : out) {
        p.done(u.slot, true);
    }
    CHECK(resident(p) == std::set<int>({0, 1, 2, 3}), "%s: warm fills the empty slots", name);
    CHECK(p.pin(3), "%s: pin", name);
    // ranking 5, 1, 6, 0, 2, 4: targets 5, 1, 6, 0; 3 is pinned, so 2 (ranked 5th) and then nothing else goes
    out.clear();
    p.retarget({5, 1, 6, 0, 2, 4}, out);
    CHECK(out.size() == 1 && out[0].expert == 5 && p.slot_of(2) < 0, "%s: one copy, over the lowest-ranked resident (%zu)", name, out.size());
    CHECK(resident(p) == std::set<int>({0, 1, 3, 5}), "%s: residents after retarget", name);
    CHECK(consistent(p), "%s: consistent after retarget", name);
    // the copy of 5 still loading: a second ranking that drops it cannot take its slot
    out.clear();
    p.retarget({7, 8, 1}, out);
    CHECK(resident(p).count(5) == 1 && resident(p).count(3) == 1, "%s: loading and pinned residents stay", name);
    CHECK(out.size() == 1 && resident(p) == std::set<int>({1, 3, 5, 7}), "%s: 7 in over 0, 8 finds no slot (%zu)", name, out.size());
    for (const auto & u : out) {
        p.done(u.slot, true);
    }
    // a ranking it already holds copies nothing
    out.clear();
    p.retarget({1, 3, 5, 7}, out);
    CHECK(out.empty(), "%s: nothing to copy", name);
    CHECK(consistent(p), "%s: consistent at the end", name);
}

// random routing: the invariants hold whatever happens
static void test_random(llama_moe_policy_kind kind, const char * name) {
    llama_moe_layer_policy p(config(kind, 64, 12));
    uint32_t rng = 12345;
    auto next = [&]() { rng = rng*1664525u + 1013904223u; return rng >> 8; };
    std::vector<llama_moe_upload> inflight;
    bool ok = true;
    for (int t = 0; t < 2000; ++t) {
        int32_t ids[8];
        for (int k = 0; k < 8; ++k) {
            // skewed: half the routing goes to experts 0..9
            ids[k] = (next() % 2) ? (int32_t) (next() % 10) : (int32_t) (next() % 64);
        }
        p.observe(ids, 8);
        std::vector<llama_moe_upload> out;
        p.plan(out, false);
        // uploads complete one step later, as with the real copy thread
        for (const auto & u : inflight) {
            p.done(u.slot, true);
        }
        inflight = out;
        ok = ok && consistent(p) && out.size() <= 2;
    }
    CHECK(ok, "%s: invariants under random routing", name);
    int hot = 0;
    for (int e = 0; e < 10; ++e) {
        hot += p.slot_of(e) >= 0;
    }
    CHECK(hot >= 7, "%s: the skewed experts end up resident (%d of 10)", name, hot);
}

// the hysteresis bonus grows with n_slots * interval; that product must not overflow int32
static void test_freq_bonus_no_overflow() {
    llama_moe_policy_config c = config(LLAMA_MOE_POLICY_FREQ, 4, 2);
    c.interval = 1 << 30; // 2 slots * 2^30 is past INT32_MAX
    llama_moe_layer_policy p(c);
    const int32_t fill[2] = {0, 1};
    p.observe(fill, 2);
    step(p);
    CHECK(resident(p) == std::set<int>({0, 1}), "filled with 0 and 1");
    // expert 2 routed 10 times, the residents not at all: below the largest bonus (24), above the smallest (6)
    for (int t = 0; t < 10; ++t) {
        const int32_t id = 2;
        p.observe(&id, 1);
    }
    step(p, true);
    CHECK(resident(p) == std::set<int>({0, 1}), "a huge interval gives the largest bonus: no swap (an overflow made it the smallest)");
}

// the C API (llama_moe_policy_*) runs the same policy and checks its arguments
static void test_c_api() {
    llama_moe_policy_params bad = { 8, 9, LLAMA_MOE_CACHE_POLICY_FREQ, 40, 2, 16, 2 };
    CHECK(llama_moe_policy_init(&bad) == nullptr, "more slots than experts is refused");
    bad = { 0, 0, LLAMA_MOE_CACHE_POLICY_FREQ, 40, 2, 16, 2 };
    CHECK(llama_moe_policy_init(&bad) == nullptr, "no experts is refused");
    bad = { 8, 4, (enum llama_moe_cache_policy) 7, 40, 2, 16, 2 };
    CHECK(llama_moe_policy_init(&bad) == nullptr, "an unknown policy is refused");
    CHECK(llama_moe_policy_init(nullptr) == nullptr, "NULL params are refused");

    llama_moe_policy_params pp = { 16, 4, LLAMA_MOE_CACHE_POLICY_FREQ, 8, 2, 16, 2 }; // as config() below
    llama_moe_policy * cp = llama_moe_policy_init(&pp);
    llama_moe_layer_policy ref(config(LLAMA_MOE_POLICY_FREQ, 16, 4));
    CHECK(cp != nullptr, "valid params give a policy");
    bool same = cp != nullptr;
    uint32_t rng = 7;
    for (int t = 0; t < 300 && same; ++t) {
        int32_t ids[2];
        for (int k = 0; k < 2; ++k) {
            rng = rng * 1664525u + 1013904223u;
            ids[k] = (int32_t) ((rng >> 16) % (k == 0 ? 5 : 16));
        }
        if (ids[0] == ids[1]) {
            ids[1] = (ids[1] + 1) % 16;
        }
        llama_moe_policy_observe(cp, ids, 2);
        ref.observe(ids, 2);
        int32_t slots[4], experts[4];
        const int32_t n = llama_moe_policy_plan(cp, false, slots, experts, 4);
        const auto want = step(ref);
        same = n == (int32_t) want.size();
        for (int32_t i = 0; i < n && same; ++i) {
            same = slots[i] == want[i].slot && experts[i] == want[i].expert;
            llama_moe_policy_done(cp, slots[i], true);
        }
        for (int e = 0; e < 16 && same; ++e) {
            same = llama_moe_policy_slot_of(cp, e) == ref.slot_of(e);
        }
    }
    CHECK(same, "the C API plans exactly what the class plans");
    CHECK(llama_moe_policy_slot_of(cp, 16) == -2 && llama_moe_policy_expert_in(cp, -1) == -2, "out-of-range arguments give -2");
    CHECK(!llama_moe_policy_pin(cp, 99), "pinning an expert out of range fails");
    CHECK(llama_moe_policy_n_rebalances(cp) == ref.n_rebalances(), "same rebalance count");
    llama_moe_policy_free(cp);
}

int main() {
    test_fill(LLAMA_MOE_POLICY_FREQ, "freq");
    test_fill(LLAMA_MOE_POLICY_LRU, "lru");
    test_freq_rebalance();
    test_lru_admission();
    test_upload_cap_and_busy();
    test_pin(LLAMA_MOE_POLICY_FREQ, "freq");
    test_pin(LLAMA_MOE_POLICY_LRU, "lru");
    test_retarget(LLAMA_MOE_POLICY_FREQ, "freq");
    test_retarget(LLAMA_MOE_POLICY_LRU, "lru");
    test_random(LLAMA_MOE_POLICY_FREQ, "freq");
    test_random(LLAMA_MOE_POLICY_LRU, "lru");
    test_freq_bonus_no_overflow();
    test_c_api();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail == 0 ? 0 : 1;
}
