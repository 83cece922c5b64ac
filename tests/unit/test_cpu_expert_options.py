"""The switches of how the CPU computes a decode step's experts (api.CPU_EXPERT_OPTIONS): one table maps the
Python argument, llama-server's flag and its LLAMA_ARG_ variable; off by default; arguments beat the
environment; bad values name their source."""

from __future__ import annotations

import pytest

from moecache import api


def test_defaults_and_names():
    assert api._cpu_expert_options({}, {}) == {"cpu_experts_flat": False, "cpu_experts_x4": False,
                                               "cpu_experts_overlap": False}
    assert {n: (o.flag, o.env, o.boolean) for n, o in api.CPU_EXPERT_OPTIONS.items()} == {
        "cpu_experts_flat": ("--cpu-experts-flat", "LLAMA_ARG_CPU_EXPERTS_FLAT", True),
        "cpu_experts_x4": ("--cpu-experts-x4", "LLAMA_ARG_CPU_EXPERTS_X4", True),
        "cpu_experts_overlap": ("--cpu-experts-overlap", "LLAMA_ARG_CPU_EXPERTS_OVERLAP", True)}


@pytest.mark.parametrize("word,value", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_variables(word, value):
    got = api._cpu_expert_options({}, {"LLAMA_ARG_CPU_EXPERTS_X4": word})
    assert got == {"cpu_experts_flat": False, "cpu_experts_x4": value, "cpu_experts_overlap": False}
    assert api._cpu_expert_options({}, {"LLAMA_ARG_CPU_EXPERTS_OVERLAP": word})["cpu_experts_overlap"] is value


def test_an_argument_beats_the_variable():
    got = api._cpu_expert_options({"cpu_experts_flat": False}, {"LLAMA_ARG_CPU_EXPERTS_FLAT": "1"})
    assert got["cpu_experts_flat"] is False


@pytest.mark.parametrize("kwargs,env,match", [
    ({"cpu_experts_x4": 1}, {}, "cpu_experts_x4 must be True or False"),
    ({}, {"LLAMA_ARG_CPU_EXPERTS_FLAT": "maybe"}, "environment variable LLAMA_ARG_CPU_EXPERTS_FLAT"),
    ({"cpu_experts_x8": True}, {}, "unknown CPU-experts option"),
])
def test_bad_values_name_their_source(kwargs, env, match):
    with pytest.raises((ValueError, TypeError), match=match):
        api._cpu_expert_options(kwargs, env)
