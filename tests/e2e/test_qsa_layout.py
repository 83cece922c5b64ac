"""The QSA block layout kept across ubatches through the real llama-server on the CPU.

Where a KV stream holds one sequence, set_input_qsa takes each block's cells from a layout it keeps
and updates only where the cells' positions changed, instead of regrouping every cell per ubatch.
LLAMA_QSA_LAYOUT_CHECK=1 builds the grouped layout too and aborts on any difference, so a request
that completes under it is a request on which the two agreed on every ubatch: a deep prompt in
ubatches of 16, a prompt extended from the cache, one that leaves it, one cleared slot, two
sequences in one unified stream (the grouped scan's case) and five streams at once.
LLAMA_QSA_LAYOUT_FAST=0 is the pin's path: the output is the same bit for bit. Under the same switch, each
in-place update of the layout (a grown window, a cut of the tail) is compared with a rebuild
from the cells, field by field, and aborts on any difference.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from moe_cache_checks import complete, logprobs, real_text
from moecache.server import ServerProcess

CHECKED = "LLAMA_QSA_LAYOUT_CHECK: the layout by position equals the grouped one"


def server_args(n_parallel=1, n_ctx=4096, unified=False):
    return ["-t", "2", "-c", str(n_ctx), "-np", str(n_parallel), "-ngl", "0", "-fa", "on",
            "-b", "256", "-ub", "16", "-kvu" if unified else "-no-kvu"]


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def requests(text: str) -> list[dict]:
    """A deep prompt; the same extended (the cache's prefix reused); a different start (the slot's
    cells replaced)."""
    return [
        {"prompt": text[:6000], "n_predict": 16, "cache_prompt": True},
        {"prompt": text[:7000], "n_predict": 16, "cache_prompt": True},
        {"prompt": text[3000:5000], "n_predict": 16, "cache_prompt": True},
    ]


def run(model, env, reqs, args=None, extra=()):
    with ServerProcess(model, args=(args or server_args()) + list(extra), env=env, timeout=300) as srv:
        outs = [complete_with(srv, r) for r in reqs]
        log = srv.log_text()
    return outs, log


def complete_with(srv, req):
    body = dict(req)
    prompt = body.pop("prompt")
    return complete(srv, prompt, n_predict=body.pop("n_predict"), **body)


@pytest.mark.parametrize("device", [[], ["--kq-mask-device"]], ids=["host-bias", "device-bias"])
def test_the_kept_layout_equals_the_grouped_one_on_every_ubatch(qwen4exp_8l, text, device):
    """With --kq-mask-device the layouts write the device's block values and tails instead of the
    bias rows: compared the same way."""
    reqs = requests(text)
    checked, log = run(qwen4exp_8l, {"LLAMA_QSA_LAYOUT_CHECK": "1"}, reqs, extra=device)
    assert CHECKED in log
    assert checked[1]["tokens_cached"] > 1000  # the second request reused the first one's cells
    stock, stock_log = run(qwen4exp_8l, {"LLAMA_QSA_LAYOUT_FAST": "0", "LLAMA_QSA_LAYOUT_CHECK": "1"}, reqs, extra=device)
    assert CHECKED not in stock_log  # off: nothing to compare
    fast, _ = run(qwen4exp_8l, {}, reqs, extra=device)
    for a, b, c in zip(stock, checked, fast):
        assert a["tokens"] == b["tokens"] == c["tokens"]
        assert logprobs(a) == logprobs(b) == logprobs(c)  # exact


def test_two_sequences_in_one_unified_stream_and_five_streams_agree(qwen4exp_8l, text):
    """-kvu -np 2: while both slots hold cells the stream has two sequences and the grouped scan
    runs; alone, one of them takes the kept layout. -np 5 -no-kvu: five kept layouts at once."""
    prompts = [text[i * 700:i * 700 + 2500] for i in range(5)]
    env = {"LLAMA_QSA_LAYOUT_CHECK": "1"}
    for args, n in ((server_args(n_parallel=2, n_ctx=8192, unified=True), 2),
                    (server_args(n_parallel=5, n_ctx=5 * 2048), 5)):
        with ServerProcess(qwen4exp_8l, args=args, env=env, timeout=300) as srv:
            solo = [complete(srv, p, n_predict=12) for p in prompts[:n]]
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                together = list(pool.map(lambda p: complete(srv, p, n_predict=12), prompts[:n]))
            assert CHECKED in srv.log_text()
        for a, b in zip(solo, together):
            assert a["tokens"] == b["tokens"]


BUILT = "llama_qsa_layout: built over"


def test_a_growing_window_and_a_cut_tail_update_the_layout_in_place(qwen4exp_8l, text):
    """A prompt ubatch's larger window (n_kv) used to rebuild the layout over every cell, and
    so did a request's cut of the slot's tail (a full block losing a cell); now the layout takes the new
    cells and drops only the cut blocks' ids. Under LLAMA_QSA_LAYOUT_CHECK=1 and bit for bit against the
    rebuilds (LLAMA_QSA_LAYOUT_INCREMENTAL=0), with the layout built once where it was built on every
    ubatch that grew the window."""
    reqs = [
        {"prompt": text[:6000], "n_predict": 16, "cache_prompt": True},
        {"prompt": text[:7000], "n_predict": 16, "cache_prompt": True},  # cuts the first one's tokens
        {"prompt": text[:7000] + text[8000:8600], "n_predict": 16, "cache_prompt": True},  # cuts the second's
    ]
    args = server_args() + ["-lv", "5"]  # the build lines are debug lines
    checked = {"LLAMA_QSA_LAYOUT_CHECK": "1"}
    fast, log = run(qwen4exp_8l, checked, reqs, args=args)
    rebuilt, rebuilt_log = run(qwen4exp_8l, {**checked, "LLAMA_QSA_LAYOUT_INCREMENTAL": "0"}, reqs, args=args)
    assert CHECKED in log and CHECKED in rebuilt_log
    assert fast[1]["tokens_cached"] > 1000 and fast[2]["tokens_cached"] > 1000
    # built where the memory was cleared (the warm-up's decode, a prompt from position 0) and nowhere else
    resets = 2 + log.count("memory_seq_rm [0, end)")
    assert 1 <= log.count(BUILT) <= resets, (log.count(BUILT), resets)
    assert rebuilt_log.count(BUILT) > resets + 8, rebuilt_log.count(BUILT)
    for a, b in zip(rebuilt, fast):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact
