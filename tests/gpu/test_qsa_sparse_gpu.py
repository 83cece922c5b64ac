"""QSA sparse attention (--qsa-sparse, patch 0024) on CUDA: tiny-qwen4exp with every layer on the
GPU, f16 and q8_0 KV. The gathered path attends the same cells as the masked one: the same greedy
tokens, log-probabilities within device rounding, at a depth of ~2.5k tokens, prompt and decode.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, max_logprob_diff, real_text
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "16", "-no-kvu"]


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsa") / "tiny-qwen4exp.gguf"
    return synth.write_model(path, preset="tiny-qwen4exp", seed=0, progress=False)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_sparse_attention_on_cuda_equals_the_masked_path(qwen4exp, kv):
    prompt = real_text(2500, 10000)
    args = ARGS + ["-ctk", kv, "-ctv", kv]
    outs = []
    for extra in ([], ["--qsa-sparse"]):
        with ServerProcess(qwen4exp, args=args + extra, timeout=300) as srv:
            outs.append(complete(srv, prompt, n_predict=16))
    masked, sparse = outs
    assert sparse["tokens_evaluated"] > 2000
    assert sparse["tokens"] == masked["tokens"]
    assert max_logprob_diff(masked, sparse) < 2e-2
