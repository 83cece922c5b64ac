"""The expert types real files use through every path of the hot-expert cache on CUDA (the CPU test device's
tests/e2e/test_moe_cache_types.py): the `demo` preset (rows of 256) as Q4_K_M (Q4_K and Q6_K experts) and as
MXFP4_MOE, and a gpt-oss of rows of 256 (tiny-gpt-oss widened: the GPU kernels' tiles are longer than its 64)
as MXFP4_MOE (MXFP4 experts with biases, as gpt-oss ships them). Uploads into slots, the misses on the CPU
and on the GPU (through the address tables), and a prompt the prefill-phase swap runs at a 4x ubatch with its
warm restore: the stock path's tokens (experts on the CPU), log-probabilities apart by rounding, up to a near
tie of the stock path's best two.

Marked `gpu`: run by benchmarks/gpu/run.sh on the GPU machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_cache_checks import assert_close_tokens, cache_stats, complete, real_text, token_steps
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-b", "2048", "-lm", "none",
        "--no-webui"]
MODELS = {("demo", "q4_k_m"): {"q4_k", "q6_k"}, ("demo", "mxfp4_moe"): {"mxfp4"},
          ("gpt-oss-256", "mxfp4_moe"): {"mxfp4"}}
PROMPTS = ["def add(a, b):\n    return a + b\n", "The history of the city begins"]


@pytest.fixture(scope="module", params=sorted(MODELS), ids=lambda k: f"{k[0]}-{k[1]}")
def typed_model(request, moecache_cache_dir, llama_server_bin):
    from moecache import synth
    from moecache.gguf import GGUFReader

    name, quant = request.param
    preset = name
    if name == "gpt-oss-256":
        preset = replace(synth.get_preset("tiny-gpt-oss"), name="gpt-oss-256", n_embd=256, n_ff_exp=256, n_ff=256)
    models = moecache_cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    path = models / f"{name}-{quant}-seed0-gpu-types.gguf"
    if not path.exists():
        synth.write_model(path, preset=preset, quant=quant, seed=0, progress=False, threads=8)
    with GGUFReader(path) as g:
        types = {t.type.name.lower() for t in g.tensors if "_exps.weight" in t.name}
    assert MODELS[request.param] <= types, types  # the experts really are those types
    return path


def run(model, args, prompts, n_predict=16):
    with ServerProcess(model, args=[*BASE, *args], timeout=180) as srv:
        outs = [complete(srv, p, n_predict=n_predict) for p in prompts]
        return outs, cache_stats(srv)


def assert_close(ref, outs):
    for a, b in zip(ref, outs):
        assert_close_tokens(a["tokens"], token_steps(a), b["tokens"], token_steps(b), bound=5e-2)


@pytest.mark.parametrize("miss", ["cpu", "gpu"])
def test_slots_and_both_miss_paths_on_cuda(typed_model, miss):
    ref, _ = run(typed_model, ["-ub", "64"], PROMPTS)
    outs, st = run(typed_model, ["-ub", "64", "--moe-cache-slots", "8", "--moe-cache-miss", miss], PROMPTS)
    assert_close(ref, outs)
    tot = st["total"]
    assert tot["uploads"] > 0 and tot["hits"] > 0 and tot["misses"] > 0, tot
    if miss == "gpu":
        assert all(l["table"] and l["miss"] == "device" for l in st["layers"]), st["layers"]
        assert tot["n_miss_device"] > 0, tot


def test_a_swapped_prompt_and_its_warm_restore_on_cuda(typed_model):
    prompt = [real_text(400, 1400)]
    ref, _ = run(typed_model, ["-ub", "256"], prompt)
    outs, st = run(typed_model, ["-ub", "64", "--moe-cache-slots", "8", "--prefill-ubatch", "256",
                                 "--prefill-min-tokens", "128"], prompt)
    assert outs[0]["timings"].get("prefill_ubatch") == 256 and outs[0]["timings"]["prompt_n"] >= 128
    assert_close(ref, outs)
    assert st["total"]["uploads"] > 0 and st["prefill_swap"]["swaps"] == 1, st["prefill_swap"]
