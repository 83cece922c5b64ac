"""CUDA: the build sees the GPU, the API and the server run models on it.

Marked `gpu`: run by benchmarks/gpu/run.sh on a CUDA machine, deselected in CI.
"""

from __future__ import annotations

import numpy as np
import pytest

import moecache
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def cuda_devices() -> list[dict]:
    return [d for d in moecache.devices() if d["name"].startswith("CUDA")]


def test_devices_report_a_cuda_gpu_with_memory():
    gpus = cuda_devices()
    assert gpus, f"no CUDA device among {moecache.devices()} (was moecache built with -DGGML_CUDA=on?)"
    for d in gpus:
        assert 0 < d["memory_free"] <= d["memory_total"]
    assert "CUDA" in moecache.system_info()


@pytest.fixture(scope="module")
def gpu_model(tiny_model):
    return moecache.Model(tiny_model, n_gpu_layers=99)


def test_generate_on_gpu_is_deterministic(gpu_model):
    a = gpu_model.context(n_ctx=1024, n_batch=256, n_ubatch=64).generate(PROMPT, max_tokens=24)
    b = gpu_model.context(n_ctx=1024, n_batch=256, n_ubatch=64).generate(PROMPT, max_tokens=24)
    assert a.tokens == b.tokens and len(a.tokens) > 0
    assert a.timings["decode_tps"] > 0 and a.timings["prefill_tps"] > 0


@pytest.mark.parametrize("placement", [dict(tensor_overrides=[("exps", "CPU")]), dict(n_cpu_moe=2)])
def test_experts_in_host_ram_generate(tiny_model, placement):
    """Experts in host RAM (the layout every moecache feature starts from) run and stay greedy-stable."""
    m = moecache.Model(tiny_model, n_gpu_layers=99, pinned=True, **placement)
    a = m.context(n_ctx=1024, n_batch=256, n_ubatch=64).generate(PROMPT, max_tokens=24)
    b = m.context(n_ctx=1024, n_batch=256, n_ubatch=64).generate(PROMPT, max_tokens=24)
    assert a.tokens == b.tokens and len(a.tokens) > 0


def test_routing_trace_on_gpu_matches_cpu(tiny_model, gpu_model):
    """The top-k expert choice is the same on the GPU as on the CPU for nearly every token."""
    cpu_model = moecache.Model(tiny_model, n_gpu_layers=0)
    tokens = cpu_model.tokenize(PROMPT * 8)
    cpu = cpu_model.context(n_ctx=1024, n_batch=256, n_ubatch=64).trace_routing(tokens)
    gpu = gpu_model.context(n_ctx=1024, n_batch=256, n_ubatch=64).trace_routing(tokens)
    assert cpu.shape == gpu.shape
    same = (np.sort(cpu, axis=-1) == np.sort(gpu, axis=-1)).all(axis=-1).mean()
    assert same > 0.95, f"only {same:.1%} of (token, layer) expert sets agree between CPU and GPU"


def test_server_on_gpu_answers_chat(tiny_model):
    # -lv 4: the server's default verbosity leaves out the buffer lines that name the device
    with ServerProcess(tiny_model, args=["-ngl", "99", "-c", "1024", "-np", "1", "--no-webui", "-lv", "4"]) as srv:
        status, body = srv.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None
        assert "CUDA0 model buffer size" in srv.log_text()
