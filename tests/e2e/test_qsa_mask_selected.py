"""QSA's attention mask built at the selected cells only, through the real llama-server on the CPU.

Where a QSA layer keeps the masked attention (a prompt ubatch at depth), the pin fills an [n_kv, n_tokens]
mask with -inf, writes zeros at the cells the indexer selected and adds the KQ mask to it. The series
writes the KQ mask's own values at the selected cells instead (the same mask: 0 + x = x, -inf + x = -inf)
and, where the KQ mask is built on the device from positions (--kq-mask-device), builds those values
at the selected cells alone by the same steps; with the block-level top-k (--qsa-block-topk) every use of
the full mask is then such a value, so the graph no longer builds the [n_kv, n_tokens] mask at all.
LLAMA_QSA_MASK_SELECTED=0 builds it as the pin does: the outputs are equal bit for bit.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import QSA_MASK_SELECTED_CASES, assert_same_outputs, complete, full_kq_mask_ops, real_text
from moecache.server import ServerProcess

PIN = {"LLAMA_QSA_MASK_SELECTED": "0"}
TIMED = {"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000"}


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def run(model, text, env, extra):
    """A deep prompt in ubatches of 64 (the masked path: 64 x 11 cells > n_kv at the start), the same prompt
    extended from the cache, another prompt on the same slot; decode steps take the sparse path."""
    args = ["-t", "2", "-c", "8192", "-np", "1", "-ngl", "0", "-fa", "on", "-b", "256", "-ub", "64", "-lv", "4",
            *extra]
    with ServerProcess(model, args=args, env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=12, cache_prompt=True),
                complete(srv, text[:7000], n_predict=12, cache_prompt=True),
                complete(srv, text[3000:5000], n_predict=12, cache_prompt=True)]
        return outs, srv.log_text()


@pytest.mark.parametrize("extra", list(QSA_MASK_SELECTED_CASES.values()), ids=list(QSA_MASK_SELECTED_CASES))
def test_the_mask_at_the_selected_cells_gives_the_pins_output(qwen4exp_8l, text, extra):
    pin, _ = run(qwen4exp_8l, text, PIN, extra)
    sel, _ = run(qwen4exp_8l, text, {}, extra)
    assert sel[0]["tokens_evaluated"] > 1000 and sel[1]["tokens_cached"] > 1000
    assert_same_outputs(pin, sel)


def test_the_block_level_with_the_device_mask_never_builds_the_full_mask(qwen4exp_8l, text):
    extra = QSA_MASK_SELECTED_CASES["device-block"]
    _, pin_log = run(qwen4exp_8l, text, {**PIN, **TIMED}, extra)
    _, log = run(qwen4exp_8l, text, TIMED, extra)
    assert full_kq_mask_ops(pin_log, "CPU", 64), "the pin's graph builds the mask: the check below would see it"
    assert full_kq_mask_ops(log, "CPU", 64) == []
