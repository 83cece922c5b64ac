"""QSA's attention mask built at the selected cells (LLAMA_QSA_MASK_SELECTED) on CUDA: tiny-qwen4exp-8l with
every layer on the GPU, a ~2.5k-token prompt in ubatches of 64 (the masked path), the same prompt extended
and decode steps (the sparse path). The series writes the KQ mask's values at the selected cells, built
there from positions where the device builds the mask, instead of zeros plus the whole mask: the outputs
equal LLAMA_QSA_MASK_SELECTED=0's bit for bit, and with the block-level top-k and the device mask the
deep ubatches never build the [n_kv, n_tokens] mask.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import QSA_MASK_SELECTED_CASES, assert_same_outputs, complete, full_kq_mask_ops, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

PIN = {"LLAMA_QSA_MASK_SELECTED": "0"}
TIMED = {"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000", "GGML_CUDA_DISABLE_GRAPHS": "1"}


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def run(model, text, env, extra):
    args = ["-t", "8", "-c", "8192", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "64", "-lv", "4",
            *extra]
    with ServerProcess(model, args=args, env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=12, cache_prompt=True),
                complete(srv, text[:7000], n_predict=12, cache_prompt=True)]
        return outs, srv.log_text()


@pytest.mark.parametrize("extra", list(QSA_MASK_SELECTED_CASES.values()), ids=list(QSA_MASK_SELECTED_CASES))
def test_the_mask_at_the_selected_cells_on_cuda_gives_the_pins_output(qwen4exp_8l, text, extra):
    pin, _ = run(qwen4exp_8l, text, PIN, extra)
    sel, _ = run(qwen4exp_8l, text, {}, extra)
    assert sel[0]["tokens_evaluated"] > 1000 and sel[1]["tokens_cached"] > 1000
    assert_same_outputs(pin, sel)


def test_no_full_mask_on_cuda_with_the_block_level(qwen4exp_8l, text):
    extra = QSA_MASK_SELECTED_CASES["device-block"]
    _, pin_log = run(qwen4exp_8l, text, {**PIN, **TIMED}, extra)
    _, log = run(qwen4exp_8l, text, TIMED, extra)
    assert full_kq_mask_ops(pin_log, "CUDA0", 64)
    assert full_kq_mask_ops(log, "CUDA0", 64) == []
