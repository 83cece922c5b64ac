"""The hot-expert cache on rpc-server devices: several devices on one machine without a GPU. An rpc-server on
loopback runs the patched CPU backend, which implements MUL_MAT_ID's skip ids, but the RPC device cannot say
so; LLAMA_MOE_CACHE_ASSUME_SKIP_IDS=1 (a test switch) lets the cache take it. The graphs then split as on a GPU
machine: the cached layers on the device, each layer's misses in a CPU split between two device splits.

- Every split of a decode step takes only what it must from the other backend: the CPU's split the layer's
  input and the ids of its misses, the device's next split the misses' result. The scheduler's split dump
  (GGML_SCHED_DEBUG=1) names each split's inputs. gpt-oss's expert biases used to add two inputs there: the
  device's split copied the layer's host bias tensor (the last bias addition of the misses ran on the device)
  and the CPU's split the device's maps and routed ids (the misses' bias ids were looked up on the CPU); on an
  H100 that was 4.2-4.7 ms of copies a token for gpt-oss-120b's 18 cached layers.
- The output equals the stock path's on the same device (greedy tokens)."""

from __future__ import annotations

import re

import pytest

from conftest import _tiny_model
from moe_cache_checks import cache_stats, complete
from moecache.server import ServerProcess

PROMPTS = ["The committee met on Tuesday to discuss the budget", "def fibonacci(n):\n"]
# the inputs a split may copy from the other backend in a decode step with the cache (graph inputs aside)
ALLOWED = re.compile(r"^(attn_post_norm|ffn_norm)-\d+|^ffn_moe_cold(_ids)?-\d+|^ \(reshaped\)$|^out_ids$")
GRAPH_INPUTS = {"embd", "inp_pos", "attn_inp_k_idxs", "attn_inp_v_idxs", "attn_inp_kq_mask", "attn_inp_k_idxs_swa",
                "attn_inp_v_idxs_swa", "attn_inp_kq_mask_swa", "inp_out_ids"}


@pytest.fixture(scope="module", params=["tiny", "tiny-gpt-oss"])
def model(request, moecache_cache_dir):
    return _tiny_model(moecache_cache_dir, request.param)


def last_graph_splits(log: str) -> list[tuple[str, list[str]]]:
    """The splits of the last graph the scheduler dumped: (backend, input names), in order."""
    lines = [l for l in log.splitlines() if "## SPLIT #" in l]
    graphs, cur = [], []
    for l in lines:
        m = re.search(r"## SPLIT #(\d+): (\S+) # \d+ inputs", l)
        if not m:
            continue
        if m.group(1) == "0" and cur:
            graphs.append(cur)
            cur = []
        # the dump's items are logged one by one: each has its own log prefix (time, level) in the line
        items = re.sub(r"\d+\.\d+\.\d+\.\d+ [A-Z] ", "", l[m.end():])
        cur.append((m.group(2), re.findall(r"\[(.+?) \(\s*\d+[KMG]?\)\]", items)))
    if cur:
        graphs.append(cur)
    return graphs[-1] if graphs else []


def run(model, port, extra, env):
    args = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none",
            "--rpc", f"127.0.0.1:{port}", "--device", "RPC0", *extra]
    with ServerProcess(model, args=args, env=env, timeout=180) as srv:
        outs = [complete(srv, p, n_predict=8) for p in PROMPTS]
        return outs, cache_stats(srv), srv.log_text()


def test_decode_splits_take_only_the_misses_and_the_output_is_the_stock_one(model, rpc_servers):
    (port,) = rpc_servers(1)
    ref, _, _ = run(model, port, [], {})
    env = {"LLAMA_MOE_CACHE_ASSUME_SKIP_IDS": "1", "GGML_SCHED_DEBUG": "1"}
    outs, st, log = run(model, port, ["--moe-cache-slots", "8", "-v"], env)
    assert st["enabled"] and st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in ref]
    splits = last_graph_splits(log)
    # a decode step: the cached layers on the device, each layer's misses in a CPU split between two of them
    assert sum(1 for backend, _ in splits if backend == "CPU") >= 4, splits
    extra = [(b, name) for b, names in splits for name in names
             if name not in GRAPH_INPUTS and not ALLOWED.match(name)]
    assert not extra, f"split inputs beyond the layer's input, the misses' ids and their result: {extra}"
