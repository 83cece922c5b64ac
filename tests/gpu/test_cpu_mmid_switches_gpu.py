"""The CPU's experimental MUL_MAT_ID switches on the H200 machine's CPU (its AVX512 VNNI kernels): with every
routed expert in pinned host buffers (the GGUF layout the hot-expert cache uploads from), decode with
GGML_CPU_MMID_FLAT=1 and GGML_CPU_DOT_X4=1 must be bit-identical to the stock
path, with the experts computed on the CPU and with the cache's misses computed there; switched by the
environment variables and by the per-context flags (whose path the CPU backend's line confirms). The model
is the tiny preset in Q4_0, the type with a four-row kernel. The CPU e2e twin is
tests/e2e/test_cpu_mmid_switches.py.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, cache_stats, complete, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

# --no-repack: the GGUF layout, where the four-row kernel applies, on any build (pinned buffers are not repacked)
BASE_ARGS = ["-t", "8", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-repack", "--no-webui"]
CACHE_ARGS = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16",
              "--moe-cache-rebalance-interval", "4"]
SWITCHES = {"GGML_CPU_MMID_FLAT": "1", "GGML_CPU_DOT_X4": "1"}
SYNC_UPLOADS = {"LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
FLAGS = ["--cpu-experts-flat", "--cpu-experts-x4", "-lv", "4"]  # the same switches per context
SAID = "one token's experts (q4_0): flat split of rows, four-row dot products"


@pytest.mark.parametrize("by", ["env", "flags"])
@pytest.mark.parametrize("cache", [False, True], ids=["cpu-experts", "cache-misses"])
def test_the_switches_are_bit_identical_on_the_gpu_machine(tiny_q4_0, cache, by):
    args = BASE_ARGS + (CACHE_ARGS if cache else [])
    # with the cache, the uploads' timing decides which experts the GPU computes (which round differently
    # from the CPU's): each step waits for them, so both runs hit the same experts at the same steps
    sync = SYNC_UPLOADS if cache else {}
    stock_env = {**{k: "0" for k in SWITCHES}, **sync}
    switched = (args, {**SWITCHES, **sync}) if by == "env" else (args + FLAGS, stock_env)
    runs = {}
    for name, (run_args, env) in (("stock", (args, stock_env)), ("switched", switched)):
        with ServerProcess(tiny_q4_0, args=run_args, env=env, timeout=180) as srv:
            runs[name] = ([complete(srv, p) for p in PROMPTS], cache_stats(srv) if cache else None)
            if by == "flags" and name == "switched":
                assert SAID in srv.log_text(), srv.log_text()[-3000:]  # the CPU backend took them
    (base, base_st), (outs, st) = runs["stock"], runs["switched"]
    for a, b in zip(base, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0
    if cache:
        # some experts missed (computed on the CPU) and some were uploaded, in both runs
        assert st["total"]["uploads"] > 0 and base_st["total"]["uploads"] > 0
        assert st["total"]["misses"] > 0 and base_st["total"]["misses"] > 0, st["total"]
