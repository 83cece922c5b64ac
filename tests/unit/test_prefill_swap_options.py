"""The prefill-phase swap's options (api.PREFILL_SWAP_OPTIONS): one table maps the Python argument,
llama-server's flag, its LLAMA_ARG_ variable and the public write-up's LLAMA_PHASE_PREFILL_* name;
arguments beat the environment, the new name beats the old one, bad values name their source."""

from __future__ import annotations

import pytest

from moecache import api

DEFAULTS = {"prefill_ubatch": 0, "prefill_min_tokens": 1024, "prefill_swap_mode": "transaction",
            "prefill_warm_restore": True, "prefill_restore_wait_ms": 0}


def test_defaults_and_names():
    assert api._prefill_swap_options({}, {}) == DEFAULTS
    t = api.PREFILL_SWAP_OPTIONS
    assert {n: o.flag for n, o in t.items()} == {
        "prefill_ubatch": "--prefill-ubatch", "prefill_min_tokens": "--prefill-min-tokens",
        "prefill_swap_mode": "--prefill-swap-mode", "prefill_warm_restore": "--prefill-warm-restore",
        "prefill_restore_wait_ms": "--prefill-restore-wait"}
    for name, o in t.items():
        assert o.env == "LLAMA_ARG_" + o.flag[2:].upper().replace("-", "_")
    assert {n: o.aliases for n, o in t.items() if o.aliases} == {
        "prefill_ubatch": ("LLAMA_PHASE_PREFILL_UBATCH",), "prefill_min_tokens": ("LLAMA_PHASE_PREFILL_MIN_TOKENS",),
        "prefill_swap_mode": ("LLAMA_PHASE_PREFILL_MODE",),
        "prefill_restore_wait_ms": ("LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS",)}


def test_environment_and_old_names():
    env = {"LLAMA_PHASE_PREFILL_UBATCH": "2048", "LLAMA_ARG_PREFILL_MIN_TOKENS": " 4096 ",
           "LLAMA_PHASE_PREFILL_MIN_TOKENS": "1", "LLAMA_PHASE_PREFILL_MODE": "bypass",
           "LLAMA_ARG_PREFILL_WARM_RESTORE": "Off", "LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS": "250"}
    assert api._prefill_swap_options({}, env) == {"prefill_ubatch": 2048, "prefill_min_tokens": 4096,
                                                  "prefill_swap_mode": "bypass", "prefill_warm_restore": False,
                                                  "prefill_restore_wait_ms": 250}
    # the restore wait's new name beats its old one
    assert api._prefill_swap_options({}, {**env, "LLAMA_ARG_PREFILL_RESTORE_WAIT": "0"})["prefill_restore_wait_ms"] == 0
    # an argument beats every variable; a blank primary name lets the old one through
    got = api._prefill_swap_options({"prefill_ubatch": 512, "prefill_warm_restore": True},
                                    {**env, "LLAMA_ARG_PREFILL_UBATCH": " "})
    assert got["prefill_ubatch"] == 512 and got["prefill_warm_restore"] is True


@pytest.mark.parametrize("kwargs,env,match", [
    ({"prefill_ubatch": -1}, {}, r"prefill_ubatch must be an integer >= 0"),
    ({"prefill_min_tokens": 0}, {}, r"prefill_min_tokens must be an integer >= 1"),
    ({"prefill_swap_mode": "Bypass"}, {}, r"prefill_swap_mode must be one of 'transaction', 'bypass'"),
    ({"prefill_warm_restore": 1}, {}, r"prefill_warm_restore must be True or False"),
    ({"prefill_restore_wait_ms": -1}, {}, r"prefill_restore_wait_ms must be an integer in \[0, 600000\]"),
    ({"prefill_restore_wait_ms": 600001}, {}, r"prefill_restore_wait_ms must be an integer"),
    ({}, {"LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS": "1s"},
     r"LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS \(the old name of LLAMA_ARG_PREFILL_RESTORE_WAIT\)"),
    ({}, {"LLAMA_PHASE_PREFILL_UBATCH": "2k"}, r"LLAMA_PHASE_PREFILL_UBATCH \(the old name of LLAMA_ARG_PREFILL_UBATCH\)"),
    ({}, {"LLAMA_ARG_PREFILL_SWAP_MODE": "fast"}, r"LLAMA_ARG_PREFILL_SWAP_MODE \(prefill_swap_mode\) must be one of"),
    ({}, {"LLAMA_ARG_PREFILL_WARM_RESTORE": "maybe"}, r"LLAMA_ARG_PREFILL_WARM_RESTORE \(prefill_warm_restore\) must be one of on"),
])
def test_bad_values_name_their_source(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        api._prefill_swap_options(kwargs, env)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown prefill swap option"):
        api._prefill_swap_options({"prefill_ubatchh": 1}, {})
