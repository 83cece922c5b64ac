"""Every MoE architecture of the pin through the hot-expert cache, on the CPU with the library's host test
device as the GPU. The pin's own test-llama-archs writes one small random model per architecture; each MoE
one is loaded through moecache.Model with the routed experts in host memory, and its greedy tokens on the
stock path must be those of the cache (one slot per layer: nearly every routed expert a miss) with the
misses on the CPU and on the device, and those of a prompt that the prefill-phase swap runs at a 4x ubatch
(against the stock path at that ubatch). An architecture the cache cannot hold or the API cannot run is
listed below with its reason: one that newly fails, is newly refused or newly runs fails this test (so the
lists and docs/architectures.md stay true).

Each model runs in a process of its own: a library abort (what this test exists to catch) fails that
architecture, not the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moecache.paths import binary

# the architectures the API refuses, and why (moecache.MoecacheError at Model.context)
REFUSED = {"llada-moe": "is a diffusion model", "rnd1": "is a diffusion model"}
# the architectures whose layers the cache holds none of, and why (per layer "reason" in its stats)
NOT_CACHED = {
    "ernie4_5": "no routed experts",      # the test model of the dense variant, named ernie4_5-moe.gguf
    "paddleocr": "no routed experts",
}


RUN_ONE = r"""
import json, sys
import moecache
path = sys.argv[1]
out = {}
try:
    m = moecache.Model(path, n_gpu_layers=-1, cpu_moe=True, repack=False)
    out["arch"] = m.arch
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    def gen(n_ubatch=32, **kw):
        ctx = m.context(n_ctx=512, n_ubatch=n_ubatch, n_batch=512, n_threads=1, **kw)
        g = ctx.generate(prompt, max_tokens=6)
        st = ctx.expert_cache.stats_json() if kw.get("moe_cache_slots") else None
        return g, st
    out["stock"] = gen()[0].tokens
    for miss in ("cpu", "gpu"):
        g, st = gen(moe_cache_slots=1, moe_cache_miss=miss)
        out[miss] = g.tokens
        out[miss + "_cached"] = sum(1 for l in st["layers"] if not l.get("reason"))
        out[miss + "_reasons"] = sorted({l["reason"] for l in st["layers"] if l.get("reason")})
        out[miss + "_steps"] = st["total"]["n_steps"]
    out["stock_128"] = gen(n_ubatch=128)[0].tokens
    g, st = gen(moe_cache_slots=1, moe_cache_miss="gpu", prefill_ubatch=128, prefill_min_tokens=64)
    out["swap"] = g.tokens
    out["swap_ubatch"] = g.timings.get("prefill_ubatch")
except moecache.MoecacheError as e:
    out["refused"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, llama_server_bin):
    """test-llama-archs -o DIR: its MoE models (named <arch>-moe.gguf)."""
    out = tmp_path_factory.mktemp("archs")
    r = subprocess.run([str(binary("test-llama-archs")), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    models = sorted(out.glob("*-moe.gguf"))
    assert len(models) >= 50, [m.name for m in models]  # the pin writes 55: a broken generator must not pass
    return models


def _run(model: Path, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN_ONE, str(model)], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = "\n".join(r.stderr.strip().splitlines()[-8:])
        return {"model": model.name, "crashed": f"exit status {r.returncode}: {tail}"}
    return {"model": model.name, **json.loads(lines[-1][len("RESULT "):])}


def test_every_moe_architecture_runs_through_the_cache(arch_models, subprocess_env):
    env = {**subprocess_env, "LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda m: _run(m, env), arch_models))
    problems = []
    seen = set()
    for r in results:
        name = r["model"]
        if "crashed" in r:
            problems.append(f"{name}: the process died ({r['crashed']})")
            continue
        if "refused" in r:
            arch = next((a for a in REFUSED if f"'{a}'" in r["refused"]), None)
            if arch is None or REFUSED[arch] not in r["refused"]:
                problems.append(f"{name}: newly refused: {r['refused']}")
            seen.add(arch)
            continue
        arch = r["arch"]
        seen.add(arch)
        if arch in REFUSED:
            problems.append(f"{name}: {arch} is listed as refused but ran")
        for path in ("cpu", "gpu"):
            if r[path] != r["stock"]:
                problems.append(f"{name}: the cache with misses on the {path} gave {r[path]}, the stock path {r['stock']}")
        cached, on_device = r["cpu_cached"], r["gpu_cached"]
        if arch in NOT_CACHED:
            if cached or on_device or NOT_CACHED[arch] not in r["cpu_reasons"]:
                problems.append(f"{name}: listed as not cached ({NOT_CACHED[arch]}) but {cached}/{on_device} layers "
                                f"cached, reasons {r['cpu_reasons']}")
        elif not cached or on_device != cached or not r["cpu_steps"] or not r["gpu_steps"]:
            problems.append(f"{name}: {cached}/{on_device} layers cached, {r['cpu_steps']}/{r['gpu_steps']} cache steps "
                            f"(reasons {r['cpu_reasons']}): newly refused?")
        if r["swap"] != r["stock_128"]:
            problems.append(f"{name}: the prompt swapped to ubatch 128 gave {r['swap']}, the stock path at 128 "
                            f"{r['stock_128']}")
        if arch not in NOT_CACHED and r["swap_ubatch"] != 128:
            problems.append(f"{name}: the prompt did not swap (ubatch {r['swap_ubatch']})")
    missing = (set(REFUSED) | set(NOT_CACHED)) - seen
    assert not missing, f"listed but not written by test-llama-archs: {sorted(missing)}"
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
