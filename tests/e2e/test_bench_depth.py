"""`moecache bench` at a depth, against the real llama-server (tiny model, CPU): every slot caches the
depth first, each request reuses it (the server's cache_n) and prefills only its new tokens, with two
users on two slots as well; the report gives each depth its own table and the depth's own prefill."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCENARIO = """
name = "depth"
model = {{ synth = "tiny" }}
max_tokens = 8
repetitions = 2
warmup = 1
users = [1, 2]
prompts_dir = "{prompts}"
server_args = ["-ngl", "0", "-t", "2", "-c", "2048", "-np", "2", "-no-kvu"]

[[prompts]]
name = "prose"
files = ["prose/python-language-reference.txt"]
lengths = [32]
depths = [0, 400]

[[arms]]
name = "stock"
baseline = true
args = []

[[arms]]
name = "ub16"
args = ["-ub", "16"]
"""


def test_bench_at_a_depth_reuses_the_cached_tokens(tmp_path, tiny_model, llama_server_bin, subprocess_env):
    scenario = tmp_path / "depth.toml"
    scenario.write_text(textwrap.dedent(SCENARIO.format(prompts=(REPO / "benchmarks" / "prompts").as_posix())))
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "moecache", "bench", str(scenario), "--out", str(out)],
                       env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(next(out.glob("*-depth.json")).read_text())
    rows = data["results"]
    assert {(x["arm"], x.get("depth", 0), x["users"]) for x in rows} == {
        (a, d, u) for a in ("stock", "ub16") for d in (0, 400) for u in (1, 2)}
    for row in rows:
        assert not row.get("error"), row
        assert row["prompt_n"] == 32  # only the new tokens are prefilled, at depth too
        reqs = [q for s in row["samples"] for q in (s.get("requests") or [s])]
        if row.get("depth"):
            assert all(q["cache_n"] >= 400 for q in reqs), [q["cache_n"] for q in reqs]
            fill = row["depth_fill"]
            assert fill["tokens"] == 400 and fill["slots"] == 2 and fill["prefill_tps"] > 0
        else:
            assert all(not q.get("cache_n") for q in reqs)  # no prompt caching without a depth
    md = next(out.glob("*-depth.md")).read_text()
    assert "### `prose` prompt, 32 tokens at depth 400" in md
    assert "The 400 cached tokens, prefilled from an empty slot: stock" in md


def test_bench_copies_a_depth_to_the_other_slots(tmp_path, tiny_model, llama_server_bin, subprocess_env):
    # depth_fill = "copy": slot 0 prefills the depth, the server's slot copy fills slot 1,
    # and both users' requests reuse it
    text = SCENARIO.split("[[arms]]")[0].replace("depths = [0, 400]", "depths = [400]").replace(
        "users = [1, 2]", "users = [2]\ndepth_fill = \"copy\"")
    scenario = tmp_path / "copy.toml"
    scenario.write_text(textwrap.dedent(text.format(prompts=(REPO / "benchmarks" / "prompts").as_posix()))
                        + "[[arms]]\nname = \"stock\"\nbaseline = true\nargs = []\n")
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "moecache", "bench", str(scenario), "--out", str(out)],
                       env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(next(out.glob("*-depth.json")).read_text())["results"]
    assert not row.get("error"), row
    reqs = [q for s in row["samples"] for q in s["requests"]]
    assert len(reqs) == 4 and all(q["cache_n"] >= 400 for q in reqs), [q["cache_n"] for q in reqs]
    fill = row["depth_fill"]
    assert fill["fill"] == "copy" and fill["slots"] == 2 and fill["copy_ms"] > 0, fill
    assert "then slot 1 got slot 0's cache copied" in next(out.glob("*-depth.md")).read_text()
