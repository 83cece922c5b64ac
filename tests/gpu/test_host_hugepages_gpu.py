"""Pinned host buffers on transparent huge pages (--host-hugepages or GGML_CUDA_HOST_HUGEPAGES=1):
the experts in host memory come from an MADV_HUGEPAGE mapping page-locked with cudaHostRegister instead of
cudaMallocHost. Same bytes, same kernels: the output must be bit-identical, with the experts computed
on the CPU and uploaded into the hot-expert cache's slots from there. When the huge pages cannot be had
(GGML_CUDA_HOST_HUGEPAGES_FAIL=1) the server warns, falls back to cudaMallocHost and answers the same.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, anon_huge_kb, cache_stats, complete, max_logprob_diff, thp_mode
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE_ARGS = ["-t", "8", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui"]
CACHE_ARGS = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16",
              "--moe-cache-rebalance-interval", "4"]


def _run(model, args, env=None):
    with ServerProcess(model, args=args, env=env or {}, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv) if "--moe-cache-slots" in args else None
        huge_kb = anon_huge_kb(srv.proc.pid)
        log = srv.log_text()
    return outs, st, huge_kb, log


@pytest.mark.parametrize("cache,switch", [(False, "flag"), (True, "flag"), (False, "env")],
                         ids=["cpu-experts", "cache", "cpu-experts-env"])
def test_huge_page_host_buffers_are_bit_identical(tiny_model, cache, switch):
    args = BASE_ARGS + (CACHE_ARGS if cache else [])
    # with the cache, hits (GPU) and misses (CPU) round differently: each step waits for its uploads, so
    # both runs hit the same experts at the same steps whatever the uploads' timing
    sync = {"LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"} if cache else {}
    base, base_st, base_kb, _ = _run(tiny_model, args, {"GGML_CUDA_HOST_HUGEPAGES": "0", **sync})
    if switch == "flag":
        outs, st, kb, log = _run(tiny_model, [*args, "--host-hugepages"], sync)
    else:
        outs, st, kb, log = _run(tiny_model, args, {"GGML_CUDA_HOST_HUGEPAGES": "1", **sync})
    assert "using cudaMallocHost" not in log  # the huge-page path ran, no fallback
    for a, b in zip(base, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0
    if cache:
        assert st["total"]["uploads"] > 0 and base_st["total"]["uploads"] > 0
    if thp_mode() != "never":
        # the experts' buffer (padded to 2 MiB) is backed by huge pages only with the switch on
        assert kb >= base_kb + 2048, (kb, base_kb)


def test_without_huge_pages_the_server_warns_and_answers_the_same(tiny_model):
    base, _, _, _ = _run(tiny_model, BASE_ARGS)
    outs, _, _, log = _run(tiny_model, [*BASE_ARGS, "--host-hugepages"], {"GGML_CUDA_HOST_HUGEPAGES_FAIL": "1"})
    assert "on huge pages, using cudaMallocHost" in log
    for a, b in zip(base, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0
