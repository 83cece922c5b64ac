"""A new context checkpoint in the buffers of the one it supersedes or evicts, through the real
llama-server on the CPU with a hybrid model (tiny qwen4exp: each checkpoint holds its recurrent state).

The same prompt again supersedes the checkpoints at the same token counts, and with --ctx-checkpoints 2 every
new one evicts the oldest; each takes the erased one's buffers (the trace says so) and writes its state over
them. Requests that restore those checkpoints (a prompt that shares all but its end with the last one) must
answer bit for bit as with LLAMA_CHECKPOINT_REUSE=0, which allocates every checkpoint afresh.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, logprobs, real_text
from moecache.server import ServerProcess

TEXT = real_text(1500, 6000)
REUSED = "in an erased one's buffers"


def run(model, extra, env):
    args = ["-t", "2", "-c", "4096", "-np", "1", "-ngl", "0", "-fa", "on", "-b", "256", "-ub", "64", "-lv", "4"]
    # the same prompt twice, then ones that share all but their end with it (a checkpoint restored)
    prompts = [TEXT[:3000], TEXT[:3000], TEXT[:2990] + " And then", TEXT[:3000], TEXT[:2600] + " Finally"]
    with ServerProcess(model, args=args + extra, env=env, timeout=300) as srv:
        outs = [complete(srv, p, n_predict=12, cache_prompt=True) for p in prompts]
        log = srv.log_text()
    return outs, log


@pytest.mark.parametrize("extra", [[], ["--ctx-checkpoints", "2"]], ids=["superseded", "evicted"])
def test_a_checkpoint_in_reused_buffers_restores_as_a_fresh_one(qwen4exp, extra):
    fresh, fresh_log = run(qwen4exp, extra, {"LLAMA_CHECKPOINT_REUSE": "0"})
    outs, log = run(qwen4exp, extra, {})
    assert REUSED not in fresh_log
    assert log.count(REUSED) >= 2, log[-3000:]
    assert "restored context checkpoint" in log  # the later prompts rolled back to one
    for a, b in zip(outs, fresh):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact
        assert a["timings"]["cache_n"] == b["timings"]["cache_n"]
