"""The prefill-phase swap's warm restore ranks the experts it refills the slots with: by the prompt's routing, and
with an expert profile (moecache-server keeps one) by the prompt's share plus each expert's share of what decode
routed before, this run's and earlier runs'. On a model with the 30B shape's calibrated routing (128 experts,
top-8, cut to 4 small layers), on the host test device with synchronous uploads (the hits are then a property of
the routing and the ranking alone), the blended ranking serves more of the decoded tokens' experts from the
slots than the prompt's alone (LLAMA_MOE_CACHE_WARM_BLEND=0), both in the same server's later requests and in a
restarted server's first ones, and the tokens stay the same. The same server's later swaps are partial releases
that keep every bank (the test device has no budget): the kept layers are retargeted to the ranking, copying
only the experts that differ (with LLAMA_PREFILL_SWAP_RETARGET=0 they keep the last request's experts and the
blend gains nothing there: 37.5% either way, against 41.4% retargeted or fully restored)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from moecache.server import ServerProcess

ENV = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
ARGS = ["-t", "2", "-c", "4096", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "64", "-b", "1024",
        "--moe-cache-slots", "24", "--prefill-ubatch", "256", "--prefill-min-tokens", "128"]
FILES = ("functools.py", "heapq.py", "textwrap.py")
N_PREDICT = 32


@pytest.fixture(scope="module")
def calibrated(moecache_cache_dir):
    from moecache import synth

    path = moecache_cache_dir / "models" / "calibrated-128x8-4l-q8_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        preset = replace(synth.get_preset("qwen3-30b-a3b"), name="calibrated-4l", n_layer=4, n_embd=256,
                         n_ff_exp=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=64)
        synth.write_model(path, preset=preset, quant="q8_0", seed=0, routing_strength=2.0, context_mix=0.1,
                          progress=False, threads=2)
    return path


def run(model, profile: Path, blend: str, rounds: int):
    """Each round sends the prompts once: per request the hit rate over its decoded tokens, and its tokens."""
    root = Path(__file__).resolve().parents[2]
    texts = [(root / "benchmarks" / "prompts" / "code" / f).read_text()[:2500] for f in FILES]
    out = []
    with ServerProcess(model, args=[*ARGS, "--moe-cache-profile", str(profile)],
                       env={**ENV, "LLAMA_MOE_CACHE_WARM_BLEND": blend}, timeout=300) as srv:
        for _ in range(rounds):
            for t in texts:
                _, before = srv.get("/moe-cache")
                status, body = srv.post("/completion", {"prompt": t, "n_predict": N_PREDICT, "temperature": 0.0,
                                                        "cache_prompt": False, "ignore_eos": True,
                                                        "return_tokens": True}, timeout=600)
                assert status == 200, body
                _, after = srv.get("/moe-cache")
                assert body["timings"].get("prefill_ubatch") == 256, body["timings"]  # the prompt swapped
                a, b = after["prefill_swap"]["after_restore"], before["prefill_swap"]["after_restore"]
                hits, misses = a["hits"] - b["hits"], a["misses"] - b["misses"]
                assert hits + misses > 0
                out.append((hits / (hits + misses), body["tokens"]))
    return out


def test_the_profile_ranks_the_warm_restore(calibrated, tmp_path, llama_server_bin):
    rates = {}
    tokens = {}
    for blend in ("0", "1"):
        profile = tmp_path / f"blend{blend}.profile"
        first = run(calibrated, profile, blend, rounds=2)
        restarted = run(calibrated, profile, blend, rounds=1)
        n = len(FILES)
        rates[blend] = (sum(r for r, _ in first[n:]) / n, sum(r for r, _ in restarted) / n)
        tokens[blend] = [t for _, t in first + restarted]
    # the same server's second round, and a restarted server's requests: more hits with the history blended in
    assert rates["1"][0] > rates["0"][0] + 0.01 and rates["1"][1] > rates["0"][1] + 0.01, rates
    assert tokens["0"] == tokens["1"]
