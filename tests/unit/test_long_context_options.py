"""The long-context switches (api.LONG_CONTEXT_OPTIONS): one table maps the Python argument,
llama-server's flag and its LLAMA_ARG_ variable; off by default; arguments beat the environment;
bad values name their source."""

from __future__ import annotations

import pytest

from moecache import api


def test_defaults_and_names():
    assert api._long_context_options({}, {}) == {"qsa_sparse": False}
    o = api.LONG_CONTEXT_OPTIONS["qsa_sparse"]
    assert (o.flag, o.env, o.boolean) == ("--qsa-sparse", "LLAMA_ARG_QSA_SPARSE", True)


@pytest.mark.parametrize("word,value", [("1", True), ("on", True), ("TRUE", True), ("0", False), (" off ", False)])
def test_the_variable(word, value):
    assert api._long_context_options({}, {"LLAMA_ARG_QSA_SPARSE": word}) == {"qsa_sparse": value}


def test_an_argument_beats_the_variable():
    assert api._long_context_options({"qsa_sparse": False}, {"LLAMA_ARG_QSA_SPARSE": "1"}) == {"qsa_sparse": False}


@pytest.mark.parametrize("kwargs,env,match", [
    ({"qsa_sparse": 1}, {}, "qsa_sparse must be True or False"),
    ({}, {"LLAMA_ARG_QSA_SPARSE": "maybe"}, "environment variable LLAMA_ARG_QSA_SPARSE"),
    ({"qsa_spares": True}, {}, "unknown long-context option"),
])
def test_bad_values_name_their_source(kwargs, env, match):
    with pytest.raises((ValueError, TypeError), match=match):
        api._long_context_options(kwargs, env)
