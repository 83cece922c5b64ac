"""moecache-server: our flags vs llama-server's, the model check, and what --demo passes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moecache import server


def test_passthrough_args_are_kept_verbatim_and_in_order():
    argv = ["-m", "x.gguf", "-ngl", "99", "-ot", "exps=CPU", "-c", "8192", "--port", "9000",
            "-fa", "on", "--temp", "-1", "-p", "a prompt with --demo inside"]
    ours, rest = server.split_args(argv)
    assert ours.demo is False and ours.help is False
    assert rest == argv


def test_our_flags_are_taken_out_wherever_they_are():
    ours, rest = server.split_args(["-ngl", "99", "--demo", "--port", "9001", "-t", "2"])
    assert ours.demo is True
    assert rest == ["-ngl", "99", "--port", "9001", "-t", "2"]


def test_llama_server_short_flags_that_start_with_h_are_not_help():
    # argparse would read `-hf` as `-h -f`; our parser has no -h option
    ours, rest = server.split_args(["-hf", "org/repo", "-hff", "file.gguf"])
    assert ours.help is False
    assert rest == ["-hf", "org/repo", "-hff", "file.gguf"]


def test_help_flags():
    assert server.split_args(["--help"])[0].help is True
    ours, rest = server.split_args(["-h", "-ngl", "1"])
    assert ours.help is True and rest == ["-ngl", "1"]


def test_our_flags_are_not_abbreviated():
    # `--de` must not silently become --demo; it stays for llama-server to judge
    ours, rest = server.split_args(["--de"])
    assert ours.demo is False and rest == ["--de"]


@pytest.mark.parametrize("args,value", [
    (["-m", "a.gguf"], "a.gguf"),
    (["--model", "b.gguf", "-ngl", "1"], "b.gguf"),
    (["--model=c.gguf"], "c.gguf"),
    (["-m", "a.gguf", "-m", "d.gguf"], "d.gguf"),  # the last one wins, as in llama-server
    (["-ngl", "1"], None),
    (["-m"], ""),
])
def test_find_model_flag(args, value):
    assert server.find_flag_value(args, server.MODEL_FLAGS) == value


def test_check_model_file(tmp_path):
    good = tmp_path / "ok.gguf"
    good.write_bytes(b"GGUF" + b"\0" * 60)
    assert server.check_model_file(good) is None

    msg = server.check_model_file(tmp_path / "missing.gguf")
    assert "not found" in msg and "missing.gguf" in msg and "Fix" in msg

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 zip, not gguf")
    msg = server.check_model_file(bad)
    assert "not a GGUF file" in msg and "bad.gguf" in msg

    msg = server.check_model_file(tmp_path)
    assert "directory" in msg


def _no_server(monkeypatch):
    """Make any attempt to start a process fail the test."""
    def boom(*a, **k):
        raise AssertionError(f"a process was started: {a}")

    monkeypatch.setattr(subprocess, "Popen", boom)
    monkeypatch.setattr(server, "run_forwarding", boom)


def test_missing_model_exits_2_without_starting_anything(tmp_path, monkeypatch, capsys):
    _no_server(monkeypatch)
    path = tmp_path / "missing.gguf"
    assert server.main(["-m", str(path), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not found" in err and "Fix" in err


def test_not_gguf_model_exits_2(tmp_path, monkeypatch, capsys):
    _no_server(monkeypatch)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 100)
    assert server.main(["--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a GGUF file" in err and str(path) in err


def test_demo_with_model_is_a_usage_error(tmp_path, monkeypatch, capsys):
    _no_server(monkeypatch)
    assert server.main(["--demo", "-m", "x.gguf"]) == 2
    assert "--demo" in capsys.readouterr().err


def test_demo_makes_the_model_once_and_serves_it_on_loopback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    made = []

    def fake_write_model(path, preset, seed, **kw):
        made.append((preset, seed))
        with open(path, "wb") as f:
            f.write(b"GGUF" + b"\0" * 60)
        return path

    import moecache.synth

    monkeypatch.setattr(moecache.synth, "write_model", fake_write_model)
    monkeypatch.setattr(server, "_server_binary", lambda: "llama-server")
    monkeypatch.setattr(server, "cuda_devices", lambda exe: [])
    runs = []
    monkeypatch.setattr(server, "run_forwarding",
                        lambda cmd, env=None, ready_url=None: runs.append((cmd, ready_url)) or 0)

    assert server.main(["--demo", "-t", "2"]) == 0
    assert server.main(["--demo", "--port", "9123", "--host", "0.0.0.0"]) == 0
    assert made == [("demo", 0)]  # cached: made once
    model = str(server.demo_model_path())
    assert model.startswith(str(tmp_path / "models"))

    cmd, ready = runs[0]
    assert ready == "http://127.0.0.1:8080"
    assert cmd[0] == "llama-server"
    assert cmd[cmd.index("-m") + 1] == model
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "8080"
    assert cmd[-2:] == ["-t", "2"]

    cmd, ready = runs[1]
    assert ready == "http://127.0.0.1:9123"  # 0.0.0.0 is polled on loopback
    assert cmd.count("--port") == 1 and cmd[cmd.index("--port") + 1] == "9123"
    assert cmd.count("--host") == 1 and cmd[cmd.index("--host") + 1] == "0.0.0.0"

    err = capsys.readouterr().err
    assert "http://127.0.0.1:8080" in err and "http://0.0.0.0:9123" in err
    assert "SYNTHETIC" in err and "gibberish" in err


def test_a_demo_model_of_an_older_generator_is_not_reused(tmp_path, monkeypatch):
    import moecache.synth

    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    old = server.demo_model_path()
    old.parent.mkdir(parents=True)
    old.write_bytes(b"GGUF" + b"\0" * 60)  # what the current generator cached
    monkeypatch.setattr(moecache.synth, "SYNTH_VERSION", moecache.synth.SYNTH_VERSION + 1)
    made = []

    def fake_write_model(path, preset, seed, **kw):
        made.append(Path(path))
        Path(path).write_bytes(b"GGUF" + b"\0" * 60)
        return path

    monkeypatch.setattr(moecache.synth, "write_model", fake_write_model)
    monkeypatch.setattr(server, "_server_binary", lambda: "llama-server")
    monkeypatch.setattr(server, "cuda_devices", lambda exe: [])
    runs = []
    monkeypatch.setattr(server, "run_forwarding", lambda cmd, env=None, ready_url=None: runs.append(cmd) or 0)
    assert server.main(["--demo"]) == 0
    assert made == [server.demo_model_path()] and made[0] != old  # the newer generator makes its own
    assert runs[0][runs[0].index("-m") + 1] == str(made[0])


def test_run_forwarding_returns_the_exit_code():
    assert server.run_forwarding(["sh", "-c", "exit 3"]) == 3
    assert server.run_forwarding(["sh", "-c", "kill -TERM $$"]) == 128 + 15


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_run_forwarding_child_dies_with_a_killed_parent(subprocess_env, tmp_path):
    # the child writes its pid, then waits on a signal; the parent is SIGKILLed: nothing is forwarded
    pid_file = tmp_path / "child.pid"
    child_script = f"import os, signal; open({str(pid_file)!r}, 'w').write(str(os.getpid())); signal.pause()"
    parent_script = ("import sys; from moecache.server import run_forwarding; "
                     f"run_forwarding([sys.executable, '-c', {child_script!r}])")
    parent = subprocess.Popen([sys.executable, "-c", parent_script], env=subprocess_env)
    child = None
    try:
        deadline = time.monotonic() + 60  # a bound on Python's start-up, not a target
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the child (pid {child}) outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (an orphan's zombie waits for its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_help_lists_our_flags_and_says_all_llama_server_flags_pass(monkeypatch, capsys):
    def missing():
        raise FileNotFoundError("llama-server was not found (build first)")

    monkeypatch.setattr(server, "_server_binary", missing)
    assert server.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--demo" in out
    assert "Every llama-server flag is accepted" in out
    assert "build first" in out  # tells how to get llama-server's own help


# --- --demo shows the hot-expert cache --------------------------------------------------------


@pytest.fixture
def demo_runs(tmp_path, monkeypatch):
    """main(["--demo", ...]) with a fake model, a fake binary and no process: the runs it asked for
    as (cmd, env, ready_url); set `cuda` on the returned list to fake the device list."""
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    model = server.demo_model_path()
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF" + b"\0" * 60)
    for var in (*server.CACHE_SIZE_ENV, *server.EXPERT_PLACEMENT_ENV, *server.REPACK_ENV, *server.METRICS_ENV,
                *server.MODEL_ENV, *server.HOST_ENV, *server.PORT_ENV, *server.CTX_ENV, server.HOST_DEVICE_ENV):
        monkeypatch.delenv(var, raising=False)

    class Runs(list):
        cuda: list[str] | None = []

    runs = Runs()
    monkeypatch.setattr(server, "_server_binary", lambda: "llama-server")
    monkeypatch.setattr(server, "cuda_devices", lambda exe: runs.cuda)
    monkeypatch.setattr(server, "run_forwarding",
                        lambda cmd, env=None, ready_url=None: runs.append((cmd, env, ready_url)) or 0)
    return runs


def _flag_value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_demo_on_a_cuda_machine_caches_hot_experts_on_the_gpu(demo_runs, capsys):
    demo_runs.cuda = ["CUDA0"]
    assert server.main(["--demo"]) == 0
    [(cmd, env, _)] = demo_runs
    assert "--cpu-moe" in cmd and "--no-repack" in cmd and "--metrics" in cmd
    assert _flag_value(cmd, "--moe-cache-slots") == "16"
    assert env is None  # the server's slots go to the GPU: nothing to add to the environment
    err = capsys.readouterr().err
    assert "http://127.0.0.1:8080/moe-cache" in err and "http://127.0.0.1:8080/metrics" in err
    assert "16 slots per layer on CUDA0" in err


def test_demo_without_cuda_uses_the_host_device(demo_runs, capsys, monkeypatch):
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    demo_runs.cuda = None  # the device list could not be read: no CUDA
    assert server.main(["--demo", "--port", "9001"]) == 0
    [(cmd, env, _)] = demo_runs
    assert "--cpu-moe" in cmd and "--no-repack" in cmd and _flag_value(cmd, "--moe-cache-slots") == "16"
    assert env[server.HOST_DEVICE_ENV] == "1"
    assert env["SOMETHING_ELSE"] == "kept"  # the rest of the environment passes through
    err = capsys.readouterr().err
    assert "http://127.0.0.1:9001/moe-cache" in err and "LLAMA_MOE_CACHE_HOST_DEVICE=1" in err


def test_tuning_the_cache_keeps_the_demos_slots(demo_runs):
    assert server.main(["--demo", "--moe-cache-policy", "lru", "--moe-cache-max-uploads", "4"]) == 0
    [(cmd, _, _)] = demo_runs
    assert _flag_value(cmd, "--moe-cache-slots") == "16"
    assert cmd[-4:] == ["--moe-cache-policy", "lru", "--moe-cache-max-uploads", "4"]


def test_demo_cache_flags_come_before_the_users_flags(demo_runs):
    assert server.main(["--demo", "-t", "2"]) == 0
    [(cmd, _, _)] = demo_runs
    assert cmd[-2:] == ["-t", "2"]
    assert cmd.index("--moe-cache-slots") < cmd.index("-t")


@pytest.mark.parametrize("user, absent", [
    (["--moe-cache-slots", "4"], ["16"]),
    (["--moe-cache-slots=0"], ["--moe-cache-slots"]),
    (["--moe-cache-size", "512"], ["--moe-cache-slots"]),
    (["--moe-cache-size=512"], ["--moe-cache-slots"]),
    (["--n-cpu-moe", "3"], ["--cpu-moe"]),
    (["-ot", "exps=CPU"], ["--cpu-moe"]),
    (["-cmoe"], ["--cpu-moe"]),
    (["--repack"], ["--no-repack"]),
    (["-nr"], ["--no-repack"]),
    (["--metrics"], []),
])
def test_the_users_own_flags_win(demo_runs, user, absent):
    assert server.main(["--demo", *user]) == 0
    [(cmd, _, _)] = demo_runs
    assert cmd[-len(user):] == user
    ours = cmd[:-len(user)]
    for a in absent:
        assert a not in ours, (a, cmd)
    assert cmd.count("--metrics") == 1


@pytest.mark.parametrize("var, value, absent", [
    ("LLAMA_ARG_MOE_CACHE_SLOTS", "4", "--moe-cache-slots"),
    ("LLAMA_ARG_MOE_HOT_K", "4", "--moe-cache-slots"),  # the old name of LLAMA_ARG_MOE_CACHE_SLOTS
    ("LLAMA_ARG_MOE_CACHE_SIZE", "256", "--moe-cache-slots"),
    ("LLAMA_ARG_N_CPU_MOE", "2", "--cpu-moe"),
    ("LLAMA_ARG_CPU_MOE", "1", "--cpu-moe"),
    ("LLAMA_ARG_OVERRIDE_TENSOR", "exps=CPU", "--cpu-moe"),
    ("LLAMA_ARG_REPACK", "1", "--no-repack"),
    ("LLAMA_ARG_NO_REPACK", "1", "--no-repack"),
    ("LLAMA_ARG_ENDPOINT_METRICS", "1", "--metrics"),
    ("LLAMA_ARG_HOST", "127.0.0.2", "--host"),
    ("LLAMA_ARG_PORT", "9555", "--port"),
    ("LLAMA_ARG_CTX_SIZE", "1024", "-c"),
])
def test_the_users_environment_wins(demo_runs, monkeypatch, var, value, absent):
    monkeypatch.setenv(var, value)
    assert server.main(["--demo"]) == 0
    [(cmd, _, _)] = demo_runs
    assert absent not in cmd, cmd


def test_the_demo_adds_its_listen_and_context_flags_when_nothing_decides_them(demo_runs):
    assert server.main(["--demo"]) == 0
    [(cmd, _, ready)] = demo_runs
    assert (_flag_value(cmd, "--host"), _flag_value(cmd, "--port"), _flag_value(cmd, "-c")) == \
        (server.DEFAULT_HOST, str(server.DEFAULT_PORT), str(server.DEMO_CTX))
    assert ready == f"http://{server.DEFAULT_HOST}:{server.DEFAULT_PORT}"


def test_the_banner_and_ready_url_show_the_port_and_host_of_the_environment(demo_runs, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_PORT", "9555")
    monkeypatch.setenv("LLAMA_ARG_HOST", "0.0.0.0")
    assert server.main(["--demo"]) == 0
    [(cmd, _, ready)] = demo_runs
    assert "--port" not in cmd and "--host" not in cmd
    assert ready == "http://127.0.0.1:9555"  # all addresses: polled on loopback
    err = capsys.readouterr().err
    assert "URL:   http://0.0.0.0:9555 " in err and "http://0.0.0.0:9555/moe-cache" in err
    assert ":8080" not in err


def test_flags_win_over_the_environment_in_the_banner_too(demo_runs, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_PORT", "9555")
    assert server.main(["--demo", "--port", "9556"]) == 0  # llama-server: a flag overrides its variable
    [(cmd, _, ready)] = demo_runs
    assert cmd.count("--port") == 1 and _flag_value(cmd, "--port") == "9556"
    assert ready.endswith(":9556")
    assert "9555" not in capsys.readouterr().err


def test_a_host_list_is_polled_on_its_first_address(demo_runs, monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_HOST", "127.0.0.3, 127.0.0.4")
    assert server.main(["--demo"]) == 0
    [(_, _, ready)] = demo_runs
    assert ready == f"http://127.0.0.3:{server.DEFAULT_PORT}"


def test_demo_with_a_model_in_the_environment_is_a_usage_error(demo_runs, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_MODEL", "mine.gguf")
    assert server.main(["--demo"]) == 2
    assert demo_runs == []
    err = capsys.readouterr().err
    assert "LLAMA_ARG_MODEL" in err and "mine.gguf" in err and "Fix" in err


def test_a_host_device_setting_of_the_user_is_kept(demo_runs, monkeypatch):
    monkeypatch.setenv(server.HOST_DEVICE_ENV, "0")
    assert server.main(["--demo"]) == 0
    [(_, env, _)] = demo_runs
    assert env is None  # the inherited environment, with the user's value


def test_cuda_devices_reads_the_device_list(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\necho 'ggml_cuda_init: found 2 CUDA devices' >&2\n"
                   "printf 'Available devices:\\n  CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)\\n"
                   "  CUDA1: NVIDIA H200 (143771 MiB, 142000 MiB free)\\n  BLAS: OpenBLAS (0 MiB, 0 MiB free)\\n'\n")
    exe.chmod(0o755)
    assert server.cuda_devices(exe) == ["CUDA0", "CUDA1"]
    exe.write_text("#!/bin/sh\nprintf 'Available devices:\\n  (none)\\n'\n")
    assert server.cuda_devices(exe) == []
    exe.write_text("#!/bin/sh\nexit 1\n")
    assert server.cuda_devices(exe) is None
    assert server.cuda_devices(tmp_path / "missing") is None
