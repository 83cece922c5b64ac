"""The CPU's experimental MUL_MAT_ID switches change how a decode step's expert rows are computed, not what:
- GGML_CPU_MMID_FLAT=1 splits the rows of one token's experts into one contiguous run per
  thread instead of a slice of every expert per thread; every row is still one thread's dot product;
- GGML_CPU_DOT_X4=1 computes four Q4_0 rows' dot products at once, each row with the one-row
  kernel's operations in the same order (checked to fail with two rows' results swapped).
So decode must be bit-identical to the stock path: the same tokens and the same log-probabilities, with the
experts in the model's buffers and with the hot-expert cache's expert tables (its banks on the host test
device). Whether they are faster is for the benchmarks (bench-cpu-mmid, run.sh cpu-mmid on the H200).

The same switches per context: llama_context_params.cpu_experts_flat / .cpu_experts_x4, the flags
--cpu-experts-flat / --cpu-experts-x4 (LLAMA_ARG_CPU_EXPERTS_FLAT / _X4) and the Python parameters of the same
names. Since the output cannot tell, the CPU backend says once, in an info line, which path the first decode
step with a switch on took, and the tests read it (checked to fail with the backend's value not passed on to
its plans).
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, assert_options_in_help, complete, logprobs, server_help
from moecache import api
from moecache.server import ServerProcess

ARGS = ["-t", "2", "-c", "1024", "-np", "1", "--no-repack", "--no-webui"]  # repacked experts take their own kernels
CACHE = ["--cpu-moe", "--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16"]


@pytest.mark.parametrize("switch,model", [("GGML_CPU_MMID_FLAT", "tiny_model"), ("GGML_CPU_DOT_X4", "tiny_q4_0")],
                         ids=["flat", "x4"])
@pytest.mark.parametrize("extra,env", [([], {}), (CACHE, {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"})],
                         ids=["experts", "cache-tables"])
def test_decode_with_the_switch_is_bit_identical(request, switch, model, extra, env):
    path = request.getfixturevalue(model)
    outs = {}
    for on in ("0", "1"):
        with ServerProcess(path, args=[*ARGS, *extra], env={**env, switch: on}, timeout=120) as srv:
            outs[on] = [complete(srv, p, n_predict=24) for p in PROMPTS]
    for a, b in zip(outs["0"], outs["1"]):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)


def said(log: str) -> list[str]:
    """The CPU backend's line on the path of a decode step's experts, as (split, dots)."""
    return re.findall(r"one token's experts \(q4_0\): (\w+) split of rows, ([\w-]+) dot products", log)


@pytest.mark.parametrize("args,env,path,lines", [
    ([], {}, [], []),
    (["--cpu-experts-flat", "--cpu-experts-x4"], {}, [("flat", "four-row")],
     ["one run of the experts' rows per thread", "four Q4_0 or MXFP4 rows' dot products at once"]),
    ([], {"LLAMA_ARG_CPU_EXPERTS_X4": "1"}, [("stock", "four-row")], ["four Q4_0 or MXFP4 rows' dot products at once"]),
    (["--cpu-experts-x4", "--no-cpu-experts-x4"], {}, [], []),
], ids=["off", "flags", "variable", "no-flag"])
def test_the_flags_reach_the_cpu_backend(tiny_q4_0, args, env, path, lines):
    """The flags and their variables turn the switches on for the server's CPU backend (the line of its first
    decode step says which path it took); the tokens and log-probabilities stay those of the stock path."""
    outs = {}
    for name, extra, extra_env in (("stock", [], {}), ("switched", args, env)):
        with ServerProcess(tiny_q4_0, args=[*ARGS, "-lv", "4", *extra], env={**extra_env, "GGML_CPU_MMID_FLAT": "0",
                                                                             "GGML_CPU_DOT_X4": "0"},
                           timeout=120) as srv:
            outs[name] = [complete(srv, p, n_predict=8) for p in PROMPTS]
            log = srv.log_text()
    assert said(log) == path, log[-3000:]
    for line in lines:
        assert f"the CPU's experts at decode: {line}" in log
    if not lines:
        assert "the CPU's experts at decode" not in log
    for a, b in zip(outs["stock"], outs["switched"]):
        assert a["tokens"] == b["tokens"] and logprobs(a) == logprobs(b)


def test_the_flags_and_their_variables_are_in_the_help(llama_server_bin):
    assert_options_in_help(server_help(llama_server_bin), api.CPU_EXPERT_OPTIONS)


def test_the_python_api_takes_them(core, tiny_q4_0, monkeypatch):
    """moecache.Model(...).context(cpu_experts_flat=True, cpu_experts_x4=True), or the LLAMA_ARG_ variables: the
    library says it set them on the CPU backend, the CPU backend that it took them, and the tokens are those
    without them."""
    import moecache
    from moecache import _core

    for var in ("LLAMA_ARG_CPU_EXPERTS_FLAT", "LLAMA_ARG_CPU_EXPERTS_X4", "LLAMA_ARG_CPU_EXPERTS_OVERLAP"):
        monkeypatch.delenv(var, raising=False)
    model = moecache.Model(tiny_q4_0, repack=False)  # the GGUF layout, where the four-row kernel applies
    kw = {"n_ctx": 512, "n_batch": 64, "n_ubatch": 32, "n_threads": 2}
    off = model.context(**kw)
    assert "the CPU's experts at decode" not in "\n".join(_core.log_tail(400))
    on = model.context(**kw, cpu_experts_flat=True, cpu_experts_x4=True, cpu_experts_overlap=True)
    tail = "\n".join(_core.log_tail(400))
    assert "the CPU's experts at decode: one run of the experts' rows per thread" in tail
    assert "the CPU's experts at decode: four Q4_0 or MXFP4 rows' dot products at once" in tail
    monkeypatch.setenv("LLAMA_ARG_CPU_EXPERTS_X4", "on")
    by_env = model.context(**kw)
    assert [c.cpu_expert_options for c in (off, on, by_env)] == [
        {"cpu_experts_flat": False, "cpu_experts_x4": False, "cpu_experts_overlap": False},
        {"cpu_experts_flat": True, "cpu_experts_x4": True, "cpu_experts_overlap": True},
        {"cpu_experts_flat": False, "cpu_experts_x4": True, "cpu_experts_overlap": False}]
    a, b, c = (ctx.generate(PROMPTS[0], max_tokens=8, temperature=0.0) for ctx in (off, on, by_env))
    assert a.tokens == b.tokens == c.tokens
    # the first decode step with a switch on (on's: off's took the stock path, which says nothing)
    assert said("\n".join(_core.log_tail(400))) == [("flat", "four-row")]
