"""MTP drafts (--spec-type draft-mtp) through the hot-expert cache on CUDA (tests/e2e/test_spec_mtp.py on the CPU
test device): `tiny-qwen35moe-mtp` widened to rows of 256 (the GPU kernels' tiles are longer than its 64), its
MTP block's drafts mostly accepted. Verify batches of a few tokens go through the cache with the misses on the
CPU and on the GPU, beside the n-gram drafter, and after a prompt the prefill-phase swap ran (once: never for a
verify batch). A verify batch is a few tokens at once where plain decoding is one: the GPU's kernels differ,
so tokens must be plain decoding's up to a near tie of its best two (the comparison ends there).

Marked `gpu`: run by benchmarks/gpu/run.sh on the GPU machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_cache_checks import assert_close_tokens, cache_stats, complete, real_text, token_steps
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "64", "-b", "2048",
        "-lm", "none", "--no-webui"]
CACHE = ["--moe-cache-slots", "4"]
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def mtp_model(moecache_cache_dir):
    from moecache import synth

    path = moecache_cache_dir / "models" / "qwen35moe-mtp-256-q8_0-seed0-gpu.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        preset = replace(synth.get_preset("tiny-qwen35moe-mtp"), name="qwen35moe-mtp-256", n_embd=256, n_ff_exp=256,
                         n_ff=256, n_ff_shexp=256)
        synth.write_model(path, preset=preset, quant="q8_0", seed=0, progress=False, threads=8)
    return path


def generate(model, args, prompt=PROMPT, n_predict=48, n_probs=0):
    with ServerProcess(model, args=[*BASE, *args], timeout=180) as srv:
        out = complete(srv, prompt, n_predict=n_predict, n_probs=n_probs)
        st = cache_stats(srv) if "--moe-cache-slots" in args else None
        if "--spec-type" in args:
            status, slots = srv.get("/slots")
            assert status == 200, slots
            out["by_type"] = slots[0]["speculative_stats"]["by_type"]
        return out, st


@pytest.fixture(scope="module")
def plain(mtp_model, llama_server_bin):
    return generate(mtp_model, [], n_probs=4)[0]


def assert_as_plain(plain, out):
    assert_close_tokens(plain["tokens"], token_steps(plain), out["tokens"])


def test_mtp_drafts_are_accepted_on_cuda(mtp_model, plain):
    out, _ = generate(mtp_model, ["--spec-type", "draft-mtp"])
    t = out["timings"]
    assert_as_plain(plain, out)
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0.2 * t["draft_n"], t


@pytest.mark.parametrize("miss", ["cpu", "gpu"])
def test_mtp_verify_batches_go_through_the_cache_on_cuda(mtp_model, plain, miss):
    out, st = generate(mtp_model, ["--spec-type", "draft-mtp", *CACHE, "--moe-cache-miss", miss])
    assert_as_plain(plain, out)
    assert out["timings"]["draft_n_accepted"] > 0
    tot = st["total"]
    assert tot["n_tokens"] > tot["n_steps"] > 0 and tot["batches_cached"] > 0 and tot["hits"] > 0, tot
    if miss == "gpu":
        assert tot["n_miss_device"] > 0, tot
    assert st["layers"][-1]["reason"].startswith("an MTP (nextn) block"), st["layers"][-1]


def test_mtp_and_ngram_drafts_together_on_cuda(mtp_model, plain):
    out, st = generate(mtp_model, ["--spec-type", "draft-mtp,ngram-map-k4v", "--spec-draft-n-max", "3", *CACHE])
    assert_as_plain(plain, out)
    by_type = {x["type"]: x for x in out["by_type"]}
    assert set(by_type) == {"draft-mtp", "ngram-map-k4v"}, out["by_type"]
    assert by_type["draft-mtp"]["draft_n_accepted"] > 0
    assert sum(x["draft_n_accepted"] for x in by_type.values()) == out["timings"]["draft_n_accepted"]
    assert st["total"]["batches_cached"] > 0


def test_a_swapped_prompt_then_mtp_decoding_on_cuda(mtp_model):
    prompt = real_text(300, 900)
    swap = [*CACHE, "--prefill-ubatch", "256", "--prefill-min-tokens", "128"]
    ref, _ = generate(mtp_model, swap, prompt=prompt, n_predict=24, n_probs=4)
    out, st = generate(mtp_model, [*swap, "--spec-type", "draft-mtp"], prompt=prompt, n_predict=24)
    assert_close_tokens(ref["tokens"], token_steps(ref), out["tokens"])
    assert ref["timings"]["prefill_ubatch"] == out["timings"]["prefill_ubatch"] == 256
    assert out["timings"]["draft_n_accepted"] > 0
    assert st["prefill_swap"]["swaps"] == 1, st["prefill_swap"]
