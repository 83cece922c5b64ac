"""The QSA block layout kept across ubatches, the per-block bias built on the device
(with --kq-mask-device) and the pooled-key store on CUDA: tiny-qwen4exp with
every layer on the GPU. The layout's tensors are the pin's bit for bit (LLAMA_QSA_LAYOUT_CHECK=1
aborts on a difference) and the store's keys run the pin's per-row ops, so the output equals the
pin's path (LLAMA_QSA_LAYOUT_FAST=0: grouped scan, every block pooled, host bias) exactly: a deep
prompt in ubatches of 16, the same prompt extended from the cache, and a different one.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete, logprobs, real_text
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "8192", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "16", "-no-kvu", "-lv", "4"]
CHECKED = "LLAMA_QSA_LAYOUT_CHECK: the layout by position equals the grouped one"
STORE_USED = "QSA pools only the blocks its pooled-key store lacks"


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsalayout") / "tiny-qwen4exp.gguf"
    return synth.write_model(path, preset="tiny-qwen4exp", seed=0, progress=False)


def run(model, env, extra):
    text = real_text(2500, 9000)
    with ServerProcess(model, args=ARGS + extra, env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=16, cache_prompt=True),
                complete(srv, text[:7000], n_predict=16, cache_prompt=True),
                complete(srv, text[3000:5000], n_predict=16, cache_prompt=True)]
        return outs, srv.log_text()


def test_the_kept_layout_the_device_bias_and_the_store_on_cuda_are_the_pins_output(qwen4exp):
    pin, _ = run(qwen4exp, {"LLAMA_QSA_LAYOUT_FAST": "0"}, [])
    for extra in ([], ["--kq-mask-device"]):
        outs, log = run(qwen4exp, {"LLAMA_QSA_LAYOUT_CHECK": "1"}, extra)
        assert CHECKED in log
        for a, b in zip(pin, outs):
            assert a["tokens"] == b["tokens"] and logprobs(a) == logprobs(b), extra
        # the default: the kept layout and the pooled-key store
        outs, log = run(qwen4exp, {}, extra)
        assert STORE_USED in log
        for a, b in zip(pin, outs):
            assert a["tokens"] == b["tokens"] and logprobs(a) == logprobs(b), ("store", extra)
