"""The prefill-phase swap on CUDA: the cache's banks in VRAM, the experts in host
memory. The checks of tests/e2e/test_prefill_swap.py with the banks, compute buffers and CUDA pools
really freed and allocated again, and CUDA graphs captured before a swap dropped with the pools.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, cache_stats, complete, logprobs, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

UB, PREFILL_UB = 32, 256
BASE_ARGS = ["-t", "8", "-c", "2048", "-b", "512", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui",
             "--metrics"]
CACHE = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
SWAP = ["-ub", str(UB), "--prefill-ubatch", str(PREFILL_UB), "--prefill-min-tokens", "64"]
LONG = "The committee met on Tuesday to discuss the budget for the coming year, and " * 24  # ~360 tokens
SHORT = "def fibonacci(n):\n"


def requests(srv):
    # decode between two swaps runs CUDA graphs captured with the restored pools
    return [complete(srv, LONG, n_predict=24), complete(srv, SHORT, n_predict=24), complete(srv, LONG, n_predict=24)]


@pytest.fixture(scope="module")
def stock_big(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(PREFILL_UB)] + CACHE, timeout=180) as srv:
        yield requests(srv)


@pytest.fixture(scope="module")
def stock_small(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(UB)] + CACHE, timeout=180) as srv:
        yield requests(srv)


def first_step_diff(a, b) -> float:
    pa, pb = logprobs(a)[0], logprobs(b)[0]
    assert [t for t, _ in pa] == [t for t, _ in pb]
    return max(abs(x - y) for (_, x), (_, y) in zip(pa, pb))


def test_swap_on_cuda_equals_the_stock_path_at_the_prefill_ubatch(tiny_model, stock_big):
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, timeout=180) as srv:
        outs = requests(srv)
        st = cache_stats(srv)
    sw = st["prefill_swap"]
    print("prefill swap on CUDA:", sw)
    assert sw["swaps"] == 2 and not any(sw["failed"].values())
    assert outs[0]["timings"]["prefill_ubatch"] == PREFILL_UB
    for i in (0, 2):
        d = first_step_diff(outs[i], stock_big[i])
        print(f"request {i}: first-step log-prob difference to the stock path at -ub {PREFILL_UB}: {d:.3g}")
        assert d < 1e-3
    for a, b in zip(stock_big, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2  # the cache's hits on the GPU, misses on the CPU
    # the banks, the compute buffers and the pools came back; the cache serves again. The second swap freed only
    # what the first prompt took of the banks' memory: on this GPU nothing, every bank stayed
    assert sw["last"]["n_slots"] == N_EXPERT // 2 and st["enabled"] is True
    assert sw["partial"]["swaps"] == 1 and sw["partial"]["last_bytes_kept"] == st["total"]["bytes_vram"] > 0, sw
    assert sw["after_restore"]["hits"] > 0 and sw["warm_uploads"] > 0


@pytest.mark.parametrize("how", ["full", "partial"])
def test_a_swap_that_frees_all_or_part_of_the_banks_on_cuda_equals_the_stock_path(tiny_model, stock_big, how):
    """full: every swap frees every bank (LLAMA_PREFILL_SWAP_PARTIAL=0). partial: the second swap frees the banks
    of the last two layers (LLAMA_PREFILL_SWAP_PARK_MIB: 3/8 of the banks, no headroom) and keeps the others: the
    CUDA buffers of some layers freed and allocated again while the kept ones stay published."""
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, timeout=180) as srv:
        bank_mib = cache_stats(srv)["total"]["bytes_vram"] / 2**20
    env = ({"LLAMA_PREFILL_SWAP_PARTIAL": "0"} if how == "full" else
           {"LLAMA_PREFILL_SWAP_PARK_MIB": f"{bank_mib * 3 / 8:.6f}"})
    args = BASE_ARGS + SWAP + CACHE + ["--moe-cache-headroom", "0"]
    with ServerProcess(tiny_model, args=args, env=env, timeout=180) as srv:
        outs = requests(srv)
        st = cache_stats(srv)
    sw = st["prefill_swap"]
    print(f"prefill swap on CUDA ({how}):", sw)
    assert sw["swaps"] == 2 and not any(sw["failed"].values()) and sw["partial"]["fallbacks"] == 0, sw
    for a, b in zip(stock_big, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2
    assert sw["last"]["n_slots"] == N_EXPERT // 2 and st["enabled"] is True
    if how == "full":
        assert sw["partial"]["swaps"] == 0 and sw["last"]["bytes_released"] >= st["total"]["bytes_vram"] > 0, sw
    else:
        assert sw["partial"]["swaps"] == 1 and sw["partial"]["last_bytes_kept"] == st["total"]["bytes_vram"] // 2, sw
        assert sw["last"]["bytes_released"] >= st["total"]["bytes_vram"] // 2, sw


@pytest.mark.parametrize("step", ["reserve", "restore", "banks", "upload", "partial:2", "unpark:2"])
def test_cuda_swap_failures_keep_serving(tiny_model, stock_big, stock_small, step):
    # partial, unpark: the second swap's partial release fails and frees every bank after all
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env={"LLAMA_PREFILL_SWAP_FAIL": step},
                       timeout=180) as srv:
        outs = requests(srv)
        sw = cache_stats(srv)["prefill_swap"]
    if ":" in step:
        assert sw["partial"]["fallbacks"] == 1 and not any(sw["failed"].values()), sw
    else:
        assert sw["failed"][step] == 1
    ref0 = stock_small[0] if step == "reserve" else stock_big[0]
    assert outs[0]["tokens"] == ref0["tokens"]
    assert [o["tokens"] for o in outs[1:]] == [o["tokens"] for o in stock_big[1:]]


def test_a_restore_that_waits_for_its_warm_copies_on_cuda(tiny_model, stock_big):
    """--prefill-restore-wait on CUDA: the restore waits until the warm copies into the VRAM banks are made
    (each 10 ms slower here), then decode reads them; the output is the stock one."""
    env = {"LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "10"}
    args = BASE_ARGS + SWAP + CACHE + ["--prefill-restore-wait", "10000"]
    with ServerProcess(tiny_model, args=args, env=env, timeout=180) as srv:
        out = complete(srv, LONG, n_predict=24)
        sw = cache_stats(srv)["prefill_swap"]
    print("prefill swap on CUDA, restore waited:", sw["last"], sw["after_restore"])
    assert sw["swaps"] == 1 and not any(sw["failed"].values()) and sw["warm_uploads"] > 0, sw
    assert sw["last"]["restore_ms"] >= sw["warm_uploads"] * 10 * 0.9, sw
    assert out["tokens"] == stock_big[0]["tokens"]
    assert sw["after_restore"]["hits"] > 0
