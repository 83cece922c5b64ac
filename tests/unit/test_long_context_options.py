"""The long-context switches (api.LONG_CONTEXT_OPTIONS): one table maps the Python argument,
llama-server's flag and its LLAMA_ARG_ variable; off by default; arguments beat the environment;
bad values name their source."""

from __future__ import annotations

import pytest

from moecache import api


def test_defaults_and_names():
    assert api._long_context_options({}, {}) == {"qsa_sparse": False, "kq_mask_device": False, "qsa_block_topk": False}
    t = api.LONG_CONTEXT_OPTIONS
    assert {n: (o.flag, o.env, o.boolean) for n, o in t.items()} == {
        "qsa_sparse": ("--qsa-sparse", "LLAMA_ARG_QSA_SPARSE", True),
        "kq_mask_device": ("--kq-mask-device", "LLAMA_ARG_KQ_MASK_DEVICE", True),
        "qsa_block_topk": ("--qsa-block-topk", "LLAMA_ARG_QSA_BLOCK_TOPK", True)}


@pytest.mark.parametrize("word,value", [("1", True), ("on", True), ("TRUE", True), ("0", False), (" off ", False)])
@pytest.mark.parametrize("name", ["qsa_sparse", "kq_mask_device", "qsa_block_topk"])
def test_the_variable(name, word, value):
    env = api.LONG_CONTEXT_OPTIONS[name].env
    assert api._long_context_options({}, {env: word})[name] is value


def test_an_argument_beats_the_variable():
    assert api._long_context_options({"qsa_sparse": False}, {"LLAMA_ARG_QSA_SPARSE": "1"})["qsa_sparse"] is False


@pytest.mark.parametrize("kwargs,env,match", [
    ({"qsa_sparse": 1}, {}, "qsa_sparse must be True or False"),
    ({}, {"LLAMA_ARG_QSA_SPARSE": "maybe"}, "environment variable LLAMA_ARG_QSA_SPARSE"),
    ({"qsa_spares": True}, {}, "unknown long-context option"),
])
def test_bad_values_name_their_source(kwargs, env, match):
    with pytest.raises((ValueError, TypeError), match=match):
        api._long_context_options(kwargs, env)
