"""Native tests built with the patched tree (tests/native/*.cpp), run through pytest so CI runs them."""

from __future__ import annotations

import subprocess

import pytest

from moecache.paths import binary


def run_native(name: str, *args: str, timeout: float = 600) -> str:
    try:
        exe = binary(name)
    except FileNotFoundError as e:
        pytest.fail(f"the native test {name} is not built: {e}")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{name} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    return r.stdout


def test_mul_mat_id_skip_ids_on_cpu():
    """Patch 0001: MUL_MAT_ID rows with id < 0 are zero, the others unchanged (F32/F16/Q4_0/Q8_0/Q4_K, 1..64 tokens)."""
    out = run_native("test-mul-mat-id-skip", "2")
    assert "140 passed, 0 failed" in out, out[-2000:]


def test_moe_cache_policies():
    """Patch 0002: fill order, FREQ rebalance with hysteresis, LRU admission gate and victim, upload cap,
    busy slots, failed uploads, pins, and the map invariants under random routing."""
    out = run_native("test-moe-cache-policy")
    assert out.strip().endswith("0 failed"), out[-2000:]
    assert " passed," in out
