"""QSA's block tables kept on the device through the real llama-server on the CPU.

With --qsa-sparse --kq-mask-device --qsa-block-topk and the pooled-key store, the per-block inputs of
QSA's block-level top-k (each block id's cells, its first position and visibility for the top-k and
the device bias, its row in the store) live in tables in the store's buffer type; a graph writes only
the block ids around the full blocks' end and any that changed (a block completed, a cut of the
tail), or every block id of its window where more did. Through requests that edit the cache in each
way the server does (a deep prompt in ubatches, a shared prefix with the tail cut and rewritten, a
different prompt, decode past window growth, two slots), the output must equal LLAMA_QSA_TABLES=0's
(the inputs written whole each ubatch) bit for bit, also where every second graph's write is taken as
not run (LLAMA_QSA_TABLES_DROP_CONFIRM=2) and where the tables cannot be allocated (LLAMA_DEV_TABLE_FAIL_ALLOC=1:
a warning, and the inputs as before). LLAMA_QSA_TABLES_CHECK=1 compares the tables with a full
write's values after every graph (the CPU's tables are in host memory) and aborts on a difference, so
concurrent requests, which cannot be compared with another run, are checked too.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete_requests, real_text
from moecache.server import ServerProcess

LONG = real_text(1500, 9000)
REQUESTS = [("long", 300), ("long+", 40), ("mid", 40), (PROMPTS[0], 40), ("long", 40)]
ARGS = ["-t", "2", "-c", "8192", "-ngl", "0", "-fa", "on", "-b", "256", "-ub", "64",
        "--qsa-sparse", "--kq-mask-device", "--qsa-block-topk", "-no-kvu", "-lv", "5"]
DELTA = "QSA's block tables written where changed"
CHECK = {"LLAMA_QSA_TABLES_CHECK": "1"}
CHECKED = "LLAMA_QSA_TABLES_CHECK: the block tables equal a full write"


def run(model, env, n_parallel=1, concurrent=False):
    with ServerProcess(model, args=ARGS + ["-np", str(n_parallel)], env=env, timeout=300) as srv:
        status, body = srv.post("/tokenize", {"content": LONG})
        assert status == 200 and len(body["tokens"]) > 1700, len(body["tokens"])
        toks = body["tokens"]
        prompts = {"long": toks[:1500], "long+": toks[:1500] + toks[1501:1530], "mid": toks[300:1200]}
        requests = [(prompts.get(p, p), n) for p, n in REQUESTS]
        return complete_requests(srv, requests, n_parallel, concurrent), srv.log_text()


@pytest.mark.parametrize("n_parallel", [1, 2], ids=["one-slot", "two-slots"])
def test_the_block_tables_give_the_output_of_the_whole_inputs(qwen4exp_8l, n_parallel):
    ref, ref_log = run(qwen4exp_8l, {"LLAMA_QSA_TABLES": "0"}, n_parallel)
    out, log = run(qwen4exp_8l, CHECK, n_parallel)
    assert DELTA in log and CHECKED in log and DELTA not in ref_log
    assert_same_outputs(ref, out)


def test_a_write_taken_as_not_run_is_written_again(qwen4exp_8l):
    ref, _ = run(qwen4exp_8l, {"LLAMA_QSA_TABLES": "0"})
    out, log = run(qwen4exp_8l, {**CHECK, "LLAMA_QSA_TABLES_DROP_CONFIRM": "2"})
    assert DELTA in log
    assert_same_outputs(ref, out)


def test_two_streams_in_one_graph_keep_their_tables(qwen4exp_8l):
    outs, log = run(qwen4exp_8l, CHECK, 2, concurrent=True)
    assert DELTA in log and CHECKED in log
    assert all(len(o["tokens"]) == n for o, (_, n) in zip(outs, REQUESTS))


def test_tables_that_cannot_be_allocated_leave_the_inputs(qwen4exp_8l):
    """LLAMA_DEV_TABLE_FAIL_ALLOC=1 (fault injection): no table can be had; the server warns, starts and
    answers as with the tables off."""
    ref, _ = run(qwen4exp_8l, {"LLAMA_QSA_TABLES": "0"})
    out, log = run(qwen4exp_8l, {"LLAMA_DEV_TABLE_FAIL_ALLOC": "1"})
    assert "could not allocate the table qsa_blk_cells" in log and DELTA not in log
    assert_same_outputs(ref, out)
