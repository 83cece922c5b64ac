"""--host-hugepages on the CPU build: the weights' CPU buffers (-lm none: not a file mapping)
go on transparent huge pages and the server answers exactly as without them; the flag and its variable
are in --help; a bad value of the variable stops the server with an error that names it. The Python
Model says the switch is ignored without a GPU's pinned memory. (On the H200,
tests/gpu/test_host_hugepages_gpu.py checks the pinned host buffers.)
"""

from __future__ import annotations

import subprocess
import warnings

import pytest

from moe_cache_checks import PROMPTS, anon_huge_kb, complete, thp_mode
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
        base_kb = anon_huge_kb(srv.proc.pid)
    with ServerProcess(tiny_model, args=[*ARGS, "--host-hugepages"], timeout=120) as srv:
        assert [complete(srv, p)["tokens"] for p in PROMPTS] == base
        kb = anon_huge_kb(srv.proc.pid)
    with ServerProcess(tiny_model, args=ARGS, env={"LLAMA_ARG_HOST_HUGEPAGES": "1"}, timeout=120) as srv:
        assert [complete(srv, p)["tokens"] for p in PROMPTS] == base
        env_kb = anon_huge_kb(srv.proc.pid)
    if thp_mode() == "madvise":
        # the weights' buffer (about 20 MiB) is on huge pages only with the switch; with THP "always" both
        # are, with "never" neither
        assert kb >= base_kb + 4096 and env_kb >= base_kb + 4096, (kb, env_kb, base_kb)


def test_a_bad_value_of_the_variable_names_it(tiny_model):
    srv = ServerProcess(tiny_model, args=ARGS, env={"LLAMA_ARG_HOST_HUGEPAGES": "maybe"}, timeout=60)
    with pytest.raises(ServerError):
        srv.start()
    try:
        assert "LLAMA_ARG_HOST_HUGEPAGES" in srv.log_text()
    finally:
        srv.stop()
        srv.cleanup()


def test_python_model_says_hugepages_do_not_apply_to_a_file_mapping(tiny_model):
    with pytest.warns(RuntimeWarning, match="hugepages=True is ignored"):
        m = api.Model(tiny_model, cpu_moe=True, hugepages=True, repack=False)
    assert m.placement["hugepages"] is True
    assert any("hugepages" in n for n in m.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = api.Model(tiny_model, cpu_moe=True, hugepages=True, use_mmap=False, repack=False)
        repacked = api.Model(tiny_model, cpu_moe=True, hugepages=True)
    assert loaded.notes == [] and repacked.notes == []
