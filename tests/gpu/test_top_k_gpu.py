"""CUDA top-k: many long rows in one radix select pick the CPU's indices; ggml_top_k_ordered
returns exactly the CPU's indices in the CPU's order.

test-backend-ops compares the CUDA op with the CPU's as index sets (by value where there are ties),
over upstream's cases and the patch's: rows of 262144 cells with k 2051, the shape of a QSA prefill
ubatch at depth. The per-row path (GGML_CUDA_TOP_K_RADIX=0) must still pass too.

Marked `gpu`: run by benchmarks/gpu/run.sh on a CUDA machine, deselected in CI.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from moecache.paths import binary

pytestmark = pytest.mark.gpu

QSA_CASE = re.compile(r"TOP_K\(type=f32,ne=\[262144,24,1,1\],k=2051,ties=(\d)\): (.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_top_k_cases(**env) -> str:
    proc = subprocess.run([str(binary("test-backend-ops")), "test", "-o", "TOP_K", "-b", "CUDA0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    out = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("radix", ["1", "0"], ids=["rows-at-once", "per-row"])
def test_top_k_on_cuda_equals_the_cpu(radix):
    out = run_top_k_cases(GGML_CUDA_TOP_K_RADIX=radix)
    found = {ties: status.strip() for ties, status in QSA_CASE.findall(out)}
    # both QSA-shaped cases ran on the GPU (not skipped as unsupported) and matched the CPU
    assert found == {"0": "OK", "1": "OK"}, "\n".join(line for line in out.splitlines() if "262144" in line)
    assert "FAIL" not in out


ORDERED_CASE = re.compile(r"TOP_K\(type=f32,ne=\[([0-9,]+)\],k=(\d+),ties=(\d),ordered=1\): (.*)")


def test_ordered_top_k_on_cuda_is_the_cpus_exactly():
    """Ties at the k-th value from the lowest indices, the indices in increasing order: compared index by
    index (long runs of ties), at small shapes and at a QSA ubatch's block and candidate rows."""
    out = run_top_k_cases()
    found = ORDERED_CASE.findall(out)
    assert len(found) == 22, "\n".join(line for line in out.splitlines() if "ordered" in line)
    assert all(status.strip() == "OK" for *_, status in found), found
    assert ("65536,508,1,1", "515", "1", "OK") in [(ne, k, t, st.strip()) for ne, k, t, st in found]
