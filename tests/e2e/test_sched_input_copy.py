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


def run(model, port, *extra, **env):
    args = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "99", "--rpc", f"127.0.0.1:{port}",
            "-ub", "32", "-lv", "5", *extra]
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


READ_BATCHED = "read from RPC0"
# the layers on the rpc-server, their experts on the host's CPU: a CPU split in every layer
EXPERTS_ON_CPU = ("--cpu-moe", "--no-repack")


def test_a_host_splits_reads_from_a_device_in_one_batch_leave_the_output_bit_identical(tiny_model, rpc_servers):
    """The layers on an rpc-server with their experts on the host's CPU (--cpu-moe): each layer's CPU split
    reads its inputs (the hidden state, the routed ids) from the device, as one batch of asynchronous reads
    and one wait (GGML_SCHED_HOST_READ_BATCH=0: a wait and a synchronous read each); same bytes, same output."""
    [port] = rpc_servers(1)
    batched, log_batched = run(tiny_model, port, *EXPERTS_ON_CPU)
    apart, log_apart = run(tiny_model, port, *EXPERTS_ON_CPU, GGML_SCHED_HOST_READ_BATCH="0")
    assert READ_BATCHED in log_batched, "the CPU splits' inputs were not read in one batch"
    assert READ_BATCHED not in log_apart
    assert_same_outputs(apart, batched)


def test_a_device_splits_inputs_from_host_memory_on_its_stream_leave_the_output_bit_identical(tiny_model, rpc_servers):
    """The same placement the other way: each layer's CPU result goes into the next device split as a copy on
    the device's stream ahead of its graph, and host memory is written again only once that copy is waited for
    (GGML_SCHED_HOST_WRITE_ASYNC=0: a synchronous copy each); prompts of several ubatches and decode steps,
    same bytes, same output."""
    [port] = rpc_servers(1)
    on_stream, log_on = run(tiny_model, port, *EXPERTS_ON_CPU)
    waited, log_waited = run(tiny_model, port, *EXPERTS_ON_CPU, GGML_SCHED_HOST_WRITE_ASYNC="0")
    line = "copied from host memory on its stream"
    assert line in log_on and "RPC0" in next(ln for ln in log_on.splitlines() if line in ln)
    assert line not in log_waited
    assert_same_outputs(waited, on_stream)
