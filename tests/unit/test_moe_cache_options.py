"""The hot-expert cache options of a Context: defaults, environment variables, and the checks that
refuse bad values with a message naming the argument or the variable (no native module needed)."""

from __future__ import annotations

import pytest

from moecache import api

DEFAULTS = {
    "moe_cache_slots": 0,
    "moe_cache_size_mib": 0,
    "moe_cache_policy": "freq",
    "moe_cache_rebalance_interval": 40,
    "moe_cache_max_batch": 8,
    "moe_cache_admit_misses": 2,
    "moe_cache_admit_window": 16,
    "moe_cache_max_uploads": 2,
    "moe_cache_headroom_mib": 512,
    "moe_cache_miss": "cpu",
    "moe_cache_miss_auto_pct": 25,
    "moe_cache_miss_split_pct": 50,
    "moe_cache_warm_prompts": False,
    "moe_cache_profile": "",
    "moe_cache_slots_by_layer": False,
}

# llama.cpp's LLAMA_ARG_<FLAG> names, as llama-server takes them
ENV = {
    "moe_cache_slots": "LLAMA_ARG_MOE_CACHE_SLOTS",
    "moe_cache_size_mib": "LLAMA_ARG_MOE_CACHE_SIZE",
    "moe_cache_policy": "LLAMA_ARG_MOE_CACHE_POLICY",
    "moe_cache_rebalance_interval": "LLAMA_ARG_MOE_CACHE_REBALANCE_INTERVAL",
    "moe_cache_max_batch": "LLAMA_ARG_MOE_CACHE_MAX_BATCH",
    "moe_cache_admit_misses": "LLAMA_ARG_MOE_CACHE_ADMIT_MISSES",
    "moe_cache_admit_window": "LLAMA_ARG_MOE_CACHE_ADMIT_WINDOW",
    "moe_cache_max_uploads": "LLAMA_ARG_MOE_CACHE_MAX_UPLOADS",
    "moe_cache_headroom_mib": "LLAMA_ARG_MOE_CACHE_HEADROOM",
    "moe_cache_miss": "LLAMA_ARG_MOE_CACHE_MISS",
    "moe_cache_miss_auto_pct": "LLAMA_ARG_MOE_CACHE_MISS_AUTO_PCT",
    "moe_cache_miss_split_pct": "LLAMA_ARG_MOE_CACHE_MISS_SPLIT_PCT",
    "moe_cache_warm_prompts": "LLAMA_ARG_MOE_CACHE_WARM_PROMPTS",
    "moe_cache_profile": "LLAMA_ARG_MOE_CACHE_PROFILE",
    "moe_cache_slots_by_layer": "LLAMA_ARG_MOE_CACHE_SLOTS_BY_LAYER",
}
# the older names, still read when the new one is unset
ALIASES = {
    "moe_cache_slots": "LLAMA_ARG_MOE_HOT_K",
    "moe_cache_rebalance_interval": "LLAMA_ARG_MOE_HOT_REBALANCE_INTERVAL",
    "moe_cache_max_batch": "LLAMA_MOE_HOT_PP_BYPASS_N_TOKENS",
}
FLAGS = {
    "moe_cache_slots": "--moe-cache-slots",
    "moe_cache_size_mib": "--moe-cache-size",
    "moe_cache_policy": "--moe-cache-policy",
    "moe_cache_rebalance_interval": "--moe-cache-rebalance-interval",
    "moe_cache_max_batch": "--moe-cache-max-batch",
    "moe_cache_admit_misses": "--moe-cache-admit-misses",
    "moe_cache_admit_window": "--moe-cache-admit-window",
    "moe_cache_max_uploads": "--moe-cache-max-uploads",
    "moe_cache_headroom_mib": "--moe-cache-headroom",
    "moe_cache_miss": "--moe-cache-miss",
    "moe_cache_miss_auto_pct": "--moe-cache-miss-auto-pct",
    "moe_cache_miss_split_pct": "--moe-cache-miss-split-pct",
    "moe_cache_warm_prompts": "--moe-cache-warm-prompts",
    "moe_cache_profile": "--moe-cache-profile",
    "moe_cache_slots_by_layer": "--moe-cache-slots-by-layer",
}


def test_defaults_without_arguments_or_environment():
    assert api._moe_cache_options({}, {}) == DEFAULTS
    assert api._moe_cache_options(None, {}) == DEFAULTS
    # None means "not passed"
    assert api._moe_cache_options({name: None for name in DEFAULTS}, {}) == DEFAULTS


def test_every_option_has_its_environment_variable_aliases_and_flag():
    assert {name: o.env for name, o in api.MOE_CACHE_OPTIONS.items()} == ENV
    assert {name: o.aliases for name, o in api.MOE_CACHE_OPTIONS.items() if o.aliases} == \
        {name: (alias,) for name, alias in ALIASES.items()}
    assert {name: o.flag for name, o in api.MOE_CACHE_OPTIONS.items()} == FLAGS
    for name, o in api.MOE_CACHE_OPTIONS.items():
        # llama.cpp's scheme: the flag's name, upper case, after LLAMA_ARG_
        assert o.env == "LLAMA_ARG_" + o.flag.lstrip("-").replace("-", "_").upper(), name


def test_os_environ_is_the_default_environment(monkeypatch):
    for var in (*ENV.values(), *ALIASES.values()):
        monkeypatch.delenv(var, raising=False)
    assert api._moe_cache_options({}) == DEFAULTS
    monkeypatch.setenv("LLAMA_ARG_MOE_CACHE_SLOTS", "12")
    assert api._moe_cache_options({})["moe_cache_slots"] == 12


def test_environment_gives_the_defaults():
    env = {
        "LLAMA_ARG_MOE_CACHE_SLOTS": "16",
        "LLAMA_ARG_MOE_CACHE_SIZE": "2048",
        "LLAMA_ARG_MOE_CACHE_POLICY": "lru",
        "LLAMA_ARG_MOE_CACHE_REBALANCE_INTERVAL": "100",
        "LLAMA_ARG_MOE_CACHE_MAX_BATCH": "32",
        "LLAMA_ARG_MOE_CACHE_ADMIT_MISSES": "3",
        "LLAMA_ARG_MOE_CACHE_ADMIT_WINDOW": "64",
        "LLAMA_ARG_MOE_CACHE_MAX_UPLOADS": "4",
        "LLAMA_ARG_MOE_CACHE_HEADROOM": "1024",
        "LLAMA_ARG_MOE_CACHE_MISS": "split",
        "LLAMA_ARG_MOE_CACHE_MISS_AUTO_PCT": "40",
        "LLAMA_ARG_MOE_CACHE_MISS_SPLIT_PCT": "70",
        "LLAMA_ARG_MOE_CACHE_WARM_PROMPTS": "on",
        "LLAMA_ARG_MOE_CACHE_PROFILE": " experts.profile ",
        "LLAMA_ARG_MOE_CACHE_SLOTS_BY_LAYER": "1",
    }
    assert api._moe_cache_options({}, env) == {
        "moe_cache_slots": 16,
        "moe_cache_size_mib": 2048,
        "moe_cache_policy": "lru",
        "moe_cache_rebalance_interval": 100,
        "moe_cache_max_batch": 32,
        "moe_cache_admit_misses": 3,
        "moe_cache_admit_window": 64,
        "moe_cache_max_uploads": 4,
        "moe_cache_headroom_mib": 1024,
        "moe_cache_miss": "split",
        "moe_cache_miss_auto_pct": 40,
        "moe_cache_miss_split_pct": 70,
        "moe_cache_warm_prompts": True,
        "moe_cache_profile": "experts.profile",
        "moe_cache_slots_by_layer": True,
    }


def test_arguments_win_over_the_environment():
    env = {"LLAMA_ARG_MOE_CACHE_SLOTS": "16", "LLAMA_ARG_MOE_CACHE_POLICY": "lru", "LLAMA_ARG_MOE_CACHE_MAX_BATCH": "4"}
    got = api._moe_cache_options({"moe_cache_slots": 0, "moe_cache_policy": "freq", "moe_cache_max_batch": None}, env)
    assert got["moe_cache_slots"] == 0  # an explicit 0 is passed, not "unset"
    assert got["moe_cache_policy"] == "freq"
    assert got["moe_cache_max_batch"] == 4  # None: the environment's


def test_an_argument_wins_even_over_a_bad_environment_value():
    got = api._moe_cache_options({"moe_cache_slots": 3}, {"LLAMA_ARG_MOE_CACHE_SLOTS": "lots",
                                                          "LLAMA_ARG_MOE_HOT_K": "lots"})
    assert got["moe_cache_slots"] == 3


def test_empty_environment_values_count_as_unset():
    env = {var: "" for var in (*ENV.values(), *ALIASES.values())}
    env["LLAMA_ARG_MOE_CACHE_SLOTS"] = "   "
    assert api._moe_cache_options({}, env) == DEFAULTS


def test_environment_numbers_may_have_spaces_and_signs():
    assert api._moe_cache_options({}, {"LLAMA_ARG_MOE_CACHE_SLOTS": " 8\n"})["moe_cache_slots"] == 8
    assert api._moe_cache_options({}, {"LLAMA_ARG_MOE_CACHE_SLOTS": "+8"})["moe_cache_slots"] == 8


@pytest.mark.parametrize("value", ["freq", "lru"])
def test_policy_names(value):
    assert api._moe_cache_options({"moe_cache_policy": value}, {})["moe_cache_policy"] == value
    assert api._moe_cache_options({}, {"LLAMA_ARG_MOE_CACHE_POLICY": value})["moe_cache_policy"] == value
    assert api._moe_cache_options({}, {"LLAMA_ARG_MOE_CACHE_POLICY": f" {value}\n"})["moe_cache_policy"] == value


@pytest.mark.parametrize("value", ["fifo", "", "lfu", "LRU", "Freq", " lru", 0, 1, True])
def test_bad_policy_argument_names_the_argument_and_the_choices(value):
    with pytest.raises(ValueError) as e:
        api._moe_cache_options({"moe_cache_policy": value}, {})
    msg = str(e.value)
    assert "moe_cache_policy" in msg and "'freq'" in msg and "'lru'" in msg and repr(value) in msg


@pytest.mark.parametrize("value", ["fifo", "LRU"])  # spelled as llama-server takes them
def test_bad_policy_in_the_environment_names_the_variable(value):
    with pytest.raises(ValueError) as e:
        api._moe_cache_options({}, {"LLAMA_ARG_MOE_CACHE_POLICY": value})
    msg = str(e.value)
    assert "LLAMA_ARG_MOE_CACHE_POLICY" in msg and repr(value) in msg and "'lru'" in msg


@pytest.mark.parametrize("name, bad", [
    ("moe_cache_slots", -1),
    ("moe_cache_size_mib", -1),
    ("moe_cache_rebalance_interval", 0),
    ("moe_cache_max_batch", 0),
    ("moe_cache_max_batch", 65),
    ("moe_cache_admit_misses", 0),
    ("moe_cache_admit_window", 0),
    ("moe_cache_max_uploads", 0),
    ("moe_cache_slots", 2**31),  # does not fit the C int32
    ("moe_cache_slots", 1.5),
    ("moe_cache_slots", "4"),
    ("moe_cache_slots", True),
])
def test_bad_argument_values_name_the_argument(name, bad):
    with pytest.raises(ValueError) as e:
        api._moe_cache_options({name: bad}, {})
    msg = str(e.value)
    assert msg.startswith(name + " must be an integer")
    assert repr(bad) in msg or str(bad) in msg


@pytest.mark.parametrize("name, good", [
    ("moe_cache_slots", 0), ("moe_cache_slots", 128), ("moe_cache_size_mib", 0), ("moe_cache_size_mib", 65536),
    ("moe_cache_rebalance_interval", 1), ("moe_cache_max_batch", 1), ("moe_cache_max_batch", 64),
    ("moe_cache_admit_misses", 1), ("moe_cache_admit_window", 1), ("moe_cache_max_uploads", 1),
])
def test_values_at_the_edges_of_the_ranges(name, good):
    assert api._moe_cache_options({name: good}, {})[name] == good


def test_ranges_are_in_the_messages():
    with pytest.raises(ValueError, match=r"in \[1, 64\]"):
        api._moe_cache_options({"moe_cache_max_batch": 100}, {})
    with pytest.raises(ValueError, match=">= 0"):
        api._moe_cache_options({"moe_cache_slots": -3}, {})
    with pytest.raises(ValueError, match=">= 1"):
        api._moe_cache_options({"moe_cache_max_uploads": 0}, {})


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    got = api._moe_cache_options({"moe_cache_slots": np.int64(8), "moe_cache_max_batch": np.int32(4)}, {})
    assert got["moe_cache_slots"] == 8 and type(got["moe_cache_slots"]) is int
    assert got["moe_cache_max_batch"] == 4


@pytest.mark.parametrize("name, bad", [
    ("moe_cache_slots", "-1"),
    ("moe_cache_slots", "many"),
    ("moe_cache_slots", "1.5"),
    ("moe_cache_slots", "1_000"),
    ("moe_cache_size_mib", "2G"),
    ("moe_cache_rebalance_interval", "0"),
    ("moe_cache_max_batch", "65"),
    ("moe_cache_max_batch", "0"),
    ("moe_cache_admit_misses", "0"),
    ("moe_cache_admit_window", "-5"),
    ("moe_cache_max_uploads", "0"),
    ("moe_cache_slots", str(2**31)),
])
def test_bad_environment_values_name_the_variable(name, bad):
    var = ENV[name]
    with pytest.raises(ValueError) as e:
        api._moe_cache_options({}, {var: bad})
    msg = str(e.value)
    assert f"environment variable {var}" in msg and name in msg and repr(bad) in msg


# --- the older variable names ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALIASES))
def test_the_primary_name_sets_the_option(name):
    value = DEFAULTS[name] + 3
    assert api._moe_cache_options({}, {ENV[name]: str(value)})[name] == value


@pytest.mark.parametrize("name", list(ALIASES))
def test_an_old_name_alone_still_sets_the_option(name):
    value = DEFAULTS[name] + 3
    assert api._moe_cache_options({}, {ALIASES[name]: str(value)})[name] == value
    # a blank new name counts as unset, so the old one still decides
    assert api._moe_cache_options({}, {ENV[name]: " ", ALIASES[name]: str(value)})[name] == value


@pytest.mark.parametrize("name", list(ALIASES))
def test_the_primary_name_wins_over_the_old_one(name):
    primary, old = DEFAULTS[name] + 1, DEFAULTS[name] + 2
    env = {ENV[name]: str(primary), ALIASES[name]: str(old)}
    assert api._moe_cache_options({}, env)[name] == primary
    # the old name is not read at all then, not even checked
    assert api._moe_cache_options({}, {ENV[name]: str(primary), ALIASES[name]: "bad"})[name] == primary


@pytest.mark.parametrize("name", list(ALIASES))
def test_a_bad_value_under_an_old_name_names_that_name(name):
    with pytest.raises(ValueError) as e:
        api._moe_cache_options({}, {ALIASES[name]: "bad"})
    msg = str(e.value)
    assert f"environment variable {ALIASES[name]}" in msg and ENV[name] in msg and name in msg and "'bad'" in msg


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="moe_cache_slot"):
        api._moe_cache_options({"moe_cache_slot": 4}, {})


def test_environment_mapping_is_not_modified():
    env = {"LLAMA_ARG_MOE_CACHE_SLOTS": "4", "LLAMA_ARG_MOE_HOT_K": "5"}
    api._moe_cache_options({"moe_cache_slots": 2}, env)
    api._moe_cache_options({}, env)
    assert env == {"LLAMA_ARG_MOE_CACHE_SLOTS": "4", "LLAMA_ARG_MOE_HOT_K": "5"}


# --- Context checks the options before it reaches the native module ---------------------------


def _unloaded_model():
    """A Model object that was never loaded: enough for the checks that run before native code."""
    return api.Model.__new__(api.Model)


@pytest.fixture
def no_native(monkeypatch):
    def boom():
        raise AssertionError("the native module was reached before the options were checked")

    monkeypatch.setattr(api, "_core", boom)
    for var in (*ENV.values(), *ALIASES.values()):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("kwargs, words", [
    ({"moe_cache_policy": "fifo"}, "moe_cache_policy"),
    ({"moe_cache_slots": -1}, "moe_cache_slots"),
    ({"moe_cache_max_batch": 65}, "moe_cache_max_batch"),
    ({"moe_cache_admit_window": 0}, "moe_cache_admit_window"),
])
def test_context_refuses_bad_options(no_native, kwargs, words):
    with pytest.raises(ValueError, match=words):
        api.Context(_unloaded_model(), n_threads=1, **kwargs)
    with pytest.raises(ValueError, match=words):
        api.Model.context(_unloaded_model(), n_threads=1, **kwargs)  # forwards them


def test_context_refuses_a_bad_environment_value(no_native, monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_MOE_CACHE_MAX_UPLOADS", "none")
    with pytest.raises(ValueError, match="LLAMA_ARG_MOE_CACHE_MAX_UPLOADS"):
        api.Context(_unloaded_model(), n_threads=1)


def test_context_options_are_keyword_arguments(no_native):
    with pytest.raises(TypeError):
        api.Context(_unloaded_model(), 4096, 2048, 512, 1, "auto", 16)  # moe_cache_* are keyword-only
    with pytest.raises(TypeError):
        api.Context(_unloaded_model(), n_threads=1, moe_cache_slot=16)  # misspelled
