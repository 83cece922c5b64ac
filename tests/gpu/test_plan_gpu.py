"""`moecache plan` on CUDA: the figures of the plan (llama-server --memory-probe, a no_alloc model and context)
are what the server then allocates on the GPU: its weights, its KV cache, its compute buffer and its slot
banks, to the 0.01 MiB of llama.cpp's load log; a budget too small for the whole model plans the experts
in host memory and the slots in what is left; a budget above it plans everything in VRAM.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, cache_stats, complete
from moecache.plan import GiB, MiB, Request, make_plan
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

CTX, USERS, UB = 512, 2, 64


def _request(model, gib):
    # --fit off: the fit's own no_alloc probe would log its buffers first (0.00 MiB of weights)
    return Request(model, ctx=CTX, users=USERS, ubatch=UB, gpu_mem_gib=[gib], extra_args=["--fit", "off"])


def _mib(what: str, log: str) -> list[float]:
    return [float(m) for m in re.findall(r"CUDA0 " + what + r" =\s+([0-9.]+) MiB", log)]


def test_the_plan_is_what_the_server_allocates_on_cuda(tiny_model):
    big = make_plan(_request(tiny_model, 100.0))
    assert big.all_in_vram and "--cpu-moe" not in big.args()
    # the smallest budget above the cached plan's fixed part and 9.5 slots: the experts go to host memory
    probe_plan = make_plan(_request(tiny_model, (big.devices[0].fixed - 1) / GiB))
    assert not probe_plan.all_in_vram, probe_plan.render()
    d0 = probe_plan.devices[0]
    assert d0.slot > 0 and d0.n_moe_layers == 4
    plan = make_plan(_request(tiny_model, (d0.fixed + 9.5 * d0.slot) / GiB))
    d = plan.devices[0]
    assert plan.slots == 9, plan.render()
    with ServerProcess(tiny_model, args=["-t", "8", *plan.args(), "-lv", "4"], timeout=180) as srv:
        st = cache_stats(srv)
        out = complete(srv, PROMPTS[0])
        log = srv.log_text()
    assert out["tokens"]
    assert st["n_slots"] == plan.slots
    # the banks: the slots the plan priced, and the CUDA allocator's padding of each bank tensor (a quantized
    # row and the buffer's alignment, whatever the slot count: 512 bytes each on the tiny model)
    pad = st["total"]["bytes_vram"] - plan.slots * d.slot
    assert 0 <= pad <= 3 * d.n_moe_layers * 1024, pad
    assert _mib("slot banks", log) == [round(st["total"]["bytes_vram"] / MiB, 2)]
    assert _mib("model buffer size", log) == [round(d.model / MiB, 2)]
    assert _mib("KV buffer size", log) == [round(d.context / MiB, 2)]
    assert _mib("compute buffer size", log)[0] == round(d.compute / MiB, 2)


def test_the_whole_model_plan_on_cuda(tiny_model):
    plan = make_plan(_request(tiny_model, 100.0))
    d = plan.devices[0]
    with ServerProcess(tiny_model, args=["-t", "8", *plan.args(), "-lv", "4"], timeout=180) as srv:
        st = cache_stats(srv)
        log = srv.log_text()
    assert not st["enabled"] and plan.slots == 0
    assert _mib("model buffer size", log) == [round(d.model / MiB, 2)]
    assert _mib("KV buffer size", log) == [round(d.context / MiB, 2)]
    assert N_EXPERT == plan.n_expert


def test_whole_layers_and_cached_layers_as_planned_on_cuda(demo_and_qwen4exp):
    """Per layer, whole experts in VRAM against slots: with bandwidths given, a budget that holds some of the
    demo model's layers whole plans --n-cpu-moe; the server keeps those layers' experts in VRAM (the cache says
    so per layer), caches the others with the planned slots, allocates the weights the probe priced, and
    answers as the stock path does (experts on the CPU) up to a near tie."""
    from dataclasses import replace

    from moe_cache_checks import assert_close_tokens, token_steps
    from moecache.plan import parse_bandwidth, place_layers

    model = demo_and_qwen4exp["demo"]
    req = replace(_request(model, 100.0), swap=False)
    big = make_plan(req)
    # just below the whole model: the layout with every layer's experts in host memory
    every = make_plan(replace(req, gpu_mem_gib=[(big.devices[0].fixed - 1) / GiB]))
    assert not every.all_in_vram
    d0 = every.devices[0]
    layer = d0.slot / d0.n_moe_layers * every.n_expert
    budget = (d0.fixed + 5.5 * layer) / GiB  # five layers' experts whole, or slots
    plan = place_layers(make_plan(replace(req, gpu_mem_gib=[budget], bandwidth=parse_bandwidth("host=50,device=2000,h2d=0.5"))))
    r = plan.residency
    assert r is not None and r.resident > 0 and plan.request.n_cpu_moe == every.n_layer - r.resident, plan.render()
    d = plan.devices[0]
    with ServerProcess(model, args=["-t", "8", *plan.args(), "-lv", "4"], timeout=180) as srv:
        st = cache_stats(srv)
        out = complete(srv, PROMPTS[0])
        log = srv.log_text()
    layers = st["layers"]
    n = plan.request.n_cpu_moe
    assert all(not l.get("reason") for l in layers[:n]), layers[:n]
    assert all(l.get("reason") == "experts already in device memory" for l in layers[n:]), layers[n:]
    assert st["n_slots"] == plan.slots
    assert _mib("model buffer size", log) == [round(d.model / MiB, 2)]
    with ServerProcess(model, args=["-t", "8", "-ngl", "99", "--cpu-moe", "-c", str(CTX * USERS), "-np", str(USERS),
                                    "--fit", "off"], timeout=180) as srv:
        ref = complete(srv, PROMPTS[0])
    assert_close_tokens(ref["tokens"], token_steps(ref), out["tokens"], token_steps(out))
