"""QSA's block-level top-k (--qsa-block-topk) through the real llama-server on the CPU.

tiny-qwen4exp-8l's QSA layers select 8 cells in whole blocks of 4 plus the incomplete tail: a width of
11 cells per token. With the flag each QSA layer ranks its blocks first (n_sel = ceil((11 - 1)/4) + 2 = 5
per token) and then only the chosen blocks' cells, where the cache layout allows it (one sequence per
KV stream, cells in position order); every top-k there takes ties at the cut from the lowest cells
(ggml_top_k_ordered). The cell-level path with the same tie rule (the flag with
LLAMA_QSA_BLOCK_TOPK_BLOCKS above the block count, which turns the block level off) is the reference:
the same cells in the same order, so the output is equal bit for bit. One block fewer (the bound
without its margin) must change the output: the test sees the selection.

The model has two QSA layers because the first one's output for every prompt token reaches the
second's cache: with one QSA layer, the last, only the last prompt token's selection shows.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from moe_cache_checks import complete, logprobs, max_logprob_diff, real_text
from moecache.server import ServerProcess

USED = "before its cells (block-level top-k)"
CELL_LEVEL = {"LLAMA_QSA_BLOCK_TOPK_BLOCKS": "1000000"}  # more blocks than any cache: never the block level
NO_MARGIN = {"LLAMA_QSA_BLOCK_TOPK_BLOCKS": "4"}  # ceil((width - 1)/ratio) + 1


def server_args(n_parallel=1, n_ctx=8192, extra=()):
    return ["-t", "2", "-c", str(n_ctx), "-np", str(n_parallel), "-ngl", "0", "-fa", "on",
            "-b", "256", "-ub", "16", "-no-kvu", "-lv", "4", *extra]


@pytest.fixture(scope="module")
def text() -> str:
    return real_text(2500, 9000)


def run(model, text, env, extra=(), flag=True):
    """A deep prompt, the same prompt extended from the cache, another prompt on the same slot."""
    args = server_args(extra=[*extra, *(["--qsa-block-topk"] if flag else [])])
    with ServerProcess(model, args=args, env=env, timeout=300) as srv:
        outs = [complete(srv, text[:6000], n_predict=16, cache_prompt=True),
                complete(srv, text[:7000], n_predict=16, cache_prompt=True),
                complete(srv, text[3000:5000], n_predict=16, cache_prompt=True)]
        return outs, srv.log_text()


@pytest.fixture(scope="module")
def cell_level(qwen4exp_8l, text):
    outs, log = run(qwen4exp_8l, text, CELL_LEVEL)
    assert USED not in log
    return outs


@pytest.fixture(scope="module")
def block_level(qwen4exp_8l, text):
    outs, log = run(qwen4exp_8l, text, {})
    assert USED in log
    return outs


def equal(a_outs, b_outs):
    for a, b in zip(a_outs, b_outs):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact


def test_the_block_level_selects_the_cell_levels_cells(cell_level, block_level):
    assert block_level[1]["tokens_cached"] > 1000 and block_level[0]["tokens_evaluated"] > 1000
    equal(cell_level, block_level)


@pytest.mark.parametrize("extra", [["--kq-mask-device"], ["--qsa-sparse"], ["-ctk", "q8_0", "-ctv", "q8_0"]],
                         ids=["device-mask", "sparse", "q8_0"])
def test_with_the_other_long_context_paths(qwen4exp_8l, text, extra):
    ref, _ = run(qwen4exp_8l, text, CELL_LEVEL, extra)
    blk, log = run(qwen4exp_8l, text, {}, extra)
    assert USED in log
    equal(ref, blk)


def test_one_block_fewer_changes_the_output(qwen4exp_8l, text, cell_level):
    """Without the bound's margin a token whose own block is seen in part loses cells of the last block
    the cell level takes: the check above would catch a selection that is not the cell level's."""
    outs, log = run(qwen4exp_8l, text, NO_MARGIN)
    assert "QSA selects 4 blocks per token" in log
    assert any(logprobs(a) != logprobs(b) for a, b in zip(cell_level, outs))


def test_five_sessions_at_once_equal_their_solo_outputs(qwen4exp_8l, text):
    """-np 5 with a KV stream per sequence: the block level runs per stream."""
    prompts = [text[i * 700:i * 700 + 2500] for i in range(5)]
    with ServerProcess(qwen4exp_8l, args=server_args(n_parallel=5, n_ctx=5 * 2048, extra=["--qsa-block-topk"]),
                       timeout=300) as srv:
        solo = [complete(srv, p, n_predict=12) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            together = list(pool.map(lambda p: complete(srv, p, n_predict=12), prompts))
        assert USED in srv.log_text()
    # batched with the others, a step's products round differently, and through 8 layers that shows: the
    # tokens are the same, the log-probabilities within rounding (without the flag up to 0.026 here, with
    # it up to 0.040: a rounding can also move a tie at the cut)
    for a, b in zip(solo, together):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < 0.1


def test_sequences_sharing_a_stream_take_the_cell_level(qwen4exp_8l, text):
    """A unified cache (-kvu) holds both slots' sequences in one stream: the second prompt, with the first
    one's cells still cached, takes the cell level; the output is the flag's all the same."""
    args = ["-t", "2", "-c", "8192", "-np", "2", "-ngl", "0", "-fa", "on", "-b", "256", "-ub", "16", "-kvu", "-lv", "4",
            "--qsa-block-topk"]
    outs = []
    for env in (CELL_LEVEL, {}):
        with ServerProcess(qwen4exp_8l, args=args, env=env, timeout=300) as srv:
            outs.append([complete(srv, text[:3000], n_predict=12, id_slot=0, cache_prompt=True),
                         complete(srv, text[3000:6000], n_predict=12, id_slot=1, cache_prompt=True),
                         complete(srv, text[:3500], n_predict=12, id_slot=0, cache_prompt=True)])
    equal(*outs)


def test_the_environment_variable_turns_it_on(qwen4exp_8l, text, block_level):
    outs, log = run(qwen4exp_8l, text, {"LLAMA_ARG_QSA_BLOCK_TOPK": "1"}, flag=False)
    assert USED in log
    equal(block_level, outs)


def test_the_python_api_turns_it_on(core, qwen4exp_8l, text, monkeypatch):
    """moecache.Model(...).context(qsa_block_topk=True), or LLAMA_ARG_QSA_BLOCK_TOPK: the server's tokens
    with the flag, at the same batch sizes."""
    import moecache

    monkeypatch.delenv("LLAMA_ARG_QSA_BLOCK_TOPK", raising=False)
    prompt = text[:5000]
    args = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "0", "-fa", "on", "-b", "256", "-ub", "16", "-lv", "4",
            "--qsa-block-topk"]
    with ServerProcess(qwen4exp_8l, args=args, timeout=300) as srv:
        served = complete(srv, prompt, n_predict=12)
        assert USED in srv.log_text()
    model = moecache.Model(qwen4exp_8l)
    kw = {"n_ctx": 2048, "n_batch": 256, "n_ubatch": 16, "n_threads": 2, "flash_attn": "on"}
    on = model.context(**kw, qsa_block_topk=True)
    assert on.long_context_options["qsa_block_topk"] is True
    assert model.context(**kw).long_context_options["qsa_block_topk"] is False
    monkeypatch.setenv("LLAMA_ARG_QSA_BLOCK_TOPK", "1")
    by_env = model.context(**kw)
    assert by_env.long_context_options["qsa_block_topk"] is True
    a, b = (ctx.generate(prompt, max_tokens=12, temperature=0.0) for ctx in (on, by_env))
    assert a.tokens == b.tokens == served["tokens"]
    with pytest.raises(ValueError, match="LLAMA_ARG_QSA_BLOCK_TOPK"):
        monkeypatch.setenv("LLAMA_ARG_QSA_BLOCK_TOPK", "maybe")
        model.context(**kw)
