"""The CUDA fusion of a relu and its sum over dimension 1: QSA's indexer rectifies each
head's block scores and sums the heads, one [n_blocks, n_tokens] view at a time, which made a relu pass
and one add per head over [n_blocks, n_heads, n_tokens]; the fused kernel reads the scores once and adds
the rectified heads in the graph's order, so the output is the unfused one bit for bit. tiny-qwen4exp
with 2 and with 16 indexer heads, the prompt's ubatches and the decode steps, the masked and the sparse
QSA paths, against GGML_CUDA_RELU_SUM_FUSE=0; the one-time log line shows the fused kernel ran.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_cache_checks import complete, logprobs, real_text
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "512", "-ub", "256", "-lv", "4"]
FUSED = "relu and its sum over dimension 1 fused"


@pytest.fixture(scope="module", params=[2, 16], ids=["2-heads", "16-heads"])
def qwen4exp(request, tmp_path_factory):
    preset = replace(synth.PRESETS["tiny-qwen4exp"], name=f"tiny-qwen4exp-{request.param}h",
                     indexer_n_head=request.param)
    path = tmp_path_factory.mktemp("relu-sum") / f"{preset.name}.gguf"
    return synth.write_model(path, preset=preset, seed=0, progress=False)


@pytest.mark.parametrize("sparse", [[], ["--qsa-sparse"]], ids=["masked", "sparse"])
def test_the_fused_indexer_score_is_the_unfused_one_bit_for_bit(qwen4exp, sparse):
    prompt = real_text(2500, 10000)
    outs, logs = [], []
    for env in ({"GGML_CUDA_RELU_SUM_FUSE": "0"}, {}):
        with ServerProcess(qwen4exp, args=ARGS + sparse, env=env, timeout=300) as srv:
            outs.append(complete(srv, prompt, n_predict=16))
            logs.append(srv.log_text())
    unfused, fused = outs
    assert fused["tokens_evaluated"] > 2000
    assert FUSED not in logs[0]
    assert FUSED in logs[1], logs[1][-3000:]
    assert fused["tokens"] == unfused["tokens"]
    assert logprobs(fused) == logprobs(unfused)  # exact
