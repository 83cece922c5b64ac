"""`moecache plan` against the real llama-server on the CPU, with the library's host test device as the
GPU (LLAMA_MOE_CACHE_HOST_DEVICE=1, its size LLAMA_MOE_CACHE_HOST_DEVICE_MIB): the plan's figures come
from llama-server --memory-probe (a no_alloc model and context) and must be what the server then
allocates: its KV buffer, its compute buffer and its slot banks, and the slot count, which must survive
a prompt that swaps (the swap's restore used to reserve larger decode buffers and lose a slot).
`moecache-server --plan auto` applies the plan; a budget that cannot hold the context says what to change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_cache_checks import N_EXPERT, cache_stats, complete
from moecache.plan import HOST_DEVICE_ENV, HOST_DEVICE_MIB_ENV, MiB, PlanError, Request, make_plan, probe
from moecache.server import ServerProcess

HOST = {HOST_DEVICE_ENV: "1"}
CTX, USERS, UB = 256, 2, 64
SLOTS = 9  # the budget holds the context and 9.5 slots


def _request(model, **kw):
    return Request(model, ctx=CTX, users=USERS, ubatch=UB, **kw)


@pytest.fixture(scope="module")
def budget(tiny_model, llama_server_bin):
    """A host test device that holds the planned context, the headroom and 9.5 slots (MiB)."""
    env = {**os.environ, **HOST}
    big = make_plan(_request(tiny_model, gpu_mem_gib=[4.0], swap=False), environ=env)
    d = big.devices[0]
    assert d.slot > 0 and d.n_moe_layers == 4 and big.slots == N_EXPERT
    return (d.fixed + (SLOTS + 0.5) * d.slot) / MiB


def _mib(pattern: str, log: str) -> list[float]:
    return [float(m) for m in re.findall(pattern + r" =\s+([0-9.]+) MiB", log)]


def test_the_plan_is_what_the_server_allocates(tiny_model, budget):
    env = {**os.environ, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    plan = make_plan(_request(tiny_model), environ=env)
    d = plan.devices[0]
    assert plan.host_test_device and plan.slots == SLOTS and plan.prefill_ubatch == 4 * UB, plan.render()
    args = ["-t", "2", *plan.args(), "--prefill-min-tokens", "128", "-lv", "4"]  # -lv 4: the buffer sizes
    with ServerProcess(tiny_model, args=args, env={**HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}, timeout=120) as srv:
        before = cache_stats(srv)
        out = complete(srv, "hello world " * 90, n_predict=4)  # 181 tokens: a prompt that swaps
        after = cache_stats(srv)
        log = srv.log_text()
    assert out["timings"]["prompt_n"] >= 128
    assert "prefill swap" in log
    # the slots the plan made room for, before and after a swapped prompt
    assert before["n_slots"] == plan.slots and after["n_slots"] == plan.slots, (before["n_slots"], after["n_slots"])
    assert before["total"]["bytes_vram"] == plan.slots * d.slot
    # the server's own report of its buffers (llama.cpp's load log, 2 decimals of MiB)
    assert _mib("CPU KV buffer size", log) == [round(d.context / MiB, 2)], [l for l in log.splitlines() if "buffer" in l]
    compute = _mib("CPU compute buffer size", log)
    assert compute[0] == round(d.compute / MiB, 2), compute  # the stock graphs the banks are sized after
    assert round(d.prefill_compute / MiB, 2) in compute  # the swap's, at the planned ubatch
    assert _mib("CPU slot banks", log) == [round(plan.slots * d.slot / MiB, 2)]


def test_the_json_and_the_command_line_agree(tiny_model, budget, subprocess_env):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    r = subprocess.run([sys.executable, "-m", "moecache.plan", str(tiny_model), "--ctx", str(CTX), "--users",
                        str(USERS), "--ubatch", str(UB)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"--moe-cache-slots {SLOTS}" in r.stdout and "--prefill-ubatch 256" in r.stdout
    assert f"-c {CTX * USERS} -np {USERS} -ub {UB}" in r.stdout and "KV cache" in r.stdout


def test_a_budget_below_the_context_says_what_to_change(tiny_model, subprocess_env):
    env = {**subprocess_env, **HOST}
    r = subprocess.run([sys.executable, "-m", "moecache.plan", str(tiny_model), "--ctx", str(CTX), "--users",
                        str(USERS), "--gpu-mem", "0.5"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "over the 512.0 MiB budget" in r.stderr and "Fix: lower --ctx or --users" in r.stderr


def test_a_probe_that_fails_names_the_problem(tiny_model, llama_server_bin, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(PlanError, match="could not make the model and context"):
        probe(bad, ["-ngl", "99"])
    with pytest.raises(PlanError, match="could not make the model and context"):
        probe(tiny_model, ["--no-such-flag"])


def test_the_probe_loads_nothing_and_opens_no_port(tiny_model, llama_server_bin):
    """--memory-probe answers without binding (port 1 is not ours to bind) and without reading weights."""
    p = probe(tiny_model, ["-ngl", "99", "--port", "1"])
    assert p["n_expert"] == N_EXPERT and p["n_expert_used"] == 4 and p["host"]["model"] > 0


def test_the_probe_fails_where_the_server_would(tiny_model, llama_server_bin, tmp_path):
    """A routing trace counts (its read-back enlarges the graphs), so the probe opens it as the server
    does: one that cannot be written fails the probe, naming the file."""
    with pytest.raises(PlanError, match="cannot open the routing trace file"):
        probe(tiny_model, ["-ngl", "99", "--moe-routing-trace", str(tmp_path / "missing" / "trace.jsonl")])
    plain = probe(tiny_model, ["-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "256"])
    traced = probe(tiny_model, ["-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "256"], routing_readback=True)
    assert traced["host"]["compute"] > plain["host"]["compute"]


def _launch(args, env, port, query="/moe-cache"):
    """moecache-server with `args` until healthy: (status and JSON of `query`, its whole output)."""
    from moecache.server import http_request
    import time

    proc = subprocess.Popen([sys.executable, "-m", "moecache.server", *args, "-t", "2",
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if http_request(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        answer = http_request(f"http://127.0.0.1:{port}{query}")
    finally:
        proc.terminate()
        text = proc.communicate(timeout=30)[0]
    return answer, text


def _plan_lines(text):
    return [line for line in text.splitlines() if line.startswith("moecache-server: plan:")]


PLANNED = ("-ngl 99 -b 2048 --cpu-moe --no-repack -lm none --host-hugepages --cpu-experts-flat --cpu-experts-x4 "
           f"--cpu-experts-overlap --moe-cache-slots {SLOTS} --moe-cache-warm-prompts --prefill-ubatch 256 "
           "--prefill-restore-wait 1000 --moe-cache-profile ")


def test_moecache_server_plan_auto(tiny_model, budget, subprocess_env, free_port):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    (status, st), text = _launch(["--plan", "auto", "-m", str(tiny_model), "-c", str(CTX * USERS),
                                  "-np", str(USERS), "-ub", str(UB)], env, free_port())
    assert status == 200 and st["n_slots"] == SLOTS, st
    # the user's -c, -np and -ub stay theirs; the plan adds the rest, and --plan auto prints its table
    assert f"added: {PLANNED}" in text and "command:" in text, text


def test_a_moe_that_does_not_fit_is_planned_by_default(tiny_model, budget, subprocess_env, free_port):
    """No --plan: the same plan, said in two lines (what and why), not the whole table."""
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    (status, st), text = _launch(["-m", str(tiny_model), "-c", str(CTX * USERS), "-np", str(USERS), "-ub", str(UB)],
                                 env, free_port())
    assert status == 200 and st["n_slots"] == SLOTS, st
    lines = _plan_lines(text)
    assert len(lines) == 2, text
    assert f"added: {PLANNED}" in lines[0] and f"{SLOTS} of {N_EXPERT} experts per layer" in lines[0]
    assert "why: the model" in lines[1] and "--plan off" in lines[1]
    assert "command:" not in text


@pytest.mark.parametrize("how", ["flag", "env"])
def test_plan_off_is_llama_servers_placement(tiny_model, budget, subprocess_env, free_port, how):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    args = ["-m", str(tiny_model), "-c", str(CTX * USERS), "-np", str(USERS), "-ub", str(UB)]
    if how == "flag":
        args = ["--plan", "off", *args]
    else:
        env["LLAMA_ARG_PLAN"] = "off"
    (status, st), text = _launch(args, env, free_port())
    assert not _plan_lines(text), text
    assert status == 200 and not st.get("n_slots"), st  # no cache: llama-server's placement


def test_your_flags_win_over_the_default_plan(tiny_model, budget, subprocess_env, free_port):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}", "LLAMA_ARG_UBATCH": str(UB)}
    (status, st), text = _launch(["-m", str(tiny_model), "-c", str(CTX * USERS), "-np", str(USERS),
                                  "--moe-cache-slots", "3", "--no-host-hugepages"], env, free_port())
    assert status == 200 and st["n_slots"] == 3, st
    added = _plan_lines(text)[0].split("added: ")[1]
    assert "--moe-cache-slots" not in added.split() and "--host-hugepages" not in added and "-ub" not in added.split()
    assert "--cpu-moe" in added


def test_a_default_plan_that_cannot_be_made_starts_as_llama_server(tiny_model, subprocess_env, free_port):
    """--plan auto stops (below); without --plan the server starts with llama-server's placement and says why."""
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: "100"}
    (status, _), text = _launch(["-m", str(tiny_model)], env, free_port(), query="/health")
    lines = _plan_lines(text)
    assert status == 200 and len(lines) == 1 and "plan: none, llama-server's own placement (" in lines[0], text


def test_a_dense_model_is_not_planned(gemma_model, subprocess_env, free_port):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: "100"}
    (status, _), text = _launch(["-m", str(gemma_model), "-c", "512"], env, free_port(), query="/health")
    assert status == 200 and not _plan_lines(text), text


def test_plan_auto_that_cannot_fit_stops_before_starting(tiny_model, subprocess_env):
    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: "100"}
    r = subprocess.run([sys.executable, "-m", "moecache.server", "--plan", "auto", "-m", str(tiny_model)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--plan auto:" in r.stderr and "Fix:" in r.stderr


BENCH = """
name = "planned"
model = {{ synth = "tiny" }}
max_tokens = 8
repetitions = 1
warmup = 0
prompts_dir = "{prompts}"
server_args = ["-t", "2", "-c", "512", "-np", "2", "-ub", "64"]
env = {{ LLAMA_MOE_CACHE_HOST_DEVICE = "1", LLAMA_MOE_CACHE_HOST_DEVICE_MIB = "{budget:.6f}" }}

[[prompts]]
name = "prose"
files = ["prose/python-language-reference.txt"]
lengths = [32]

[[arms]]
name = "stock"
baseline = true
args = ["-ngl", "99", "--cpu-moe"]

[[arms]]
name = "planned"
plan = true
plan_measure = true
args = []
"""


def test_a_bench_arm_the_plan_completes(tmp_path, tiny_model, budget, subprocess_env):
    """`plan = true` in a scenario's arm: `moecache plan` completes its flags before its server starts; the
    result records the plan, and the report lists it beside the measured rates."""
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    scenario = tmp_path / "planned.toml"
    scenario.write_text(BENCH.format(prompts=(repo / "benchmarks" / "prompts").as_posix(), budget=budget))
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "moecache", "bench", str(scenario), "--out", str(out)],
                       env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(next(out.glob("*-planned.json")).read_text())
    arm = {a["name"]: a for a in data["arms"]}["planned"]
    assert arm["plan"]["slots"] == SLOTS and "--moe-cache-slots" in arm["plan"]["added"]
    assert arm["server_args"][:len(arm["plan"]["added"])] == arm["plan"]["added"]
    assert arm["moe_cache"]["n_slots"] == SLOTS
    # plan_measure: the plan's own measurement of the planned command, at the scenario's prompt and max_tokens
    m = arm["plan"]["measured"]
    assert m["prompt_tokens"] == 32 and m["decode_tokens"] == 8 and m["decode_tps"] > 0 and m["prefill_tps"] > 0
    assert m["text"] == "given"  # the scenario's prompt text, as the arm's requests
    # and the arm's own protocol (its first prompt again each time), beside it in the report
    assert len(m["repeated"]["samples"]["decode_tps"]) == 2 and m["repeated"]["decode_tps"] > 0
    md = next(out.glob("*-planned.md")).read_text()
    assert "### Plans" in md and f"--moe-cache-slots {SLOTS}" in md
    assert "timed the arm's protocol too" in md
    # and its plots, where matplotlib is installed (the test extra has it)
    pytest.importorskip("matplotlib")
    assert sorted(p.rsplit("-planned-", 1)[1] for p in data["plots"]) == ["hit-rate.png", "rates.png"]
    for name in data["plots"]:
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and f"![{name}]({name})" in md


def test_the_plan_measures_its_own_command(tiny_model, budget, subprocess_env):
    """--measure starts the planned server and times it on real text: the medians of the server's own
    timings and the cache's hit rate over the timed requests; a prompt the context cannot hold is refused."""
    import json

    env = {**subprocess_env, **HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}"}
    base = [sys.executable, "-m", "moecache.plan", str(tiny_model), "--ctx", str(CTX), "--users", str(USERS),
            "--ubatch", str(UB), "--bandwidth", "none", "--measure"]
    r = subprocess.run([*base, "--prompt-tokens", "128", "--json"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    m = plan["measured"]
    assert plan["slots"] == SLOTS and m["prompt_tokens"] == 128 and m["decode_tokens"] == 64 and m["reps"] == 2
    assert m["prefill_tps"] > 0 and m["decode_tps"] > 0 and len(m["samples"]["decode_tps"]) == 2
    assert 0.0 < m["hit_rate"] <= 1.0 and m["text"] == "bundled"
    text = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "code" / "heapq.py"
    r = subprocess.run([*base, "--prompt-tokens", "128", "--measure-text", str(text), "--json"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["measured"]["text"] == "given"
    r = subprocess.run([*base, "--prompt-tokens", "1000"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "do not fit in 256 tokens of context per user" in r.stderr


def test_a_probe_without_a_model_is_an_error(llama_server_bin):
    """Without -m llama-server would start its router and listen: --memory-probe refuses instead."""
    r = subprocess.run([str(llama_server_bin), "--memory-probe", "-"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--memory-probe needs a model" in (r.stdout + r.stderr)


def test_the_python_api_loads_what_the_server_plans(tiny_model, budget, monkeypatch):
    """moecache.load: the plan's placement and cache as Model/Context settings; your options win; without a
    GPU (no test device either) it loads on the CPU with a warning."""
    import warnings

    import moecache

    monkeypatch.setenv(HOST_DEVICE_ENV, "1")
    monkeypatch.setenv(HOST_DEVICE_MIB_ENV, f"{budget:.6f}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pinned=True without a GPU: the test device is host memory
        model, ctx = moecache.load(tiny_model, n_ctx=CTX * USERS, n_ubatch=UB, n_threads=2)
    assert ctx.plan is not None and ctx.plan.slots > 0
    assert model.placement["cpu_moe"] and not model.placement["repack"]
    assert ctx.expert_cache.stats()["n_slots"] == ctx.plan.slots
    assert ctx.prefill_swap.enabled == bool(ctx.plan.prefill_ubatch)
    assert len(ctx.generate("Hello", max_tokens=8).tokens) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _, mine = moecache.load(tiny_model, n_ctx=CTX * USERS, n_ubatch=UB, n_threads=2, moe_cache_slots=2)
    assert mine.expert_cache.stats()["n_slots"] == 2
    monkeypatch.delenv(HOST_DEVICE_ENV)
    if not moecache.native_module().have_gpu():
        with pytest.warns(RuntimeWarning, match="no GPU"):
            _, plain = moecache.load(tiny_model, n_ctx=512, n_threads=2)
        assert plain.plan is None and not plain.expert_cache.enabled
    with pytest.raises(ValueError, match="plan must be"):
        moecache.load(tiny_model, plan="yes")


@pytest.mark.parametrize("miss", [["--moe-cache-miss", "gpu"], ["--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", "30"],
                                  ["--moe-cache-miss", "split", "--moe-cache-miss-split-pct", "31"]])
def test_the_planned_combination_with_the_misses_on_the_device(tiny_model, budget, tmp_path, miss):
    """What the plan gives a GPU machine now: the cache with warm prompts, the prefill swap, the expert profile
    and the misses placed by the cost model (gpu, auto with its crossover, or split at its share), together. On the
    host test device the misses on the device compute what the CPU's would, so a prompt that swaps and the decode
    after it give the tokens and log-probabilities of the same plan with the misses on the CPU; so does a restart that
    reads the profile the first start wrote."""
    from moe_cache_checks import logprobs

    env = {**HOST, HOST_DEVICE_MIB_ENV: f"{budget:.6f}", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
    plan = make_plan(_request(tiny_model), environ={**os.environ, **env})
    profile = tmp_path / "experts.profile"
    prompts = ["hello world " * 90, "def f(x):\n    return x * 2\n" * 4]  # 181 tokens (swapped), then a short one

    def serve(extra):
        args = ["-t", "2", *plan.args(), "--prefill-min-tokens", "128", *extra]
        with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
            outs = [complete(srv, p, n_predict=12) for p in prompts]
            st = cache_stats(srv)
            log = srv.log_text()
            srv.stop()
        return outs, st, log

    ref, _, _ = serve([])
    outs, st, log = serve([*miss, "--moe-cache-profile", str(profile)])
    assert outs[0]["timings"].get("prefill_ubatch") == plan.prefill_ubatch and st["warm_prompts"] and st["profile"]
    assert st["total"]["n_miss_device"] > 0 if miss[1] == "gpu" else st["miss"] == miss[1], st["total"]
    again, st2, log2 = serve([*miss, "--moe-cache-profile", str(profile)])
    assert st2["profile_uploads"] > 0 and "is ignored" not in log2
    for a, b, c in zip(ref, outs, again):
        assert a["tokens"] == b["tokens"] == c["tokens"]
        assert logprobs(a) == logprobs(b) == logprobs(c)
