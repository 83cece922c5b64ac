"""The decode step's splits with the hot-expert cache on CUDA (tests/e2e/test_moe_cache_rpc.py does the same on an
rpc-server): each cached layer's CPU split takes the layer's input and the ids of its misses, the next CUDA split
the misses' result, and nothing else beyond what the stock graph's splits take. gpt-oss's expert biases used to
add the layer's host bias tensor to every CUDA split (4.2-4.7 ms a token for gpt-oss-120b's 18 cached layers on
an H100). The scheduler's split dump (GGML_SCHED_DEBUG=1, at the debug log level) names each split's inputs.

Marked `gpu`: run by benchmarks/gpu/run.sh on the GPU machine."""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import assert_close_tokens, cache_stats, complete, last_graph_splits, token_steps
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none", "--no-webui",
        "-v"]
PROMPTS = ["The committee met on Tuesday to discuss the budget", "def fibonacci(n):\n"]
ALLOWED = re.compile(r"^ffn_moe_cold(_ids|_bias_ids)?-\d+$|^leaf_\d+$")


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_cached_layers_split_only_for_their_misses_on_cuda(moecache_cache_dir, preset):
    model = moecache_cache_dir / "models" / synth.cached_model_name(preset, None, seed=0)
    model.parent.mkdir(parents=True, exist_ok=True)
    if not model.exists():
        synth.write_model(model, preset=preset, quant=synth.DEFAULT_QUANT, seed=0, progress=False, threads=2)
    env = {"GGML_SCHED_DEBUG": "1"}
    runs = []
    for extra in ([], ["--moe-cache-slots", "8", "--moe-cache-miss", "cpu"]):
        with ServerProcess(model, args=BASE + extra, env=env, timeout=180) as srv:
            runs.append(([complete(srv, p, n_predict=8) for p in PROMPTS], cache_stats(srv), srv.log_text()))
    (ref, _, ref_log), (outs, st, log) = runs
    assert st["enabled"] and st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    for a, b in zip(ref, outs):
        assert_close_tokens(a["tokens"], token_steps(a), b["tokens"], token_steps(b))
    splits, stock = last_graph_splits(log), last_graph_splits(ref_log)
    cuda_with_cold = [names for b, names in splits
                      if b.startswith("CUDA") and any(re.fullmatch(r"ffn_moe_cold-\d+", n) for n in names)]
    assert len(cuda_with_cold) >= 4, splits
    stock_inputs = {n for _, names in stock for n in names}
    extra = [(b, n) for b, names in splits for n in names if n not in stock_inputs and not ALLOWED.match(n)]
    print(f"{preset}: {len(splits)} splits, inputs beyond the stock graph's: {extra}")
    assert not extra, extra
