"""Flash attention's per-query sparse gather (ggml_flash_attn_ext_set_sparse_per_query) on CUDA.

With a mask that leaves each query a short list of columns and the op's n_kv_max hint, the pin's CUDA
flash attention gathers per group of 8 queries the union of their columns (per query for at most 4
queries). QSA's queries at depth choose different cells, so the union is about 8 lists long and every
query of the group pays for all of it; the op's hint takes the one-query variant for batches too, and
GGML_CUDA_FA_SPARSE_PER_QUERY=0/1 overrides the hint. test-backend-ops compares CUDA with the CPU over
the sparse cases of the qwen4exp shape (head size 256, 2 KV heads of 8 query heads, 16384 cells, 64 and
67 queries, f16 and q8_0 caches, selections of each query's own or shared by 8 queries), with and without
the hint, under each setting of the variable.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from moecache.paths import binary

pytestmark = pytest.mark.gpu

CASE = re.compile(r"FLASH_ATTN_EXT\(hsk=256,hsv=256,nh=2,nr23=\[8,1\],kv=16384,nb=(64|67),[^)]*type_K=(f16|q8_0),"
                  r"[^)]*n_kv_max=512(?:,sparse_per_query=([01]),rows_shared=(\d+))?\): (\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("env", [None, "0", "1"], ids=["hint", "union", "per-query"])
def test_sparse_flash_attention_on_cuda_equals_the_cpu(env):
    environ = {k: v for k, v in os.environ.items() if k != "GGML_CUDA_FA_SPARSE_PER_QUERY"}
    if env is not None:
        environ["GGML_CUDA_FA_SPARSE_PER_QUERY"] = env
    proc = subprocess.run([str(binary("test-backend-ops")), "test", "-o", "FLASH_ATTN_EXT", "-b", "CUDA0",
                           "-p", "kv=16384,nb=6[47],.*n_kv_max=512"],
                          capture_output=True, text=True, timeout=600, env=environ)
    out = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    found = {(nb, t, hint or "0", shared or "1"): status for nb, t, hint, shared, status in CASE.findall(out)}
    assert set(found) == {(nb, t, hint, shared) for hint in "01"
                          for nb, t, shared in [("64", "f16", "1"), ("67", "f16", "1"), ("64", "q8_0", "1"),
                                                ("64", "f16", "8")]}, sorted(found)
    assert all(status == "OK" for status in found.values()), found
    assert "FAIL" not in out
