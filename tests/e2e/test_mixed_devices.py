"""Mixed devices in a layer split through the real llama-server.

The mixed-GPU post ran one model over a CUDA device and a Vulkan one: devices that differ in what they
support. Here two rpc-servers on loopback stand for the devices, with some layers left on the host's CPU
(-ngl below the layer count) or the KV cache on the host (-nkvo): the layer split then runs without the
scheduler's pipeline, and the server says why at start-up (upstream says nothing, and the devices simply
run one after the other). Every multi-GPU switch of the series still works there: sequence compaction,
prefill chunks and decode groups, with every request's solo tokens, also with the scheduler's host overlap
(GGML_SCHED_HOST_OVERLAP=1): with the KV cache on the host, the CPU writes it in place (SET_ROWS through a
view) and the devices' splits read it through other views, with no edge between them; a device split that
ran beside the CPU's before it counted that write read stale keys and gave other tokens.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import PROMPTS, assert_same_tokens, complete, solo_and_together
from moecache.server import ServerProcess

N_SLOTS = 4
N_PREDICT = [32, 8, 32, 16]
SWITCHES = ["--pp-overrides", "--seq-compact", "--prefill-chunk", "16", "--decode-groups", "2"]


def server_args(ports, *args):
    rpc = ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports)]
    return ["-t", "2", "-c", str(512 * N_SLOTS), "-np", str(N_SLOTS), "-no-kvu", "-ub", "32", "--cache-ram", "0",
            "-sm", "layer", "-lv", "4", *rpc, *args]


@pytest.mark.parametrize("placement,why", [
    (["-ngl", "1"], r"pipeline parallelism off over 2 devices: not every layer and the output are on a device "
                    r"\(-ngl 1 of \d+ layers; -ngl all offloads them\)"),
    (["-ngl", "99", "-nkvo"], r"pipeline parallelism off over 2 devices: the KV cache is on the host \(-nkvo\)"),
], ids=["cpu-layers", "host-kv"])
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["overlap-off", "host-overlap"])
def test_a_split_without_the_pipeline_says_why_and_every_switch_works(tiny_model, rpc_servers, placement, why, overlap):
    ports = rpc_servers(2)
    env = {"GGML_SCHED_HOST_OVERLAP": overlap}
    with ServerProcess(tiny_model, args=server_args(ports, *placement, *SWITCHES), env=env, timeout=180) as srv:
        solo, together = solo_and_together(srv, N_PREDICT)
        log = srv.log_text()
    assert re.search(why, log), log[-4000:]
    assert "pipeline parallelism enabled" not in log
    assert "sequence compaction on" in log and "decode groups on" in log
    assert re.search(r"decode groups: \d+ generating slots in \d+ groups: \[", log), log[-3000:]
    assert_same_tokens(solo, together)


def test_a_full_split_keeps_the_pipeline_and_says_nothing_of_it(tiny_model, rpc_servers):
    ports = rpc_servers(2)
    with ServerProcess(tiny_model, args=server_args(ports, "-ngl", "99"), timeout=180) as srv:
        out = complete(srv, PROMPTS[0], n_predict=4)
        log = srv.log_text()
    assert "pipeline parallelism enabled" in log and "pipeline parallelism off" not in log
    assert len(out["tokens"]) == 4
