"""The expert types real files use through every path of the hot-expert cache, on the CPU with the library's
host test device as the GPU: the `demo` preset (rows of 256 values, so K-quants apply) made with the built
llama-quantize as Q4_K_M (Q4_K and Q6_K experts) and as MXFP4_MOE (MXFP4 experts), and the `tiny-gpt-oss`
preset as MXFP4_MOE (MXFP4 experts with biases, as gpt-oss ships them).
Uploads into slots, the two branches with the misses on the CPU, the misses on the device through the address
tables, the misses split between the device and the CPU, and a prompt the prefill-phase swap runs at a 4x ubatch with its warm restore each give the stock
path's tokens and top log-probabilities bit for bit."""

from __future__ import annotations

import pytest

from moe_cache_checks import assert_same_outputs, cache_stats, complete, real_text
from moecache.server import ServerProcess

ENV = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
BASE = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-b", "2048"]
# (preset, quant): the expert types they give
MODELS = {("demo", "q4_k_m"): {"q4_K", "q6_K"}, ("demo", "mxfp4_moe"): {"mxfp4"},
          ("tiny-gpt-oss", "mxfp4_moe"): {"mxfp4"}}  # gpt-oss as it ships: MXFP4 experts with biases


@pytest.fixture(scope="module", params=sorted(MODELS), ids=lambda k: f"{k[0]}-{k[1]}")
def typed_model(request, moecache_cache_dir, llama_server_bin):
    from moecache import synth
    from moecache.gguf import GGUFReader

    preset, quant = request.param
    models = moecache_cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    path = models / synth.cached_model_name(preset, quant, seed=0)
    if not path.exists():
        synth.write_model(path, preset=preset, quant=quant, seed=0, progress=False, threads=2)
    with GGUFReader(path) as g:
        types = {t.type.name.lower() for t in g.tensors if "_exps.weight" in t.name}
    assert {t.lower() for t in MODELS[request.param]} <= types, types  # the experts really are those types
    return path


def run(model, args, prompts, n_predict=12):
    with ServerProcess(model, args=[*BASE, *args], env=ENV, timeout=180) as srv:
        outs = [complete(srv, p, n_predict=n_predict) for p in prompts]
        return outs, cache_stats(srv), srv.log_text()


SHORT = ["def add(a, b):\n    return a + b\n", "The history of the city begins"]


@pytest.mark.parametrize("miss", ["cpu", "gpu", "split"])
def test_slots_and_both_miss_paths_are_exact(typed_model, miss):
    ref, _, _ = run(typed_model, ["-ub", "64"], SHORT)
    outs, st, _ = run(typed_model, ["-ub", "64", "--moe-cache-slots", "8", "--moe-cache-miss", miss], SHORT)
    assert_same_outputs(ref, outs)
    tot = st["total"]
    assert tot["uploads"] > 0 and tot["hits"] > 0 and tot["misses"] > 0, tot
    if miss == "gpu":
        assert all(l["table"] and l["miss"] == "device" for l in st["layers"]), st["layers"]
    if miss == "split":  # the device's share of the misses (with the biases' own rows for tiny-gpt-oss)
        assert all(l["miss"] == "split" and not l["table"] for l in st["layers"]), st["layers"]
        assert any(l["split_device"] > 0 for l in st["layers"]), st["layers"]


def test_a_swapped_prompt_and_its_warm_restore_are_exact(typed_model):
    prompt = [real_text(400, 1400)]
    ref, _, _ = run(typed_model, ["-ub", "256"], prompt)
    outs, st, _ = run(typed_model, ["-ub", "64", "--moe-cache-slots", "8", "--prefill-ubatch", "256",
                                      "--prefill-min-tokens", "128"], prompt)
    # the server's own timings (its log line comes after the response: reading it here would race)
    assert outs[0]["timings"].get("prefill_ubatch") == 256 and outs[0]["timings"]["prompt_n"] >= 128
    assert_same_outputs(ref, outs)
    assert st["total"]["uploads"] > 0
