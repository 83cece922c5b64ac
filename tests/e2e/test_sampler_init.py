"""A prompt's sampler set-up reads only the tokens its samplers can remember, through the
real llama-server on the CPU.

Before a prompt's first token the server resets the slot's sampler and accepts every prompt token, one
by one, so that the penalties and DRY see the recent text: at 250k cached tokens that took 43-63 ms of
every request on the H200's host. Only the last `common_sampler_n_history` text tokens reach any
sampler's state (the penalties' and DRY's windows, the sampler's own ring), so the server now accepts
those alone. Sampling with penalties and DRY (a seeded draw, the probabilities after the chain) must be
bit for bit LLAMA_SAMPLER_INIT_FULL=1's, which accepts them all as upstream does.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import complete, real_text
from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "4096", "-ngl", "0", "-np", "1", "-b", "512", "-ub", "128"]
# real text, then a counted phrase repeated well past every window: the window's oldest token is
# one of the phrase's words, which are the likely next tokens, so a window one token short changes
# a frequency penalty or a DRY match length that shows in the first step's probabilities
LONG = real_text(1200, 4000) + "\n\n" + " one two three four five six seven eight nine ten," * 60
# the probabilities after every sampler of the chain over the whole vocabulary (no top-k), and
# penalties gentle enough that the repeated words stay likely: then one count more or less of any
# word in a window moves every probability
SAMPLING = {"temperature": 0.9, "seed": 11, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "n_probs": 8,
            "post_sampling_probs": True}
PENALTIES = {"repeat_penalty": 1.0, "frequency_penalty": 0.02, "presence_penalty": 0.0, "repeat_last_n": 400}
DRY = {"dry_multiplier": 0.01, "dry_base": 1.01, "dry_allowed_length": 2, "dry_penalty_last_n": 300}
NO_PENALTIES = {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
FULL = {"LLAMA_SAMPLER_INIT_FULL": "1"}
# the sampler's own ring of accepted tokens at the server's default n_prev (common_params_sampling)
N_PREV = 64


def run(model, env, requests, sampling):
    with ServerProcess(model, args=BASE, env={"LLAMA_ARG_LOG_VERBOSITY": "4", **env}, timeout=300) as srv:
        outs = [complete(srv, p, n_predict=48, cache_prompt=True, **sampling) for p in requests]
        return outs, srv.log_text()


def probs(out):
    return [[(p["id"], p["prob"]) for p in t["top_probs"]] for t in out["completion_probabilities"]]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert probs(x) == probs(y)  # exact


def accepted_from(log):
    return [int(m) for m in re.findall(r"init sampler, took [0-9.]+ ms, .* accepted from (\d+)", log)]


@pytest.mark.parametrize("sampling", [
    {**SAMPLING, **PENALTIES, "dry_multiplier": 0.0},
    {**SAMPLING, **NO_PENALTIES, **DRY},
    {**SAMPLING, **PENALTIES, **DRY, "repeat_last_n": 200},
], ids=["penalties", "dry", "both"])
def test_the_window_samples_as_every_token_does(gemma_model, sampling):
    # a prompt, the same one again from the cache, and one that extends it
    requests = [LONG, LONG, LONG + " one two"]
    full, full_log = run(gemma_model, FULL, requests, sampling)
    kept, kept_log = run(gemma_model, {}, requests, sampling)
    same(full, kept)
    # the switch feeds every token, the default only the window's: the prompt is far longer than it
    assert accepted_from(full_log) == [0, 0, 0]
    starts = accepted_from(kept_log)
    assert len(starts) == 3 and all(s > 0 for s in starts), starts
    n_prompt = kept[0]["tokens_evaluated"]
    window = max(N_PREV, sampling.get("repeat_last_n", 64), sampling.get("dry_penalty_last_n", 64))
    assert starts[0] == n_prompt - window, (starts, n_prompt, window)


def test_a_prompt_shorter_than_the_window_is_read_whole(gemma_model):
    short = "The quick brown fox jumps over the lazy dog."
    full, _ = run(gemma_model, FULL, [short], {**SAMPLING, **PENALTIES, **DRY})
    kept, log = run(gemma_model, {}, [short], {**SAMPLING, **PENALTIES, **DRY})
    same(full, kept)
    assert accepted_from(log) == [0]
