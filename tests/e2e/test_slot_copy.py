"""POST /slots/N?action=copy: an idle slot's cached prompt copied into other idle slots,
through the real llama-server on the CPU with the tiny qwen4exp (KV cells, recurrent state, the QSA
indexer's keys, and the context checkpoints a hybrid model needs to reuse a prefix).

Several sessions that share a long prefix then prefill it once: `moecache bench` fills five slots at
250k this way (depth_fill = "copy"). A copied slot must answer as one that prefilled the prefix
itself: the same tokens, and the prefix reused (cache_n) in the first request and again in the second,
which on a hybrid model rolls back to a copied checkpoint.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, real_text
from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "12288", "-ngl", "0", "-np", "3", "-ub", "256"]
LONG = ["--override-kv", "qwen4exp.context_length=int:262144"]
PREFIX = real_text(900, 2400)
TAILS = [" The first question is", " Another matter:", " In short,", " Next,", " Finally", " Also"]
# two rounds of one request per slot: slot 1 first keeps only part of the prefix, so a hybrid model rolls
# its recurrent state back to a checkpoint that the copy brought (else it prefills from the start)
REQUESTS = [(0, PREFIX), (1, PREFIX[:-150]), (2, PREFIX), (0, PREFIX), (1, PREFIX), (2, PREFIX)]


def run(model, args, fill):
    """Every slot gets PREFIX (by `fill`), then REQUESTS, each with its own tail."""
    with ServerProcess(model, args=BASE + args, timeout=300) as srv:
        n_prefix = complete(srv, PREFIX, n_predict=1, cache_prompt=True, id_slot=0, temperature=0)["tokens_evaluated"]
        copy = fill(srv)
        outs = []
        for i, (slot, prompt) in enumerate(REQUESTS):
            out = complete(srv, prompt + TAILS[i], n_predict=12, cache_prompt=True, id_slot=slot, temperature=0)
            outs.append((out["tokens"], out["timings"]["cache_n"]))
        return n_prefix, copy, outs


def prefill_each(srv):
    for slot in (1, 2):
        complete(srv, PREFIX, n_predict=1, cache_prompt=True, id_slot=slot, temperature=0)
    return None


def copy_from_0(srv):
    status, body = srv.post("/slots/0?action=copy", {"to": [1, 2]})
    assert status == 200, body
    return body


# One KV stream per slot: the copy moves the cells' data, so a copied slot's cells lie where its own
# prefill would have put them, and QSA's choice (its top-k takes some cells of a block whose cells tie)
# is the same. One unified stream: the copy adds the slot's sequence to the cells, so the sessions' new
# tokens land in other cells than after three prefills; attention skips the other sequences' cells
# exactly, QSA's ties need not, so that case runs the qwen3moe model (idle slots of a unified cache
# are cleared when a task starts unless --no-cache-idle-slots).
@pytest.mark.parametrize("case", ["streams", "unified"])
def test_copied_slots_answer_as_prefilled_ones(request, case):
    if case == "streams":
        model, args = request.getfixturevalue("qwen4exp"), ["-no-kvu", "--qsa-sparse"] + LONG
    else:
        model, args = request.getfixturevalue("tiny_model"), ["-kvu", "--no-cache-idle-slots"]
    n_prefix, _, want = run(model, args, prefill_each)
    n, copy, got = run(model, args, copy_from_0)
    assert copy["to"] == [1, 2] and copy["n_copied"] == n_prefix == n, copy
    assert (copy["n_checkpoints"] > 0) == (case == "streams"), copy  # the hybrid model's, copied too
    assert [t for t, _ in got] == [t for t, _ in want]
    # the cache reused by every request as after the prefills, the shortened prefix's from a checkpoint
    assert [c for _, c in got] == [c for _, c in want]
    assert all(got[i][1] >= n_prefix - 4 for i in (0, 2, 3, 5)), [c for _, c in got]
    assert 0 < got[1][1] < n_prefix - 4, got[1][1]


def test_a_bad_copy_is_refused_and_the_server_still_answers(qwen4exp):
    with ServerProcess(qwen4exp, args=BASE + LONG + ["-no-kvu"], timeout=300) as srv:
        status, body = srv.post("/slots/0?action=copy", {"to": [1]})
        assert status == 400 and "holds no cached prompt" in body["error"]["message"], body
        complete(srv, PREFIX, n_predict=1, cache_prompt=True, id_slot=0, temperature=0)
        for to, words in [([0], "itself"), ([1, 1], "twice"), ([7], "\"to\": slot id '7' is out of range: this server has 3 slot(s), 0 to 2"), ([], "names no slot")]:
            status, body = srv.post("/slots/0?action=copy", {"to": to})
            assert status == 400 and words in body["error"]["message"], (to, body)
        status, body = srv.post("/slots/0?action=copy", {"slots": [1]})
        assert status == 400 and "needs a body" in body["error"]["message"], body
        status, body = srv.post("/slots/9?action=copy", {"to": [1]})
        assert status == 400 and "slot id '9' is out of range: this server has 3 slot(s)" in body["error"]["message"], body
        # nothing was copied: slot 1 is empty and still serves
        out = complete(srv, PREFIX + TAILS[0], n_predict=4, cache_prompt=True, id_slot=1, temperature=0)
        assert out["timings"]["cache_n"] == 0 and len(out["tokens"]) == 4
        out = complete(srv, PREFIX + TAILS[0], n_predict=4, cache_prompt=True, id_slot=0, temperature=0)
        assert out["timings"]["cache_n"] > 0


def test_a_copy_that_would_not_last_is_refused(qwen4exp):
    # a unified KV cache with --cache-idle-slots (the default) clears idle slots when a task starts
    with ServerProcess(qwen4exp, args=BASE + LONG + ["-kvu"], timeout=300) as srv:
        complete(srv, PREFIX, n_predict=1, cache_prompt=True, id_slot=0, temperature=0)
        status, body = srv.post("/slots/0?action=copy", {"to": [1]})
        assert status == 501 and "--no-cache-idle-slots" in body["error"]["message"], body
        assert complete(srv, PREFIX, n_predict=2, cache_prompt=True, id_slot=0, temperature=0)["tokens"]
