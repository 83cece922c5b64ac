"""CUDA get_rows of short rows: one thread per value gives the CPU's rows.

A QSA layer's expansion in decode gathers n_kv rows of one value each. test-backend-ops compares the
CUDA op with the CPU's over upstream's cases and the patch's: rows of 1, 3 and 64 values, 70000 of
them in two batches, and views of the ids and of the source, for f32, f16 and i32. The one-block-
per-row path (GGML_CUDA_GET_ROWS_SHORT=0) must pass the same cases.

Marked `gpu`: run by benchmarks/gpu/run.sh on a CUDA machine, deselected in CI.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from moecache.paths import binary

pytestmark = pytest.mark.gpu

SHORT_CASE = re.compile(r"GET_ROWS\(type=(f32|f16|i32),n=(1|3|64),m=(1000|50),r=(70000|40),[^)]*\): (\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("short", ["1", "0"], ids=["thread-per-value", "block-per-row"])
def test_get_rows_on_cuda_equals_the_cpu(short):
    proc = subprocess.run([str(binary("test-backend-ops")), "test", "-o", "GET_ROWS", "-b", "CUDA0"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GGML_CUDA_GET_ROWS_SHORT": short})
    out = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    found = {(t, n, m): status for t, n, m, _, status in SHORT_CASE.findall(out)}
    # every short-row case ran on the GPU (not skipped as unsupported) and matched the CPU
    expected = {(t, n, m) for t in ("f32", "f16", "i32") for n in ("1", "3", "64") for m in ("1000", "50")}
    assert set(found) == expected, sorted(found)
    assert all(status == "OK" for status in found.values()), found
    assert "FAIL" not in out


CAST_CASE = re.compile(r"GET_ROWS_CAST\(type=(\w+),type_dst=(\w+),n=(\d+),[^)]*\): (\S+)")


def test_get_rows_with_its_cast_on_cuda_equals_the_cpu():
    """A get_rows whose rows go to f16/bf16 runs as one gather on CUDA (fused), from f16,
    f32, bf16, q8_0 and q4_0 rows; the CPU runs the two ops."""
    proc = subprocess.run([str(binary("test-backend-ops")), "test", "-o", "GET_ROWS_CAST", "-b", "CUDA0"],
                          capture_output=True, text=True, timeout=300)
    out = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    found = {(t, d, n): status for t, d, n, status in CAST_CASE.findall(out)}
    expected = {(t, d, n) for t in ("f16", "f32", "bf16", "q8_0", "q4_0") for d in ("f16", "bf16") for n in ("512", "256")}
    assert set(found) == expected, sorted(found)
    assert all(status == "OK" for status in found.values()), found
