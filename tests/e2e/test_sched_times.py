"""GGML_SCHED_TIMES (patches 0033, 0034): the scheduler reports each backend's time in its splits, the input
copies apart, and the host's time between graphs, when it is freed (1) or every N graphs (N > 1).
A hybrid graph of two backends (the layers on an rpc-server on loopback, the experts on the CPU:
`-ot exps=CPU`) must report both, with the splits they ran, and the context its host steps per ubatch
(each input by type); without the variable nothing is reported.
"""

from __future__ import annotations

import os
import re
import subprocess

from moecache.paths import binary

TIMES = re.compile(r"ggml_sched_times: backend=(\S+) graphs=(\d+) splits_per_graph=([\d.]+) "
                   r"compute_ms_per_graph=([\d.]+) copy_ms_per_graph=([\d.]+)")
STEPS = re.compile(r"llama_host_times: ubatches=(\d+) decode_ms=([\d.]+) .* compute_ms=([\d.]+) .* inputs: (.*)")
HOST = re.compile(r"ggml_sched_times: host graphs=(\d+) gaps=(\d+) gap_ms_per_graph=([\d.]+)")
N_GEN = 8


def bench(model, port, **env) -> tuple[list[tuple], list[tuple], list[tuple]]:
    proc = subprocess.run([str(binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(N_GEN), "-r", "1",
                           "-t", "1", "-ngl", "99", "--rpc", f"127.0.0.1:{port}", "-ot", "exps=CPU", "-v"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return TIMES.findall(proc.stderr), HOST.findall(proc.stderr), STEPS.findall(proc.stderr)


def test_each_backend_reports_its_splits(tiny_model, rpc_servers):
    [port] = rpc_servers(1)
    timed, host, steps = bench(tiny_model, port, GGML_SCHED_TIMES="1")
    every, every_host, every_steps = bench(tiny_model, port, GGML_SCHED_TIMES="4")
    untimed = bench(tiny_model, port)
    assert untimed == ([], [], [])
    # the context's host steps (patch 0034): one line at free, the inputs by type, decode >= compute
    [(ubatches, decode_ms, compute_ms, inputs)] = steps
    assert int(ubatches) == N_GEN + 1
    assert float(decode_ms) >= float(compute_ms) > 0
    names = {kv.split("=")[0] for kv in inputs.split()}
    assert {"llm_graph_input_attn_kv", "llm_graph_input_embd"} <= names, names
    assert [int(u) for u, _, _, _ in every_steps] == [4, 4, 1]
    assert [int(g) for g, _, _ in host] == [N_GEN + 1]
    assert float(host[0][2]) > 0
    by_backend = {name: (int(g), float(s), float(c), float(cp)) for name, g, s, c, cp in timed}
    assert set(by_backend) == {"CPU", f"RPC0[127.0.0.1:{port}]"}, by_backend
    for name, (graphs, splits, compute_ms, copy_ms) in by_backend.items():
        assert graphs == N_GEN + 1, (name, graphs)  # the warm-up token and the timed ones
        # the experts of each layer are a CPU split between two of the device's
        assert splits >= 2, (name, splits)
        assert compute_ms > 0, name
    # only the CPU's splits copy their inputs from the other device
    assert by_backend["CPU"][3] > 0
    # every 4 graphs, then the rest at free: 4 + 4 + 1 per backend
    assert [int(g) for g, _, _ in every_host] == [4, 4, 1]
    assert sorted(int(g) for _, g, _, _, _ in every) == [1, 1, 4, 4, 4, 4]
