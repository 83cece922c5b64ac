"""The pooled-key store of QSA layers through the real llama-server on the CPU.

Each QSA layer keeps the pooled (normed, rotated) indexer key of every full block beside its cache,
so a ubatch pools only the blocks the store lacks (new, changed, or written by it) and reads the
others; every row goes through the pin's ops, so the scores and the output are the pin's bit for bit
(LLAMA_QSA_POOL_STORE=0): a deep prompt in ubatches of 16, the prompt extended from the cache, a
different prompt on the same slot, the KQ mask and QSA bias built on the device, sparse attention,
and five sessions at once.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from moe_cache_checks import assert_same_outputs, complete, logprobs, op_shape, op_time_reports, real_text
from moecache.server import ServerProcess

USED = "QSA pools only the blocks its pooled-key store lacks"


def server_args(n_parallel=1, n_ctx=8192):
    return ["-t", "2", "-c", str(n_ctx), "-np", str(n_parallel), "-ngl", "0", "-fa", "on",
            "-b", "256", "-ub", "16", "-no-kvu", "-lv", "4"]


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def run(model, text, env, extra=()):
    with ServerProcess(model, args=server_args() + list(extra), env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=24, cache_prompt=True),
                complete(srv, text[:7000], n_predict=24, cache_prompt=True),
                complete(srv, text[3000:5000], n_predict=24, cache_prompt=True)]
        return outs, srv.log_text()


@pytest.mark.parametrize("extra", [[], ["--kq-mask-device"], ["--qsa-sparse"]], ids=["masked", "device", "sparse"])
def test_the_store_gives_the_pins_output_bit_for_bit(qwen4exp_8l, text, extra):
    pin, pin_log = run(qwen4exp_8l, text, {"LLAMA_QSA_POOL_STORE": "0"}, extra)
    kept, log = run(qwen4exp_8l, text, {}, extra)
    assert USED in log and USED not in pin_log
    assert "QSA pooled-key store:" in log
    assert kept[1]["tokens_cached"] > 1000
    for a, b in zip(pin, kept):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact


def test_five_sessions_with_the_store_equal_the_pins(qwen4exp_8l, text):
    prompts = [text[i * 700:i * 700 + 2500] for i in range(5)]
    outs = []
    for env in ({"LLAMA_QSA_POOL_STORE": "0"}, {}):
        with ServerProcess(qwen4exp_8l, args=server_args(n_parallel=5, n_ctx=5 * 2048), env=env, timeout=300) as srv:
            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                outs.append(list(pool.map(lambda p: complete(srv, p, n_predict=12), prompts)))
    for a, b in zip(*outs):
        assert a["tokens"] == b["tokens"]


def test_a_store_that_cannot_be_allocated_leaves_the_pins_pooling(qwen4exp_8l, text):
    """LLAMA_QSA_POOL_STORE_FAIL=1 injects the allocation failure: the server warns, starts, and
    answers with the pin's output, pooling every block."""
    pin, _ = run(qwen4exp_8l, text, {"LLAMA_QSA_POOL_STORE": "0"})
    failed, log = run(qwen4exp_8l, text, {"LLAMA_QSA_POOL_STORE_FAIL": "1"})
    assert "no memory for the QSA pooled-key store" in log
    assert USED not in log and "QSA pooled-key store:" not in log
    for a, b in zip(pin, failed):
        assert a["tokens"] == b["tokens"] and logprobs(a) == logprobs(b)


def test_a_prompt_in_several_batches_pools_only_its_new_blocks(qwen4exp_8l, text):
    """The server removes a slot's cells past its end before every batch of a prompt: a range
    that holds none of them changes no cell, so the store stays and each ubatch gathers the members of its
    new blocks only (GGML_SCHED_OP_TIMES names the gather: `qsa_pool_members`, r cells for each of
    pool_cap blocks), where every batch's first ubatch used to gather every block's. The output is the pin's bit for bit."""
    args = ["-t", "2", "-c", "8192", "-np", "1", "-ngl", "0", "-fa", "on", "-b", "128", "-ub", "64", "-lv", "4"]
    timed = {"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000"}
    prompt = text[:6000]
    with ServerProcess(qwen4exp_8l, args=args, env=timed, timeout=300) as srv:
        out = complete(srv, prompt, n_predict=8)
        log = srv.log_text()
    with ServerProcess(qwen4exp_8l, args=args, env={"LLAMA_QSA_POOL_STORE": "0"}, timeout=300) as srv:
        ref = complete(srv, prompt, n_predict=8)
    assert out["tokens"] == ref["tokens"] and logprobs(out) == logprobs(ref)
    cap_rows = 4 * (64 // 4 + 2)  # r cells for each of pool_cap = n_tps/r + 2 blocks
    gathers = [op_shape(e)[1] for r in op_time_reports(log) if r["backend"] == "CPU" and r["tokens"] == 64
               for e in r["rows"] if e.startswith("GET_ROWS qsa_pool_members [")]
    assert len(gathers) > 20, gathers  # the prompt's full ubatches, two per batch
    # each ubatch of 64 tokens completes at most 16 blocks: it gathers the members of pool_cap blocks
    assert gathers == [cap_rows] * len(gathers), gathers


def test_a_new_continuation_of_a_cached_prefix_pools_only_its_new_blocks(qwen4exp_8l, text):
    """A request that shares a prefix with the slot's cache but goes on differently cuts the slot's tail
    (seq_rm from the end of the common prefix): the blocks before the cut keep their pooled keys, so its
    ubatches gather the members of their new blocks only, where the cut used to drop the whole store
    and the first ubatch pooled every block (LLAMA_QSA_TAIL_CUT_KEEP=0 keeps that behaviour: the check
    below fails with it). The outputs are the pin's bit for bit."""
    args = ["-t", "2", "-c", "8192", "-np", "1", "-ngl", "0", "-fa", "on", "-b", "128", "-ub", "64", "-lv", "4"]
    timed = {"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000"}

    def serve(env):
        with ServerProcess(qwen4exp_8l, args=args, env=env, timeout=300) as srv:
            status, body = srv.post("/tokenize", {"content": text})
            assert status == 200, body
            toks = body["tokens"]
            # the prefix alone first, as a depth is cached: the slot's recurrent state can go back to its end
            prefix = toks[:1100]
            outs = [complete(srv, prefix, n_predict=1, cache_prompt=True)]
            mark = len(srv.log_text())
            outs += [complete(srv, prefix + toks[1100 + i * 300:1400 + i * 300], n_predict=8, cache_prompt=True)
                     for i in range(2)]
            return outs, srv.log_text()[mark:]

    def gathers(log):
        return [op_shape(e)[1] for r in op_time_reports(log) if r["backend"] == "CPU" and r["tokens"] == 64
                for e in r["rows"] if e.startswith("GET_ROWS qsa_pool_members [")]

    ref, _ = serve({"LLAMA_QSA_POOL_STORE": "0"})
    kept, log = serve(timed)
    _, reset_log = serve({**timed, "LLAMA_QSA_TAIL_CUT_KEEP": "0"})
    assert all(o["timings"]["cache_n"] >= 1000 for o in kept[1:]), [o["timings"] for o in kept]
    assert_same_outputs(ref, kept)
    cap_rows = 4 * (64 // 4 + 2)
    assert len(gathers(log)) >= 4 and gathers(log) == [cap_rows] * len(gathers(log)), gathers(log)
    # without the fix each request's first ubatch gathers every block's members
    assert max(gathers(reset_log)) > 10 * cap_rows, gathers(reset_log)
