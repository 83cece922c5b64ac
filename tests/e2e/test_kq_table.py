"""The device mask's cell positions kept across graphs through the real llama-server on the CPU.

With --kq-mask-device the cells' positions live in a table of the KV cache's buffer type, and a graph
writes only the cells edited since the table last got them (set_rows of a few values), or every cell
of its window where more were edited, the sequence is new, or the table holds nothing yet. The
requests below edit the cache in each way the server does (a shared prefix: the tail cut and
rewritten; a different prompt; the same one; decode past a window's 256-cell padding; two streams
at once), on a plain KV cache (qwen3moe) and on the hybrid one (qwen4exp, its QSA reading the
positions at the cells it selects). Every output must equal LLAMA_KQ_TABLE=0's (the positions an
input written whole each ubatch) bit for bit, also where every second graph's write is taken as not
run (LLAMA_KQ_TABLE_DROP_CONFIRM=2, as after a failed decode) and where the table cannot be
allocated (LLAMA_DEV_TABLE_FAIL_ALLOC=1: a warning, and the input as before). LLAMA_KQ_TABLE_CHECK=1
compares the table with every cell's position after each graph (the CPU's table is in host memory)
and aborts on a difference: so concurrent requests, whose graphs of two streams are batched as timing
falls and so cannot be compared with another run, are checked too.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete_requests, real_text
from moecache.server import ServerProcess

LONG = real_text(1200, 6000)
# the first prompt, 1000 tokens, ends on a ubatch of 232 in a window of 256 cells: a write that takes the
# window's new cells (empty ones among them) with the ubatch's, then 300 decode steps past two windows
N_LONG = 1000
REQUESTS = [("long", 300), ("long+", 40), (PROMPTS[0], 40), (PROMPTS[0], 40), (PROMPTS[1] * 6, 40)]
DELTA = "the device's cell positions written where edited"
NO_TABLE = "could not allocate the table kq_cell_pos"
ARGS = {
    "qwen3moe": ["-t", "2", "-c", "4096", "-ngl", "0", "-fa", "on", "-b", "512", "-ub", "256", "--kq-mask-device"],
    "qwen4exp": ["-t", "2", "-c", "4096", "-ngl", "0", "-fa", "on", "-b", "512", "-ub", "256", "--kq-mask-device",
                 "--qsa-sparse", "--qsa-block-topk"],
}


CHECK = {"LLAMA_KQ_TABLE_CHECK": "1"}
CHECKED = "LLAMA_KQ_TABLE_CHECK: the kept positions equal the cells'"


def run(model, args, env, n_parallel=1, concurrent=False):
    """The requests one after the other (with two slots, on alternate slots), or two at a time."""
    with ServerProcess(model, args=args + ["-np", str(n_parallel), "-no-kvu", "-lv", "5"], env=env, timeout=300) as srv:
        status, body = srv.post("/tokenize", {"content": LONG})
        assert status == 200 and len(body["tokens"]) > N_LONG + 16, body
        long = body["tokens"][:N_LONG]
        prompts = {"long": long, "long+": long + body["tokens"][N_LONG + 1:N_LONG + 16]}
        requests = [(prompts.get(p, p), n) for p, n in REQUESTS]
        return complete_requests(srv, requests, n_parallel, concurrent), srv.log_text()


@pytest.fixture(params=["qwen3moe", "qwen4exp"])
def model(request, tiny_model, qwen4exp):
    return request.param, {"qwen3moe": tiny_model, "qwen4exp": qwen4exp}[request.param]


@pytest.mark.parametrize("n_parallel", [1, 2], ids=["one-slot", "two-slots"])
def test_the_kept_positions_give_the_output_of_the_whole_input(model, n_parallel):
    name, path = model
    ref, ref_log = run(path, ARGS[name], {"LLAMA_KQ_TABLE": "0"}, n_parallel)
    out, log = run(path, ARGS[name], CHECK, n_parallel)
    assert DELTA in log and CHECKED in log and DELTA not in ref_log
    assert_same_outputs(ref, out)


def test_two_streams_in_one_graph_keep_their_positions(model):
    """Concurrent requests decode in graphs of two streams; their batching depends on timing, so
    the outputs are not compared: LLAMA_KQ_TABLE_CHECK compares the table after every graph."""
    name, path = model
    outs, log = run(path, ARGS[name], CHECK, 2, concurrent=True)
    assert DELTA in log and CHECKED in log
    assert all(len(o["tokens"]) == n for o, (_, n) in zip(outs, REQUESTS))


def test_a_write_taken_as_not_run_is_written_again(model):
    name, path = model
    ref, _ = run(path, ARGS[name], {"LLAMA_KQ_TABLE": "0"})
    out, log = run(path, ARGS[name], {"LLAMA_KQ_TABLE_DROP_CONFIRM": "2"})
    assert DELTA in log
    assert_same_outputs(ref, out)


def test_a_table_that_cannot_be_allocated_leaves_the_input(tiny_model):
    ref, _ = run(tiny_model, ARGS["qwen3moe"], {"LLAMA_KQ_TABLE": "0"})
    out, log = run(tiny_model, ARGS["qwen3moe"], {"LLAMA_DEV_TABLE_FAIL_ALLOC": "1"})
    assert NO_TABLE in log and DELTA not in log
    assert_same_outputs(ref, out)
