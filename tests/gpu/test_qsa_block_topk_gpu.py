"""QSA's block-level top-k (--qsa-block-topk) on CUDA: tiny-qwen4exp-8l (two QSA layers)
with every layer on the GPU, at a depth of ~2.5k tokens in ubatches of 16. The block level selects the
cells of the cell level with the same tie rule (LLAMA_QSA_BLOCK_TOPK_BLOCKS above the block count turns
it off), so the output is equal bit for bit: masked, with the device-built mask, with sparse attention,
and with a q8_0 cache. One block fewer than the bound must change it.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, logprobs, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "8192", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "16", "-no-kvu", "-lv", "4",
        "--qsa-block-topk"]
USED = "before its cells (block-level top-k)"
CELL_LEVEL = {"LLAMA_QSA_BLOCK_TOPK_BLOCKS": "1000000"}


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def run(model, text, env, extra=()):
    with ServerProcess(model, args=ARGS + list(extra), env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=16, cache_prompt=True),
                complete(srv, text[:7000], n_predict=16, cache_prompt=True)]
        return outs, srv.log_text()


@pytest.mark.parametrize("extra", [[], ["--kq-mask-device"], ["--qsa-sparse"], ["-ctk", "q8_0", "-ctv", "q8_0"]],
                         ids=["masked", "device-mask", "sparse", "q8_0"])
def test_the_block_level_on_cuda_equals_the_cell_level(qwen4exp_8l, text, extra):
    ref, ref_log = run(qwen4exp_8l, text, CELL_LEVEL, extra)
    blk, log = run(qwen4exp_8l, text, {}, extra)
    assert USED in log and USED not in ref_log
    assert blk[0]["tokens_evaluated"] > 1000 and blk[1]["tokens_cached"] > 1000
    for a, b in zip(ref, blk):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact


def test_one_block_fewer_changes_the_output(qwen4exp_8l, text):
    ref, _ = run(qwen4exp_8l, text, CELL_LEVEL)
    outs, log = run(qwen4exp_8l, text, {"LLAMA_QSA_BLOCK_TOPK_BLOCKS": "4"})
    assert "QSA selects 4 blocks per token" in log
    assert any(logprobs(a) != logprobs(b) for a, b in zip(ref, outs))
