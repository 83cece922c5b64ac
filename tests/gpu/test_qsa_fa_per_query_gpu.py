"""QSA's prompt ubatches ask flash attention for per-query sparse gathers (--qsa-sparse) on CUDA.

The pin's CUDA flash attention gathers, for a batch with a sparse mask, the union of each 8 queries'
selected cells; with --qsa-sparse the masked attention sets the per-query hint, so each query
gathers its own. The sparse variants exist for heads of 256 with 8 query heads per KV head, so the model is
tiny-qwen4exp with qwen4exp's attention heads (16 of 256, 2 KV) and a top-k of 256 cells: with the tiny
preset's 8, a 256-token ubatch's selections (2048 rows) are fewer than the cells past 2048, and
--qsa-sparse gathers them instead of masking. A ~8.4k-token prompt in ubatches of 256 reaches the depth
(4096 cells and 16 top-k widths) where flash attention gathers. Greedy tokens equal the pin's masked path,
log-probabilities within device rounding; CUDA logs the first batch that takes the one-query variant, and
GGML_CUDA_FA_SPARSE_PER_QUERY=0 keeps the union.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import dataclasses

import pytest

from moe_cache_checks import complete, max_logprob_diff, real_text
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

LINE = "one-query sparse flash attention for a batch"
ARGS = ["-t", "8", "-c", "16384", "-np", "1", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "256", "-lv", "4"]


@pytest.fixture(scope="module")
def model(moecache_cache_dir):
    preset = dataclasses.replace(synth.get_preset("tiny-qwen4exp"), name="tiny-qwen4exp-h256-k256",
                                 n_head=16, n_head_kv=2, head_dim=256, n_ctx_train=16384,
                                 indexer_top_k=256)
    path = moecache_cache_dir / "models" / "tiny-qwen4exp-h256-k256-seed0.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        synth.write_model(path, preset=preset, seed=0, progress=False, threads=8)
    return path


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(5000, 35000)


def run(model, text, extra, env):
    with ServerProcess(model, args=ARGS + extra, env=env, timeout=300) as srv:
        return complete(srv, text, n_predict=12), srv.log_text()


@pytest.fixture(scope="module")
def pin(model, text):
    return run(model, text, [], {})


@pytest.mark.parametrize("extra", [["--qsa-sparse"], ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"]],
                         ids=["sparse", "sparse-block"])
def test_per_query_gathers_on_cuda_keep_the_pins_tokens(model, text, pin, extra):
    masked, masked_log = pin
    out, log = run(model, text, extra, {})
    union, union_log = run(model, text, extra, {"GGML_CUDA_FA_SPARSE_PER_QUERY": "0"})
    assert out["tokens_evaluated"] > 5000
    assert LINE in log
    assert LINE not in masked_log and LINE not in union_log
    assert out["tokens"] == masked["tokens"] == union["tokens"]
    assert max_logprob_diff(masked, out) < 2e-2
    assert max_logprob_diff(union, out) < 2e-2
