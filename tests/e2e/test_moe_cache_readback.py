"""The routed ids of every layer on a device come back in one copy per step, not only the cached layers'.

A layer whose experts are whole on its device (or on the CPU by -ncmoe) is still counted (the profile, the
warm restore, the routing trace); its ids used to be copied back on their own, into pageable memory: a
synchronous read per layer per token. Here an rpc-server on loopback holds the last two layers of the tiny
qwen3moe whole (not cacheable there: RPC has no skip ids), the first two are cached on the host test device:
the log says four layers share the readback, and the routing trace equals the one of the per-layer copies
(LLAMA_MOE_CACHE_READBACK_ALL=0) and the greedy output the stock path's.
"""

from __future__ import annotations

import json

from moe_cache_checks import N_LAYER, PROMPTS, complete
from moecache.server import ServerProcess


def run(tiny_model, port, tmp_path, name, env, cache=True):
    trace = tmp_path / f"{name}.jsonl"
    args = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "3", "--rpc", f"127.0.0.1:{port}", "--no-repack", "-lv", "4"]
    if cache:
        args += ["--moe-cache-slots", "4", "--moe-routing-trace", str(trace)]
    with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
        outs = [complete(srv, p, n_predict=24) for p in PROMPTS]
        log = srv.log_text()
    records = [json.loads(line) for line in trace.read_text().splitlines()] if cache else []
    return outs, log, records


def test_layers_not_cached_share_the_one_readback(tiny_model, rpc_servers, tmp_path):
    assert N_LAYER == 4
    [port] = rpc_servers(1)
    host = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}
    stock, _, _ = run(tiny_model, port, tmp_path, "stock", {}, cache=False)
    outs, log, trace = run(tiny_model, port, tmp_path, "one", host)
    outs_apart, log_apart, trace_apart = run(tiny_model, port, tmp_path, "apart",
                                             {**host, "LLAMA_MOE_CACHE_READBACK_ALL": "0"})

    # layers 0-1 cached on the host device, 2-3 whole on the RPC device, each device's ids in one readback
    assert "the routed ids of 2 layers (2 cached)" in log, log[-3000:]
    assert "the routed ids of 2 layers (0 cached)" in log, log[-3000:]
    assert "(0 cached)" not in log_apart

    # the decode steps recorded every layer, and the same ids either way
    decoded = [r for r in trace if len(r["layers"]) == N_LAYER]
    assert len(decoded) >= 24, len(decoded)
    assert trace == trace_apart
    for a, b, c in zip(stock, outs, outs_apart):
        assert a["tokens"] == b["tokens"] == c["tokens"]
