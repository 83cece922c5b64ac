"""The prefill-phase swap through `import moecache` (CPU: the expert cache's banks on the host test
device). A long prompt runs at prefill_ubatch and generates what a context made with that n_ubatch
generates; a short one is the stock path; a failing step leaves a working context; the settings and
the counters are in ctx.prefill_swap."""

from __future__ import annotations

import pytest

import moecache
from moecache import api

LONG = "The committee met on Tuesday to discuss the budget for the coming year, and " * 20  # ~300 tokens
SHORT = "def fibonacci(n):\n"
CTX = {"n_ctx": 1024, "n_batch": 256}
CACHE = {"moe_cache_slots": 8, "moe_cache_max_uploads": 16, "moe_cache_rebalance_interval": 4}
SWAP = {"n_ubatch": 32, "prefill_ubatch": 128, "prefill_min_tokens": 64}


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    for table in (api.MOE_CACHE_OPTIONS, api.PREFILL_SWAP_OPTIONS):
        for option in table.values():
            for var in option.env_names:
                monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("LLAMA_PREFILL_SWAP_FAIL", raising=False)
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOST_DEVICE", "1")


@pytest.fixture(scope="module")
def model(tiny_model):
    return moecache.Model(tiny_model, cpu_moe=True, repack=False)


def test_a_long_prompt_swaps_and_generates_what_that_ubatch_generates(model):
    ref = model.context(**CTX, n_ubatch=128, **CACHE).generate(LONG, max_tokens=16)
    ctx = model.context(**CTX, **SWAP, **CACHE)
    assert ctx.prefill_swap.enabled and "prefill_ubatch=128" in repr(ctx.prefill_swap)
    g = ctx.generate(LONG, max_tokens=16)
    assert g.timings["prefill_ubatch"] == 128 and g.timings["prefill_swap_ms"] > 0
    assert g.tokens == ref.tokens
    short = ctx.generate(SHORT, max_tokens=8)
    assert short.timings["prefill_ubatch"] == 32 and short.timings["prefill_swap_ms"] == 0
    st = ctx.prefill_swap.stats()
    assert st["swaps"] == 1 and st["skipped"]["short"] == 1 and st["n_ubatch_last"] == 128
    assert st["n_slots"] == 8 and st["warm_uploads"] > 0 and not any(st["failed"].values())
    assert ctx.n_ubatch == 32  # the context keeps its decode ubatch


def test_without_a_prefill_ubatch_nothing_changes(model):
    ctx = model.context(**CTX, n_ubatch=32, **CACHE)
    assert not ctx.prefill_swap.enabled and repr(ctx.prefill_swap) == "moecache.PrefillSwap(off)"
    g = ctx.generate(LONG, max_tokens=4)
    assert g.timings["prefill_ubatch"] == 32 and ctx.prefill_swap.stats()["swaps"] == 0


def test_a_failed_reserve_runs_the_prompt_at_n_ubatch(model, monkeypatch):
    ref = model.context(**CTX, n_ubatch=32, **CACHE).generate(LONG, max_tokens=16)
    monkeypatch.setenv("LLAMA_PREFILL_SWAP_FAIL", "reserve")
    ctx = model.context(**CTX, **SWAP, **CACHE)
    g = ctx.generate(LONG, max_tokens=16)
    again = ctx.generate(LONG, max_tokens=16)
    assert g.timings["prefill_ubatch"] == 32 and g.tokens == ref.tokens
    assert again.timings["prefill_ubatch"] == 128
    st = ctx.prefill_swap.stats()
    assert st["failed"]["reserve"] == 1 and st["swaps"] == 1


def test_options_come_from_arguments_then_the_environment(model, monkeypatch):
    monkeypatch.setenv("LLAMA_PHASE_PREFILL_UBATCH", "128")  # the public write-up's name
    monkeypatch.setenv("LLAMA_ARG_PREFILL_WARM_RESTORE", "off")
    ctx = model.context(**CTX, n_ubatch=32, prefill_min_tokens=64)
    assert ctx.prefill_swap.options == {"prefill_ubatch": 128, "prefill_min_tokens": 64,
                                        "prefill_swap_mode": "transaction", "prefill_warm_restore": False,
                                        "prefill_restore_wait_ms": 0}
    assert ctx.generate(LONG, max_tokens=2).timings["prefill_ubatch"] == 128
    with pytest.raises(ValueError, match="prefill_swap_mode must be one of 'transaction', 'bypass'"):
        model.context(**CTX, n_ubatch=32, prefill_swap_mode="fast")
    monkeypatch.setenv("LLAMA_ARG_PREFILL_MIN_TOKENS", "many")
    with pytest.raises(ValueError, match="LLAMA_ARG_PREFILL_MIN_TOKENS .* must be an integer >= 1"):
        model.context(**CTX, n_ubatch=32)


def test_the_compute_buffer_holds_logits_for_one_output(tiny_model, capfd):
    """A large prefill ubatch costs its activations, not n_ubatch rows of logits: generate needs one
    output per decode (the upstream default reserves n_batch outputs: 1188 MiB at 2048 here)."""
    import re

    m = moecache.Model(tiny_model, verbose=True)
    capfd.readouterr()
    m.context(n_ctx=2048, n_batch=2048, n_ubatch=2048).generate(SHORT, max_tokens=2)
    log = capfd.readouterr().err
    mib = [float(x) for x in re.findall(r"CPU compute buffer size =\s*([0-9.]+) MiB", log)]
    all_logits_mib = 2048 * m.n_vocab * 4 / 2**20
    assert mib and max(mib) < all_logits_mib / 8, (mib, all_logits_mib)


def test_pinned_experts_stay_pinned_across_a_swap(model):
    import numpy as np

    # no rebalance during the few decoded tokens: what is resident after them is what the restore brought
    ctx = model.context(**CTX, **SWAP, **{**CACHE, "moe_cache_rebalance_interval": 10000})
    # the expert of layer 1 that the prompt routes least: the warm restore alone would not bring it back
    ids = ctx.trace_routing(LONG)[:, ctx.moe_layers.index(1), :]
    counts = np.bincount(ids.ravel(), minlength=model.n_expert)
    expert = int(np.argmin(counts))
    assert counts[expert] < np.sort(counts)[-CACHE["moe_cache_slots"]]  # not among the slots' worth of top experts
    ctx.expert_cache.pin(1, expert)
    ctx.expert_cache.rebalance()
    assert expert in ctx.expert_cache.resident(1)
    ctx.generate(LONG, max_tokens=8)
    assert ctx.prefill_swap.stats()["swaps"] == 1
    assert expert in ctx.expert_cache.resident(1)


def test_the_restore_can_wait_for_its_warm_copies(model, monkeypatch):
    """prefill_restore_wait_ms: the restore waits (at most that long) until its warm copies are made (each 20 ms
    slower here), so the first tokens find the prompt's experts in the slots; without it the copies run behind
    decode. The tokens are the same either way."""
    monkeypatch.setenv("LLAMA_MOE_CACHE_UPLOAD_DELAY_MS", "20")
    runs = {}
    for wait in (0, 10000):
        ctx = model.context(**CTX, **SWAP, **CACHE, prefill_restore_wait_ms=wait)
        assert f"restore_wait_ms={wait}" in repr(ctx.prefill_swap)
        runs[wait] = (ctx.generate(LONG, max_tokens=8), ctx.prefill_swap.stats())
    (cold, cold_st), (warm, warm_st) = runs[0], runs[10000]
    assert warm.tokens == cold.tokens
    assert warm_st["warm_uploads"] >= 8, warm_st
    assert warm_st["restore_ms"] >= warm_st["warm_uploads"] * 20 * 0.9, warm_st
    assert cold_st["restore_ms"] < warm_st["restore_ms"] / 2, (cold_st, warm_st)
    with pytest.raises(ValueError, match="prefill_restore_wait_ms must be an integer in"):
        model.context(**CTX, **SWAP, prefill_restore_wait_ms=-5)
