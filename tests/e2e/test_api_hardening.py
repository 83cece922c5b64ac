"""`import moecache` where users break it: Ctrl-C during a long generation, settings only the library
can check, the stats of the last token. The tiny synthetic model on the CPU."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

import moecache

HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}

GENERATE_FOREVER = """
import sys, time
import moecache
m = moecache.Model(sys.argv[1])
ctx = m.context(n_ctx=32768, n_batch=512, n_ubatch=512, n_threads=2)
print("generating", flush=True)
t0 = time.monotonic()
try:
    ctx.generate("def f():", max_tokens=30000)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(3)
"""


def test_ctrl_c_stops_a_long_generation(tiny_model, subprocess_env):
    # the child must see Ctrl-C even where the test runner was started with SIGINT ignored (a background job
    # of a shell without job control): Python maps SIGINT to KeyboardInterrupt only if it starts at SIG_DFL
    proc = subprocess.Popen([sys.executable, "-c", GENERATE_FOREVER, str(tiny_model)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=subprocess_env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "generating"
        time.sleep(2.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 3, out[-2000:]
    assert "interrupted after" in out
    assert took < 5, f"KeyboardInterrupt came {took:.1f} s after Ctrl-C"


@pytest.fixture(scope="module")
def model(tiny_model):
    return moecache.Model(tiny_model, repack=False)


@pytest.mark.parametrize("kwargs,expect", [
    (dict(moe_cache_max_batch=65), "max_batch must be in 1..64"),
    (dict(moe_cache_policy="lru", moe_cache_admit_misses=20, moe_cache_admit_window=16),
     "admit_misses (20) must not exceed admit_window (16)"),
    (dict(moe_cache_rebalance_interval=0), "rebalance_interval must be >= 1"),
])
def test_the_library_checks_cache_settings_itself(model, kwargs, expect):
    """The native module straight, past the Python checks: the library refuses the values."""
    core = moecache.native_module()
    args = dict(moe_cache_slots=4, moe_cache_size_mib=0, moe_cache_policy="freq", moe_cache_rebalance_interval=40,
                moe_cache_max_batch=8, moe_cache_admit_misses=2, moe_cache_admit_window=16, moe_cache_max_uploads=2)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        core.Context(model._m, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, **args)
    assert expect in str(e.value)


def test_stats_include_the_last_token(model, monkeypatch):
    for k, v in HOST.items():
        monkeypatch.setenv(k, v)
    ctx = model.context(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, moe_cache_slots=8)
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"
    a = ctx.generate(prompt, max_tokens=20)
    b = ctx.generate(prompt * 2, max_tokens=12)  # clears the memory first: a's last tokens must stay counted
    st = ctx.expert_cache.stats()
    # the prompts (more than 8 tokens) bypass the cache; every generated token but the last is fed to
    # a decode, and each generation commits its last decode
    assert st["n_tokens"] == len(a.tokens) - 1 + len(b.tokens) - 1, (st["n_tokens"], len(a.tokens), len(b.tokens))
