"""Decode groups over a layer split on CUDA devices (output slots, --decode-groups) on one H200.

GGML_CUDA_DEVICES=2 shows two virtual devices on the one GPU, each with its own stream, so `-sm layer`
runs the scheduler's pipeline with events between the devices. With --decode-groups the server keeps
several groups' decodes in flight, each writing its logits into its own output slot, and a read waits for
that slot's event only (CPU test devices record no events: this is the path CI cannot run).

The four sessions come in one request (four prompts), so their prompts are batched the same way in every
run, and the groups form the same way. A group's decode has the same shapes on one device and over the
split, so the split's outputs must equal one device's bit for bit: a read that did not wait for its own
copies, or a group's decode that overwrote another's inputs or outputs in flight, would show here. (Against
each session's solo run only rounding bounds could be asserted: a batch of four prompts is not the
shapes of one; the CPU e2e test checks the solo tokens.)

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete, metric_values
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

N_SLOTS = 4
ARGS = {"demo": [], "tiny-qwen4exp": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]}
BASE = ["-t", "8", "-c", str(1024 * N_SLOTS), "-np", str(N_SLOTS), "-no-kvu", "-ngl", "99", "-fa", "on",
        "-ub", "64", "--cache-ram", "0", "--metrics"]
FORMED = re.compile(r"decode groups: 4 generating slots in (\d+) groups: \[")
EVENTS = "output slots: a read waits for its own slot's copies"


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


def steps(srv):
    return metric_values(srv, "decode_group_steps_total").get("decode_group_steps_total")


def run(model, args, **env):
    """One request with four prompts: four sessions decoding at once, 48 tokens each."""
    env = {"LLAMA_ARG_LOG_VERBOSITY": "5", **env}
    prompts = [PROMPTS[i % len(PROMPTS)] * (i + 2) for i in range(N_SLOTS)]
    with ServerProcess(model, args=BASE + args, env=env, timeout=300) as srv:
        outs = complete(srv, prompts, n_predict=48)
        n_steps = steps(srv)
        log = srv.log_text()
    assert isinstance(outs, list) and len(outs) == N_SLOTS, outs
    return sorted(outs, key=lambda o: o["index"]), n_steps, log


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
@pytest.mark.parametrize("n_groups", [2, 4])
def test_groups_over_two_cuda_devices_equal_groups_on_one(models, name, n_groups):
    groups = ARGS[name] + ["--decode-groups", str(n_groups)]
    ref, _, log_one = run(models[name], groups + ["-sm", "none"])
    outs, n_steps, log = run(models[name], groups + ["-sm", "layer"], GGML_CUDA_DEVICES="2")
    assert "using device CUDA1 " in log, log[-3000:]
    assert [int(g) for g in FORMED.findall(log)] == [n_groups], log[-3000:]
    assert FORMED.findall(log_one) == FORMED.findall(log)
    assert n_steps >= 40  # 47 grouped decodes per group after the first token
    assert EVENTS in log  # the CUDA path: reads wait for their slot's event, not for all work
    assert_same_outputs(ref, outs)
