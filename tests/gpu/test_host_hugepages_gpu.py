"""Pinned host buffers on transparent huge pages (patch 0075, GGML_CUDA_HOST_HUGEPAGES=1): the experts
in host memory come from an MADV_HUGEPAGE mapping page-locked with cudaHostRegister instead of
cudaMallocHost. Same bytes, same kernels: the output must be bit-identical, with the experts computed
on the CPU and uploaded into the hot-expert cache's slots from there.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, cache_stats, complete, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE_ARGS = ["-t", "8", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui"]
CACHE_ARGS = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16",
              "--moe-cache-rebalance-interval", "4"]


def _anon_huge_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1:text.index("]")]


def _run(model, args, huge: bool):
    env = {"GGML_CUDA_HOST_HUGEPAGES": "1" if huge else "0"}
    with ServerProcess(model, args=args, env=env, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv) if "--moe-cache-slots" in args else None
        huge_kb = _anon_huge_kb(srv.proc.pid)
    return outs, st, huge_kb


@pytest.mark.parametrize("cache", [False, True], ids=["cpu-experts", "cache"])
def test_huge_page_host_buffers_are_bit_identical(tiny_model, cache):
    args = BASE_ARGS + (CACHE_ARGS if cache else [])
    base, base_st, base_kb = _run(tiny_model, args, huge=False)
    outs, st, kb = _run(tiny_model, args, huge=True)
    for a, b in zip(base, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0
    if cache:
        assert st["total"]["uploads"] > 0 and base_st["total"]["uploads"] > 0
    if _thp_mode() != "never":
        # the experts' buffer (padded to 2 MiB) is backed by huge pages only with the switch on
        assert kb >= base_kb + 2048, (kb, base_kb)
