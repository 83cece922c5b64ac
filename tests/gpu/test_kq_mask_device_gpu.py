"""The KQ mask built on the device (--kq-mask-device) on CUDA: the demo model and the tiny
qwen4exp with every layer on the GPU. The mask's values are the host's, so the output is the stock
output bit for bit; and the mask's nodes run on the GPU beside the attention (no extra split).

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import PROMPTS, complete, logprobs, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "64", "-lv", "4"]
GRAPH = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = ([\d /]+), splits = ([\d /]+), ")
LONG = real_text(1500, 4000)


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
def test_the_device_mask_on_cuda_is_the_stock_output(models, name):
    runs = []
    for extra in ([], ["--kq-mask-device"]):
        with ServerProcess(models[name], args=BASE + extra, timeout=300) as srv:
            outs = [complete(srv, p, n_predict=24) for p in PROMPTS + [LONG]]
            runs.append((outs, GRAPH.search(srv.log_text()).groups()))
    (ref, (ref_nodes, ref_splits)), (out, (nodes, splits)) = runs
    for a, b in zip(ref, out):
        assert a["tokens"] == b["tokens"] and logprobs(a) == logprobs(b)
    assert nodes != ref_nodes and splits == ref_splits, (ref_nodes, nodes, ref_splits, splits)
