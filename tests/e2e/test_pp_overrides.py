"""Pipeline parallelism with tensor overrides (--pp-overrides) through the real llama-server.

A layer split over two rpc-servers on loopback (two devices, as two GPUs would be). Upstream turns the
scheduler's pipeline parallelism off for any tensor override; with --pp-overrides it stays on where no
override puts a weight on the host that a GPU op would copy per ubatch: a get_rows table (token_embd),
or any weight with --no-op-offload. Expert weights on the host with op offload on still turn it off,
with a line that names the first one and the fix. Pipeline parallelism changes which buffers the
inputs are copied into, not what is computed: the output equals the same split without it, and one
device, bit for bit.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_cache_checks import (PROMPTS, assert_options_in_help, assert_same_outputs, complete, max_logprob_diff,
                              server_help)
from moecache.server import ServerProcess

PP_ON = "pipeline parallelism enabled"
KEPT = "pipeline parallelism kept with tensor overrides"
STAYS_OFF = "pipeline parallelism stays off: 3 tensor overrides put weights on the host"
EXPERTS_ON_HOST = r"blk\.1\.ffn_.*_exps=CPU"


def server_args(ports, *args, n_parallel=1, n_ctx=1024):
    rpc = ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports)] if ports else []
    # ubatches of 32 tokens: the prompts below take several, so ubatches overlap in the pipeline
    return ["-t", "2", "-c", str(n_ctx), "-np", str(n_parallel), "-ngl", "99", "-ub", "32", "-lv", "4", *rpc, *args]


def run(model, ports, *args, **env):
    with ServerProcess(model, args=server_args(ports, *args), env=env, timeout=180) as srv:
        outs = [complete(srv, p * 4, n_predict=16) for p in PROMPTS]
        log = srv.log_text()
    return outs, log


@pytest.fixture(scope="module")
def one_device(tiny_model):
    return run(tiny_model, [])[0]


@pytest.mark.parametrize("args,pp,line", [
    ((), True, None),  # no override: upstream's rule already keeps it
    (("-ot", EXPERTS_ON_HOST), False, None),  # upstream: any override turns it off
    (("-ot", EXPERTS_ON_HOST, "--pp-overrides"), False, STAYS_OFF),
    (("-ot", EXPERTS_ON_HOST, "--pp-overrides", "--no-op-offload"), True, "op offload is off"),
    (("-ot", "token_embd=CPU", "--pp-overrides"), True, "none puts a weight on the host"),
])
def test_pipeline_parallelism_with_overrides_and_the_same_output(tiny_model, rpc_servers, one_device, args, pp, line):
    outs, log = run(tiny_model, rpc_servers(2), *args)
    assert (PP_ON in log) == pp, log[-3000:]
    if line:
        assert line in log
    if "--pp-overrides" not in args:
        assert KEPT not in log and "stays off" not in log  # the switch off: upstream's rule alone
    assert_same_outputs(one_device, outs)


def test_the_switch_reads_its_environment_variable(tiny_model, rpc_servers):
    _, log = run(tiny_model, rpc_servers(2), "-ot", "token_embd=CPU", LLAMA_ARG_PP_OVERRIDES="1")
    assert KEPT in log and PP_ON in log


def test_the_flag_and_its_variable_are_in_the_help(llama_server_bin):
    from moecache import api

    assert_options_in_help(server_help(llama_server_bin), api.MULTI_GPU_OPTIONS)


def test_the_python_api_takes_it(core, tiny_model, monkeypatch):
    """moecache.Model(..., tensor_overrides=...).context(pp_overrides=True), or LLAMA_ARG_PP_OVERRIDES: on one
    device there is no pipeline, so the tokens are those without it."""
    import moecache

    monkeypatch.delenv("LLAMA_ARG_PP_OVERRIDES", raising=False)
    model = moecache.Model(tiny_model, tensor_overrides="token_embd=CPU")
    kw = {"n_ctx": 512, "n_batch": 64, "n_ubatch": 32, "n_threads": 2}
    on = model.context(**kw, pp_overrides=True)
    off = model.context(**kw)
    monkeypatch.setenv("LLAMA_ARG_PP_OVERRIDES", "1")
    by_env = model.context(**kw)
    assert (on.multi_gpu_options["pp_overrides"], off.multi_gpu_options["pp_overrides"],
            by_env.multi_gpu_options["pp_overrides"]) == (True, False, True)
    a, b, c = (ctx.generate(PROMPTS[0], max_tokens=8, temperature=0.0) for ctx in (on, off, by_env))
    assert a.tokens == b.tokens == c.tokens


def test_five_sessions_over_the_pipelined_split_equal_their_solo_runs(tiny_model, rpc_servers):
    """Five requests at once over the layer split with the pipeline (-np 5, a KV stream each): multi-sequence
    ubatches in flight on two devices. Each request's tokens equal its solo run on the same server; the
    log-probabilities within the bound of a batch's other matmul shapes (as for five sessions elsewhere)."""
    args = server_args(rpc_servers(2), "-no-kvu", "-ot", "token_embd=CPU", "--pp-overrides", n_parallel=5,
                       n_ctx=2560)
    prompts = [PROMPTS[i % 2] * (i + 1) for i in range(5)]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        solo = [complete(srv, p, n_predict=24) for p in prompts]
        with ThreadPoolExecutor(5) as pool:
            together = list(pool.map(lambda p: complete(srv, p, n_predict=24), prompts))
        log = srv.log_text()
    assert PP_ON in log
    for a, b in zip(solo, together):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 2e-2
