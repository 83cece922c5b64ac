"""Prefill in chunks beside decoders (--prefill-chunk) through the real llama-server.

The server puts every generating slot's next token and up to n_batch prompt tokens into one batch per
step, so a long prompt arriving while others decode holds each decoder's next token for a whole batch of
prompt work (at 250k tokens of context, about a second per step). With --prefill-chunk N a step takes at
most N prompt tokens while the generating slots are at least as many as the prefilling ones, so the
prompt runs over more, shorter steps and each decoder waits for N prompt tokens' work at most. Chunks
change how the prompt is batched, not what is computed: the decoder's and the prompt's tokens equal their
solo runs, their log-probabilities within the bound of other batch shapes.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_cache_checks import (PROMPTS, assert_refused, complete, max_logprob_diff, real_text, server_help,
                              wait_generating)
from moecache.server import ServerProcess

CHUNK = 32
N_DECODE = 200  # outlasts the prompt's chunked steps with room to spare
LONG = real_text(300, 1600)
STEP = re.compile(r"prefill chunk: (\d+) prompt tokens beside (\d+) generating slots \(at most (\d+)\)")


def server_args(*args):
    return ["-t", "2", "-c", "8192", "-np", "2", "-no-kvu", "-ngl", "99", "-b", "512", "-ub", "64",
            "--cache-ram", "0", "-lv", "5", *args]


def still_generating(srv, id_slot):
    status, slots = srv.get("/slots")
    assert status == 200, slots
    return bool(next(s for s in slots if s["id"] == id_slot).get("is_processing"))


def prompt_beside_a_decoder(srv, tries=5):
    """The decoder on slot 0 and the long prompt on slot 1: each alone, then the prompt sent while the
    decoder generates. On a loaded 2-core machine the client can be starved long enough for the decoder to
    finish before a poll sees it or before the prompt arrives; then nothing ran beside it and the pair is
    sent again."""
    dec_solo = complete(srv, PROMPTS[0], n_predict=N_DECODE, id_slot=0)
    long_solo = complete(srv, LONG, n_predict=8, id_slot=1)
    for _ in range(tries):
        with ThreadPoolExecutor(1) as pool:
            dec = pool.submit(complete, srv, PROMPTS[0], n_predict=N_DECODE, id_slot=0)
            if not wait_generating(srv, dec.done, id_slot=0, n_decoded=4):
                dec.result()
                continue
            long_beside = complete(srv, LONG, n_predict=8, id_slot=1)
            overlapped = still_generating(srv, 0)
            dec_beside = dec.result()
        if overlapped:
            break
    else:
        raise AssertionError(f"the decoder of {N_DECODE} tokens finished before the prompt in {tries} tries")
    return (dec_solo, dec_beside), (long_solo, long_beside)


def assert_same(a, b):
    assert a["tokens"] == b["tokens"]
    assert max_logprob_diff(a, b) < 2e-2


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen4exp"])
def test_a_long_prompt_beside_a_decoder_runs_in_chunks_with_the_same_tokens(tiny_model, qwen4exp, name):
    model, extra = (tiny_model, []) if name == "tiny" else (qwen4exp, ["-fa", "on", "--qsa-sparse"])
    with ServerProcess(model, args=server_args(*extra, "--prefill-chunk", str(CHUNK)), timeout=180) as srv:
        (dec_solo, dec_beside), (long_solo, long_beside) = prompt_beside_a_decoder(srv)
        log = srv.log_text()
    steps = [tuple(map(int, m.groups())) for m in STEP.finditer(log)]
    n_prompt = long_solo["tokens_evaluated"]
    assert n_prompt > 8 * CHUNK
    # every step beside the decoder took at most a chunk, and the prompt ran in several of them
    assert steps and all(n <= CHUNK and n_dec == 1 and cap == CHUNK for n, n_dec, cap in steps)
    assert sum(1 for n, _, _ in steps if n > 0) >= 4, steps
    assert dec_beside["tokens_predicted"] == N_DECODE
    assert_same(dec_solo, dec_beside)
    assert_same(long_solo, long_beside)


def test_off_by_default_the_prompt_takes_whole_batches(tiny_model):
    with ServerProcess(tiny_model, args=server_args(), timeout=180) as srv:
        (dec_solo, dec_beside), (long_solo, long_beside) = prompt_beside_a_decoder(srv)
        log = srv.log_text()
    assert not STEP.search(log)
    assert_same(dec_solo, dec_beside)
    assert_same(long_solo, long_beside)


def test_the_variable_sets_it_and_a_bad_value_is_refused(tiny_model, llama_server_bin):
    env = {"LLAMA_ARG_PREFILL_CHUNK": str(CHUNK)}
    with ServerProcess(tiny_model, args=server_args(), env=env, timeout=180) as srv:
        prompt_beside_a_decoder(srv)
        log = srv.log_text()
    assert any(cap == CHUNK for _, _, cap in (map(int, m.groups()) for m in STEP.finditer(log)))
    assert_refused(llama_server_bin, tiny_model, ["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0")


def test_the_flag_and_its_variable_are_in_the_help(llama_server_bin):
    text = server_help(llama_server_bin)
    assert "--prefill-chunk N" in text and "LLAMA_ARG_PREFILL_CHUNK" in text


def test_a_client_starved_past_the_whole_decoder_sends_the_pair_again(tiny_model):
    """CI's 2-core machine once starved the client until the decoder had ended unseen; the helper then
    waited its 60 s out. Here the first poll of /slots is held until the pair's first decoder is done."""
    with ServerProcess(tiny_model, args=server_args(), timeout=180) as srv:
        get, post, polls, decoders = srv.get, srv.post, [], []
        first_pair_decoder_done = threading.Event()

        def counted_post(path, body, *args, **kwargs):
            out = post(path, body, *args, **kwargs)
            if body.get("n_predict") == N_DECODE:
                decoders.append(out)
                if len(decoders) == 2:  # the solo run, then the pair's
                    first_pair_decoder_done.set()
            return out

        def starved_get(path, *args, **kwargs):
            if path == "/slots":
                polls.append(path)
                if len(polls) == 1:
                    assert first_pair_decoder_done.wait(120)
            return get(path, *args, **kwargs)

        srv.get, srv.post = starved_get, counted_post
        (dec_solo, dec_beside), (long_solo, long_beside) = prompt_beside_a_decoder(srv)
    assert len(decoders) >= 3 and len(polls) > 2
    assert_same(dec_solo, dec_beside)
    assert_same(long_solo, long_beside)
