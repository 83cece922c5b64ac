"""Decode groups over a layer split on CUDA devices (issue 13; patches 0066-0067) on one H200.

GGML_CUDA_DEVICES=2 shows two virtual devices on the one GPU, each with its own stream, so `-sm layer`
runs the scheduler's pipeline with events between the devices. With --decode-groups the server keeps
several groups' decodes in flight, each writing its logits into its own output slot, and a read waits for
that slot's event only (CPU test devices record no events: this is the path CI cannot run). Four
sessions decoding at once in groups give their solo runs' tokens, log-probabilities within the bound of
a batch's other shapes, on the demo model and on the tiny qwen4exp (recurrent and QSA layers).

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_cache_checks import PROMPTS, complete, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

N_SLOTS = 4
N_PREDICT = [48, 16, 48, 32]
ARGS = {"demo": [], "tiny-qwen4exp": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]}
BASE = ["-t", "8", "-c", str(1024 * N_SLOTS), "-np", str(N_SLOTS), "-no-kvu", "-ngl", "99", "-fa", "on",
        "-ub", "64", "--cache-ram", "0", "--metrics", "-sm", "layer"]
FORMED = re.compile(r"decode groups: \d+ generating slots in \d+ groups: \[")
EVENTS = "output slots: a read waits for its own slot's copies"


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


def steps(srv):
    status, text = srv.get("/metrics")
    assert status == 200, text
    for line in str(text).splitlines():
        if line.startswith("llamacpp:decode_group_steps_total "):
            return int(float(line.split()[1]))
    return None


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
@pytest.mark.parametrize("n_groups", [2, 4])
def test_groups_over_two_cuda_devices_keep_every_session_s_solo_tokens(models, name, n_groups):
    prompts = [PROMPTS[i % len(PROMPTS)] * (i + 2) for i in range(N_SLOTS)]
    reqs = list(zip(prompts, N_PREDICT, range(N_SLOTS)))
    env = {"GGML_CUDA_DEVICES": "2", "LLAMA_ARG_LOG_VERBOSITY": "5"}
    args = BASE + ARGS[name] + ["--decode-groups", str(n_groups)]
    with ServerProcess(models[name], args=args, env=env, timeout=300) as srv:
        solo = [complete(srv, p, n_predict=n, id_slot=s) for p, n, s in reqs]
        with ThreadPoolExecutor(N_SLOTS) as pool:
            together = list(pool.map(lambda r: complete(srv, r[0], n_predict=r[1], id_slot=r[2]), reqs))
        n_steps = steps(srv)
        log = srv.log_text()
    assert "using device CUDA1 " in log, log[-3000:]
    assert FORMED.search(log) and n_steps >= 10, log[-3000:]
    assert EVENTS in log  # the CUDA path: reads wait for their slot's event, not for all work
    for a, b in zip(solo, together):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2
