"""The launcher checks llama-server's basic settings before starting anything: a port out of range made
llama-server listen on another port than the one it logged (and the launcher print a traceback), a
negative context size reached a GGML_ASSERT (exit 134)."""

from __future__ import annotations

import pytest

from moecache.options import check_basic_settings


@pytest.mark.parametrize("args,env,expect", [
    (["--port", "99999"], {}, "--port 99999 is not valid: a port is 1 to 65535"),
    (["--port=65536"], {}, "--port 65536 is not valid"),
    ([], {"LLAMA_ARG_PORT": "-1"}, "LLAMA_ARG_PORT=-1 is not valid"),
    (["-c", "-5"], {}, "-c -5 is not valid: the context size is a token count >= 0"),
    (["--ctx-size", "4294967296"], {}, "--ctx-size 4294967296 is not valid"),
    (["-ub", "0"], {}, "-ub 0 is not valid: the micro-batch size"),
    (["-b", "x"], {}, "-b x is not valid: the batch size"),
    (["-np", "0"], {}, "-np 0 is not valid: the slot count"),
    (["-t", "100000"], {}, "-t 100000 is not valid: the thread count"),
    (["-ngl", "most"], {}, "-ngl most is not valid: the GPU layers"),
])
def test_a_bad_basic_setting_is_named_with_its_fix(args, env, expect):
    msg = check_basic_settings(args, env)
    assert msg is not None and msg.startswith(expect), msg
    assert "Fix: e.g." in msg


@pytest.mark.parametrize("args,env", [
    ([], {}),
    (["--port", "0", "-c", "0", "-np", "-1", "-t", "0", "-ngl", "all"], {}),
    (["--port=8080", "-c", "32768", "-b", "2048", "-ub", "512", "-np", "4", "-t", "-1", "-ngl", "auto"], {}),
    ([], {"LLAMA_ARG_PORT": "8080", "LLAMA_ARG_CTX_SIZE": "0", "LLAMA_ARG_N_GPU_LAYERS": "99"}),
    (["--port", "8080"], {"LLAMA_ARG_PORT": "99999"}),  # the flag wins, as in llama-server
])
def test_good_settings_pass(args, env):
    assert check_basic_settings(args, env) is None
