"""Flash attention's one-query sparse variant for batches (GGML_CUDA_FA_SPARSE_PER_QUERY=1) on CUDA.

With a mask that leaves each query a short list of columns and the op's n_kv_max hint, the pin's CUDA
flash attention gathers per group of 8 queries the union of their columns (per query for at most 4
queries). QSA's queries at depth choose different cells, so the union is about 8 lists long and every
query of the group pays for all of it; the switch takes the one-query variant for batches too.
test-backend-ops compares CUDA with the CPU over the sparse cases of the qwen4exp shape (head size 256,
2 KV heads of 8 query heads, 16384 cells, 64 and 67 queries, f16 and q8_0 caches), with and without it.

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
                  r"[^)]*n_kv_max=512\): (\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("per_query", ["0", "1"], ids=["8-query-union", "per-query"])
def test_sparse_flash_attention_on_cuda_equals_the_cpu(per_query):
    proc = subprocess.run([str(binary("test-backend-ops")), "test", "-o", "FLASH_ATTN_EXT", "-b", "CUDA0",
                           "-p", "kv=16384,nb=6[47],.*n_kv_max=512"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GGML_CUDA_FA_SPARSE_PER_QUERY": per_query})
    out = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    found = {(nb, t): status for nb, t, status in CASE.findall(out)}
    assert set(found) == {("64", "f16"), ("67", "f16"), ("64", "q8_0")}, sorted(found)
    assert all(status == "OK" for status in found.values()), found
    assert "FAIL" not in out
