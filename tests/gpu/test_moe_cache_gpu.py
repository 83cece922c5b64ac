"""Hot-expert cache on CUDA: the equality checks of tests/e2e/test_moe_cache_server.py
with the slot banks in VRAM and the misses on the CPU. Through the server (own process).

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, N_LAYER, N_USED, PROMPTS, cache_stats, complete, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE_ARGS = ["-t", "8", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui"]
stats = cache_stats


@pytest.fixture(scope="module")
def stock(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS, timeout=180) as srv:
        yield [complete(srv, p) for p in PROMPTS]


def test_held_empty_cache_on_cuda_matches_stock(tiny_model, stock):
    env = {"LLAMA_MOE_CACHE_HOLD_EMPTY": "1"}
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "8"], env=env, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = stats(srv)
    assert st["enabled"] and st["total"]["hits"] == 0 and st["total"]["misses"] > 0
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 1e-3


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_cache_on_cuda_matches_stock(tiny_model, stock, policy):
    args = BASE_ARGS + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-policy", policy,
                        "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)
        outs = [complete(srv, p) for p in PROMPTS]
        st = stats(srv)["total"]
    assert st["uploads"] > 0 and st["hit_rate_recent"] > 0.5, st
    assert st["hits"] + st["misses"] == st["n_tokens"] * N_USED * N_LAYER
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        # hits run on the GPU, misses on the CPU: only device rounding may differ
        assert max_logprob_diff(a, b) < 2e-2


@pytest.mark.parametrize("fail,extra", [
    ("upload:3", []),                # one layer's upload fails: that layer takes the stock path
    ("staging", ["--no-host"]),      # experts in pageable memory, no pinned staging: direct copies
    ("alloc", []),                   # no banks at all: the stock graphs
])
def test_cuda_cache_failures_keep_serving_the_stock_output(tiny_model, stock, fail, extra):
    args = BASE_ARGS + extra + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-max-uploads", "16",
                                "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(tiny_model, args=args, env={"LLAMA_MOE_CACHE_FAIL": fail}, timeout=180) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)
        outs = [complete(srv, p) for p in PROMPTS]
        st = stats(srv)
        again = complete(srv, PROMPTS[1])
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
    assert again["tokens"] == stock[1]["tokens"]
    if fail == "alloc":
        assert st["enabled"] is False
    elif fail == "staging":
        assert st["enabled"] is True and st["total"]["uploads"] > 0
    else:
        assert sum(1 for layer in st["layers"] if not layer["cached"]) == 1


def test_cache_active_ubatches_of_64_with_every_expert_resident(tiny_model):
    """-ub 64 under --moe-cache-max-batch 64: the prompt's ubatches run through the cache. Once every
    expert is resident the CPU half of a layer has only skip ids, and the scheduler, which copies the
    host experts of batches of 32+ tokens to the GPU, must then copy none (its scan for the first used
    expert had no bound). The output equals the stock path's."""
    long_prompt = PROMPTS[1] * 6
    shared = ["-ub", "64", "-b", "64"]
    with ServerProcess(tiny_model, args=BASE_ARGS + shared, timeout=180) as srv:
        ref = complete(srv, long_prompt, n_predict=16)
    args = BASE_ARGS + shared + ["--moe-cache-max-batch", "64", "--moe-cache-slots", str(N_EXPERT),
                                 "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        for _ in range(3):
            complete(srv, PROMPTS[0] * 3, n_predict=48)  # fill every slot
        out = complete(srv, long_prompt, n_predict=16)
        st = stats(srv)
    resident = [layer["n_resident"] for layer in st["layers"]]
    assert out["tokens"] == ref["tokens"]
    assert st["total"]["batches_cached"] > 0 and max(resident) == N_EXPERT, resident


def test_maps_kept_on_cuda_match_the_maps_as_an_input(tiny_model):
    """The cache's maps kept in VRAM (changed between graphs) against the graph's input: with every upload
    waited for (LLAMA_MOE_CACHE_SYNC_UPLOADS=1) both runs put the same experts in the same slots at the same
    steps, so a stale map (a hit computed on the CPU, or the wrong slot) would change the log-probabilities;
    the kept maps also equal the host's after every change (LLAMA_MOE_CACHE_MAPS_CHECK=1)."""
    args = BASE_ARGS + ["--moe-cache-slots", "6", "--moe-cache-policy", "lru", "--moe-cache-max-uploads", "4", "-lv", "4"]
    runs = []
    for maps in ("1", "0"):
        env = {"LLAMA_MOE_CACHE_SYNC_UPLOADS": "1", "LLAMA_MOE_CACHE_DEVICE_MAPS": maps, "LLAMA_MOE_CACHE_MAPS_CHECK": "1"}
        with ServerProcess(tiny_model, args=args, env=env, timeout=180) as srv:
            outs = [complete(srv, p * 2, n_predict=32) for p in PROMPTS + PROMPTS]
            runs.append((outs, stats(srv)["total"], srv.log_text()))
    (kept, st, log), (as_input, st_input, _) = runs
    assert "cached layers kept in CUDA0" in log and "equal the host's" in log and "differ from the host's" not in log
    assert st["uploads"] > 0 and st["evictions"] > 0 and st["hits"] == st_input["hits"], (st, st_input)
    for a, b in zip(as_input, kept):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0
