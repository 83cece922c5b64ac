"""`import moecache` on a real (synthetic, tiny qwen3moe) model: metadata, tokens, greedy
generation, timings, routing traces, and the same output as llama-server for the same prompt."""

from __future__ import annotations

import os

import numpy as np
import pytest

import moecache
from moecache import synth

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "import os, sys\nfor i in range(10):\n    print(i * i)\n") * 3


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model  # tests/conftest.py: the tiny synthetic qwen3moe, written once per session


@pytest.fixture(scope="module")
def model(model_path):
    return moecache.Model(model_path)


@pytest.fixture(scope="module")
def ctx(model):
    return model.context(n_ctx=1024, n_batch=256, n_ubatch=64)


def test_metadata_matches_the_preset(model, model_path):
    p = synth.get_preset("tiny")
    assert model.path == str(model_path)
    assert model.arch == "qwen3moe"
    assert (model.n_layer, model.n_embd, model.n_vocab) == (p.n_layer, p.n_embd, p.n_vocab)
    assert (model.n_expert, model.n_expert_used) == (p.n_expert, p.n_expert_used)
    assert model.metadata["general.architecture"] == "qwen3moe"
    assert model.metadata["qwen3moe.block_count"] == str(p.n_layer)
    assert model.metadata["moecache.synth.preset"] == "tiny"
    assert model.n_params > 0 and 0 < model.size <= os.path.getsize(model_path)
    assert "qwen3moe" in model.desc


def test_tokenize_round_trip(model):
    text = "Hello world! The year is 2024; x = [1, 2, 3]  # ok"
    tokens = model.tokenize(text, add_special=False)
    assert len(tokens) > 5 and all(0 <= t < model.n_vocab for t in tokens)
    assert model.detokenize(tokens) == text
    assert "".join(model.token_to_piece(t) for t in tokens) == text
    # special tokens are parsed by default, and not when asked
    assert model.tokenize("<|im_start|>", add_special=False) == [151644]
    assert len(model.tokenize("<|im_start|>", add_special=False, parse_special=False)) > 1


def test_greedy_generation_is_deterministic(model, ctx):
    a = ctx.generate(PROMPT, max_tokens=12)
    b = ctx.generate(PROMPT, max_tokens=12)  # from a cleared KV cache again
    other = model.context(n_ctx=1024, n_batch=256, n_ubatch=64)
    c = other.generate(PROMPT, max_tokens=12)
    assert a.tokens == b.tokens == c.tokens
    assert a.text == b.text == c.text
    assert a.prompt_tokens == len(model.tokenize(PROMPT))
    if a.finish_reason == "length":
        assert len(a.tokens) == 12
    # the prompt may be given as tokens
    d = ctx.generate(model.tokenize(PROMPT), max_tokens=12)
    assert d.tokens == a.tokens


def test_timings_are_measured(ctx):
    g = ctx.generate(TEXT, max_tokens=8)
    t = g.timings
    assert t["prefill_tokens"] == g.prompt_tokens > 50
    assert t["prefill_s"] > 0 and t["prefill_tps"] == pytest.approx(t["prefill_tokens"] / t["prefill_s"])
    if g.finish_reason == "length":
        assert t["decode_tokens"] == len(g.tokens) - 1  # the last sampled token is not decoded
        assert t["decode_s"] > 0 and t["decode_tps"] > 0


def test_sampling_with_a_seed_is_reproducible(ctx):
    a = ctx.generate(PROMPT, max_tokens=10, temperature=1.5, seed=7, top_k=0, top_p=1.0)
    b = ctx.generate(PROMPT, max_tokens=10, temperature=1.5, seed=7, top_k=0, top_p=1.0)
    assert a.tokens == b.tokens
    runs = {tuple(ctx.generate(PROMPT, max_tokens=10, temperature=1.5, seed=s, top_k=0, top_p=1.0).tokens)
            for s in range(4)}
    assert len(runs) > 1  # random weights give a flat distribution: seeds must differ


def test_top_logprobs_give_the_distribution_before_each_token(ctx):
    """The N most likely tokens before each generated one, best first: greedy picks the first; sampling draws
    from the model's own distribution (the entries do not change with temperature); none unless asked."""
    g = ctx.generate(PROMPT, max_tokens=8, top_logprobs=5)
    assert len(g.top_logprobs) == len(g.tokens) > 0
    for token, step in zip(g.tokens, g.top_logprobs):
        ids, lps = [t for t, _ in step], [lp for _, lp in step]
        assert len(step) == 5 and len(set(ids)) == 5 and token == ids[0]
        assert all(a >= b for a, b in zip(lps, lps[1:])) and lps[0] <= 0.0
        assert 0.0 < sum(np.exp(lps)) <= 1.0 + 1e-5
    hot = ctx.generate(PROMPT, max_tokens=1, temperature=1.5, seed=3, top_logprobs=5)
    assert hot.top_logprobs[0] == pytest.approx(g.top_logprobs[0])
    assert ctx.generate(PROMPT, max_tokens=4).top_logprobs == []
    with pytest.raises(ValueError, match="top_logprobs"):
        ctx.generate(PROMPT, max_tokens=1, top_logprobs=-1)


def test_stop_string_cuts_the_text(ctx):
    full = ctx.generate(PROMPT, max_tokens=12)
    assert len(full.text) > 6
    stop = full.text[3:6]
    g = ctx.generate(PROMPT, max_tokens=12, stop=[stop])
    assert g.finish_reason == "stop"
    assert g.text == full.text[:full.text.index(stop)]
    assert stop not in g.text


def test_max_tokens_zero_and_context_limits(model, ctx):
    g = ctx.generate(PROMPT, max_tokens=0)
    assert g.tokens == [] and g.text == "" and g.finish_reason == "length"
    small = model.context(n_ctx=256, n_batch=64, n_ubatch=64)  # llama.cpp pads n_ctx to a multiple of 256
    long_tokens = model.tokenize(TEXT * 4)
    assert len(long_tokens) > small.n_ctx
    with pytest.raises(ValueError, match="n_ctx"):
        small.generate(long_tokens, max_tokens=1)
    # generation stops when the context is full (the last sampled token needs no KV cell)
    prompt = long_tokens[:small.n_ctx - 5]
    g = small.generate(prompt, max_tokens=1000)
    assert len(prompt) + len(g.tokens) <= small.n_ctx + 1
    if g.finish_reason == "length":
        assert len(prompt) + len(g.tokens) == small.n_ctx + 1


def test_bad_generation_parameters(ctx):
    for kwargs, name in [({"max_tokens": -1}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
                         ({"top_p": 0.0}, "top_p"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ValueError, match=name):
            ctx.generate(PROMPT, **kwargs)
    with pytest.raises(ValueError, match="out of range"):
        ctx.generate([10**9], max_tokens=1)


def test_bad_context_parameters(model):
    for kwargs, name in [({"n_ctx": 0}, "n_ctx"), ({"n_batch": 64, "n_ubatch": 128}, "n_ubatch"),
                         ({"flash_attn": "maybe"}, "flash_attn"), ({"n_threads": 0}, "n_threads")]:
        with pytest.raises(ValueError, match=name):
            model.context(**kwargs)


def _overcommit_always() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1: a huge allocation succeeds and then gets the process killed")
def test_context_too_large_for_memory(model):
    with pytest.raises(MemoryError) as e:
        model.context(n_ctx=1 << 28)  # a KV cache of 512 GiB
    assert isinstance(e.value, moecache.OutOfMemoryError)
    assert "n_ctx=268435456" in str(e.value)


def test_trace_routing(model, ctx):
    tokens = model.tokenize(TEXT)
    ids = ctx.trace_routing(tokens)
    assert ids.dtype == np.int32
    assert ids.shape == (len(tokens), model.n_layer, model.n_expert_used)
    assert ctx.moe_layers == list(range(model.n_layer))  # qwen3moe: every layer is MoE
    assert ids.min() >= 0 and ids.max() < model.n_expert
    # top-k picks distinct experts for every token and layer
    assert all(len(set(row)) == model.n_expert_used for row in ids.reshape(-1, model.n_expert_used))
    # same tokens, same routing; and causal: a prefix of whole ubatches routes the same
    assert np.array_equal(ctx.trace_routing(tokens), ids)
    n = ctx.n_ubatch
    assert np.array_equal(ctx.trace_routing(tokens[:n]), ids[:n])
    # the first layer's routing is close to the one predicted from the weights alone
    ref = synth.reference_trace(model.path, tokens)
    agree = np.mean([set(a) == set(b) for a, b in zip(ids[:, 0], ref[:, 0])])
    assert agree >= 0.8, agree
    # and the trace does not disturb generation
    assert ctx.generate(PROMPT, max_tokens=6).tokens == ctx.generate(PROMPT, max_tokens=6).tokens


# --- the same answer as llama-server -----------------------------------------------------------


def test_greedy_output_matches_llama_server(model, model_path, llama_server_bin):
    from moecache.server import ServerProcess

    args = ["-np", "1", "-c", "1024", "-b", "256", "-ub", "64", "-ngl", "0", "--no-webui"]
    with ServerProcess(model_path, args=args) as srv:
        for prompt in (PROMPT, TEXT):
            ours = model.context(n_ctx=1024, n_batch=256, n_ubatch=64).generate(prompt, max_tokens=16)
            status, theirs = srv.post("/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0.0,
                                                      "cache_prompt": False, "return_tokens": True})
            assert status == 200, theirs
            assert theirs["tokens_evaluated"] == ours.prompt_tokens
            assert theirs["tokens"][:len(ours.tokens)] == ours.tokens
            assert theirs["content"] == ours.text
