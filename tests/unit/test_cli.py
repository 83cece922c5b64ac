"""The `moecache` command: --version, and one name in every usage line (`moecache <cmd>` when reached
through it, the console script's own name otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import moecache
from moecache import cli, info, server
from moecache.orchestrator import __main__ as build_main
from moecache.orchestrator.upstream import PIN


def _moecache(args, env):
    return subprocess.run([sys.executable, "-m", "moecache", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_version_prints_the_version_and_the_pin(subprocess_env):
    r = _moecache(["--version"], subprocess_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"moecache {moecache.__version__} (llama.cpp {PIN.commit})"
    assert r.stdout.strip() == info.version_line()


def test_info_starts_with_the_version_line(capsys, monkeypatch):
    monkeypatch.setattr(info, "collect", lambda: {
        "moecache": "x", "llama_cpp_commit": "y", "python": "3.x", "native_module": None,
        "native_error": "not built", "system_info": None, "gpu_offload": None, "devices": [],
        "buffer_types": [], "binaries": {}})
    info.main([])
    assert capsys.readouterr().out.startswith(info.version_line() + ", Python 3.x")


def test_help_lists_version(capsys):
    assert cli.main(["--help"]) == 0
    assert "--version" in capsys.readouterr().out


@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_usage_names_the_subcommand_as_it_was_reached(command, subprocess_env):
    r = _moecache([command, "--help"], subprocess_env)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"usage: moecache {command} "), first


def test_nested_usage_of_build_names_the_subcommand(subprocess_env):
    r = _moecache(["build", "apply", "--help"], subprocess_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: moecache build apply "), r.stdout.splitlines()[0]


def test_console_scripts_keep_their_own_names(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        build_main.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: moecache-build ")

    def missing():
        raise FileNotFoundError("llama-server was not found")

    monkeypatch.setattr(server, "_server_binary", missing)
    assert server.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: moecache-server ")
