"""Warm starts of the hot-expert cache, on the CPU with the library's host test device as the GPU.

- --moe-cache-warm-prompts: a prompt's most-routed experts fill the empty slots before its tokens decode,
  so the first request hits where a cold cache misses.
- --moe-cache-profile FILE: written at shutdown (this run's routing added), read at start (its hottest
  experts fill the slots before the first request); a damaged or foreign file is ignored with a warning
  and rewritten at shutdown; a failed write (LLAMA_MOE_CACHE_FAIL=profile) leaves the old file whole.
- --moe-cache-slots-by-layer: the profile also sizes each layer's slots from its routing, in the same memory.

LLAMA_MOE_CACHE_SYNC_UPLOADS=1 makes each step wait for the uploads in flight, so the hit counts do not
depend on how fast this machine copies.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, N_LAYER, PROMPTS, cache_stats, complete
from moecache.server import ServerProcess

ENV = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
SLOTS = 4
ARGS = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "64",
        "--moe-cache-slots", str(SLOTS)]
PROMPT = PROMPTS[0] * 4  # far more tokens than the cache's max_batch: the prompt takes the stock path
N_PREDICT = 16


def first_request(model, *extra, env=None):
    """A fresh server's first request: (its tokens, the cache's stats after it, the server's log)."""
    with ServerProcess(model, args=[*ARGS, *extra], env={**ENV, **(env or {})}, timeout=120) as srv:
        out = complete(srv, PROMPT, n_predict=N_PREDICT)
        st = cache_stats(srv)
        srv.stop()
        return out["tokens"], st, srv.log_text()


@pytest.fixture(scope="module")
def cold(tiny_model):
    tokens, st, _ = first_request(tiny_model)
    assert st["warm_prompt_uploads"] == 0 and st["profile_uploads"] == 0
    return tokens, st


def test_a_prompt_warms_the_empty_slots(tiny_model, cold):
    tokens, st, _ = first_request(tiny_model, "--moe-cache-warm-prompts")
    assert st["warm_prompts"] and 0 < st["warm_prompt_uploads"] <= SLOTS * N_LAYER
    assert st["total"]["hits"] > cold[1]["total"]["hits"], (st["total"], cold[1]["total"])
    assert tokens == cold[0]


def test_the_profile_is_written_at_shutdown_and_warms_the_next_start(tiny_model, cold, tmp_path):
    profile = tmp_path / "experts.profile"
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile))
    assert st["profile"] and st["profile_uploads"] == 0 and "is ignored" not in log
    lines = profile.read_text().splitlines()
    assert lines[0] == "moecache-expert-profile 1" and lines[1].startswith("model ") and lines[-1] == "end"
    counts = [list(map(int, line.split()[2:])) for line in lines[2:-1]]
    assert len(counts) == N_LAYER and all(len(c) == N_EXPERT for c in counts)
    assert sum(map(sum, counts)) > 0
    first = profile.read_text()

    tokens2, st2, log2 = first_request(tiny_model, "--moe-cache-profile", str(profile))
    assert st2["profile_uploads"] == SLOTS * N_LAYER and "is ignored" not in log2
    assert st2["total"]["hits"] > cold[1]["total"]["hits"], (st2["total"], cold[1]["total"])
    assert tokens2 == tokens == cold[0]
    # this run's routing was added
    again = [list(map(int, line.split()[2:])) for line in profile.read_text().splitlines()[2:-1]]
    assert sum(map(sum, again)) > sum(map(sum, counts)) and profile.read_text() != first


@pytest.mark.parametrize("content, why", [
    ("garbage\n", "not an expert profile"),
    ("moecache-expert-profile 1\nmodel llama 4 16 1 1\nend\n", "belongs to another model"),
    (None, "cut short"),
    (None, "damaged line"),
])
def test_a_damaged_or_foreign_profile_is_ignored_and_replaced(tiny_model, cold, tmp_path, content, why):
    profile = tmp_path / "experts.profile"
    first_request(tiny_model, "--moe-cache-profile", str(profile))
    good = profile.read_text().splitlines()
    if content is None:
        content = "\n".join(good[:-1]) + "\n" if why == "cut short" else "\n".join(good[:2] + ["layer x 1 2"] + good[2:]) + "\n"
    profile.write_text(content)
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile))
    assert "is ignored" in log and why in log, log[-3000:]
    assert st["profile_uploads"] == 0 and tokens == cold[0]
    assert st["total"]["hits"] == cold[1]["total"]["hits"]  # a cold start, as without a profile
    text = profile.read_text().splitlines()
    assert text[0] == "moecache-expert-profile 1" and text[1] == good[1] and text[-1] == "end"


def test_a_failed_write_leaves_the_old_profile_whole(tiny_model, cold, tmp_path):
    profile = tmp_path / "experts.profile"
    first_request(tiny_model, "--moe-cache-profile", str(profile))
    before = profile.read_bytes()
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile),
                                    env={"LLAMA_MOE_CACHE_FAIL": "profile"})
    assert "was not written (injected: LLAMA_MOE_CACHE_FAIL=profile)" in log
    assert profile.read_bytes() == before and not (tmp_path / "experts.profile.tmp").exists()
    assert st["profile_uploads"] == SLOTS * N_LAYER and tokens == cold[0]


def test_an_unwritable_profile_is_a_warning(tiny_model, cold, tmp_path):
    profile = tmp_path / "missing-folder" / "experts.profile"
    tokens, _, log = first_request(tiny_model, "--moe-cache-profile", str(profile))
    assert "was not written (No such file or directory)" in log and tokens == cold[0]


def test_the_python_api_keeps_a_profile_too(tiny_model, tmp_path, monkeypatch):
    import gc

    import moecache

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    profile = tmp_path / "api.profile"
    model = moecache.Model(tiny_model, n_gpu_layers=-1, cpu_moe=True, repack=False)
    ctx = model.context(n_ctx=512, n_ubatch=64, n_threads=2, moe_cache_slots=SLOTS, moe_cache_profile=profile,
                        moe_cache_warm_prompts=True)
    ctx.generate(PROMPT, max_tokens=8)
    assert ctx.expert_cache.stats_json()["warm_prompt_uploads"] > 0
    del ctx
    gc.collect()
    assert profile.read_text().startswith("moecache-expert-profile 1\n")
    again = model.context(n_ctx=512, n_ubatch=64, n_threads=2, moe_cache_slots=SLOTS, moe_cache_profile=str(profile))
    assert again.expert_cache.stats_json()["profile_uploads"] == SLOTS * N_LAYER


def test_tune_writes_a_profile_the_server_reads(tiny_model, cold, tmp_path, subprocess_env):
    """`moecache tune TRACE --write-profile FILE --model MODEL`: the trace's routing counts as the profile
    of the model the library itself fingerprints; a fresh server starts with its hottest experts."""
    import subprocess
    import sys

    trace = tmp_path / "routing.jsonl"
    library = tmp_path / "library.profile"
    with ServerProcess(tiny_model, args=[*ARGS, "--moe-routing-trace", str(trace), "--moe-cache-profile",
                                         str(library)], env=ENV, timeout=120) as srv:
        complete(srv, PROMPT, n_predict=N_PREDICT)
        srv.stop()
    written = tmp_path / "tuned.profile"
    r = subprocess.run([sys.executable, "-m", "moecache", "tune", str(trace), "--write-profile", str(written),
                        "--model", str(tiny_model), "--slots", "4"],
                       env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wrote {written}" in r.stdout
    lines = written.read_text().splitlines()
    assert lines[1] == library.read_text().splitlines()[1]  # the library's own fingerprint of the model
    assert len(lines) == N_LAYER + 3 and sum(sum(map(int, l.split()[2:])) for l in lines[2:-1]) > 0
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(written))
    assert st["profile_uploads"] == SLOTS * N_LAYER and "is ignored" not in log
    assert st["total"]["hits"] > cold[1]["total"]["hits"] and tokens == cold[0]
    # without --model: refused, naming the fix
    r = subprocess.run([sys.executable, "-m", "moecache", "tune", str(trace), "--write-profile", str(written)],
                       env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--write-profile needs --model" in r.stderr


def test_warm_copies_take_the_link_in_rank_order_across_layers(tiny_model):
    """A warm start's copies run while decode starts (no LLAMA_MOE_CACHE_SYNC_UPLOADS here, each copy made
    slow): they go in rank order across the layers, each layer's most-routed expert first, so every layer
    holds its top expert after the first few copies. Layer after layer (LLAMA_MOE_CACHE_WARM_INTERLEAVE=0) the
    first layer fills while the last one stays empty."""
    slots = 12
    args = [a if a != str(SLOTS) else str(slots) for a in ARGS] + ["--moe-cache-warm-prompts"]

    def resident(**env):
        env = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "20", **env}
        with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
            complete(srv, PROMPT, n_predict=96)
            st = cache_stats(srv)
        counts = [layer["n_resident"] for layer in st["layers"]]
        # the copies still running, past the first round
        assert len(counts) == N_LAYER and N_LAYER <= sum(counts) < (N_LAYER - 1) * slots, counts
        return counts

    interleaved = resident()
    assert min(interleaved) >= 1, interleaved
    in_layer_order = resident(LLAMA_MOE_CACHE_WARM_INTERLEAVE="0")
    assert in_layer_order[0] > 0 and in_layer_order[-1] == 0, in_layer_order


def profile_with(path, rows):
    """The profile a run wrote (its header and fingerprint) with these counts per layer."""
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [f"layer {il} " + " ".join(map(str, c)) for il, c in enumerate(rows)]
                              + ["end", ""]))


def test_the_profile_sizes_each_layers_slots(tiny_model, cold, tmp_path):
    """Layers whose routing the profile shows on 2 experts give slots to layers that spread over all 16: the
    total stays, each keeps at least half the even share, and the tokens are the cache's without it. Without
    the switch, or with a damaged profile, every layer has the even share."""
    profile = tmp_path / "experts.profile"
    first_request(tiny_model, "--moe-cache-profile", str(profile))
    narrow, wide = [50, 50] + [0] * (N_EXPERT - 2), [10] * N_EXPERT
    rows = [narrow, wide, narrow, wide]
    assert len(rows) == N_LAYER
    profile_with(profile, rows)
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile), "--moe-cache-slots-by-layer")
    sizes = [layer["n_slots"] for layer in st["layers"]]
    assert sizes == [SLOTS // 2, SLOTS + SLOTS // 2, SLOTS // 2, SLOTS + SLOTS // 2], sizes
    assert st["n_slots"] == SLOTS and "is ignored" not in log
    assert st["total"]["bytes_vram"] == cold[1]["total"]["bytes_vram"]  # the same memory
    assert [layer["n_resident"] for layer in st["layers"]] == [2, SLOTS + SLOTS // 2, 2, SLOTS + SLOTS // 2]
    assert tokens == cold[0]
    # the variable turns it on as the flag does; without either, the even share
    profile_with(profile, rows)
    _, st, _ = first_request(tiny_model, "--moe-cache-profile", str(profile),
                             env={"LLAMA_ARG_MOE_CACHE_SLOTS_BY_LAYER": "1"})
    assert [layer["n_slots"] for layer in st["layers"]] == sizes
    profile_with(profile, rows)
    _, st, _ = first_request(tiny_model, "--moe-cache-profile", str(profile))
    assert [layer["n_slots"] for layer in st["layers"]] == [SLOTS] * N_LAYER
    # a damaged profile: the even share, said in its warning, and the same tokens
    profile.write_text("garbage\n")
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile), "--moe-cache-slots-by-layer")
    assert [layer["n_slots"] for layer in st["layers"]] == [SLOTS] * N_LAYER
    assert "is ignored" in log and "with the even share of slots a layer" in log and tokens == cold[0]


def test_slots_by_layer_survive_a_failed_bank_allocation(tiny_model, cold, tmp_path):
    """LLAMA_MOE_CACHE_FAIL=alloc with layers sized by the profile: the cache is off, the server answers with
    the stock path's tokens."""
    profile = tmp_path / "experts.profile"
    first_request(tiny_model, "--moe-cache-profile", str(profile))
    profile_with(profile, [[50, 50] + [0] * (N_EXPERT - 2), [10] * N_EXPERT] * (N_LAYER // 2))
    tokens, st, log = first_request(tiny_model, "--moe-cache-profile", str(profile), "--moe-cache-slots-by-layer",
                                    env={"LLAMA_MOE_CACHE_FAIL": "alloc"})
    assert not st["enabled"] and "injected" in log
    with ServerProcess(tiny_model, args=[a for a in ARGS if a not in ("--moe-cache-slots", str(SLOTS))],
                       env=ENV, timeout=120) as srv:
        stock = complete(srv, PROMPT, n_predict=N_PREDICT)["tokens"]
    assert tokens == stock
