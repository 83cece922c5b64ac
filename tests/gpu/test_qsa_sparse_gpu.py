"""QSA sparse attention (--qsa-sparse) on CUDA: tiny-qwen4exp with every layer on the
GPU, f16 and q8_0 KV. The gathered path attends the same cells as the masked one: the same greedy
tokens, log-probabilities within device rounding, at a depth of ~2.5k tokens, prompt and decode.
The gathered rows go to f16 in the gather itself: bit for bit what the gather and
its cast give, in decode after prompt ubatches of 256 tokens.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, logprobs, max_logprob_diff, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "16", "-no-kvu"]


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


def run_256(model, prompt, extra, env):
    args = ARGS + ["-ub", "256", "-lv", "4"] + extra  # the later -ub wins: the prompt masked, decode sparse
    with ServerProcess(model, args=args, env=env, timeout=300) as srv:
        return complete(srv, prompt, n_predict=16), srv.log_text()


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_the_fused_gather_is_the_unfused_one_bit_for_bit(qwen4exp_8l, kv):
    """GGML_CUDA_GET_ROWS_CAST_FUSE=0 keeps get_rows (f32 rows) and the cast to f16 apart."""
    prompt = real_text(2500, 10000)
    extra = ["-ctk", kv, "-ctv", kv, "--qsa-sparse"]
    fused, log = run_256(qwen4exp_8l, prompt, extra, {})
    apart, log_apart = run_256(qwen4exp_8l, prompt, extra, {"GGML_CUDA_GET_ROWS_CAST_FUSE": "0"})
    line = "get_rows and its cast to f16 fused"
    assert line in log and line not in log_apart
    assert fused["tokens"] == apart["tokens"]
    assert logprobs(fused) == logprobs(apart)  # exact
