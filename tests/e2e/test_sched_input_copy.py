"""The scheduler copies a split's user inputs in one batch through the real llama-server.

A split on a device backend that sets tensors asynchronously (here an rpc-server on loopback; CUDA on
the H200: tests/gpu/test_sched_input_copy_gpu.py) gets the host's inputs (tokens, positions, masks,
output ids) as asynchronous copies between one wait before and one after, in place of a wait and a
synchronous copy each. The data the graph reads is the same, so the output is the same bit for bit
with the batch (the default) and without it (GGML_SCHED_INPUT_COPY_BATCH=0); the batch's debug line
says it was taken, and only with the switch on.
"""

from __future__ import annotations

from moe_cache_checks import PROMPTS, assert_same_outputs, complete
from moecache.server import ServerProcess

BATCHED = "copied in one batch"


def run(model, port, **env):
    args = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "99", "--rpc", f"127.0.0.1:{port}",
            "-ub", "32", "-lv", "5"]
    with ServerProcess(model, args=args, env=env, timeout=180) as srv:
        # a prompt of several ubatches, then decode steps: every graph's inputs pass through the copies
        outs = [complete(srv, p * 3, n_predict=24) for p in PROMPTS]
        log = srv.log_text()
    return outs, log


def test_batched_input_copies_leave_the_output_bit_identical(tiny_model, rpc_servers):
    [port] = rpc_servers(1)
    batched, log_batched = run(tiny_model, port)
    one_by_one, log_one = run(tiny_model, port, GGML_SCHED_INPUT_COPY_BATCH="0")
    assert BATCHED in log_batched, "the device split's inputs did not take the batched copies"
    assert BATCHED not in log_one
    assert_same_outputs(one_by_one, batched)
