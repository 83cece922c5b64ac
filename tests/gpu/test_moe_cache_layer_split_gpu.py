"""The hot-expert cache and the prefill-phase swap over a layer split on one H200.

GGML_CUDA_DEVICES=2 makes the pin's CUDA backend show two virtual devices on the one GPU. With `-sm layer`
and the experts on the host (--cpu-moe), each cached layer keeps its slots on its own device, which the
cache's JSON names; the prefill-phase swap releases and restores the banks of both. A
layer's kernels and their order do not depend on which device runs it, so the greedy tokens and
log-probabilities equal one device's with the same cache and swap, bit for bit.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, cache_stats, complete
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "2048", "-b", "512", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui"]
N_EXPERT = 32  # the demo preset
CACHE = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
SWAP = ["-ub", "32", "--prefill-ubatch", "256", "--prefill-min-tokens", "64"]
LONG = "The committee met on Tuesday to discuss the budget for the coming year, and " * 24  # ~360 tokens


@pytest.fixture(scope="module")
def demo(demo_and_qwen4exp):
    return demo_and_qwen4exp["demo"]


def run(model, args, **env):
    with ServerProcess(model, args=BASE + args, env={"LLAMA_ARG_LOG_VERBOSITY": "4", **env}, timeout=300) as srv:
        outs = [complete(srv, p, n_predict=24) for p in PROMPTS + [LONG, PROMPTS[0]]]
        st = cache_stats(srv)
        log = srv.log_text()
    return outs, st, log


def cached_devices(st) -> set:
    return {layer.get("device") for layer in st["layers"] if layer["cached"]}


@pytest.mark.parametrize("extra", [[], SWAP], ids=["cache", "cache-and-swap"])
def test_each_layer_caches_on_its_own_device_with_one_devices_output(demo, extra):
    one, st_one, _ = run(demo, CACHE + extra + ["-sm", "none"])
    two, st_two, log = run(demo, CACHE + extra + ["-sm", "layer"], GGML_CUDA_DEVICES="2")
    assert "using device CUDA1 " in log
    assert cached_devices(st_one) == {"CUDA0"}
    assert cached_devices(st_two) == {"CUDA0", "CUDA1"}, st_two["layers"]
    assert st_two["total"]["hits"] > 0 and st_two["total"]["uploads"] == st_one["total"]["uploads"]
    if extra:
        swap = st_two["prefill_swap"]
        assert swap["swaps"] >= 1 and sum(swap["failed"].values()) == 0, swap
    assert_same_outputs(one, two)
