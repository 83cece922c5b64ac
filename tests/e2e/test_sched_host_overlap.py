"""With --cpu-experts-overlap (or ggml's GGML_SCHED_HOST_OVERLAP=1) the scheduler computes a host split while the
device runs the split after it, where that split needs nothing the host computed (off by default in llama-server;
moecache-server's plan turns it on with the experts on the CPU).

In a run of device nodes after a host (CPU) node, the nodes that need nothing the host computed go first; the
device's split ends before the others and is launched before the host's split computes. Through the real
llama-server with the layers on an rpc-server on loopback (an asynchronous device, as CUDA is):
- the experts on the CPU (`--cpu-moe`) of a model with a shared expert: the shared expert (computed after the
  routed experts' sum in llama.cpp's graph) is moved before that sum and runs beside the CPU's experts;
- the hot-expert cache with its misses on the CPU (`LLAMA_MOE_CACHE_ASSUME_SKIP_IDS=1`): the graph puts the
  misses before the hits, so the hits run on the device beside them; the stock graph of a model without a
  shared expert (`tiny`) has nothing to run beside its CPU splits.
The same ops on the same bytes in another order: the output is the same bit for bit with the switch on and off.
"""

from __future__ import annotations

import pytest

from conftest import _tiny_model
from moe_cache_checks import assert_same_outputs, cache_stats, complete
from moecache.server import ServerProcess

BESIDE = "computed while RPC0"
ON = {"GGML_SCHED_HOST_OVERLAP": "1"}
OFF = {"GGML_SCHED_HOST_OVERLAP": "0"}  # the default, said here: the suite may run with it on
PROMPTS = ["The committee met on Tuesday to discuss the budget", "def fibonacci(n):\n"]


def run(model, port, *extra, **env):
    args = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none",
            "--rpc", f"127.0.0.1:{port}", "--device", "RPC0", "-ub", "32", "-lv", "5", *extra]
    with ServerProcess(model, args=args, env=env, timeout=180) as srv:
        # a prompt of several ubatches, then decode steps
        outs = [complete(srv, p * 3, n_predict=16) for p in PROMPTS]
        stats = cache_stats(srv) if "--moe-cache-slots" in extra else None
        return outs, srv.log_text(), stats


def test_a_shared_expert_runs_beside_the_cpus_experts_and_the_output_is_the_same(moecache_cache_dir, rpc_servers):
    model = _tiny_model(moecache_cache_dir, "tiny-qwen35moe")
    [port] = rpc_servers(1)
    beside, log_beside, _ = run(model, port, **ON)
    apart, log_apart, _ = run(model, port, **OFF)
    assert BESIDE in log_beside, "no device split ran beside the CPU's experts"
    assert BESIDE not in log_apart
    assert_same_outputs(apart, beside)


def test_the_flag_and_its_variable_turn_it_on_for_the_context(moecache_cache_dir, rpc_servers):
    """--cpu-experts-overlap (LLAMA_ARG_CPU_EXPERTS_OVERLAP) sets it on the context's scheduler, without ggml's
    variable; --no-cpu-experts-overlap and the default leave it off. The output is the same every way."""
    model = _tiny_model(moecache_cache_dir, "tiny-qwen35moe")
    [port] = rpc_servers(1)
    flag, log_flag, _ = run(model, port, "--cpu-experts-overlap", **OFF)
    var, log_var, _ = run(model, port, **OFF, LLAMA_ARG_CPU_EXPERTS_OVERLAP="1")
    off, log_off, _ = run(model, port, "--no-cpu-experts-overlap", **OFF)
    assert BESIDE in log_flag and BESIDE in log_var, "the flag did not turn the overlap on"
    assert BESIDE not in log_off
    assert_same_outputs(off, flag)
    assert_same_outputs(off, var)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_the_caches_hits_run_beside_its_misses_and_the_output_is_the_same(moecache_cache_dir, rpc_servers, preset):
    model = _tiny_model(moecache_cache_dir, preset)
    [port] = rpc_servers(1)
    cache = ("--moe-cache-slots", "8")
    skip_ids = {"LLAMA_MOE_CACHE_ASSUME_SKIP_IDS": "1"}
    stock, log_stock, _ = run(model, port, **ON)
    beside, log_beside, st = run(model, port, *cache, **skip_ids, **ON)
    apart, log_apart, _ = run(model, port, *cache, **skip_ids, **OFF)
    assert st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    if preset == "tiny":
        # no shared expert: the stock graph's device splits all start from the CPU's output
        assert BESIDE not in log_stock
    assert BESIDE in log_beside, "the cache's hits did not run beside its misses"
    assert BESIDE not in log_apart
    assert_same_outputs(apart, beside)
    assert [o["tokens"] for o in beside] == [o["tokens"] for o in stock]


def test_a_device_write_in_place_is_not_passed_by_its_readers(moecache_cache_dir, rpc_servers):
    """The keys' projection on the CPU (-ot attn_k.weight=CPU), the KV cache on the device: the device writes each
    step's keys into the cache in place (SET_ROWS through a view) from the CPU's output, and attention reads the
    cache through another view with no edge to that write. Moving attention before the write (it needs nothing
    the host computed) would read stale keys: the reordering stops at a run's first node that writes in place."""
    model = _tiny_model(moecache_cache_dir, "tiny")
    [port] = rpc_servers(1)
    keys_on_cpu = ("-ot", r"attn_k\.weight=CPU")
    beside, _, _ = run(model, port, *keys_on_cpu, **ON)
    apart, _, _ = run(model, port, *keys_on_cpu, **OFF)
    assert_same_outputs(apart, beside)
