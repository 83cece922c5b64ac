"""Decode groups in the server (--decode-groups) through the real llama-server.

Over a pipelined layer split, one batch in flight leaves every device but one idle. With --decode-groups N
the generating slots are split into up to N groups of consecutive slots; each group decodes into its own
output slot of the context (llama_output_slots_set), and a step samples one group's tokens and submits
its next batch while the other groups' decodes run. Only while every busy slot generates: a prompt
arriving drains the groups and the step is upstream's again. A group is its slots' own sequences, so
every request's tokens equal its solo run, its log-probabilities within the bound of a batch's other
shapes (as for five sessions elsewhere). The CPU records no events, so there every read waits for all
work; an rpc-server's device does, so over rpc-servers a read waits for its own slot's event (what the
grouping computes is tested, not the overlap; tests/gpu has the CUDA path).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_cache_checks import (PROMPTS, assert_refused, assert_same_tokens, complete, metric_values, server_help,
                              session_prompts, slot_server_args, solo_and_together)
from moecache.server import ServerProcess

N_SLOTS = 4
# different lengths: the groups lose members as sessions end, and drain when one slot is left
N_PREDICT = [40, 12, 40, 24]
ON = "decode groups on"
# a formation's line, e.g. "decode groups: 4 generating slots in 2 groups: [0 1] [2 3]"
FORMED = re.compile(r"decode groups: \d+ generating slots in \d+ groups: \[")
EVENTS = "output slots: a read waits for its own slot's copies"
NO_EVENTS = "output slots: the device records no events, a read waits for all work"
QWEN4EXP_ARGS = ["-fa", "on", "--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]


def group_metrics(srv):
    """{name: value} of the llamacpp:decode_group_* counters in /metrics (empty where not reported)."""
    return metric_values(srv, "decode_group_")


@pytest.fixture(scope="module")
def models(tiny_model, qwen4exp):
    return {"tiny": (tiny_model, []), "tiny-qwen4exp": (qwen4exp, QWEN4EXP_ARGS)}


@pytest.mark.parametrize("name,n_rpc,split", [("tiny", 0, []), ("tiny-qwen4exp", 0, []),
                                              ("tiny", 2, ["-sm", "layer"])])
def test_groups_form_and_every_request_keeps_its_solo_tokens(models, rpc_servers, name, n_rpc, split):
    model, extra = models[name]
    ports = rpc_servers(n_rpc) if n_rpc else ()
    args = slot_server_args(N_SLOTS, *extra, *split, "--decode-groups", "2", rpc_ports=ports)
    with ServerProcess(model, args=args, env={"LLAMA_ARG_LOG_VERBOSITY": "5"}, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        # the server answers on, in upstream's step
        after = complete(srv, session_prompts(N_SLOTS)[0], n_predict=N_PREDICT[0])
        counters = group_metrics(srv)
        log = srv.log_text()
    assert ON in log
    # each formation's line names the groups: consecutive slots
    assert "generating slots in 2 groups: [" in log, log[-3000:]
    assert counters["decode_group_formations_total"] == len(FORMED.findall(log)) >= 1
    # each grouped step decoded one group's tokens; four sessions of 12-40 tokens give far more than one
    assert counters["decode_group_steps_total"] >= 10, counters
    # where the logits come from: the CPU records no events, an rpc-server's device does
    assert (EVENTS if n_rpc else NO_EVENTS) in log
    assert [o["id_slot"] for o in together] == [0, 1, 2, 3]
    assert_same_tokens(solo, together)
    assert after["tokens"] == solo[0]["tokens"]


def test_a_prompt_arriving_drains_the_groups(tiny_model):
    """Two long sessions decode in groups; a third request arrives meanwhile: its prompt drains the groups
    (upstream's step takes it beside the decoders), and once it generates too the groups form again."""
    # the first two long enough that they still decode together when the second one's request comes late on a
    # loaded machine (with 60 each the groups once never formed in CI)
    reqs = [(PROMPTS[i % len(PROMPTS)] * (i + 2), n, i) for i, n in enumerate([200, 200, 20])]
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS, "--decode-groups", "2"), timeout=180) as srv:
        solo = [complete(srv, p, n_predict=n, id_slot=s) for p, n, s in reqs]
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(complete, srv, p, n_predict=n, id_slot=s) for p, n, s in reqs[:2]]
            deadline = time.monotonic() + 60
            while not FORMED.search(srv.log_text()) and time.monotonic() < deadline:
                time.sleep(0.01)
            late = pool.submit(complete, srv, reqs[2][0], n_predict=reqs[2][1], id_slot=2)
            together = [f.result() for f in first] + [late.result()]
        log = srv.log_text()
    assert len(FORMED.findall(log)) >= 1
    assert_same_tokens(solo, together)


def test_off_by_default_no_groups(tiny_model):
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS), timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        counters = group_metrics(srv)
        log = srv.log_text()
    assert ON not in log and not FORMED.search(log) and counters == {}
    assert_same_tokens(solo, together)


def test_the_option_reads_its_environment_variable(tiny_model):
    env = {"LLAMA_ARG_DECODE_GROUPS": "3"}
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS), env=env, timeout=180) as srv:
        log = srv.log_text()
    assert "decode groups on: up to 3 groups" in log


def test_a_failed_set_up_turns_groups_off_and_changes_no_output(tiny_model):
    """LLAMA_DECODE_GROUPS_FAULT=1: setting up the output slots fails. A warning says so, the slots decode
    in one batch per step with their solo tokens, and the server answers on."""
    env = {"LLAMA_DECODE_GROUPS_FAULT": "1"}
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS, "--decode-groups", "2"), env=env, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        again = complete(srv, session_prompts(N_SLOTS)[0], n_predict=N_PREDICT[0], id_slot=2)
        counters = group_metrics(srv)
        log = srv.log_text()
    assert "could not be set up (LLAMA_DECODE_GROUPS_FAULT); groups are off from here" in log
    assert not FORMED.search(log) and counters["decode_group_steps_total"] == 0
    assert_same_tokens(solo, together)
    assert again["tokens"] == solo[0]["tokens"]


# short n-grams, so that the tiny model's output drafts at all
@pytest.mark.parametrize("spec", [["ngram-mod", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-match", "1"],
                                  ["ngram-simple", "--spec-ngram-simple-size-n", "1"]], ids=lambda s: s[0])
def test_n_gram_drafting_works_in_groups(tiny_model, spec):
    """A group's step drafts for its own slots only (another group's draft may be in flight) and verifies
    them when its tokens are sampled: drafts are verified, so the tokens are the solo runs'."""
    args = slot_server_args(N_SLOTS, "--decode-groups", "2", "--spec-type", *spec, "--spec-min-accept", "0",
                       "--spec-max-users", "0")
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        counters = group_metrics(srv)
        log = srv.log_text()
    assert ON in log and FORMED.search(log), log[-3000:]
    assert counters["decode_group_steps_total"] >= 10, counters
    assert sum(o["timings"].get("draft_n", 0) for o in together) > 0  # the drafters did draft
    # the tokens only: an accepted draft token's step has no probabilities of its own
    assert [o["tokens"] for o in solo] == [o["tokens"] for o in together]


@pytest.mark.parametrize("args,line", [
    (["-np", "1"], "--decode-groups is off with one slot"),
    (["-md", "DRAFT", "--spec-type", "draft-simple"],
     "--decode-groups is off with a draft model's speculative decoding"),
])
def test_where_it_cannot_act_it_says_why(tiny_model, args, line):
    args = [str(tiny_model) if a == "DRAFT" else a for a in args]  # the model drafts for itself
    with ServerProcess(tiny_model, args=slot_server_args(N_SLOTS, "--decode-groups", "2", *args), timeout=180) as srv:
        out = complete(srv, PROMPTS[0], n_predict=4)
        log = srv.log_text()
    assert line in log and ON not in log
    assert len(out["tokens"]) == 4


def test_a_negative_count_is_refused(tiny_model, llama_server_bin):
    assert_refused(llama_server_bin, tiny_model, ["--decode-groups", "-1"], "--decode-groups must be >= 0")


def test_the_option_and_its_variable_are_in_the_help(llama_server_bin):
    text = server_help(llama_server_bin)
    assert "--decode-groups" in text and "LLAMA_ARG_DECODE_GROUPS" in text


def test_a_full_kv_cache_fails_the_requests_as_upstream_does_and_never_hangs(tiny_model):
    """A unified KV cache of 256 cells, two sessions that need more: a group's decode finds no room. The
    groups give the step back (they used to form again on the same failing batch, forever); upstream's
    step halves the batch and fails the requests, and the server answers on."""
    args = ["-t", "2", "-c", "256", "-np", "2", "-kvu", "-ub", "32", "--cache-ram", "0", "--decode-groups", "2"]
    body = lambda p: {"prompt": p, "n_predict": 230, "temperature": 0.0, "cache_prompt": False}
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: srv.post("/completion", body(p), timeout=120), [PROMPTS[0], PROMPTS[1]]))
        after = complete(srv, PROMPTS[0], n_predict=4)
        log = srv.log_text()
    assert "no room in the KV cache for a group's tokens" in log, log[-3000:]
    assert any(status != 200 for status, _ in outs), outs  # as upstream: the context was exceeded
    assert len(after["tokens"]) == 4
