"""MTP drafts (--spec-type draft-mtp) through the hot-expert cache and the prefill-phase swap, on the CPU with
the library's host test device as the GPU. The `tiny-qwen35moe-mtp` synthetic model has an MTP block whose
projection passes the next token's embedding through, so its drafts are mostly what the model then predicts:
the accepted path runs, not only rejections. Greedy speculation must give the tokens of plain decoding, with
the cache (its verify batches of a few tokens go through it; the MTP block, which runs in the draft's own
context, is not cached and says why), with the n-gram drafter beside it, and after a prompt the swap ran (the
verify batches are far below the swap's minimum: it runs once, for the prompt). /slots counts each drafter's
drafted and accepted tokens apart."""

from __future__ import annotations

import pytest

from moe_cache_checks import cache_stats, real_text
from moecache.server import ServerProcess

ENV = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
BASE = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "64", "-b", "2048"]
CACHE = ["--moe-cache-slots", "4"]
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def mtp_model(moecache_cache_dir):
    from moecache import synth

    models = moecache_cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    path = models / synth.cached_model_name("tiny-qwen35moe-mtp", "q8_0", seed=0)
    if not path.exists():
        synth.write_model(path, preset="tiny-qwen35moe-mtp", quant="q8_0", seed=0, progress=False, threads=2)
    return path


def generate(model, args, prompt=PROMPT, n_predict=48):
    with ServerProcess(model, args=[*BASE, *args], env=ENV, timeout=120) as srv:
        status, out = srv.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                               "cache_prompt": False, "return_tokens": True}, timeout=300)
        assert status == 200, out
        st = cache_stats(srv) if "--moe-cache-slots" in args else None
        if "--spec-type" in args:
            status, slots = srv.get("/slots")
            assert status == 200, slots
            out["by_type"] = slots[0]["speculative_stats"]["by_type"]
        return out, st, srv.log_text()


@pytest.fixture(scope="module")
def plain(mtp_model, llama_server_bin):
    return generate(mtp_model, [])[0]["tokens"]


def test_mtp_drafts_are_accepted_and_change_nothing(mtp_model, plain):
    out, _, log = generate(mtp_model, ["--spec-type", "draft-mtp"])
    t = out["timings"]
    assert out["tokens"] == plain
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0.2 * t["draft_n"], t  # the accepted path runs
    assert "creating MTP draft context" in log


@pytest.mark.parametrize("draft", ["mtp", "model-td-1"])
def test_the_draft_context_shares_the_target_threadpool(mtp_model, plain, draft):
    # a draft context without a pool starts threads for each of its graphs while the target's pool spins
    # (7-12x slower MTP decoding on a 16-core GPU host); it shares the target's pool where the thread counts
    # match (MTP's always do) and keeps starting its own where they differ (a draft model run at -td 1)
    args = (["--spec-type", "draft-mtp"] if draft == "mtp"
            else ["--spec-type", "draft-simple", "-md", str(mtp_model), "-td", "1", "-ngld", "99"])
    out, _, log = generate(mtp_model, args)
    assert out["tokens"] == plain and out["timings"]["draft_n_accepted"] > 0
    shared = "the draft context shares the target's CPU threadpools" in log
    assert shared == (draft == "mtp"), log[-2000:]


@pytest.mark.parametrize("miss", ["cpu", "gpu"])
def test_mtp_verify_batches_go_through_the_cache(mtp_model, plain, miss):
    out, st, _ = generate(mtp_model, ["--spec-type", "draft-mtp", *CACHE, "--moe-cache-miss", miss])
    assert out["tokens"] == plain and out["timings"]["draft_n_accepted"] > 0
    tot = st["total"]
    # verify batches of a few tokens each, every one through the cache (the prompt bypasses it: too long)
    assert tot["n_tokens"] > tot["n_steps"] > 0, tot
    assert tot["batches_cached"] + tot["batches_bypassed"]["batch"] == tot["n_steps"], tot
    assert tot["batches_bypassed"]["batch"] == 1, tot
    assert tot["hits"] > 0
    mtp = st["layers"][-1]
    assert mtp["reason"].startswith("an MTP (nextn) block"), mtp
    assert all(not l.get("reason") for l in st["layers"][:-1])


def test_mtp_and_ngram_drafts_together_through_the_cache(mtp_model, plain):
    out, st, _ = generate(mtp_model, ["--spec-type", "draft-mtp,ngram-map-k4v", "--spec-draft-n-max", "3", *CACHE])
    assert out["tokens"] == plain and out["timings"]["draft_n"] > 0
    assert st["total"]["batches_cached"] > 0
    # /slots counts each drafter's drafts apart; together they are the request's
    by_type = {x["type"]: x for x in out["by_type"]}
    assert set(by_type) == {"draft-mtp", "ngram-map-k4v"}, out["by_type"]
    assert by_type["draft-mtp"]["draft_n_accepted"] > 0
    assert sum(x["draft_n"] for x in by_type.values()) == out["timings"]["draft_n"]
    assert sum(x["draft_n_accepted"] for x in by_type.values()) == out["timings"]["draft_n_accepted"]


def test_a_swapped_prompt_then_mtp_decoding(mtp_model):
    prompt = real_text(300, 900)
    swap = [*CACHE, "--prefill-ubatch", "256", "--prefill-min-tokens", "128"]
    ref, _, _ = generate(mtp_model, swap, prompt=prompt, n_predict=24)
    out, st, log = generate(mtp_model, [*swap, "--spec-type", "draft-mtp"], prompt=prompt, n_predict=24)
    assert out["tokens"] == ref["tokens"] and out["timings"]["draft_n_accepted"] > 0
    assert ref["timings"]["prefill_ubatch"] == out["timings"]["prefill_ubatch"] == 256  # both prompts swapped
    assert st["total"]["batches_cached"] > 0
    assert st["prefill_swap"]["swaps"] == 1, st["prefill_swap"]  # the prompt's, never a verify batch's
