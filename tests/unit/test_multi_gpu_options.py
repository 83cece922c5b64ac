"""The layer split's switches (api.MULTI_GPU_OPTIONS): one table maps the Python argument, llama-server's
flag and its LLAMA_ARG_ variable; off by default; arguments beat the environment; bad values name their
source."""

from __future__ import annotations

import pytest

from moecache import api


def test_defaults_and_names():
    assert api._multi_gpu_options({}, {}) == {"pp_overrides": False}
    assert {n: (o.flag, o.env, o.boolean) for n, o in api.MULTI_GPU_OPTIONS.items()} == {
        "pp_overrides": ("--pp-overrides", "LLAMA_ARG_PP_OVERRIDES", True)}


@pytest.mark.parametrize("word,value", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_variable(word, value):
    assert api._multi_gpu_options({}, {"LLAMA_ARG_PP_OVERRIDES": word})["pp_overrides"] is value


def test_an_argument_beats_the_variable():
    assert api._multi_gpu_options({"pp_overrides": False}, {"LLAMA_ARG_PP_OVERRIDES": "1"})["pp_overrides"] is False


@pytest.mark.parametrize("kwargs,env,match", [
    ({"pp_overrides": "yes"}, {}, "pp_overrides must be True or False"),
    ({}, {"LLAMA_ARG_PP_OVERRIDES": "maybe"}, "environment variable LLAMA_ARG_PP_OVERRIDES"),
    ({"pp_override": True}, {}, "unknown multi-GPU option"),
])
def test_bad_values_name_their_source(kwargs, env, match):
    with pytest.raises((ValueError, TypeError), match=match):
        api._multi_gpu_options(kwargs, env)
