"""The slots of a step sample at once, one thread each, through the real llama-server on the
CPU with five sessions decoding together.

Upstream samples the slots of a step one after the other; each sampler builds its candidates over the
whole vocabulary and runs its chain (about 0.3-0.4 ms of a host core per slot and step). The server now
reads the context for every slot first (common_sampler_sample_fetch) and runs each slot's sampler on
its own thread (common_sampler_sample_apply), which touches only that sampler: every session must draw
what it draws with LLAMA_SAMPLE_SERIAL=1, which samples them one by one as upstream does. The requests
use different samplers (seeded draws with top-k, top-p and min-p, penalties and DRY, greedy, and a
grammar, whose rejected draws sample again from the fetched logits).
"""

from __future__ import annotations

from moe_cache_checks import complete, real_text
from moecache.server import ServerProcess

ARGS = ["-t", "2", "-c", "5120", "-ngl", "0", "-np", "5", "-b", "512", "-ub", "512"]
USED = "slots sample their tokens at once, one thread each"
SAMPLERS = [
    {"temperature": 0.8, "seed": 3, "top_k": 40},
    {"temperature": 1.0, "seed": 5, "top_k": 0, "repeat_penalty": 1.1, "frequency_penalty": 0.2,
     "dry_multiplier": 0.5, "dry_allowed_length": 2},
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 7, "grammar": "root ::= [a-z ]+"},
    {"temperature": 1.2, "seed": 9, "top_k": 0, "top_p": 0.9, "min_p": 0.02},
]


def run(model, env):
    """Per sampler set, one request with five prompts: its five tasks start in one step, so every step
    batches the same sessions in both runs (requests sent apart would join the steps at other times, and
    the logits of a step depend on its batch)."""
    text = real_text(400, 2000)
    prompts = [text[i * 300:i * 300 + 600] for i in range(5)]
    with ServerProcess(model, args=ARGS, env=env, timeout=300) as srv:
        outs = []
        for sampling in SAMPLERS:
            got = complete(srv, prompts, n_predict=40, **sampling)
            assert isinstance(got, list) and len(got) == 5, got
            outs.append([o["tokens"] for o in sorted(got, key=lambda o: o["index"])])
        return outs, srv.log_text()


def test_five_sessions_draw_what_they_draw_one_by_one(tiny_model):
    serial, serial_log = run(tiny_model, {"LLAMA_SAMPLE_SERIAL": "1"})
    at_once, log = run(tiny_model, {})
    assert USED in log and USED not in serial_log
    assert all(len(t) == 40 for group in at_once for t in group)
    assert at_once == serial
