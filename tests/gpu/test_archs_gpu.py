"""Every MoE architecture of the pin through the hot-expert cache on CUDA: the sweep of tests/e2e/test_archs.py
(test-llama-archs' random models; the stock path, the cache with its misses on the CPU and on the GPU, a
prompt the prefill-phase swap runs at a 4x ubatch) with the experts' hits on the GPU. The stock path runs the
experts on the CPU, the cache its hits on the GPU: the tokens must be the stock path's, a log-probability
apart by rounding at most, up to a step where the stock path's best two were a near tie (random weights make
flat distributions: rounding may break a tie the other way; the comparison ends there). Refusals and
layers not cached as on the CPU (tests/archs_checks.py).

Marked `gpu`: run by benchmarks/gpu/run.sh on the GPU machine."""

from __future__ import annotations

import pytest

from archs_checks import run_all, sweep_problems, write_arch_models
from moe_cache_checks import assert_close_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, llama_server_bin):
    return write_arch_models(tmp_path_factory.mktemp("archs"))


def _differs(ref, out):
    try:
        assert_close_tokens(ref["tokens"], ref["steps"], out["tokens"], out["steps"], bound=5e-2)
    except AssertionError as e:
        return f"{out['tokens']} against {ref['tokens']}: {e}"
    return None


def test_every_moe_architecture_runs_through_the_cache_on_cuda(arch_models, subprocess_env):
    results = run_all(arch_models, subprocess_env, n_probs=4, workers=8)
    problems = sweep_problems(results, _differs)
    assert not problems, "\n".join(problems)
