"""Every MoE architecture of the pin through the hot-expert cache, on the CPU with the library's host test
device as the GPU. The pin's own test-llama-archs writes one small random model per architecture; each MoE
one is loaded through moecache.Model with the routed experts in host memory, and its greedy tokens on the
stock path must be those of the cache (one slot per layer: nearly every routed expert a miss) with the
misses on the CPU and on the device, and those of a prompt that the prefill-phase swap runs at a 4x ubatch
(against the stock path at that ubatch). An architecture the cache cannot hold or the API cannot run is
listed with its reason in tests/archs_checks.py: one that newly fails, is newly refused or newly runs fails this test (so the
lists and docs/architectures.md stay true).

Each model runs in a process of its own: a library abort (what this test exists to catch) fails that
architecture, not the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from archs_checks import run_all, sweep_problems, write_arch_models


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, llama_server_bin):
    return write_arch_models(tmp_path_factory.mktemp("archs"))


def test_every_moe_architecture_runs_through_the_cache(arch_models, subprocess_env):
    env = {**subprocess_env, "LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
    results = run_all(arch_models, env)
    # the host test device computes as the CPU does: the same tokens bit for bit
    problems = sweep_problems(results, lambda ref, out: None if out["tokens"] == ref["tokens"]
                              else f"{out['tokens']} against {ref['tokens']}")
    assert not problems, "\n".join(problems)


GPT_OSS = r"""
import json, sys
import moecache
m = moecache.Model(sys.argv[1], n_gpu_layers=-1, cpu_moe=True, repack=False)
out = {}
for name, kw in (("stock", {}), ("cache", {"moe_cache_slots": 2, "moe_cache_miss": sys.argv[2]})):
    ctx = m.context(n_ctx=256, n_ubatch=32, n_threads=1, **kw)
    g = ctx.generate("Once upon a time " * 5, max_tokens=12, temperature=0.8, seed=3)
    st = ctx.expert_cache.stats_json() if kw else {}
    out[name] = {"tokens": g.tokens, "hits": st.get("total", {}).get("hits"),
                 "tables": [l.get("table") for l in st.get("layers", [])],
                 "reasons": sorted({l.get("reason") or "" for l in st.get("layers", [])})}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("miss,env,table", [
    ("gpu", {}, True),                                   # one expert FFN through the tables
    ("gpu", {"LLAMA_MOE_CACHE_TABLE": "0"}, False),       # two branches, misses on the device
    ("cpu", {}, False),                                   # two branches, misses on the CPU
    ("gpu", {"LLAMA_MOE_CACHE_FAIL": "map"}, False),      # a failed mapping: the CPU's misses
])
def test_gpt_oss_experts_with_biases_run_through_the_cache(arch_models, subprocess_env, miss, env, table):
    """gpt-oss's experts have biases. Through the tables every row is a routed expert and the biases (the
    cache's copies, on the device) keep the routed ids; in two branches each branch adds its own experts'
    biases and the zero column to the rows the other computes (the CPU's from a host copy). Sampled tokens
    equal the stock path's in every case (checked to fail with the hot branch given the routed ids)."""
    model = next(m for m in arch_models if m.name == "gpt-oss-moe.gguf")
    env = {**subprocess_env, "LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1", **env}
    r = subprocess.run([sys.executable, "-c", GPT_OSS, str(model), miss], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["cache"]["tokens"] == out["stock"]["tokens"]
    assert out["cache"]["hits"] > 0 and out["cache"]["reasons"] == [""], out["cache"]
    assert all(t is table for t in out["cache"]["tables"]), out["cache"]["tables"]
