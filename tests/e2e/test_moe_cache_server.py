"""Hot-expert cache through the real llama-server on loopback.

CI has no GPU: LLAMA_MOE_CACHE_HOST_DEVICE=1 puts the slot banks in host memory, so the hit/miss
split, the maps, the uploads and their publishing all run on every CI run (hits and misses both on
the CPU). LLAMA_MOE_CACHE_HOLD_EMPTY=1 keeps the cache empty: every expert is then a miss and the
output must be bit-identical to the stock path. The same checks on CUDA are in tests/gpu.
"""

from __future__ import annotations

import json

import pytest

from moe_cache_checks import N_EXPERT, N_LAYER, N_USED, PROMPTS, cache_stats, complete, logprobs
from moecache.server import ServerError, ServerProcess

BASE_ARGS = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "0", "--no-repack", "--metrics"]
HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}
probs = logprobs


@pytest.fixture(scope="module")
def stock(tiny_model, llama_server_bin):
    with ServerProcess(tiny_model, args=BASE_ARGS, timeout=120) as srv:
        yield [complete(srv, p) for p in PROMPTS], srv.get("/moe-cache")[1]


def test_stock_server_reports_no_cache(stock):
    _, body = stock
    body = body if isinstance(body, dict) else json.loads(body)
    assert body["enabled"] is False


def test_held_empty_cache_is_bit_identical_to_stock(tiny_model, stock):
    """Every expert a miss: the hot half is all zeros, and the result must equal the stock path exactly."""
    ref, _ = stock
    env = {**HOST, "LLAMA_MOE_CACHE_HOLD_EMPTY": "1"}
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "8"], env=env, timeout=120) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
    for a, b in zip(ref, outs):
        assert a["tokens"] == b["tokens"]
        assert probs(a) == probs(b)  # exact, not approximately
    tot = st["total"]
    assert st["enabled"] is True and st["n_slots"] == 8 and st["n_layers_cached"] == N_LAYER
    assert tot["hits"] == 0 and tot["uploads"] == 0 and tot["n_resident"] == 0
    # every decoded token but the last of each request is committed: routed pairs are whole tokens
    assert tot["misses"] > 0 and tot["misses"] == tot["n_tokens"] * N_USED * N_LAYER
    assert tot["batches_bypassed"]["batch"] >= len(PROMPTS)  # the prompts are longer than 8 tokens
    assert tot["batches_cached"] >= tot["n_tokens"]


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_cache_with_every_expert_matches_stock(tiny_model, stock, policy):
    """All experts fit: after a warm-up request the decode runs (almost) only on the slots, and the
    greedy output equals the stock path token for token."""
    ref, _ = stock
    args = BASE_ARGS + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-policy", policy,
                        "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)  # warm-up: fill the slots
        warm = cache_stats(srv)["total"]
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
        status, metrics = srv.get("/metrics")
    for a, b in zip(ref, outs):
        assert a["tokens"] == b["tokens"]
        for pa, pb in zip(probs(a), probs(b)):
            assert [i for i, _ in pa] == [i for i, _ in pb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(pa, pb)) < 1e-3
    tot = st["total"]
    assert warm["uploads"] > 0 and tot["uploads"] >= warm["uploads"]
    assert tot["bytes_uploaded"] > 0
    assert tot["hits"] > warm["hits"]
    assert 0.0 < tot["hit_rate"] <= 1.0 and 0.0 <= tot["hit_rate_recent"] <= 1.0
    assert tot["hit_rate_recent"] > 0.5, tot
    assert tot["hits"] + tot["misses"] == tot["n_tokens"] * N_USED * N_LAYER
    assert st["policy"] == policy
    for layer in st["layers"]:
        assert layer["cached"] is True
        assert len(layer["resident"]) == layer["n_resident"] <= N_EXPERT
        assert len(set(layer["resident"])) == len(layer["resident"])
    assert status == 200
    text = metrics if isinstance(metrics, str) else json.dumps(metrics)
    assert "llamacpp:moe_cache_hits_total" in text and "llamacpp:moe_cache_hit_rate" in text


def test_small_cache_counts_evictions_and_traces_routing(tiny_model, tmp_path):
    """4 slots of 16: experts come and go; the routing trace has one JSON line per accepted token."""
    trace = tmp_path / "routing.jsonl"
    args = BASE_ARGS + ["--moe-cache-slots", "4", "--moe-cache-policy", "lru", "--moe-cache-admit-misses", "1",
                        "--moe-routing-trace", str(trace)]
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        for p in PROMPTS:
            complete(srv, p, n_predict=40)
        st = cache_stats(srv)["total"]
    assert st["evictions"] > 0 and st["uploads"] > st["evictions"] - 1
    assert 0.0 < st["hit_rate"] < 1.0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) >= 2 * 38
    decoded = [x for x in lines if x["cached"]]
    assert decoded, "no decode tokens in the trace"
    assert all(len(x["layers"]) == N_LAYER for x in decoded)
    for x in lines:
        assert set(x) == {"seq", "pos", "cached", "layers"}
        # the last layer runs only the rows of output tokens: prompt tokens miss it
        assert len(x["layers"]) == N_LAYER or (len(x["layers"]) == N_LAYER - 1 and str(N_LAYER - 1) not in x["layers"])
        for ids in x["layers"].values():
            assert len(ids) == N_USED and len(set(ids)) == N_USED
            assert all(0 <= i < N_EXPERT for i in ids)


def test_speculation_counts_only_accepted_tokens_and_drafts_fit_the_cache(tiny_model, tmp_path):
    """n-gram drafts verified through the cache: rejected draft tokens are computed but never counted
    (routing, hits and misses are per accepted token), drafts are capped so that no verify batch
    bypasses the cache, and the trace has each position once."""
    trace = tmp_path / "routing.jsonl"
    args = BASE_ARGS + ["--moe-cache-slots", "8", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1",
                        "--moe-routing-trace", str(trace)]
    prompt = PROMPTS[0] * 5  # a prompt whose n-grams the tiny model's greedy text partly breaks: rejected drafts
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        out = complete(srv, prompt, n_predict=320)
        st = cache_stats(srv)["total"]
    t = out["timings"]
    rejected = t["draft_n"] - t["draft_n_accepted"]
    # counted rejected tokens would lift n_tokens above `fed` below once there are more than 8
    assert rejected > 8, f"the test needs rejected drafts: {t}"
    assert 0 < t["draft_capped"] <= t["draft_verify_steps"], t  # drafts that reached the cap of 7
    # every generated token but the last was fed to a decode; the last verify step's tokens are
    # counted only once the next decode confirms them, and there is none
    fed = t["predicted_n"] - 1
    assert fed - 8 <= st["n_tokens"] <= fed, (st, t)
    assert st["hits"] + st["misses"] == st["n_tokens"] * N_USED * N_LAYER
    assert st["batches_bypassed"]["batch"] == 1  # the prompt; no verify batch was too large
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    pos = [x["pos"] for x in lines]
    assert len(pos) == len(set(pos)), "a position was traced twice (a rejected draft counted)"
    # the trace is read after the server stopped, which commits the last step's tokens too
    assert st["n_tokens"] <= sum(1 for x in lines if x["cached"]) <= fed


@pytest.mark.parametrize("flag,value,expect", [
    ("--moe-cache-policy", "bogus", "--moe-cache-policy"),
    ("--moe-cache-slots", "-3", "--moe-cache-slots"),
    ("--moe-cache-max-batch", "0", "--moe-cache-max-batch"),
])
def test_bad_cache_flags_fail_with_a_clear_error(tiny_model, llama_server_bin, flag, value, expect):
    with pytest.raises(ServerError) as e:
        with ServerProcess(tiny_model, args=BASE_ARGS + [flag, value], timeout=60):
            pass
    assert expect in str(e.value) and value in str(e.value)


def test_layers_on_the_cpu_are_not_cached_without_a_gpu(tiny_model, llama_server_bin):
    """Without the test device the cache refuses CPU-only layers and says why; output unchanged."""
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "4"], timeout=120) as srv:
        st = cache_stats(srv)
        log = srv.log_text()
    assert st["enabled"] is False
    assert "no layer can use the hot-expert cache" in log
    assert all(layer["cached"] is False for layer in st["layers"])
    assert "no GPU" in st["layers"][0]["reason"]


def test_upload_cap_grows_while_the_link_is_idle(tiny_model):
    """--moe-cache-max-uploads 1: on the test device each copy is done long before the next step, so
    while a layer wants more than the cap, the cap doubles per step (up to 8x); /moe-cache reports the
    cap in use. Output unchanged (the uploads only move experts between the CPU and the slots)."""
    args = BASE_ARGS + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-max-uploads", "1",
                        "--moe-cache-policy", "lru", "--moe-cache-admit-misses", "1"]
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        out = complete(srv, PROMPTS[0], n_predict=24)
        st = cache_stats(srv)
    with ServerProcess(tiny_model, args=BASE_ARGS, timeout=120) as srv:
        ref = complete(srv, PROMPTS[0], n_predict=24)
    assert out["tokens"] == ref["tokens"]
    assert st["max_uploads"] == 1
    assert 1 < st["upload_cap"] <= 8, st["upload_cap"]
    assert st["total"]["uploads"] > 0


def test_the_cache_fills_between_the_ubatches_of_one_decode(tiny_model):
    """-ub 1 over a prompt: one decode of many cache-active ubatches. The cache steps before each later
    ubatch of a decode (commit, publish, plan), so the prompt fills the slots as it is routed and its
    later tokens are served by them; before, the whole prompt ran on the state its decode started
    with and nothing was counted until the next decode (a request of one token has none). Output unchanged."""
    ub = ["-ub", "1", "-b", "256"]
    args = BASE_ARGS + ub + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-max-uploads", "16"]
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        out = complete(srv, PROMPTS[0], n_predict=1)
        st = cache_stats(srv)
    with ServerProcess(tiny_model, args=BASE_ARGS + ub, timeout=120) as srv:
        ref = complete(srv, PROMPTS[0], n_predict=1)
    assert out["tokens"] == ref["tokens"] and probs(out) == probs(ref)
    n_prompt = out["tokens_evaluated"]
    tot = st["total"]
    assert n_prompt > 8 and tot["n_steps"] >= n_prompt - 1, (n_prompt, tot["n_steps"])
    assert tot["uploads"] > 0 and tot["hits"] > 0, tot


def test_each_expert_s_routed_tokens_add_up_to_the_layer_s_routing(tiny_model):
    """/moe-cache's "routed" (the dashboard's heat): per cached layer, each expert's routed
    tokens since the stats were reset; they add up to the layer's hits + misses."""
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "4"], env=HOST, timeout=120) as srv:
        complete(srv, PROMPTS[0], n_predict=16)
        status, body = srv.get("/moe-cache")
        assert status == 200
        cache = body if isinstance(body, dict) else json.loads(body)
        layers = [l for l in cache["layers"] if l["cached"]]
        assert layers
        for l in layers:
            assert len(l["routed"]) == cache["n_expert"]
            assert sum(l["routed"]) == l["hits"] + l["misses"] > 0


def test_synchronous_uploads_make_the_hits_independent_of_the_link(tiny_model):
    """LLAMA_MOE_CACHE_SYNC_UPLOADS=1: a step waits for the uploads in flight, so an expert planned at
    one step serves from the next whatever the link's speed. Uploads 25 ms slower then give the same
    hits, step for step; without the switch they land steps later and serve fewer. (On a GPU a hit and
    a miss round differently: the GPU tests that compare two runs bit for bit with misses need it.)"""
    args = BASE_ARGS + ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-rebalance-interval", "4",
                        "--moe-cache-max-uploads", "16"]

    def totals(env):
        with ServerProcess(tiny_model, args=args, env={**HOST, **env}, timeout=120) as srv:
            outs = [complete(srv, p, n_predict=24) for p in PROMPTS]
            return outs, cache_stats(srv)["total"]

    sync = {"LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
    slow = {"LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "25"}
    fast_outs, fast = totals(sync)
    slow_outs, slow_sync = totals({**sync, **slow})
    _, slow_async = totals(slow)
    assert [o["tokens"] for o in fast_outs] == [o["tokens"] for o in slow_outs]
    assert fast["uploads"] > 0 and fast["misses"] > 0, fast
    assert (slow_sync["hits"], slow_sync["misses"], slow_sync["uploads"]) == \
        (fast["hits"], fast["misses"], fast["uploads"])
    assert slow_async["hits"] < fast["hits"], (slow_async, fast)
