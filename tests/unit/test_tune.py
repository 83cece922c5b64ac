"""`moecache tune`: the cache's policy, settings and slots from a routing trace.

The traces here are written by the test: two layers whose tokens route mostly into a hot set of experts
that moves every phase, so that the policies and their settings differ in hit rate. The choice must be
as good as the best of a much finer brute-force replay (within a tolerance), and the config it writes
must be what moecache-server applies, with the user's own flags and variables winning.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("moecache._core")

from moecache import tune  # noqa: E402
from moecache.cache_sim import load_trace, simulate  # noqa: E402

N_EXPERT = 32
N_USED = 2


def write_trace(path, n_tokens=600, phase=100, hot=6, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for t in range(n_tokens):
            if t % phase == 0:
                hot_sets = [rng.sample(range(N_EXPERT), hot) for _ in range(2)]
            layers = {}
            for layer, hs in enumerate(hot_sets):
                pool = hs if rng.random() < 0.85 else range(N_EXPERT)
                layers[str(layer)] = rng.sample(list(pool), N_USED)
            f.write(json.dumps({"seq": 0, "layers": layers}) + "\n")
    return path


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("tune") / "trace.jsonl")


def brute_force_best(trace, slots):
    best = 0.0
    for interval in range(5, 205, 5):
        best = max(best, simulate(trace, slots, "freq", interval=interval)["hit_rate"])
    for misses in (1, 2, 3, 4):
        for window in (4, 8, 12, 16, 24, 32, 48):
            best = max(best, simulate(trace, slots, "lru", admit_misses=misses, admit_window=window)["hit_rate"])
    return best


@pytest.mark.parametrize("slots", [4, 8, 12])
def test_the_choice_is_as_good_as_a_fine_brute_force(trace_path, slots):
    trace = load_trace(trace_path)
    [point] = tune.tune(trace, [slots], tune.grid())
    assert point["result"]["hit_rate"] >= brute_force_best(trace, slots) - 0.01
    # and the grid is not flat: the worst setting is clearly worse, so a careless pick would fail above
    assert min(t["hit_rate"] for t in point["tried"]) < point["result"]["hit_rate"] - 0.02


def test_the_curve_rises_with_slots_and_the_budget_picks_its_point(trace_path):
    trace = load_trace(trace_path)
    curve = tune.tune(trace, [4, 8, 16], tune.grid())
    rates = [p["result"]["hit_rate"] for p in curve]
    assert rates == sorted(rates) and rates[-1] > rates[0]
    cfg = tune.config_for(curve, 10, str(trace_path), 2)
    assert cfg["options"]["moe_cache_slots"] == 8  # the largest tried count within the budget
    assert cfg["expected_hit_rate"] == rates[1]


def test_main_writes_a_config_that_loads(trace_path, tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert tune.main([str(trace_path), "--slots", "4,8", "--write-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended at 8 slots: --moe-cache-slots 8 --moe-cache-policy" in text
    options = tune.load_config(out)
    assert options["moe_cache_slots"] == 8 and options["moe_cache_policy"] in ("freq", "lru")


def test_the_user_s_flags_and_variables_win(trace_path, tmp_path):
    options = {"moe_cache_slots": 8, "moe_cache_policy": "lru", "moe_cache_admit_misses": 1,
               "moe_cache_admit_window": 8}
    args = tune.config_args(options, ["-m", "x.gguf", "--moe-cache-slots", "16"],
                            {"LLAMA_ARG_MOE_CACHE_ADMIT_WINDOW": "32"})
    assert args == ["--moe-cache-policy", "lru", "--moe-cache-admit-misses", "1"]


@pytest.mark.parametrize("content,message", [
    (None, "tune config not found"),
    ("not json", "not a tune config"),
    ('{"kind": "other", "options": {}}', "not a tune config"),
    ('{"kind": "moecache-tune", "version": 9, "options": {}}', "version 9"),
    ('{"kind": "moecache-tune", "version": 1, "options": {"moe_cache_policy": "mru"}}', "moe_cache_policy"),
    ('{"kind": "moecache-tune", "version": 1, "options": {"moe_cache_slotz": 8}}', "moe_cache_slotz"),
])
def test_a_bad_config_says_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "cfg.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(tune.ConfigError, match=message):
        tune.load_config(path)


def test_bad_arguments_are_refused(trace_path, capsys):
    assert tune.main([str(trace_path), "--policy", "mru"]) == 2
    assert tune.main([str(trace_path), "--slots", "8,16", "--slots-budget", "4"]) == 2
    assert tune.main([str(trace_path.parent / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--policy: policies are 'freq' and 'lru'" in err and "below every tried slot count" in err and "not found" in err


def _fake_run(monkeypatch, tmp_path):
    from moecache import server

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(server, "_server_binary", lambda: "llama-server")
    runs = []
    monkeypatch.setattr(server, "run_forwarding",
                        lambda cmd, env=None, ready_url=None: runs.append(cmd) or 0)
    return server, model, runs


def test_moecache_server_applies_the_config_before_the_user_s_flags(trace_path, tmp_path, monkeypatch, capsys):
    server, model, runs = _fake_run(monkeypatch, tmp_path)
    cfg = tmp_path / "tune.json"
    assert tune.main([str(trace_path), "--slots", "4,8", "--write-config", str(cfg)]) == 0
    monkeypatch.delenv("LLAMA_ARG_MOE_CACHE_SLOTS", raising=False)
    assert server.main(["--tune-config", str(cfg), "-m", str(model), "--moe-cache-max-uploads", "4"]) == 0
    [cmd] = runs
    assert cmd[cmd.index("--moe-cache-slots") + 1] == "8"
    assert cmd.count("--moe-cache-max-uploads") == 1 and cmd[cmd.index("--moe-cache-max-uploads") + 1] == "4"
    assert "tune config" in capsys.readouterr().err
    # the variable form
    monkeypatch.setenv("LLAMA_ARG_TUNE_CONFIG", str(cfg))
    assert server.main(["-m", str(model)]) == 0
    assert "--moe-cache-slots" in runs[1]


def test_moecache_server_refuses_a_bad_config_without_starting(tmp_path, monkeypatch, capsys):
    server, model, runs = _fake_run(monkeypatch, tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "moecache-tune", "version": 1, "options": {"moe_cache_slots": -3}}')
    assert server.main(["--tune-config", str(bad), "-m", str(model)]) == 2
    assert runs == [] and "moe_cache_slots" in capsys.readouterr().err


def bench_result(rows):
    return {"baseline": "plain", "results": [
        {"arm": arm, "prompt": "prose", "length": n, "users": 1, "prompt_tokens": n,
         "prefill_tps": {"median": tps},
         "prefill_swap": {"swapped": 1 if swap_ms else 0, "prefill_ubatch": 2048 if swap_ms else None,
                          "swap_ms": {"median": swap_ms} if swap_ms else None}}
        for arm, n, tps, swap_ms in rows]}


def test_the_swap_s_minimum_length_comes_from_its_measured_cost():
    # without the swap 1000 t/s; swapped, 4000 t/s net plus a 300 ms swap: pays from 300/(1/1 - 1/4) = 400
    n = 16384
    swapped_tps = n / (n / 4000 + 0.3)
    rows = tune.swap_break_even(bench_result([("plain", n, 1000.0, None), ("swap", n, swapped_tps, 300.0)]))
    [r] = rows
    assert r["break_even"] == pytest.approx(400.0, rel=1e-6) and r["r1_net"] == pytest.approx(4000.0)
    # not below the swapped ubatch: the rates hold only for prompts that fill it
    assert tune.swap_options(rows) == {"prefill_ubatch": 2048, "prefill_min_tokens": 2048}
    # a costlier swap: its break-even is above the ubatch, rounded up to 64
    rows = tune.swap_break_even(bench_result([("plain", n, 1000.0, None), ("swap", n, n / (n / 4000 + 2.0), 2000.0)]))
    assert rows[0]["break_even"] == pytest.approx(2666.67, rel=1e-4)
    assert tune.swap_options(rows)["prefill_min_tokens"] == 2688


def test_a_swap_that_never_pays_leaves_it_off():
    n = 8192
    rows = tune.swap_break_even(bench_result([("plain", n, 4000.0, None), ("swap", n, n / (n / 3000 + 0.2), 200.0)]))
    assert rows[0]["break_even"] is None and tune.swap_options(rows) == {}


def test_a_bench_result_without_what_it_needs_is_refused():
    with pytest.raises(tune.SwapBenchError, match="baseline arm"):
        tune.swap_break_even(bench_result([("swap", 8192, 3000.0, 200.0)]))
    with pytest.raises(tune.SwapBenchError, match="no one-user row of an arm that swapped"):
        tune.swap_break_even(bench_result([("plain", 8192, 3000.0, None)]))


def test_main_puts_the_swap_into_the_config(trace_path, tmp_path):
    n = 16384
    res = tmp_path / "bench.json"
    res.write_text(json.dumps(bench_result([("plain", n, 1000.0, None), ("swap", n, n / (n / 4000 + 0.3), 300.0)])))
    cfg = tmp_path / "tune.json"
    assert tune.main([str(trace_path), "--slots", "8", "--swap-bench", str(res), "--write-config", str(cfg)]) == 0
    options = tune.load_config(cfg)
    assert options["prefill_ubatch"] == 2048 and options["prefill_min_tokens"] == 2048
    assert tune.config_args(options, [], {})[-4:] == ["--prefill-ubatch", "2048", "--prefill-min-tokens", "2048"]
