"""--host-hugepages (patch 0075) where there is no pinned host memory: the CPU build's server takes the
flag and its variable, says what they do in --help, and answers exactly as without them; a bad value of
the variable stops the server with an error that names it. The Python Model says the switch is ignored
without a GPU. (On the H200, tests/gpu/test_host_hugepages_gpu.py checks the huge pages themselves.)
"""

from __future__ import annotations

import subprocess

import pytest

from moe_cache_checks import PROMPTS, complete
from moecache import api
from moecache.paths import binary
from moecache.server import ServerError, ServerProcess

ARGS = ["-t", "2", "-c", "512", "-np", "1", "--cpu-moe", "-lm", "none", "--no-webui"]


def test_help_names_the_flag_and_its_variable():
    out = subprocess.run([str(binary("llama-server")), "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=60).stdout
    assert "--host-hugepages, --no-host-hugepages" in out
    assert "LLAMA_ARG_HOST_HUGEPAGES" in out


def test_flag_and_variable_leave_the_output_unchanged(tiny_model):
    with ServerProcess(tiny_model, args=ARGS, timeout=120) as srv:
        base = [complete(srv, p)["tokens"] for p in PROMPTS]
    with ServerProcess(tiny_model, args=[*ARGS, "--host-hugepages"], timeout=120) as srv:
        assert [complete(srv, p)["tokens"] for p in PROMPTS] == base
    with ServerProcess(tiny_model, args=ARGS, env={"LLAMA_ARG_HOST_HUGEPAGES": "1"}, timeout=120) as srv:
        assert [complete(srv, p)["tokens"] for p in PROMPTS] == base


def test_a_bad_value_of_the_variable_names_it(tiny_model):
    srv = ServerProcess(tiny_model, args=ARGS, env={"LLAMA_ARG_HOST_HUGEPAGES": "maybe"}, timeout=60)
    with pytest.raises(ServerError):
        srv.start()
    try:
        assert "LLAMA_ARG_HOST_HUGEPAGES" in srv.log_text()
    finally:
        srv.stop()
        srv.cleanup()


def test_python_model_says_hugepages_need_pinned_gpu_memory(tiny_model):
    with pytest.warns(RuntimeWarning, match="hugepages=True is ignored"):
        m = api.Model(tiny_model, cpu_moe=True, hugepages=True)
    assert m.placement["hugepages"] is True
    assert any("hugepages" in n for n in m.notes)
