"""A layer split over several CUDA devices with pipeline parallelism (--pp-overrides) on one H200.

GGML_CUDA_DEVICES=N makes the pin's CUDA backend show N virtual devices on the one physical GPU, each with
its own stream, so `-sm layer` runs the real multi-GPU path: the scheduler's pipeline (n_copies of every
split input, events between the devices) and CUDA's copies between devices, which run on the source
device's stream. The hop wait makes such a copy wait for the destination's last use of its buffer; without
it (GGML_SCHED_HOP_WAIT=0) a race is possible, not certain, so the equality below holds either way: the
test checks that the waits are taken and change nothing. Greedy tokens and log-probabilities over 2 and
3 devices equal one device's, bit for bit, on the demo model and on the tiny qwen4exp (recurrent and QSA
layers, the device tables); with --pp-overrides an override that copies no host weight keeps the pipeline.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "64"]
ARGS = {"demo": [], "tiny-qwen4exp": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]}
LONG = real_text(1500, 4000)
PP_ON = "pipeline parallelism enabled"
HOP_WAIT = "waits for the destination's last use of its buffer"


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


def run(model, args, **env):
    # verbosity by env, not -lv: with -lv the CUDA backend's first lines ("emulating N virtual device(s)")
    # were missing from the log on the H200 (2026-12-04), with the env they were there
    env = {"LLAMA_ARG_LOG_VERBOSITY": "5", **env}
    with ServerProcess(model, args=BASE + args, env=env, timeout=300) as srv:
        outs = [complete(srv, p, n_predict=24) for p in PROMPTS + [LONG]]
        return outs, srv.log_text()


@pytest.fixture(scope="module")
def one_device(models):
    return {name: run(path, ARGS[name] + ["-sm", "none"])[0] for name, path in models.items()}


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
@pytest.mark.parametrize("n_devices", [2, 3])
def test_layer_split_with_the_pipeline_equals_one_device(models, one_device, name, n_devices):
    outs, log = run(models[name], ARGS[name] + ["-sm", "layer"], GGML_CUDA_DEVICES=str(n_devices))
    # the last virtual device holds layers (its start-up line is not relied on: see run())
    assert f"using device CUDA{n_devices - 1} " in log, log[-3000:]
    assert PP_ON in log and HOP_WAIT in log, log[-3000:]
    assert_same_outputs(one_device[name], outs)


def test_without_the_hop_wait_the_same_and_no_wait(models, one_device):
    outs, log = run(models["demo"], ["-sm", "layer"], GGML_CUDA_DEVICES="2", GGML_SCHED_HOP_WAIT="0")
    assert PP_ON in log and HOP_WAIT not in log
    assert_same_outputs(one_device["demo"], outs)


def test_pp_overrides_keeps_the_pipeline_over_cuda_devices(models, one_device):
    args = ["-sm", "layer", "-ot", "token_embd=CPU"]
    outs, log = run(models["demo"], args + ["--pp-overrides"], GGML_CUDA_DEVICES="2")
    assert "pipeline parallelism kept with tensor overrides" in log and PP_ON in log
    assert_same_outputs(one_device["demo"], outs)
    _, log = run(models["demo"], args, GGML_CUDA_DEVICES="2")
    assert PP_ON not in log  # upstream's rule: any override turns it off
