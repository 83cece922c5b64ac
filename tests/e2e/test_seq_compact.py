"""Sequence compaction in the server (--seq-compact) through the real llama-server.

With a KV cache per slot (-no-kvu) llama.cpp's ubatch split takes only consecutive sequence ids, so when
the session of a slot in the middle ends, the generating slots around the gap decode as two ubatches per
step (two graphs; over a layer split, two passes through every device). With --seq-compact the server
moves the highest generating slot into the gap before the next step: its KV stream is copied to the idle
slot's, its state goes with it, and its response names the slot it ended in. Moving changes which stream
holds a session, not what it computes: every request's tokens equal its solo run, its log-probabilities
within the bound of a batch's other shapes (as for five sessions elsewhere).
"""

from __future__ import annotations

import pytest

from moe_cache_checks import (PROMPTS, assert_same_tokens, complete, metric_values, server_help, session_prompts,
                              slot_server_args, solo_and_together)
from moecache.server import ServerProcess

N_SLOTS = 4
# the session of slot 1 ends first; slots 0, 2 and 3 go on, so slot 3 moves into slot 1 (long enough that
# they still generate together when a request comes late on a loaded machine: with 40, once nothing moved in CI)
N_PREDICT = [120, 4, 120, 120]
ON = "sequence compaction on"
QWEN4EXP_ARGS = ["-fa", "on", "--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]


def compaction_moves(srv):
    """llamacpp:seq_compact_moves_total from /metrics, None where the server does not report it."""
    return metric_values(srv, "seq_compact_moves_total").get("seq_compact_moves_total")


@pytest.fixture(scope="module")
def models(tiny_model, qwen4exp):
    return {"tiny": (tiny_model, []), "tiny-qwen4exp": (qwen4exp, QWEN4EXP_ARGS)}


@pytest.mark.parametrize("name,n_rpc", [("tiny", 0), ("tiny-qwen4exp", 0), ("tiny", 2)])
def test_a_generating_slot_moves_into_the_gap_and_its_tokens_stay(models, rpc_servers, name, n_rpc):
    model, extra = models[name]
    ports = rpc_servers(n_rpc) if n_rpc else ()
    args = slot_server_args(N_SLOTS, *extra, "--seq-compact", rpc_ports=ports)
    with ServerProcess(model, args=args, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        # the server answers on after the moves
        after = complete(srv, session_prompts(N_SLOTS)[0], n_predict=N_PREDICT[0])
        moves = compaction_moves(srv)
        log = srv.log_text()
    assert ON in log
    assert "moved from slot" in log, log[-3000:]
    assert moves == log.count("moved from slot") >= 1  # /metrics counts them
    assert [o["id_slot"] for o in solo] == [0, 1, 2, 3]
    # the requests report the slots they ended in: slot 3's moves into slot 1 once slot 1's ends (had
    # slot 3's request come late, slot 2's would move instead: some request ends below its own slot)
    assert together[3]["id_slot"] == 1 or any(o["id_slot"] < i for i, o in enumerate(together)), together
    assert_same_tokens(solo, together)
    assert after["tokens"] == solo[0]["tokens"]


def test_off_by_default_nothing_moves(tiny_model):
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS), timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        moves = compaction_moves(srv)
        log = srv.log_text()
    assert ON not in log and "moved from slot" not in log and moves is None
    assert [o["id_slot"] for o in together] == [0, 1, 2, 3]
    assert_same_tokens(solo, together)


def test_the_switch_reads_its_environment_variable(tiny_model):
    env = {"LLAMA_ARG_SEQ_COMPACT": "1"}
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS), env=env, timeout=180) as srv:
        log = srv.log_text()
    assert ON in log


def test_a_failed_move_turns_compaction_off_and_changes_no_output(tiny_model):
    """LLAMA_SEQ_COMPACT_FAULT=1: the check before every move fails. Nothing moves, a warning says so, the
    requests end in their own slots with their solo tokens, and the server answers on."""
    env = {"LLAMA_SEQ_COMPACT_FAULT": "1"}
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS, "--seq-compact"), env=env, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        again = complete(srv, session_prompts(N_SLOTS)[0], n_predict=N_PREDICT[0], id_slot=2)
        log = srv.log_text()
    assert "failed its check (LLAMA_SEQ_COMPACT_FAULT); compaction is off from here" in log
    assert "moved from slot" not in log
    assert [o["id_slot"] for o in together] == [0, 1, 2, 3]
    assert_same_tokens(solo, together)
    assert again["tokens"] == solo[0]["tokens"]


# short n-grams, so that the tiny model's output drafts at all: ngram-mod keeps a history per sequence
@pytest.mark.parametrize("spec", [["ngram-mod", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-match", "1"],
                                  ["ngram-simple", "--spec-ngram-simple-size-n", "1"]], ids=lambda s: s[0])
def test_n_gram_drafting_moves_with_the_session(tiny_model, spec):
    """The n-gram drafters keep a map per sequence (and what it indexed): a move swaps them with the slots,
    so the moved session drafts from its own text. Drafts are verified, so the tokens are the solo runs'."""
    args = slot_server_args(N_SLOTS, "--seq-compact", "--spec-type", *spec, "--spec-min-accept", "0",
                            "--spec-max-users", "0")
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        log = srv.log_text()
    assert ON in log and "moved from slot" in log, log[-3000:]
    assert sum(o["timings"].get("draft_n", 0) for o in together) > 0  # the drafters did draft
    # the tokens only: an accepted draft token's step has no probabilities of its own
    assert [o["tokens"] for o in solo] == [o["tokens"] for o in together]


@pytest.mark.parametrize("args,line", [
    (["-kvu"], "--seq-compact does nothing here"),
    (["-md", "DRAFT", "--spec-type", "draft-simple"], "--seq-compact is off with this speculative decoding"),
])
def test_where_it_cannot_act_it_says_why(tiny_model, args, line):
    args = [str(tiny_model) if a == "DRAFT" else a for a in args]  # the model drafts for itself
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS, "--seq-compact", *args), timeout=180) as srv:
        out = complete(srv, PROMPTS[0], n_predict=4)
        log = srv.log_text()
    assert line in log and ON not in log
    assert len(out["tokens"]) == 4


def test_the_flag_and_its_variable_are_in_the_help(llama_server_bin):
    text = server_help(llama_server_bin)
    assert "--seq-compact" in text and "--no-seq-compact" in text and "LLAMA_ARG_SEQ_COMPACT" in text
