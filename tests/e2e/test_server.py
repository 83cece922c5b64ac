"""moecache-server end to end on loopback: the real llama-server with the tiny synthetic model.

Kept fast for 2-core machines: 2 threads, a 512-token context, a few short requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moecache.server import ServerError, ServerProcess, http_request

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["-t", "2", "-c", "512", "-np", "1", "-ngl", "0"]
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def srv(tiny_model, llama_server_bin):
    with ServerProcess(tiny_model, args=SERVER_ARGS, timeout=120) as s:
        yield s


def completion(srv, prompt=PROMPT, n_predict=16, **extra):
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, **extra}
    status, out = srv.post("/completion", body, timeout=120)
    assert status == 200, out
    return out


def test_health(srv):
    status, body = srv.get("/health")
    assert status == 200
    assert body == {"status": "ok"}


def test_openai_chat_completion_returns_text(srv):
    status, body = srv.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Name three sorting algorithms."}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    }, timeout=120)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert isinstance(msg["content"], str) and msg["content"].strip()
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] > 5


def test_openai_completion_returns_text(srv):
    status, body = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True}, timeout=120)
    assert status == 200, body
    assert body["object"] == "text_completion"
    text = body["choices"][0]["text"]
    assert isinstance(text, str) and text.strip()
    assert body["usage"]["completion_tokens"] == 8


def test_greedy_completion_is_deterministic(srv):
    a = completion(srv, ignore_eos=True)
    b = completion(srv, ignore_eos=True)
    assert len(a["tokens"]) == 16
    assert a["tokens"] == b["tokens"] and a["content"] == b["content"]
    # and it is the text the tokens spell, not an empty reply
    assert a["content"]
    assert a["timings"]["prompt_n"] > 5 and a["timings"]["predicted_n"] == 16


def test_a_bad_argument_gives_a_clear_error_with_the_log(tiny_model, llama_server_bin):
    s = ServerProcess(tiny_model, args=[*SERVER_ARGS, "--no-such-flag"], timeout=60)
    with pytest.raises(ServerError) as e:
        s.start()
    msg = str(e.value)
    assert "exited with status" in msg and "--no-such-flag" in msg
    assert s.proc.poll() is not None  # nothing left running
    s.cleanup()


def _launcher(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "moecache.server", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _wait_health(url, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if http_request(url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail("moecache-server did not become healthy")


def _port_is_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signals_and_shuts_down_gracefully(sig, tiny_model, llama_server_bin, free_port,
                                                             subprocess_env):
    port = free_port()
    proc = _launcher(["-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS],
                     subprocess_env)
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=15)
        assert rc == 0, proc.stdout.read()
        assert time.monotonic() - t0 < 10
        log = proc.stdout.read()
        assert "cleaning up before exit" in log  # llama-server's own graceful path ran
        deadline = time.monotonic() + 5
        while not _port_is_free(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _port_is_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_server_process_stop_is_graceful(tiny_model, llama_server_bin):
    s = ServerProcess(tiny_model, args=SERVER_ARGS).start()
    port = s.port
    t0 = time.monotonic()
    assert s.stop() == 0
    assert time.monotonic() - t0 < 10
    assert _port_is_free(port)
    s.cleanup()


def test_launcher_missing_model_is_a_clear_error(tmp_path, subprocess_env):
    missing = tmp_path / "missing.gguf"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "moecache.server", "-m", str(missing)], env=subprocess_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert str(missing) in r.stderr and "not found" in r.stderr
    assert "llama_model_load" not in r.stderr + r.stdout  # no server was started
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("args,env,expect", [
    (["--port", "99999"], {}, "--port 99999 is not valid"),
    (["-c", "-5"], {}, "-c -5 is not valid"),
    ([], {"LLAMA_ARG_PORT": "70000"}, "LLAMA_ARG_PORT=70000 is not valid"),
])
def test_launcher_refuses_basic_settings_out_of_range(tiny_model, subprocess_env, args, env, expect):
    """Before: --port 99999 printed a traceback from a thread while llama-server listened elsewhere, -c -5
    aborted in a GGML_ASSERT (exit 134). Now one line names the value and the fix, exit status 2, and no
    server starts."""
    r = subprocess.run([sys.executable, "-m", "moecache.server", "-m", str(tiny_model), *args],
                       env={**subprocess_env, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert expect in r.stderr and "Fix:" in r.stderr
    assert "Traceback" not in r.stderr and "llama_model_load" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_smoke_scenario_writes_md_and_json(tmp_path, tiny_model, llama_server_bin, subprocess_env):
    out = tmp_path / "results"
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "moecache", "bench", str(REPO / "benchmarks/scenarios/smoke.toml"),
                        "--out", str(out), "--server-logs", str(logs)],
                       env={**subprocess_env, "GGML_SCHED_TIMES": "4", "LLAMA_ARG_LOG_VERBOSITY": "4"},
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # --server-logs keeps each arm's log, with the per-backend times of every 4 graphs (GGML_SCHED_TIMES;
    # the library's info lines show from verbosity 4)
    assert sorted(p.name for p in logs.iterdir()) == ["smoke-ub32.log", "smoke-ub512.log"]
    for log in logs.iterdir():
        assert "ggml_sched_times: backend=CPU" in log.read_text(errors="replace"), log.name
    [md] = list(out.glob("*-smoke.md"))
    [js] = list(out.glob("*-smoke.json"))
    text = md.read_text()
    assert "prefill ratio" in text and "TTFT ratio" in text and "decode ratio" in text
    data = json.loads(js.read_text())
    assert data["ok"] is True and data["baseline"] == "ub512"
    assert data["model"]["synth"] == "tiny"
    assert data["llama_cpp_commit"] == "0c1e57098"
    rows = data["results"]
    assert {(r["arm"], r["prompt"], r["length"]) for r in rows} == {
        (a, p, n) for a in ("ub512", "ub32") for p, n in (("code", 256), ("prose", 128))}
    for row in rows:
        assert not row.get("error"), row
        assert row["prompt_n"] == row["length"]  # exact real-text prompt lengths
        assert row["predicted_n"] == 16
        for m in ("prefill_tps", "ttft_ms", "decode_tps"):
            assert row[m]["n"] == 2 and row[m]["median"] > 0
            assert row["ratios"][m] is not None and row["ratios"][m] > 0
        if row["arm"] == "ub512":
            assert row["ratios"] == {"prefill_tps": 1.0, "ttft_ms": 1.0, "decode_tps": 1.0, "aggregate_tps": 1.0}
    assert "-ub 32 -b 32" in " ".join(data["arms"][1]["command"])


def test_generate_matches_the_server(srv, tiny_model):
    """moecache.Model greedy generation == the server's /completion (same n_ctx, temperature 0)."""
    pytest.importorskip("moecache._core", reason="the compiled moecache._core is not importable")
    import moecache

    model = moecache.Model(str(tiny_model))
    ctx = model.context(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2)
    g = ctx.generate(PROMPT, max_tokens=16, temperature=0.0)
    out = completion(srv, n_predict=16)
    assert len(g.tokens) > 0
    assert g.tokens == out["tokens"]
    assert g.text == out["content"]


def _process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, Z, ...), None when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # after "pid (comm)": comm may hold spaces


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


# a bound for the wait, not a target: llama-server's graceful shutdown takes a fraction of it
GONE_WITHIN_S = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_killing_the_launcher_takes_llama_server_with_it(tiny_model, llama_server_bin, free_port, subprocess_env):
    port = free_port()
    proc = _launcher(["-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS],
                     subprocess_env)
    children = []
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc)
        children = _children(proc.pid)
        assert len(children) == 1, children
        [child] = children
        assert Path(f"/proc/{child}/comm").read_text().strip() == "llama-server"
        proc.send_signal(signal.SIGKILL)  # nothing can be forwarded now
        proc.wait(timeout=15)
        deadline = time.monotonic() + GONE_WITHIN_S
        while time.monotonic() < deadline and (_process_state(child) not in (None, "Z") or not _port_is_free(port)):
            time.sleep(0.1)
        assert _process_state(child) in (None, "Z"), \
            f"llama-server (pid {child}) outlived its killed launcher (state {_process_state(child)})"
        assert _port_is_free(port), f"port {port} is still taken after the launcher was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:  # an orphan left by a failure above
            if _process_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)


def test_verify_model_refuses_a_damaged_model(tmp_path, tiny_model, subprocess_env):
    """--verify-model reads every tensor first: 4 KiB overwritten in the middle of the weights (which llama.cpp
    loads and serves as nonsense) stops the start with exit status 2 and the report; an intact model passes the
    check (and would start)."""
    import random

    from moecache import check, gguf

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(tiny_model.read_bytes())
    with gguf.GGUFReader(damaged) as r:
        t = max(r.tensors, key=lambda x: x.nbytes)
        at = t.file_offset + t.nbytes // 2
    with open(damaged, "r+b") as f:
        f.seek(at)
        f.write(random.Random(5).randbytes(4096))
    r = subprocess.run([sys.executable, "-m", "moecache.server", "-m", str(damaged), "--verify-model"],
                       env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "DOES NOT MATCH" in r.stderr and "nothing was started" in r.stderr
    assert "llama_model_load" not in r.stderr + r.stdout
    assert check.check_model(tiny_model).ok
