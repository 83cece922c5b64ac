"""The scheduler's batched input copies on CUDA: the host's inputs of a CUDA split go as
asynchronous copies on the backend's stream between one wait before and one after. The output is
the same bit for bit as with one synchronous copy each (GGML_SCHED_INPUT_COPY_BATCH=0), on the demo
model with its experts on the CPU (a hybrid graph: CPU splits between CUDA ones) and on the tiny
qwen4exp with QSA's inputs and the device mask, and the batch's debug line names CUDA0.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "64", "-lv", "5"]
ARGS = {"demo": ["-ot", "exps=CPU"], "tiny-qwen4exp": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]}
LONG = real_text(1500, 4000)
BATCHED = "copied in one batch"


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


def on_and_off(model, args, switch):
    """The prompts through a server with the scheduler's change on (the default) and with `switch`=0: each
    run's outputs and log."""
    runs = []
    for env in ({}, {switch: "0"}):
        with ServerProcess(model, args=args, env=env, timeout=300) as srv:
            outs = [complete(srv, p, n_predict=24) for p in PROMPTS + [LONG]]
            runs.append((outs, srv.log_text()))
    return runs


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
def test_batched_input_copies_on_cuda_leave_the_output_bit_identical(models, name):
    (batched, log_batched), (one_by_one, log_one) = on_and_off(models[name], BASE + ARGS[name],
                                                               "GGML_SCHED_INPUT_COPY_BATCH")
    lines = [ln for ln in log_batched.splitlines() if BATCHED in ln]
    assert lines and "CUDA0" in lines[0], lines
    assert BATCHED not in log_one
    assert_same_outputs(one_by_one, batched)


def test_a_cpu_splits_reads_from_cuda_in_one_batch_leave_the_output_bit_identical(models):
    """The demo model's experts on the CPU: each layer's CPU split reads the hidden state and the routed
    ids from CUDA0 as reads queued on its stream and one wait (GGML_SCHED_HOST_READ_BATCH=0: each on its own)."""
    (batched, log_batched), (apart, log_apart) = on_and_off(models["demo"], BASE + ARGS["demo"],
                                                            "GGML_SCHED_HOST_READ_BATCH")
    lines = [ln for ln in log_batched.splitlines() if "read from CUDA0 in one batch" in ln]
    assert lines and "to CPU" in lines[0], lines
    assert "in one batch" not in "".join(ln for ln in log_apart.splitlines() if "read from" in ln)
    assert_same_outputs(apart, batched)


def test_the_cpus_results_into_cuda_on_its_stream_leave_the_output_bit_identical(models):
    """The demo model's experts on the CPU: each CPU result goes into the next CUDA split as a copy on CUDA0's
    stream ahead of its graph, waited for by an event before host memory is written again
    (GGML_SCHED_HOST_WRITE_ASYNC=0: a synchronous copy each)."""
    (on_stream, log_on), (waited, log_waited) = on_and_off(models["demo"], BASE + ARGS["demo"],
                                                           "GGML_SCHED_HOST_WRITE_ASYNC")
    line = "copied from host memory on its stream"
    lines = [ln for ln in log_on.splitlines() if line in ln]
    assert lines and "CUDA0" in lines[0], lines
    assert line not in log_waited
    assert_same_outputs(waited, on_stream)
