"""Hot-expert cache misses on CUDA (--moe-cache-miss gpu): the GPU reads the
missed experts in host memory in place (pinned at start-up), so no cached layer splits the graph.
The tiny preset's rows (64 values) are shorter than the GPU kernels' tiles, so these tests use the
`demo` preset (rows of 256). Through the server (own process).

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, cache_stats, complete, max_logprob_diff
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE_ARGS = ["-t", "8", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "-lm", "none", "--no-webui"]
N_LAYER, N_EXPERT, N_USED = 8, 32, 4  # the demo preset


@pytest.fixture(scope="module")
def demo_model(moecache_cache_dir):
    from moecache import synth

    path = moecache_cache_dir / "models" / synth.cached_model_name("demo", seed=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        synth.write_model(path, preset="demo", seed=0, progress=False)
    return path


@pytest.fixture(scope="module")
def stock(demo_model):
    with ServerProcess(demo_model, args=BASE_ARGS, timeout=180) as srv:
        yield [complete(srv, p) for p in PROMPTS]


@pytest.mark.parametrize("extra", [[], ["-lm", "mmap"], ["--no-host"]], ids=["host-buffers", "mmap", "pageable"])
def test_every_miss_on_the_gpu_matches_stock(demo_model, stock, extra):
    """A cache held empty: every routed expert is read by the GPU from host memory: the pinned host
    buffers of -lm none (mapped only), a read-only file mapping (-lm mmap) or pageable buffers
    (--no-host), which the cache page-locks. The same tokens as the CPU path; only device rounding
    differs."""
    args = BASE_ARGS + extra + ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu"]
    with ServerProcess(demo_model, args=args, env={"LLAMA_MOE_CACHE_HOLD_EMPTY": "1"}, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
    tot = st["total"]
    assert tot["n_miss_device"] == N_LAYER, st["layers"][0]
    assert tot["hits"] == 0 and tot["misses"] == tot["n_tokens"] * N_USED * N_LAYER
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2


@pytest.mark.parametrize("miss", ["gpu", "auto"])
def test_hits_and_gpu_misses_match_stock(demo_model, stock, miss):
    args = BASE_ARGS + ["--moe-cache-slots", "16", "--moe-cache-miss", miss, "--moe-cache-miss-auto-pct", "60",
                        "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(demo_model, args=args, timeout=180) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)["total"]
    assert st["uploads"] > 0 and st["hits"] > 0 and st["misses"] > 0, st
    assert st["n_miss_device"] > 0, st
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-after-the-other"])
def test_split_misses_on_cuda_match_stock(demo_model, stock, overlap):
    """--moe-cache-miss split on CUDA: each layer's hottest missed experts read by the GPU over the link, the others
    computed by the CPU at the same time (with --cpu-experts-overlap, beside the GPU's hits and share). The same
    tokens as the CPU path; only device rounding differs."""
    args = BASE_ARGS + ["--moe-cache-slots", "16", "--moe-cache-miss", "split", "--moe-cache-max-uploads", "16",
                        "--moe-cache-rebalance-interval", "4",
                        "--cpu-experts-overlap" if overlap else "--no-cpu-experts-overlap"]
    with ServerProcess(demo_model, args=args, timeout=180) as srv:
        complete(srv, PROMPTS[0] * 3, n_predict=48)
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
    tot = st["total"]
    assert tot["uploads"] > 0 and tot["hits"] > 0 and tot["misses"] > 0, tot
    assert all(layer["miss"] == "split" for layer in st["layers"]), st["layers"][0]
    assert any(0 < layer["split_device"] for layer in st["layers"]), [layer["split_device"] for layer in st["layers"]]
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2


def test_a_failed_mapping_on_cuda_keeps_the_cpu_misses(demo_model, stock):
    args = BASE_ARGS + ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu"]
    with ServerProcess(demo_model, args=args, env={"LLAMA_MOE_CACHE_FAIL": "map"}, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
        log = srv.log_text()
    assert "cannot read" in log
    assert st["enabled"] and st["total"]["n_miss_device"] == 0
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]


@pytest.fixture(scope="module")
def all_in_vram(demo_model):
    """Every expert in VRAM, one token per micro-batch (-ub 1): the stock GPU graph that the one-FFN
    path must reproduce. With -ub 1 the prompts too run decode-shaped steps, which the cache runs
    (larger batches bypass it and would compute the prompt's experts elsewhere)."""
    args = [a for a in BASE_ARGS if a != "--cpu-moe"] + ["-ub", "1"]
    with ServerProcess(demo_model, args=args, timeout=180) as srv:
        yield [complete(srv, p) for p in PROMPTS]


def test_one_expert_ffn_on_cuda_is_the_all_in_vram_result(demo_model, all_in_vram):
    """The one expert FFN on CUDA, on by default: hits (slots) and misses (host experts read in place)
    run in one expert FFN through the expert tables, i.e. the same mmvq kernels over the same bytes as
    with every expert in VRAM: the same tokens and log-probabilities, bit for bit, while the slots fill."""
    args = BASE_ARGS + ["-ub", "1", "--moe-cache-slots", "16", "--moe-cache-miss", "gpu",
                        "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
    with ServerProcess(demo_model, args=args, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
    assert all(layer["table"] for layer in st["layers"]), [layer["table"] for layer in st["layers"]]
    assert st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    for a, b in zip(all_in_vram, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) == 0.0


def test_tables_off_keeps_two_branches(demo_model, stock):
    """LLAMA_MOE_CACHE_TABLE=0: the two-branch graph (a hit and a miss branch); the stock tokens."""
    args = BASE_ARGS + ["--moe-cache-slots", "16", "--moe-cache-miss", "gpu"]
    with ServerProcess(demo_model, args=args, env={"LLAMA_MOE_CACHE_TABLE": "0"}, timeout=180) as srv:
        outs = [complete(srv, p) for p in PROMPTS]
        st = cache_stats(srv)
    assert not any(layer["table"] for layer in st["layers"])
    for a, b in zip(stock, outs):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2


def test_misses_staged_in_vram_give_the_same_bits(demo_model):
    """GGML_CUDA_MMID_TABLE_STAGE=1 copies the routed matrices into VRAM before the expert kernels read them
    (misses from mapped host memory, hits from their slots): the same bytes through the same kernels, so the
    same tokens and top log-probabilities bit for bit as reading them in place."""
    from moe_cache_checks import assert_same_outputs

    args = BASE_ARGS + ["--moe-cache-slots", "8", "--moe-cache-miss", "gpu"]
    outs = {}
    for stage in ("0", "1"):
        with ServerProcess(demo_model, args=args, env={"GGML_CUDA_MMID_TABLE_STAGE": stage}, timeout=180) as srv:
            outs[stage] = [complete(srv, p) for p in PROMPTS]
            tot = cache_stats(srv)["total"]
        assert tot["n_miss_device"] == N_LAYER and tot["misses"] > 0, tot
    assert_same_outputs(outs["0"], outs["1"])
