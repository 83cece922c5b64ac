"""The hot-expert cache through `import moecache`, on the tiny synthetic qwen3moe, on the CPU.

A CPU-only build has no GPU for the slot banks, so these tests use the library's test device:
with LLAMA_MOE_CACHE_HOST_DEVICE=1 set before a context is made, the slots live in host memory
and the hit/miss split runs entirely on the CPU. The experts are host tensors that are not
repacked (Model(cpu_moe=True, repack=False)), as the cache needs. Greedy output with the cache
must equal the stock path token for token; the counters must add up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import moecache
from moecache import api

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
CTX = {"n_ctx": 512, "n_batch": 256, "n_ubatch": 64}


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    """The test device for the slot banks, and none of the cache's environment defaults."""
    for option in api.MOE_CACHE_OPTIONS.values():
        for var in option.env_names:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOST_DEVICE", "1")


@pytest.fixture(scope="module")
def model(tiny_model):
    m = moecache.Model(tiny_model, cpu_moe=True, repack=False)
    assert m.n_expert >= 8 and 0 < m.n_expert_used < m.n_expert
    return m


def reasons(ctx) -> str:
    return "; ".join(f"layer {il}: {ctx.expert_cache.layer_reason(il)}" for il in range(ctx.model.n_layer))


def cached_context(model, **options):
    ctx = model.context(**CTX, **options)
    assert ctx.expert_cache.enabled, f"no layer is cached: {reasons(ctx)}"
    # cpu_moe=True puts the experts of every layer in host memory, and every qwen3moe layer is MoE
    assert ctx.expert_cache.layers == list(range(model.n_layer)), reasons(ctx)
    return ctx


def stock_tokens(model, max_tokens: int) -> list[int]:
    g = model.context(**CTX).generate(PROMPT, max_tokens=max_tokens)
    assert g.tokens, "the stock path generated nothing"
    return g.tokens


# --- (a) no slots is the stock path ------------------------------------------------------------


def test_zero_slots_is_the_stock_path(model):
    stock = model.context(**CTX)
    zero = model.context(**CTX, moe_cache_slots=0, moe_cache_size_mib=0)
    for ctx in (stock, zero):
        assert not ctx.expert_cache.enabled
        assert ctx.expert_cache.layers == []
        assert repr(ctx.expert_cache) == "ExpertCache(off)"
        with pytest.raises(ValueError, match="no expert cache"):
            ctx.expert_cache.stats()
        with pytest.raises(ValueError, match="no expert cache"):
            ctx.expert_cache.resident(0)
        with pytest.raises(ValueError, match="no expert cache"):
            ctx.expert_cache.pin(0, 0)
        assert isinstance(ctx.expert_cache.layer_reason(0), str) and ctx.expert_cache.layer_reason(0)
    a = stock.generate(PROMPT, max_tokens=32)
    b = zero.generate(PROMPT, max_tokens=32)
    assert a.tokens and a.tokens == b.tokens
    assert a.text == b.text


def test_a_cache_held_empty_gives_the_stock_output(model, monkeypatch):
    # the library's test switch: a cache that never uploads, so every routed expert is a miss and
    # the hot/cold split must add nothing but zeros from the slots
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOLD_EMPTY", "1")
    ref = stock_tokens(model, 32)
    ctx = cached_context(model, moe_cache_slots=model.n_expert)
    g = ctx.generate(PROMPT, max_tokens=32)
    ctx.expert_cache.rebalance()
    assert g.tokens == ref
    s = ctx.expert_cache.stats()
    assert s["hits"] == 0 and s["misses"] > 0 and s["uploads"] == 0 and s["batches_cached"] > 0
    assert all(ctx.expert_cache.resident(il) == [] for il in ctx.expert_cache.layers)


# --- (b, f) every expert fits: the same greedy output as the stock path, with either policy -----


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_all_experts_cached_gives_the_stock_output(model, policy):
    n_tokens = 48
    ref = stock_tokens(model, n_tokens)
    options = {"moe_cache_slots": model.n_expert, "moe_cache_policy": policy, "moe_cache_max_uploads": model.n_expert}
    if policy == "lru":
        # admit every routed expert at its first miss, however long ago
        options.update(moe_cache_admit_misses=1, moe_cache_admit_window=4096)
    ctx = cached_context(model, **options)
    assert ctx.moe_cache_options["moe_cache_policy"] == policy
    # warm up on the very prompt: the decode steps below route to the experts it routed to
    ctx.generate(PROMPT, max_tokens=n_tokens)
    ctx.expert_cache.rebalance()
    for il in ctx.expert_cache.layers:
        resident = ctx.expert_cache.resident(il)
        assert resident, f"layer {il}: nothing resident after the warm-up and rebalance()"
        assert len(set(resident)) == len(resident) and all(0 <= e < model.n_expert for e in resident)
    # Experts the warm-up never routed to are not resident yet; pin them so that every expert is,
    # whatever the policy does with unseen ones: then no (token, expert) pair is a miss, and the
    # output must be the stock path's bit for bit (a mix of hits and misses may round differently).
    for il in ctx.expert_cache.layers:
        for e in sorted(set(range(model.n_expert)) - set(ctx.expert_cache.resident(il))):
            ctx.expert_cache.pin(il, e)
    for _ in range(model.n_expert):  # in case a step uploads fewer than asked
        ctx.expert_cache.rebalance()
        if all(len(ctx.expert_cache.resident(il)) == model.n_expert for il in ctx.expert_cache.layers):
            break
    for il in ctx.expert_cache.layers:
        assert sorted(ctx.expert_cache.resident(il)) == list(range(model.n_expert)), f"layer {il}"
    ctx.expert_cache.reset_stats()
    got = ctx.generate(PROMPT, max_tokens=n_tokens)
    assert got.tokens == ref
    s = ctx.expert_cache.stats()
    assert s["hits"] > 0 and s["misses"] == 0 and s["batches_cached"] > 0
    assert s["n_slots"] == model.n_expert


# --- (c) the counters add up ----------------------------------------------------------------------


def test_stats_add_up(model):
    half = model.n_expert // 2
    k = model.n_expert_used
    ctx = cached_context(model, moe_cache_slots=half, moe_cache_rebalance_interval=16)
    g = ctx.generate(PROMPT, max_tokens=64)
    assert g.prompt_tokens > 8  # more than moe_cache_max_batch: the prompt takes the stock path
    assert g.timings["decode_tokens"] > 16, "the model stopped too early to exercise the cache"

    t = ctx.expert_cache.stats()
    assert t["n_layers_cached"] == len(ctx.expert_cache.layers) == model.n_layer
    assert t["n_slots"] == half
    assert 0 < t["n_tokens"] <= g.prompt_tokens + len(g.tokens)
    assert t["hits"] + t["misses"] == t["n_tokens"] * k * t["n_layers_cached"]
    assert 0.0 <= t["hit_rate"] <= 1.0 and 0.0 <= t["hit_rate_recent"] <= 1.0
    assert t["hit_rate"] == pytest.approx(t["hits"] / (t["hits"] + t["misses"]))
    assert t["batches_bypassed"]["batch"] >= 1  # the prompt
    assert set(t["batches_bypassed"]) == {"batch", "warmup"}
    assert t["batches_cached"] >= 1
    assert t["uploads"] > 0 and t["bytes_uploaded"] > 0
    assert t["evictions"] <= t["uploads"]
    assert t["step_ms_max"] >= 0.0 and t["step_ms_total"] >= t["step_ms_max"]
    assert t["bytes_vram"] > 0
    assert 0 <= t["n_resident"] <= half * t["n_layers_cached"]

    hits = misses = resident_total = 0
    for il in ctx.expert_cache.layers:
        s = ctx.expert_cache.stats(il)
        assert s["hits"] + s["misses"] == s["n_tokens"] * k, f"layer {il}: {s}"
        assert s["n_slots"] == half and 0 <= s["n_resident"] <= half
        resident = ctx.expert_cache.resident(il)
        assert len(resident) == s["n_resident"]
        assert len(set(resident)) == len(resident) and all(0 <= e < model.n_expert for e in resident)
        hits += s["hits"]
        misses += s["misses"]
        resident_total += s["n_resident"]
    assert (hits, misses, resident_total) == (t["hits"], t["misses"], t["n_resident"])

    js = ctx.expert_cache.stats_json()
    assert isinstance(js, dict) and js.get("enabled") is True
    json.dumps(js)

    assert "slots=" in repr(ctx.expert_cache) and "hit_rate=" in repr(ctx.expert_cache)
    assert "expert_cache=" in repr(ctx)

    ctx.expert_cache.reset_stats()
    r = ctx.expert_cache.stats()
    assert (r["n_tokens"], r["hits"], r["misses"], r["uploads"]) == (0, 0, 0, 0)
    assert r["n_resident"] == t["n_resident"]  # the residency stays


def test_bad_layers_are_refused(model):
    ctx = cached_context(model, moe_cache_slots=4)
    for bad in (-1, model.n_layer, 1.5):
        with pytest.raises(ValueError, match="layer"):
            ctx.expert_cache.stats(bad)
        with pytest.raises(ValueError, match="layer"):
            ctx.expert_cache.resident(bad)
        with pytest.raises(ValueError, match="layer"):
            ctx.expert_cache.layer_reason(bad)
    # the native checks, without the wrapper's
    with pytest.raises(ValueError, match="out of range"):
        ctx._c.moe_cache_layer_reason(model.n_layer)
    with pytest.raises(ValueError):
        ctx._c.moe_cache_stats(-2)


# --- (d) pinning --------------------------------------------------------------------------------


def test_pin_makes_an_expert_resident(model):
    slots = 4
    ctx = cached_context(model, moe_cache_slots=slots, moe_cache_max_uploads=slots)
    il = ctx.expert_cache.layers[0]
    before = set(ctx.expert_cache.resident(il))
    expert = next(e for e in reversed(range(model.n_expert)) if e not in before)
    ctx.expert_cache.pin(il, expert)
    ctx.expert_cache.rebalance()
    assert expert in ctx.expert_cache.resident(il)
    ctx.generate(PROMPT, max_tokens=32)  # a pinned expert is never evicted
    ctx.expert_cache.rebalance()
    assert expert in ctx.expert_cache.resident(il)

    for bad in (model.n_expert, -1):
        with pytest.raises(ValueError, match="expert"):
            ctx.expert_cache.pin(il, bad)
    with pytest.raises(ValueError, match="out of range"):
        ctx._c.moe_cache_pin(il, model.n_expert)  # the library's own check (-2)
    with pytest.raises(ValueError, match="layer"):
        ctx.expert_cache.pin(model.n_layer, 0)

    # fill the other slots with pins, then one more is refused (-3)
    others = [e for e in range(model.n_expert) if e != expert][:slots - 1]
    for e in others:
        ctx.expert_cache.pin(il, e)
    extra = next(e for e in range(model.n_expert) if e != expert and e not in others)
    with pytest.raises(ValueError, match="pinned"):
        ctx.expert_cache.pin(il, extra)
    ctx.expert_cache.rebalance()
    assert set(ctx.expert_cache.resident(il)) == {expert, *others}


# --- (e) routing traces ---------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [0, 8])
def test_record_routing_writes_jsonl(model, tmp_path, slots):
    ctx = model.context(**CTX, moe_cache_slots=slots)
    assert ctx.expert_cache.enabled == bool(slots)
    path = tmp_path / "routing.jsonl"
    ctx.record_routing(path)
    assert ctx.routing_trace_path == str(path)
    g = ctx.generate(PROMPT, max_tokens=16)
    ctx.record_routing(None)
    assert ctx.routing_trace_path is None

    lines = path.read_text().splitlines()
    assert lines, "nothing was recorded"
    n_pos = g.prompt_tokens + len(g.tokens)
    positions = []
    for line in lines:
        rec = json.loads(line)
        assert {"seq", "pos", "layers"} <= set(rec), rec
        assert rec["seq"] == 0
        assert 0 <= rec["pos"] < n_pos
        positions.append(rec["pos"])
        assert rec["layers"], rec
        for il, ids in rec["layers"].items():
            assert 0 <= int(il) < model.n_layer
            assert len(ids) == model.n_expert_used and len(set(ids)) == len(ids)
            assert all(isinstance(e, int) and 0 <= e < model.n_expert for e in ids)
    if g.timings["decode_tokens"] > 0:
        assert max(positions) >= g.prompt_tokens  # decoded tokens are recorded, not only the prompt

    # stopped: another generation adds nothing
    ctx.generate(PROMPT, max_tokens=4)
    assert path.read_text().splitlines() == lines


def test_record_routing_into_a_missing_folder_names_the_path(model, tmp_path):
    ctx = model.context(**CTX)
    bad = tmp_path / "no" / "such" / "folder" / "routing.jsonl"
    with pytest.raises(OSError) as e:
        ctx.record_routing(bad)
    assert str(bad) in str(e.value)
    assert ctx.routing_trace_path is None
    with pytest.raises(ValueError):
        ctx.record_routing(42)
    ctx.record_routing(None)  # stopping when nothing records is fine


def test_trace_routing_on_a_cached_context_leaves_the_cache_alone(model):
    ctx = cached_context(model, moe_cache_slots=model.n_expert // 2)
    ctx.generate(PROMPT, max_tokens=8)
    before = ctx.expert_cache.stats()
    tokens = model.tokenize(PROMPT)
    ids = ctx.trace_routing(tokens)
    assert ids.shape == (len(tokens), model.n_layer, model.n_expert_used)
    ref = model.context(**CTX).trace_routing(tokens)
    assert np.array_equal(ids, ref)  # the tracing context takes the stock path
    after = ctx.expert_cache.stats()
    assert (after["n_tokens"], after["hits"], after["misses"]) == (before["n_tokens"], before["hits"], before["misses"])
