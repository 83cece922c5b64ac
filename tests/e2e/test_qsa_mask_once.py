"""QSA's indexer reads the KQ mask in f32: one f32 mask for every QSA layer of a graph, the
device-built mask's own f32 values with --kq-mask-device (they are 0 or -inf, exact in f16), one cast of
the host's f16 mask otherwise, where the pin cast it once per QSA layer. A qwen4exp of 8 layers has two
QSA layers: every node timed (GGML_SCHED_OP_TIMES) shows how many casts each graph runs, and the output
of both paths is the host mask's bit for bit.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, logprobs, op_time_reports, real_text
from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "2048", "-ngl", "0", "-b", "256", "-ub", "64", "-lv", "4", "-fa", "on", "-np", "1"]
TEXT = real_text(1200, 2000)


@pytest.fixture(scope="module")
def two_qsa_layers(qwen4exp_8l):
    return qwen4exp_8l  # QSA on layers 3 and 7


def run(model, extra, env=None):
    with ServerProcess(model, args=BASE + extra, env=env or {}, timeout=300) as srv:
        out = complete(srv, TEXT, n_predict=16)
        log = srv.log_text()
    return out, log


def test_one_mask_for_every_qsa_layer(two_qsa_layers):
    timed = {"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000"}
    ref, _ = run(two_qsa_layers, [])
    host, host_log = run(two_qsa_layers, [], timed)
    dev, dev_log = run(two_qsa_layers, ["--kq-mask-device"], timed)
    for out in (host, dev):
        assert out["tokens"] == ref["tokens"]
        assert logprobs(out) == logprobs(ref)  # exact
    def casts(log):  # per graph: how many times it cast the f16 mask to f32
        return [sum(n for e, (_, n) in r["rows"].items() if e.startswith("CPY attn_inp_kq_mask (copy) ["))
                for r in op_time_reports(log) if r["backend"] == "CPU"]

    host_casts, dev_casts = casts(host_log), casts(dev_log)
    # the prompt's ubatches and the decode steps, each its own report (the last one may not be in the log
    # yet when it is read: each run is counted on its own)
    assert len(host_casts) > 16 and len(dev_casts) > 16
    # the host's f16 mask: one cast per graph for both QSA layers
    assert host_casts == [1.0] * len(host_casts)
    # the device's mask: its f32 values before the f16 cast, no cast back
    assert dev_casts == [0] * len(dev_casts)
