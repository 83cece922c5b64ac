"""The hot-expert cache where it can go wrong, through the real llama-server on loopback (CPU, the host
test device): every failing step turns the cache (or the layer) off and the server keeps answering
with the stock path's output; the banks are sized after the context; the library checks its
parameters; the stats count what really ran; the routing trace survives a sleep; a device without
skip ids (RPC) is refused; drafts of several users share the batch the cache can take.

Fault injection: LLAMA_MOE_CACHE_FAIL names the step that fails (alloc, reserve, upload[:N]; staging needs a
device with pinned host memory: tests/gpu).
"""

from __future__ import annotations

import threading
import time

import pytest

from moe_cache_checks import N_EXPERT, N_LAYER, N_USED, PROMPTS, cache_stats, complete, host_context_mib, logprobs
from moecache.server import ServerError, ServerProcess

BASE_ARGS = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "0", "--no-repack", "--metrics"]
HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}
FULL = ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]


@pytest.fixture(scope="module")
def stock(tiny_model, llama_server_bin):
    with ServerProcess(tiny_model, args=BASE_ARGS, timeout=120) as srv:
        yield [complete(srv, p) for p in PROMPTS]


def assert_same_greedy(ref, outs, exact: bool):
    for a, b in zip(ref, outs):
        assert a["tokens"] == b["tokens"]
        if exact:
            assert logprobs(a) == logprobs(b)


def test_failed_bank_allocation_leaves_the_stock_path(tiny_model, stock):
    env = {**HOST, "LLAMA_MOE_CACHE_FAIL": "alloc"}
    with ServerProcess(tiny_model, args=BASE_ARGS + FULL, env=env, timeout=120) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        again = complete(srv, PROMPTS[0])
        st = cache_stats(srv)
        log = srv.log_text()
    assert "failed to allocate" in log and "the hot-expert cache is off" in log
    assert st["enabled"] is False
    assert all(layer["reason"] == "allocation failed" for layer in st["layers"])
    assert_same_greedy(stock, outs, exact=True)  # no split at all: the stock graphs
    assert again["tokens"] == stock[0]["tokens"]


def test_banks_that_leave_too_little_for_the_compute_buffers_give_way(tiny_model, stock):
    """The reservation with the split graphs fails (injected): the cache steps back and the context
    is made with the stock graphs, instead of failing to start."""
    env = {**HOST, "LLAMA_MOE_CACHE_FAIL": "reserve"}
    with ServerProcess(tiny_model, args=BASE_ARGS + FULL, env=env, timeout=120) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
        log = srv.log_text()
    assert "with the hot-expert cache: the cache is off" in log
    assert st["enabled"] is False
    assert all(layer["reason"] == "the compute buffers did not fit beside the banks" for layer in st["layers"])
    assert_same_greedy(stock, outs, exact=True)


@pytest.mark.parametrize("which", ["upload:1", "upload:5", "upload"])
def test_failed_upload_turns_the_layer_off_and_output_stays(tiny_model, stock, which):
    env = {**HOST, "LLAMA_MOE_CACHE_FAIL": which}
    with ServerProcess(tiny_model, args=BASE_ARGS + FULL, env=env, timeout=120) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)  # the uploads happen here
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
        log = srv.log_text()
    assert "failed (injected: LLAMA_MOE_CACHE_FAIL)" in log and "takes the stock path from now on" in log
    failed = [layer for layer in st["layers"] if not layer["cached"]]
    assert failed and all("upload of expert" in layer["reason"] for layer in failed)
    if which == "upload":
        assert st["enabled"] is False and len(failed) == N_LAYER
    else:
        assert len(failed) == 1 and st["enabled"] is True  # the other layers keep their cache
    # hits (where any are left) run on the host test device too: only rounding may differ
    assert_same_greedy(stock, outs, exact=False)


def _serve(tiny_model, ubatch: str, env: dict) -> tuple[dict, str]:
    args = BASE_ARGS + ["-ub", ubatch, "-b", "1024", "--moe-cache-slots", str(N_EXPERT), "--moe-cache-headroom", "0",
                        "--fit", "off", "-lv", "4"]  # -lv 4: the buffer sizes are in the log
    with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
        st = cache_stats(srv)
        complete(srv, PROMPTS[1])
        log = srv.log_text()
    return st, log


def test_banks_are_sized_after_the_compute_buffers(tiny_model):
    """The banks take what is left on the device after the context: on a host test device that holds
    the -ub 1024 context plus 3.5 slots, -ub 1024 (a large compute buffer) gets 3 slots and -ub 8 all
    16; banks plus context never exceed the device. Before, the banks were sized against a fixed
    reserve, before the compute buffers were known: both got the same."""
    st, log = _serve(tiny_model, "1024", HOST)
    slot_mib = st["total"]["bytes_vram"] / st["n_slots"] / 2**20
    device_mib = host_context_mib(log) + 3.5 * slot_mib
    env = {**HOST, "LLAMA_MOE_CACHE_HOST_DEVICE_MIB": f"{device_mib:.4f}"}
    got = {ub: _serve(tiny_model, ub, env) for ub in ("8", "1024")}
    slots = {ub: (s["n_slots"] if s["enabled"] else 0) for ub, (s, _) in got.items()}
    assert slots == {"8": N_EXPERT, "1024": 3}, (slots, device_mib, slot_mib)
    for ub, (s, log) in got.items():
        assert s["total"]["bytes_vram"] / 2**20 + host_context_mib(log) <= device_mib + 0.01, ub
    assert "slots per layer need" in got["1024"][1]  # the clamp says what it did


@pytest.mark.parametrize("flags,expect", [
    (["--moe-cache-policy", "lru", "--moe-cache-admit-misses", "20", "--moe-cache-admit-window", "16"],
     "admit_misses (20) must not exceed admit_window (16)"),
])
def test_the_library_refuses_bad_combinations(tiny_model, llama_server_bin, flags, expect):
    with pytest.raises(ServerError) as e:
        with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "4"] + flags, env=HOST, timeout=60):
            pass
    assert expect in str(e.value)


def test_more_slots_than_experts_says_so(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "1000"], env=HOST, timeout=120) as srv:
        st = cache_stats(srv)
        log = srv.log_text()
    assert st["n_slots"] == N_EXPERT
    assert f"1000 slots asked for, the layers have {N_EXPERT} experts" in log


def test_per_layer_stats_count_whole_tokens(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "6"], env=HOST, timeout=120) as srv:
        for p in PROMPTS:
            complete(srv, p, n_predict=24)
        st = cache_stats(srv)
    for layer in st["layers"]:
        assert layer["n_tokens"] > 0
        assert layer["hits"] + layer["misses"] == layer["n_tokens"] * N_USED, layer
    # the last token of the last request is counted too: /moe-cache commits the last decode first
    assert st["total"]["n_tokens"] == 2 * 24 - 2, st["total"]


def test_routing_trace_survives_sleep_and_wake(tiny_model, tmp_path):
    trace = tmp_path / "routing.jsonl"
    args = BASE_ARGS + ["--moe-routing-trace", str(trace), "--sleep-idle-seconds", "1"]
    with ServerProcess(tiny_model, args=args, timeout=120) as srv:
        complete(srv, PROMPTS[0], n_predict=16)
        deadline = time.monotonic() + 30
        while "sleeping" not in srv.log_text().lower() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "sleeping" in srv.log_text().lower(), srv.log_text()[-2000:]
        before = trace.read_text()
        complete(srv, PROMPTS[1], n_predict=16)  # wakes the server: a new context opens the trace again
    after = trace.read_text()
    assert before and after.startswith(before) and len(after) > len(before)


def test_rpc_device_is_refused_with_a_reason(tiny_model, stock, rpc_servers):
    """Layers on an RPC device (an rpc-server on loopback with its CPU backend): the device has no
    skip ids, so the cache refuses it per layer, and the output is the stock path's."""
    [port] = rpc_servers(1)
    args = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "99", "--rpc", f"127.0.0.1:{port}", "--cpu-moe",
            "--no-repack"]
    with ServerProcess(tiny_model, args=args, timeout=120) as srv:
        ref = complete(srv, PROMPTS[0])
    with ServerProcess(tiny_model, args=args + ["--moe-cache-slots", "4"], timeout=120) as srv:
        out = complete(srv, PROMPTS[0])
        st = cache_stats(srv)
    assert st["enabled"] is False
    reasons = {layer["reason"] for layer in st["layers"]}
    assert any("RPC" in r and "does not implement MUL_MAT_ID skip ids" in r for r in reasons), reasons
    assert out["tokens"] == ref["tokens"]


def test_three_drafting_users_share_the_cache_batch(tiny_model):
    """Three users drafting at once: each verify batch holds the three sampled tokens and drafts that
    share the rest of the cache's max batch, so no decode batch bypasses the cache; only the prompts
    do (one batch each at most)."""
    args = ["-t", "2", "-c", "3072", "-np", "3", "-ngl", "0", "--no-repack", "--moe-cache-slots", "8",
            "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1"]
    outs = {}

    def run(srv, i):
        outs[i] = complete(srv, PROMPTS[i % 2] * (3 + i), n_predict=160)

    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        threads = [threading.Thread(target=run, args=(srv, i)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        st = cache_stats(srv)["total"]
    assert len(outs) == 3
    drafted = sum(o["timings"].get("draft_n", 0) for o in outs.values())
    capped = sum(o["timings"].get("draft_capped", 0) for o in outs.values())
    assert drafted > 0 and capped > 0, [o["timings"] for o in outs.values()]
    assert st["batches_bypassed"]["batch"] <= 3, st  # the prompts; before, 16 of 126 decode batches bypassed
    assert st["batches_cached"] > 20, st


def _zero_lora(model_path, out_path, rank: int = 4) -> None:
    """A LoRA adapter for the tiny model's blk.0.attn_q with lora_b = 0: it changes nothing, but a
    context with an adapter runs the experts on the stock path."""
    import numpy as np

    from moecache.gguf import GGMLType, GGUFReader, GGUFWriter

    with GGUFReader(model_path) as r:
        arch = r["general.architecture"]
        n_in, n_out = r.tensor("blk.0.attn_q.weight").shape
    w = GGUFWriter(out_path)
    w.add("general.architecture", arch)
    w.add("general.type", "adapter")
    w.add("adapter.type", "lora")
    w.add("adapter.lora.alpha", 1.0)
    a = np.random.default_rng(0).standard_normal((rank, n_in)).astype(np.float32)  # ne = [n_in, rank]
    b = np.zeros((n_out, rank), dtype=np.float32)                                   # ne = [rank, n_out]
    w.add_tensor_info("blk.0.attn_q.weight.lora_a", (n_in, rank), GGMLType.F32)
    w.add_tensor_info("blk.0.attn_q.weight.lora_b", (rank, n_out), GGMLType.F32)
    w.write_header()
    w.write_tensor_data("blk.0.attn_q.weight.lora_a", a)
    w.write_tensor_data("blk.0.attn_q.weight.lora_b", b)
    w.close()


def test_with_a_lora_the_stats_count_no_hits(tiny_model, stock, tmp_path):
    """An adapter keeps the experts on the stock path (the split is off): the slots still fill, but no
    routed expert ran on them, so the stats count only misses; before, resident experts were counted
    as hits although the CPU computed them."""
    lora = tmp_path / "zero-lora.gguf"
    _zero_lora(tiny_model, lora)
    with ServerProcess(tiny_model, args=BASE_ARGS + FULL + ["--lora", str(lora)], env=HOST, timeout=120) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)["total"]
    assert st["uploads"] > 0 and st["n_resident"] > 0
    assert st["hits"] == 0 and st["misses"] == st["n_tokens"] * N_USED * N_LAYER > 0, st
    assert_same_greedy(stock, outs, exact=False)


@pytest.mark.parametrize("env,slots", [
    ({"LLAMA_ARG_MOE_HOT_K": "4"}, 4),                                   # the public fork's name alone
    ({"LLAMA_ARG_MOE_CACHE_SLOTS": "6", "LLAMA_ARG_MOE_HOT_K": "4"}, 6),  # the LLAMA_ARG_<FLAG> name wins
    ({"LLAMA_ARG_MOE_CACHE_SLOTS": "", "LLAMA_ARG_MOE_HOT_K": "4"}, 4),   # a blank one does not hide the old name
])
def test_server_reads_the_cache_variables_and_their_old_names(tiny_model, env, slots):
    with ServerProcess(tiny_model, args=BASE_ARGS, env={**HOST, **env}, timeout=120) as srv:
        st = cache_stats(srv)
    assert st["enabled"] is True and st["n_slots"] == slots, st


def test_the_json_names_each_cached_layers_device(tiny_model):
    """/moe-cache names the device of every cached layer: with a layer split, each layer's
    slots are on its own device (tests/gpu/test_moe_cache_layer_split_gpu.py); here the host test device."""
    with ServerProcess(tiny_model, args=BASE_ARGS + ["--moe-cache-slots", "4"], env=HOST, timeout=60) as srv:
        complete(srv, PROMPTS[0], n_predict=4)
        st = cache_stats(srv)
    assert [layer.get("device") for layer in st["layers"] if layer["cached"]] == ["CPU"] * N_LAYER
