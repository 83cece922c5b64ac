"""GGML_SCHED_TIMES: the scheduler reports each backend's time in its splits, the input
copies apart, and the host's time between graphs, when it is freed (1) or every N graphs (N > 1).
A hybrid graph of two backends (the layers on an rpc-server on loopback, the experts on the CPU:
`-ot exps=CPU`) must report both, with the splits they ran, and the context its host steps per ubatch
(each input by type); without the variable nothing is reported.
GGML_SCHED_OP_TIMES=N times every node on its own, by backend, op, name without the layer's
number and shape, every N graphs: the entries must name the layers' ops once with a count per layer, fit
in the backend's compute time, and leave the output as it was.
"""

from __future__ import annotations

import os
import re
import subprocess

from moe_cache_checks import op_time_reports
from moecache.paths import binary

TIMES = re.compile(r"ggml_sched_times: backend=(\S+) graphs=(\d+) splits_per_graph=([\d.]+) "
                   r"compute_ms_per_graph=([\d.]+) copy_ms_per_graph=([\d.]+)")
STEPS = re.compile(r"llama_host_times: ubatches=(\d+) decode_ms=([\d.]+) .* compute_ms=([\d.]+) .* inputs: (.*)")
HOST = re.compile(r"ggml_sched_times: host graphs=(\d+) gaps=(\d+) gap_ms_per_graph=([\d.]+)")
N_GEN = 8


def run_bench(model, port, **env) -> str:
    proc = subprocess.run([str(binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(N_GEN), "-r", "1",
                           "-t", "1", "-ngl", "99", "--rpc", f"127.0.0.1:{port}", "-ot", "exps=CPU", "-v"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def bench(model, port, **env) -> tuple[list[tuple], list[tuple], list[tuple]]:
    log = run_bench(model, port, **env)
    return TIMES.findall(log), HOST.findall(log), STEPS.findall(log)


def test_each_backend_reports_its_splits(tiny_model, rpc_servers):
    [port] = rpc_servers(1)
    timed, host, steps = bench(tiny_model, port, GGML_SCHED_TIMES="1")
    every, every_host, every_steps = bench(tiny_model, port, GGML_SCHED_TIMES="4")
    untimed = run_bench(tiny_model, port)
    assert "ggml_sched_times" not in untimed and "llama_host_times" not in untimed
    assert "ggml_sched_op_times" not in untimed
    # the context's host steps: one line at free, the inputs by type, decode >= compute
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


def test_op_times_rank_each_backends_nodes(tiny_model, rpc_servers):
    [port] = rpc_servers(1)
    log = run_bench(tiny_model, port, GGML_SCHED_TIMES="1", GGML_SCHED_OP_TIMES="3")
    reports = op_time_reports(log)
    n_layer = 4  # the tiny preset
    device = f"RPC0[127.0.0.1:{port}]"
    # the warm-up token and the timed ones, every 3 graphs, per backend
    for name in ("CPU", device):
        assert [r["graphs"] for r in reports if r["backend"] == name] == [3, 3, 3], reports
    # the first node of each window: the token embeddings of one token
    assert {(r["first"], r["tokens"]) for r in reports} == {("embd", 1)}, reports
    # the nodes ran inside the backend's compute, timed around them
    compute = {b: float(c) * int(g) for b, g, _, c, _ in TIMES.findall(log)}
    for name in ("CPU", device):
        op_ms = sum(r["ms"] * r["graphs"] for r in reports if r["backend"] == name)
        assert 0 < op_ms <= compute[name] + 0.01, (name, op_ms, compute[name])
    by_name = {}
    for r in reports:
        for op, (ms, n) in r["rows"].items():
            by_name.setdefault((r["backend"], op), []).append((ms, n))
    # the experts are on the CPU: one entry per expert op for every layer, the layer numbers dropped
    for proj in ("gate", "up", "down"):
        [entry] = [k for k in by_name if k[0] == "CPU" and k[1].startswith(f"MUL_MAT_ID ffn_moe_{proj} [")]
        assert [n for _, n in by_name[entry]] == [n_layer] * 3, by_name[entry]
    assert any(b == device and op.startswith("MUL_MAT Qcur [") for b, op in by_name)
    assert not any(re.search(r"-\d+ \[", op) for _, op in by_name), sorted(by_name)


def test_op_times_leave_the_output_as_it_was(tiny_model):
    from moe_cache_checks import PROMPTS, complete, logprobs
    from moecache.server import ServerProcess

    def run(env):
        with ServerProcess(tiny_model, args=["-t", "2", "-c", "1024", "-ngl", "0", "-lv", "4"], env=env) as srv:
            return [complete(srv, p, n_predict=16) for p in PROMPTS[:2]], srv.log_text()

    ref, _ = run({})
    out, log = run({"GGML_SCHED_OP_TIMES": "1"})
    assert op_time_reports(log), log[-2000:]
    assert [o["tokens"] for o in out] == [o["tokens"] for o in ref]
    assert [logprobs(o) for o in out] == [logprobs(o) for o in ref]
