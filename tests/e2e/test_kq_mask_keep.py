"""A decode step's KQ mask kept from the step before through the real llama-server on the CPU.

With one token per KV stream, a causal mask without sliding window, ALiBi or 2D positions, each
stream's mask row (and the cells' positions of the device-built mask) is the last step's, redone only
for the cells edited since: the cells log their edits. The requests below edit the cache in each way
the server does: a prompt that shares a prefix with the cached one (the rest of the sequence removed,
a few cells written), one that shares nothing (every cell removed), the same prompt again, drafts
that are partly rejected (n-gram speculation rolls positions back), several streams. Every output
must equal LLAMA_KQ_MASK_KEEP=0's (every cell, every step) bit for bit.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, complete, logprobs, real_text
from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "4096", "-ngl", "0", "-b", "256", "-ub", "64"]
LONG = real_text(900, 2400)
# one request after the other on the same slot, with the prompt cache on
REQUESTS = [LONG, LONG + "\n\nIn short,", PROMPTS[0], PROMPTS[0], PROMPTS[1] * 6]


def run(model, args, env, requests=REQUESTS, n_predict=40, **extra):
    with ServerProcess(model, args=BASE + args, env=env, timeout=300) as srv:
        return [complete(srv, p, n_predict=n_predict, cache_prompt=True, **extra) for p in requests]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert logprobs(x) == logprobs(y)  # exact


KEEP_OFF = {"LLAMA_KQ_MASK_KEEP": "0"}


@pytest.mark.parametrize("args", [
    ["-fa", "on", "-np", "1"],
    ["-fa", "off", "-np", "1"],
    ["-fa", "on", "-np", "2", "-no-kvu"],
    ["-fa", "on", "-np", "1", "--kq-mask-device"],
], ids=["f16-mask", "f32-mask", "two-streams", "device-mask"])
def test_kept_rows_give_the_output_of_a_full_mask(tiny_model, args):
    same(run(tiny_model, args, KEEP_OFF), run(tiny_model, args, {}))


def test_rejected_drafts_roll_back_positions(tiny_model):
    """n-gram drafts verified in batches, the rejected tail removed: the next decode step's row must
    see the removed cells (the prompt repeats itself, so drafts are made and some are rejected)."""
    args = ["-fa", "on", "-np", "1", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2"]
    requests = [PROMPTS[1] * 8, PROMPTS[0] * 8, PROMPTS[1] * 8]
    ref = run(tiny_model, args, KEEP_OFF, requests, n_predict=96)
    out = run(tiny_model, args, {}, requests, n_predict=96)
    same(ref, out)


@pytest.mark.parametrize("sparse", [[], ["--qsa-sparse", "--kq-mask-device"]], ids=["masked-qsa", "sparse-qsa"])
def test_hybrid_memory_keeps_its_rows(qwen4exp_8l, sparse):
    args = ["-fa", "on", "-np", "1"] + sparse
    same(run(qwen4exp_8l, args, KEEP_OFF), run(qwen4exp_8l, args, {}))


def test_cells_reused_in_the_middle_of_the_cache(tiny_model):
    """Two slots in one unified stream: the second slot's cells lie behind the first's, so when the
    first slot takes an unrelated prompt its new cells fill the holes its old ones left, inside the
    row the last step kept: only the cells' edit log says they changed."""
    args = ["-fa", "on", "-np", "2", "-kvu"]
    requests = [LONG, LONG[::-1][:1500], PROMPTS[0], PROMPTS[1], LONG[:800]]
    same(run(tiny_model, args, KEEP_OFF, requests), run(tiny_model, args, {}, requests))
