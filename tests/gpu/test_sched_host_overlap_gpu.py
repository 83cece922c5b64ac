"""The scheduler's host overlap on CUDA (GGML_SCHED_HOST_OVERLAP=1, off by default): a CPU split computes while
CUDA runs the split after it, where that one needs nothing the CPU computed. The output is the same bit for bit as
without it:
- the hot-expert cache with its misses on the CPU: its hits on CUDA beside its misses (each step waits for the
  uploads, LLAMA_MOE_CACHE_SYNC_UPLOADS=1, so both runs hit the same experts at the same steps);
- the experts on the CPU of a model with a shared expert (tiny qwen35moe): the shared expert beside them.
The debug line names CUDA0. The CPU twin over an rpc-server: tests/e2e/test_sched_host_overlap.py.

Marked `gpu`: run by benchmarks/gpu/run.sh on the GPU machine.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, cache_stats, complete
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none", "-ub", "64",
        "-lv", "5"]
CACHE = ["--moe-cache-slots", "8", "--moe-cache-max-uploads", "4"]
BESIDE = "computed while CUDA0 ran the split after it"


def tiny(cache_dir, preset):
    model = cache_dir / "models" / synth.cached_model_name(preset, seed=0)
    model.parent.mkdir(parents=True, exist_ok=True)
    if not model.exists():
        synth.write_model(model, preset=preset, quant=synth.DEFAULT_QUANT, seed=0, progress=False, threads=2)
    return model


def on_and_off(model, args, env):
    runs = []
    for overlap in ("1", "0"):
        with ServerProcess(model, args=args, env={**env, "GGML_SCHED_HOST_OVERLAP": overlap}, timeout=300) as srv:
            outs = [complete(srv, p * 3, n_predict=24) for p in PROMPTS]
            st = cache_stats(srv) if "--moe-cache-slots" in args else None
            runs.append((outs, srv.log_text(), st))
    return runs


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_the_caches_hits_beside_its_misses_on_cuda_leave_the_output_bit_identical(moecache_cache_dir, preset):
    model = tiny(moecache_cache_dir, preset)
    (beside, log_beside, st), (apart, log_apart, _) = on_and_off(model, BASE + CACHE,
                                                                 {"LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"})
    assert st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    assert BESIDE in log_beside, "the cache's hits did not run beside its misses"
    assert BESIDE not in log_apart
    assert_same_outputs(apart, beside)


def test_a_shared_expert_beside_the_cpus_experts_on_cuda_leaves_the_output_bit_identical(moecache_cache_dir):
    model = tiny(moecache_cache_dir, "tiny-qwen35moe")
    (beside, log_beside, _), (apart, log_apart, _) = on_and_off(model, BASE, {})
    assert BESIDE in log_beside, "the shared expert did not run beside the CPU's experts"
    assert BESIDE not in log_apart
    assert_same_outputs(apart, beside)
