"""The architecture sweep's shared parts (tests/e2e/test_archs.py on the CPU test device, tests/gpu/
test_archs_gpu.py on CUDA): the pin's test-llama-archs writes one small random model per architecture; each
MoE one runs in a process of its own (a library abort fails that architecture, not the run) through the stock
path, the hot-expert cache with its misses on the CPU and on the device (one slot per layer: nearly every
routed expert a miss), and a prompt the prefill-phase swap runs at a 4x ubatch. Which architectures the API
refuses and which the cache holds no layer of are listed here with their reasons (docs/architectures.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the architectures the API refuses, and why (moecache.MoecacheError at Model.context)
REFUSED = {"llada-moe": "is a diffusion model", "rnd1": "is a diffusion model"}
# the architectures whose layers the cache holds none of, and why (per layer "reason" in its stats)
NOT_CACHED = {
    "ernie4_5": "no routed experts",      # the test model of the dense variant, named ernie4_5-moe.gguf
    "paddleocr": "no routed experts",
}

# argv: model path, top log-probabilities per token (0: none)
RUN_ONE = r"""
import json, sys
import moecache
path, n_probs = sys.argv[1], int(sys.argv[2])
out = {}
try:
    m = moecache.Model(path, n_gpu_layers=-1, cpu_moe=True, repack=False)
    out["arch"] = m.arch
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    def gen(n_ubatch=32, **kw):
        ctx = m.context(n_ctx=512, n_ubatch=n_ubatch, n_batch=512, n_threads=1, **kw)
        g = ctx.generate(prompt, max_tokens=6, top_logprobs=n_probs)
        st = ctx.expert_cache.stats_json() if kw.get("moe_cache_slots") else None
        return {"tokens": g.tokens, "steps": g.top_logprobs}, g, st
    out["stock"] = gen()[0]
    for miss in ("cpu", "gpu"):
        r, g, st = gen(moe_cache_slots=1, moe_cache_miss=miss)
        out[miss] = r
        out[miss + "_cached"] = sum(1 for l in st["layers"] if not l.get("reason"))
        out[miss + "_reasons"] = sorted({l["reason"] for l in st["layers"] if l.get("reason")})
        out[miss + "_steps"] = st["total"]["n_steps"]
    out["stock_128"] = gen(n_ubatch=128)[0]
    r, g, st = gen(moe_cache_slots=1, moe_cache_miss="gpu", prefill_ubatch=128, prefill_min_tokens=64)
    out["swap"] = r
    out["swap_ubatch"] = g.timings.get("prefill_ubatch")
except moecache.MoecacheError as e:
    out["refused"] = str(e)
print("RESULT " + json.dumps(out))
"""


def write_arch_models(out: Path) -> list[Path]:
    """test-llama-archs -o DIR: its MoE models (named <arch>-moe.gguf)."""
    from moecache.paths import binary

    r = subprocess.run([str(binary("test-llama-archs")), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    models = sorted(out.glob("*-moe.gguf"))
    assert len(models) >= 50, [m.name for m in models]  # the pin writes 55: a broken generator must not pass
    return models


def run_one(model: Path, env: dict, n_probs: int = 0) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN_ONE, str(model), str(n_probs)], capture_output=True, text=True,
                       timeout=300, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = "\n".join(r.stderr.strip().splitlines()[-8:])
        return {"model": model.name, "crashed": f"exit status {r.returncode}: {tail}"}
    return {"model": model.name, **json.loads(lines[-1][len("RESULT "):])}


def run_all(models: list[Path], env: dict, n_probs: int = 0, workers: int = 4) -> list[dict]:
    with ThreadPoolExecutor(max_workers=max(1, min(workers, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda m: run_one(m, env, n_probs), models))


def sweep_problems(results: list[dict], differs) -> list[str]:
    """What went wrong in the sweep's results. `differs(ref, out)`: None where the run `out` ({"tokens",
    "steps"}) is as good as the reference `ref`, else what differs."""
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
            why = differs(r["stock"], r[path])
            if why:
                problems.append(f"{name}: the cache with misses on the {path} against the stock path: {why}")
        cached, on_device = r["cpu_cached"], r["gpu_cached"]
        if arch in NOT_CACHED:
            if cached or on_device or NOT_CACHED[arch] not in r["cpu_reasons"]:
                problems.append(f"{name}: listed as not cached ({NOT_CACHED[arch]}) but {cached}/{on_device} layers "
                                f"cached, reasons {r['cpu_reasons']}")
        elif not cached or on_device != cached or not r["cpu_steps"] or not r["gpu_steps"]:
            problems.append(f"{name}: {cached}/{on_device} layers cached, {r['cpu_steps']}/{r['gpu_steps']} cache steps "
                            f"(reasons {r['cpu_reasons']}): newly refused?")
        why = differs(r["stock_128"], r["swap"])
        if why:
            problems.append(f"{name}: the prompt swapped to ubatch 128 against the stock path at 128: {why}")
        if arch not in NOT_CACHED and r["swap_ubatch"] != 128:
            problems.append(f"{name}: the prompt did not swap (ubatch {r['swap_ubatch']})")
    missing = (set(REFUSED) | set(NOT_CACHED)) - seen
    if missing:
        problems.append(f"listed but not written by test-llama-archs: {sorted(missing)}")
    return problems
