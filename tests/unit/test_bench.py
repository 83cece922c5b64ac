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
    def row(arm, prompt, length, p, t, d):
        return {"arm": arm, "prompt": prompt, "length": length,
                "prefill_tps": stats.summarize([p]), "ttft_ms": stats.summarize([t]),
                "decode_tps": stats.summarize([d])}

    rows = [row("b", "code", 8, 100, 40, 10), row("x", "code", 8, 300, 20, 5),
            row("b", "code", 16, 50, 80, 10), row("x", "code", 16, 100, 160, 20),
            {"arm": "y", "prompt": "code", "length": 8, "error": "boom"}]
    stats.add_ratios(rows, "b")
    assert rows[0]["ratios"] == {"prefill_tps": 1.0, "ttft_ms": 1.0, "decode_tps": 1.0}
    assert rows[1]["ratios"] == {"prefill_tps": 3.0, "ttft_ms": 2.0, "decode_tps": 0.5}
    assert rows[3]["ratios"] == {"prefill_tps": 2.0, "ttft_ms": 0.5, "decode_tps": 2.0}
    assert rows[4]["ratios"] == {"prefill_tps": None, "ttft_ms": None, "decode_tps": None}


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
    assert cells[4:] == ["2.00x", "2.00x", "2.00x"]
    base = next(line for line in results.splitlines() if line.startswith("| stock (baseline) |"))
    assert base.rstrip().endswith("| 1.00x | 1.00x | 1.00x |")
    assert "server exited with status 1" in text


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
"""Stands in for llama-server: /health, /props, /tokenize, /completion (stream and not)."""
import json, os, sys, time, signal
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
n_ctx = int(arg("-c", "4096"))
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if self.path == "/health": self.reply({"status": "ok"})
        elif self.path == "/props": self.reply({"default_generation_settings": {"n_ctx": n_ctx}})
        elif self.path == "/moe-cache" and arg("--moe-cache-slots"):
            slots = int(arg("--moe-cache-slots"))
            self.reply({"enabled": slots > 0, "config": {"n_slots": slots, "policy": "freq"},
                        "total": {"hits": 75, "misses": 25, "hit_rate": 0.75, "hit_rate_recent": 0.8,
                                  "uploads": 40, "bytes_uploaded": 40 << 20, "evictions": 8,
                                  "step_ms_max": 0.25, "bytes_vram": slots * 4 << 20},
                        "layers": []})
        else: self.reply({"error": "no"}, 404)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self.reply({"tokens": [ord(c) for c in body["content"]]}); return
        n = len(body["prompt"]); k = body["n_predict"]
        assert body["temperature"] == 0 and body["cache_prompt"] is False
        timings = {"prompt_n": n, "cache_n": 0, "prompt_ms": n / 10 * slow, "prompt_per_second": 10000 / slow,
                   "predicted_n": k, "predicted_ms": k * 2 * slow, "predicted_per_second": 500 / slow}
        if not body.get("stream"):
            self.reply({"content": "x" * k, "tokens": [1] * k, "timings": timings}); return
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        self.wfile.write(b'data: {"content": "", "tokens": []}\n\n'); self.wfile.flush()
        time.sleep(0.02 * slow)
        self.wfile.write(b'data: {"content": "x", "tokens": [7]}\n\n')
        self.wfile.write(('data: ' + json.dumps({"content": "", "stop": True, "timings": timings}) + '\n\n').encode())
        self.wfile.flush()
srv = ThreadingHTTPServer((arg("--host"), int(arg("--port"))), H)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
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

    calls = [json.loads(line) for line in fake_server_bin.read_text().splitlines()]
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
        "step_ms_max": 0.25, "n_slots": 16, "bytes_vram": 64 << 20}
    [md] = list(out.glob("*-t.md"))
    text = md.read_text()
    assert "| hit rate | cache MiB |" in text
    small = next(line for line in text.splitlines() if line.startswith("| small | `"))
    assert "| 75.0% | 64.0 |" in small


def test_moe_cache_summary_reads_the_totals():
    assert runner.moe_cache_summary(None) is None
    assert runner.moe_cache_summary("not json") is None
    assert runner.moe_cache_summary({"enabled": False, "total": {"hit_rate": 0.5}}) is None
    assert runner.moe_cache_summary({"total": {"hit_rate": 0.5}}) is None  # "enabled" must say so
    s = runner.moe_cache_summary({"enabled": True, "n_slots": 8,
                                  "total": {"hit_rate": 0.5, "uploads": 3, "bytes_vram": 1024, "evictions": True}})
    assert s == {"hit_rate": 0.5, "hit_rate_recent": None, "uploads": 3, "bytes_uploaded": None,
                 "evictions": None, "step_ms_max": None, "n_slots": 8, "bytes_vram": 1024}
    # flat answers (no "total") work too; "config" fills what the totals lack
    flat = runner.moe_cache_summary({"enabled": True, "hit_rate": 0.9, "config": {"n_slots": 4}})
    assert flat["hit_rate"] == 0.9 and flat["n_slots"] == 4
    assert set(flat) == set(runner.MOE_CACHE_FIELDS)


def test_report_shows_the_expert_cache_only_when_an_arm_has_one():
    run = fake_run()
    text = report.render_markdown(run)
    assert "hit rate" not in text and "cache MiB" not in text and "Expert cache" not in text
    assert "| arm | server args | env | note |" in text

    run["arms"][1]["moe_cache"] = {"hit_rate": 0.8125, "hit_rate_recent": 0.9, "uploads": 1200,
                                   "bytes_uploaded": 3 * 2**30, "evictions": 900, "step_ms_max": 0.42,
                                   "n_slots": 32, "bytes_vram": 1536 * 2**20}
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
        "fast", "81.2%", "90.0%", "1200", "3072.0", "900", "32", "1536.0", "0.42"]
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
