"""`moecache bench` asking the users' question against the real llama-server (tiny model, CPU, the library's
host test device as the GPU): an arm launched as moecache-server gets the flags moecache-server adds at start
(its default plan, the expert profile in the run's own folder), a restarted arm measures the first request of a
server that read the profile its first run wrote, and the report and the terminal give the ratios: prefill,
TTFT, the first request's and the warm decode against the baseline's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from moecache.plan import HOST_DEVICE_ENV, HOST_DEVICE_MIB_ENV, MiB, Request, make_plan

REPO = Path(__file__).resolve().parents[2]

SCENARIO = """
name = "vs"
model = {{ synth = "tiny" }}
max_tokens = 8
repetitions = 2
warmup = 0
prompts_dir = "{prompts}"
server_args = ["-t", "2", "-c", "512", "-np", "2"]
env = {{ {host} = "1", {mib} = "{budget}" }}
targets = {{ decode = 1.5, decode_floor = 1.0, first_over_warm = 0.9 }}

[[prompts]]
name = "prose"
files = ["prose/python-language-reference.txt"]
lengths = [48]

[[arms]]
name = "llama-server"
baseline = true
args = []

[[arms]]
name = "moecache-server"
launcher = "moecache-server"
restart = true
args = []
"""


def test_bench_launches_moecache_server_and_restarts_it(tmp_path, tiny_model, llama_server_bin, subprocess_env):
    # a budget that holds the context and a few slots, not the whole model: moecache-server plans
    env = {**os.environ, HOST_DEVICE_ENV: "1"}
    big = make_plan(Request(tiny_model, ctx=256, users=2, gpu_mem_gib=[4.0], swap=False), environ=env)
    d = big.devices[0]
    budget = (d.fixed + 6.5 * d.slot) / MiB
    scenario = tmp_path / "vs.toml"
    scenario.write_text(textwrap.dedent(SCENARIO.format(
        prompts=(REPO / "benchmarks" / "prompts").as_posix(), host=HOST_DEVICE_ENV, mib=HOST_DEVICE_MIB_ENV,
        budget=f"{budget:.6f}")))
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "moecache", "bench", str(scenario), "--out", str(out)],
                       env={**subprocess_env, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(next(out.glob("*-vs.json")).read_text())
    base, moe = data["arms"]
    assert base["launcher"] == "llama-server" and "plan_added" not in base
    # what moecache-server added: its plan's flags and a profile of the run's own, gone after the run
    added = moe["plan_added"]
    assert "--moe-cache-slots" in added and "--moe-cache-profile" in added, added
    profile = Path(added[added.index("--moe-cache-profile") + 1])
    assert profile.parent.parent == tmp_path and not profile.parent.exists()
    assert any(line.startswith("plan: routed experts in host memory") for line in moe["plan_lines"]), moe["plan_lines"]
    assert moe["server_args"][:len(added)] == added
    # the restart: a second start that read the first's profile, and its first request
    restart = moe["restart"]
    assert not restart.get("error") and restart["decode_tps"] > 0 and restart["predicted_n"] == 8, restart
    assert restart["moe_cache"]["uploads"] > 0  # the slots were filled from the profile or the request
    for row in data["results"]:
        assert not row.get("error"), row
        assert row["first_decode_tps"]["n"] == 1 and row["warm_decode_tps"]["n"] == 1
    md = next(out.glob("*-vs.md")).read_text()
    assert "### Against `llama-server`" in md
    assert "Arm `moecache-server` started as moecache-server, which said:" in md
    assert "| prose 48 | moecache-server |" in md
    # the scenario's targets, each with the moecache-server arm's worst case (met or not: the report's logic is
    # the unit tests'; here the table is made from a real run)
    assert "### Targets" in md
    targets = md[md.index("### Targets"):]
    row = next(line for line in targets.splitlines() if line.startswith("| moecache-server | "))
    assert len([c for c in row.strip("|").split("|")]) == 4, row
    # the same tables on the terminal
    assert "against the baseline arm 'llama-server'" in r.stdout and "| prose 48 | moecache-server |" in r.stdout
    assert "the scenario's targets" in r.stdout
