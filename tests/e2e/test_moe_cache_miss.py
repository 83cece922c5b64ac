"""Where the hot-expert cache's misses run (--moe-cache-miss), and the one-copy readback of the
routed ids, through the real llama-server on loopback.

On the CPU test device (LLAMA_MOE_CACHE_HOST_DEVICE=1) the layer's "device" is the CPU, whose host
mapping is the host tensors themselves: --moe-cache-miss gpu then builds the graphs of the GPU path
(the misses on the mapped views beside the slot bank, no CPU split) and must give the stock output
bit for bit, as the CPU computes the same products either way. The same checks on CUDA, where the
GPU reads the pinned host experts over PCIe, are in tests/gpu/test_moe_cache_miss_gpu.py.
"""

from __future__ import annotations

import json

import pytest

from moe_cache_checks import N_EXPERT, N_LAYER, N_USED, PROMPTS, cache_stats, complete, logprobs
from moecache.server import ServerError, ServerProcess

BASE_ARGS = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "0", "--no-repack", "--metrics"]
HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}
EMPTY = {**HOST, "LLAMA_MOE_CACHE_HOLD_EMPTY": "1"}


@pytest.fixture(scope="module")
def stock(tiny_model, llama_server_bin):
    with ServerProcess(tiny_model, args=BASE_ARGS, timeout=120) as srv:
        return [complete(srv, p) for p in PROMPTS]


def run(tiny_model, args, env, prompts=PROMPTS, n_predict=32):
    with ServerProcess(tiny_model, args=BASE_ARGS + args, env=env, timeout=120) as srv:
        outs = [complete(srv, p, n_predict=n_predict) for p in prompts]
        st = cache_stats(srv)
        status, metrics = srv.get("/metrics")
        log = srv.log_text()
    assert status == 200
    return outs, st, metrics if isinstance(metrics, str) else json.dumps(metrics), log


def same_as_stock(ref, outs):
    for a, b in zip(ref, outs):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact


def test_misses_on_the_device_give_the_stock_output(tiny_model, stock):
    """Every expert a miss, every miss on the (test) device: no CPU split is left, and the output is
    the stock path's exactly; the stats say where the misses ran."""
    outs, st, metrics, _ = run(tiny_model, ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu"], EMPTY)
    same_as_stock(stock, outs)
    assert st["miss"] == "device"
    tot = st["total"]
    assert tot["n_miss_device"] == N_LAYER and tot["route_switches"] == 0
    assert all(layer["miss"] == "device" and layer["mapped"] is True for layer in st["layers"])
    assert tot["misses"] > 0 and tot["misses"] == tot["n_tokens"] * N_USED * N_LAYER
    assert tot["n_steps"] >= 32 * len(PROMPTS)  # one per decode: every generated token
    assert f"llamacpp:moe_cache_miss_device_layers {N_LAYER}" in metrics


def test_misses_on_the_device_with_hits_match_stock(tiny_model, stock):
    """Slots fill while the misses run on the device: hits and misses both, greedy output unchanged."""
    args = ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu", "--moe-cache-max-uploads", "8",
            "--moe-cache-rebalance-interval", "4"]
    outs, st, _, _ = run(tiny_model, args, HOST)
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
    tot = st["total"]
    assert tot["hits"] > 0 and tot["misses"] > 0 and tot["uploads"] > 0
    assert tot["n_miss_device"] == N_LAYER


def test_a_failed_mapping_keeps_the_misses_on_the_cpu(tiny_model, stock):
    """LLAMA_MOE_CACHE_FAIL=map: the device cannot read the host experts; the misses stay on the CPU,
    the server answers, the output is unchanged."""
    env = {**EMPTY, "LLAMA_MOE_CACHE_FAIL": "map"}
    outs, st, _, log = run(tiny_model, ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu"], env)
    same_as_stock(stock, outs)
    assert "cannot read" in log and "injected: LLAMA_MOE_CACHE_FAIL" in log
    assert st["total"]["n_miss_device"] == 0
    assert all(layer["miss"] == "cpu" and layer["mapped"] is False for layer in st["layers"])


@pytest.mark.parametrize("pct,device", [(100, True), (0, False)])
def test_auto_moves_layers_by_their_recent_misses(tiny_model, stock, pct, device):
    """auto at 100%: every layer moves to the device once it has a window of routing (its misses are
    at most 100% of its routed experts); at 0% none does while anything misses. Output unchanged."""
    args = ["--moe-cache-slots", "8", "--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", str(pct)]
    # three rounds: the layers move after 16 decode steps, and the last round runs where they moved to
    outs, st, metrics, _ = run(tiny_model, args, EMPTY, prompts=PROMPTS * 3)
    same_as_stock(stock * 3, outs)
    tot = st["total"]
    assert st["miss"] == "auto" and st["miss_auto_pct"] == pct
    if device:
        assert tot["n_miss_device"] == N_LAYER and tot["route_switches"] == N_LAYER
        assert f"llamacpp:moe_cache_miss_route_switches_total {N_LAYER}" in metrics
    else:
        assert tot["n_miss_device"] == 0 and tot["route_switches"] == 0


@pytest.mark.parametrize("pct", [100, 50, 0])
def test_split_misses_give_the_stock_output(tiny_model, stock, pct):
    """--moe-cache-miss split: each layer's most-routed missed experts on the (test) device, the others on the CPU,
    in one step (a third branch reading its own map row). Every expert a miss here: at 100 the device computes
    all of them, at 0 the CPU does, at 50 each layer's hottest until they carry half its misses. The output is
    the stock path's bit for bit every way."""
    args = ["--moe-cache-slots", "8", "--moe-cache-miss", "split", "--moe-cache-miss-split-pct", str(pct)]
    outs, st, metrics, _ = run(tiny_model, args, EMPTY, prompts=PROMPTS * 2)
    same_as_stock(stock * 2, outs)
    assert st["miss"] == "split" and st["miss_split_pct"] == pct
    assert all(layer["miss"] == "split" and layer["mapped"] is True for layer in st["layers"])
    on_device = [layer["split_device"] for layer in st["layers"]]
    if pct == 100:
        assert on_device == [N_EXPERT] * N_LAYER
    elif pct == 0:
        assert on_device == [0] * N_LAYER
    else:
        assert all(0 < n < N_EXPERT for n in on_device), on_device
    assert st["total"]["n_miss_device"] == 0 and st["total"]["route_switches"] == 0  # no layer moved as a whole


def test_split_misses_with_hits_match_stock(tiny_model, stock):
    """The split while slots fill: hits on the device, the hottest misses beside them, the rest on the CPU."""
    args = ["--moe-cache-slots", "8", "--moe-cache-miss", "split", "--moe-cache-max-uploads", "8",
            "--moe-cache-rebalance-interval", "4"]
    outs, st, _, _ = run(tiny_model, args, HOST, prompts=PROMPTS * 2)
    same_as_stock(stock * 2, outs)
    tot = st["total"]
    assert tot["hits"] > 0 and tot["misses"] > 0 and tot["uploads"] > 0
    assert any(layer["split_device"] > 0 for layer in st["layers"]), [layer["split_device"] for layer in st["layers"]]


def test_split_misses_without_a_mapping_stay_on_the_cpu(tiny_model, stock):
    """LLAMA_MOE_CACHE_FAIL=map with the split: the device cannot read the host experts, so every miss stays the
    CPU's (no device share is chosen), the server answers, the output is unchanged."""
    env = {**EMPTY, "LLAMA_MOE_CACHE_FAIL": "map"}
    outs, st, _, log = run(tiny_model, ["--moe-cache-slots", "8", "--moe-cache-miss", "split",
                                        "--moe-cache-miss-split-pct", "100"], env)
    same_as_stock(stock, outs)
    assert "injected: LLAMA_MOE_CACHE_FAIL" in log
    assert all(layer["miss"] == "cpu" and layer["mapped"] is False for layer in st["layers"])


def test_routed_ids_of_many_ubatches_per_decode_are_read_back_in_order(tiny_model, tmp_path):
    """-ub 2 under --moe-cache-max-batch 8: every prompt decode runs many cache-active ubatches, each
    written into the same ids tensor and read back in one copy. The routing trace (what was read
    back) must equal the trace of the stock path, which reads each layer's ids on its own."""
    traces = {}
    for name, extra in (("stock", []), ("cache", ["--moe-cache-slots", "8"])):
        trace = tmp_path / f"{name}.jsonl"
        args = BASE_ARGS + ["-ub", "2", "-b", "64", "--moe-routing-trace", str(trace)] + extra
        with ServerProcess(tiny_model, args=args, env=EMPTY, timeout=120) as srv:
            for p in PROMPTS:
                complete(srv, p, n_predict=8)
        traces[name] = [json.loads(line) for line in trace.read_text().splitlines()]
    stock_trace, cache_trace = traces["stock"], traces["cache"]
    assert len(cache_trace) == len(stock_trace) > 2 * 16
    assert sum(1 for x in cache_trace if x["cached"]) == len(cache_trace)  # every ubatch used the cache
    for a, b in zip(stock_trace, cache_trace):
        assert (a["seq"], a["pos"]) == (b["seq"], b["pos"])
        assert a["layers"] == b["layers"], f"pos {a['pos']}"


@pytest.mark.parametrize("flag,value", [("--moe-cache-miss", "fast"), ("--moe-cache-miss-auto-pct", "101"),
                                        ("--moe-cache-miss-split-pct", "-1")])
def test_bad_miss_flags_fail_with_a_clear_error(tiny_model, llama_server_bin, flag, value):
    with pytest.raises(ServerError) as e:
        with ServerProcess(tiny_model, args=BASE_ARGS + [flag, value], timeout=60):
            pass
    assert flag in str(e.value) and value in str(e.value)


@pytest.mark.parametrize("miss", ["cpu", "gpu"])
def test_a_layer_with_every_expert_in_a_slot_runs_no_miss_branch(tiny_model, stock, miss):
    """As many slots as experts: once a layer's slots hold all of them it has no misses, and its graphs
    drop the miss branch (with the misses on the CPU, the layer's CPU split). The output stays the
    stock one while the layers fill and after."""
    args = ["--moe-cache-slots", "16", "--moe-cache-miss", miss, "--moe-cache-max-uploads", "16",
            "--moe-cache-rebalance-interval", "2"]
    warm = [PROMPTS[0] * 4]
    outs, st, _, _ = run(tiny_model, args, HOST, prompts=warm + PROMPTS)
    for a, b in zip(stock, outs[1:]):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)
    assert all(layer["complete"] is True for layer in st["layers"]), [layer["complete"] for layer in st["layers"]]
    assert st["total"]["misses"] > 0  # the layers filled during the run


def test_an_incomplete_layer_keeps_its_miss_branch(tiny_model, stock):
    """One slot short of every expert: the layers never become complete."""
    args = ["--moe-cache-slots", "15", "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "2"]
    outs, st, _, _ = run(tiny_model, args, HOST)
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
    assert not any(layer["complete"] for layer in st["layers"])


@pytest.mark.parametrize("table", [True, False], ids=["one-ffn", "two-branches"])
def test_hits_and_device_misses_in_one_expert_ffn(tiny_model, stock, table):
    """With the misses on a device that reads address tables, a cached layer runs one expert
    FFN whose experts are read at their table addresses (a slot, or the mapped host matrix), the stock
    graph's nodes only (on by default); LLAMA_MOE_CACHE_TABLE=0 keeps the
    two branches. Both give the stock output bit for bit while slots fill and serve hits."""
    args = ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu", "--moe-cache-max-uploads", "8",
            "--moe-cache-rebalance-interval", "4"]
    env = HOST if table else {**HOST, "LLAMA_MOE_CACHE_TABLE": "0"}
    outs, st, _, _ = run(tiny_model, args, env)
    same_as_stock(stock, outs)
    assert [layer["table"] for layer in st["layers"]] == [table] * N_LAYER
    tot = st["total"]
    assert tot["hits"] > 0 and tot["misses"] > 0 and tot["uploads"] > 0 and tot["n_miss_device"] == N_LAYER


def test_cpu_misses_never_use_the_tables(tiny_model, stock):
    """The tables need the misses on the device: --moe-cache-miss cpu keeps the hybrid graph."""
    outs, st, _, _ = run(tiny_model, ["--moe-cache-slots", "8"], EMPTY)
    same_as_stock(stock, outs)
    assert not any(layer["table"] for layer in st["layers"])
