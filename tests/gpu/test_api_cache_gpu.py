"""The hot-expert cache through the Python API on CUDA (in-process: the libraries loaded into Python,
the case that crashed while each library carried its own libstdc++): greedy output equals the stock
path, the stats add up, uploads land and hits happen.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

import moecache
from moe_cache_checks import N_EXPERT, N_LAYER, N_USED, PROMPTS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tiny_model):
    return moecache.Model(tiny_model, n_gpu_layers=99, cpu_moe=True, repack=False)


def test_api_cache_on_cuda_matches_stock_and_counts(model):
    stock = model.context(n_ctx=1024, n_batch=256, n_ubatch=64)
    ref = [stock.generate(p, max_tokens=32).tokens for p in PROMPTS]

    ctx = model.context(n_ctx=1024, n_batch=256, n_ubatch=64, moe_cache_slots=N_EXPERT, moe_cache_max_uploads=16,
                        moe_cache_rebalance_interval=4)
    assert ctx.expert_cache.enabled
    ctx.generate(PROMPTS[0] * 3, max_tokens=48)  # warm-up: fill the slots
    outs = [ctx.generate(p, max_tokens=32) for p in PROMPTS]
    st = ctx.expert_cache.stats()
    assert [o.tokens for o in outs] == ref
    assert st["uploads"] > 0 and st["hits"] > 0 and st["hit_rate_recent"] > 0.5, st
    assert st["hits"] + st["misses"] == st["n_tokens"] * N_USED * N_LAYER
    # every token fed to a decode is counted, the last one too (stats() commits the last decode)
    fed = 48 - 1 + sum(len(o.tokens) - 1 for o in outs)
    assert st["n_tokens"] == fed, (st["n_tokens"], fed)
    assert st["bytes_vram"] > 0 and st["n_layers_cached"] == N_LAYER
    for il in range(N_LAYER):
        layer = ctx.expert_cache.stats(il)
        assert layer["hits"] + layer["misses"] == layer["n_tokens"] * N_USED
        assert 0 < len(ctx.expert_cache.resident(il)) <= N_EXPERT
