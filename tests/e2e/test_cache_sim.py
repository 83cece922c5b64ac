"""`moecache cache-sim`: routing traces replayed through the library's own policy code."""

from __future__ import annotations

import json
import random

import pytest

from moecache import cache_sim


def write_trace(path, n_tokens=300, n_layer=2, n_expert=16, n_used=4, hot=6, seed=1):
    """Skewed routing: three quarters of the picks from `hot` experts."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for t in range(n_tokens):
            layers = {}
            for l in range(n_layer):
                ids = []
                while len(ids) < n_used:
                    e = rng.randrange(hot) if rng.random() < 0.75 else rng.randrange(n_expert)
                    if e not in ids:
                        ids.append(e)
                layers[str(l)] = ids
            f.write(json.dumps({"seq": 0, "pos": t, "cached": True, "layers": layers}) + "\n")
    return path


def test_every_expert_cached_hits_after_the_fill(tmp_path):
    tr = cache_sim.load_trace(write_trace(tmp_path / "t.jsonl"))
    assert tr.layers == [0, 1] and tr.n_used == 4 and tr.n_expert == 16
    r = cache_sim.simulate(tr, slots=16, policy="lru", max_uploads=16, warmup=20)
    assert r["hit_rate"] > 0.95 and r["evictions"] == 0
    assert cache_sim.simulate(tr, slots=0)["hit_rate"] == 0.0


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_skewed_routing_beats_the_uniform_share(tmp_path, policy):
    tr = cache_sim.load_trace(write_trace(tmp_path / "t.jsonl"))
    r = cache_sim.simulate(tr, slots=6, policy=policy, interval=16, warmup=50)
    # 6 of 16 slots: uniform routing would hit 37.5%; the skew makes the hot six worth more
    assert r["hit_rate"] > 0.5, r
    assert r["hits"] + r["misses"] == (300 - 50) * 4 * 2
    stats = cache_sim.routing_stats(tr, [6])
    assert stats["top_s_share"][6] >= r["hit_rate"] - 0.05  # hindsight is an upper bound (up to noise)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    assert cache_sim.main([str(trace), "--slots", "4,8", "--policy", "freq,lru", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "distinct experts per layer" in text and "lru" in text
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4 and {r["slots"] for r in data["results"]} == {4, 8}


def test_bad_input_is_named(tmp_path, capsys):
    assert cache_sim.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\"no\": 1}\n")
    assert cache_sim.main([str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_sim.main([str(bad), "--policy", "mru"])


def test_record_a_trace_of_real_text(tiny_model, tmp_path):
    """--record runs real text through a model and writes the trace it then replays."""
    trace = tmp_path / "tiny.jsonl"
    text = tmp_path / "t.txt"
    text.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 20)
    assert cache_sim.main([str(trace), "--record", str(tiny_model), "--text", str(text), "--tokens", "200",
                           "--threads", "2", "--slots", "4"]) == 0
    tr = cache_sim.load_trace(trace)
    assert len(tr.tokens) == 200 and tr.n_used == 4
    assert tr.layers == [0, 1, 2]  # the prompt's tokens lack the last layer (only the output row runs it)


def test_slots_by_layer_beat_the_even_share_where_layers_differ(tmp_path, capsys):
    """Layer 0 routes among 5 experts, layer 1 over all 16: sized from the first half, layer 0 gives slots to
    layer 1, and the second half hits more than with the even share. Where both layers route alike, the
    sizes stay near even and the hit rate with them."""
    rng = random.Random(3)
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for t in range(400):
            layers = {"0": rng.sample(range(5), 4), "1": rng.sample(range(16), 4)}
            f.write(json.dumps({"seq": 0, "pos": t, "cached": True, "layers": layers}) + "\n")
    tr = cache_sim.load_trace(path)
    sizes = cache_sim.layer_slots_from(tr, 8, 200)
    assert sizes[0] < 8 < sizes[1] and sum(sizes.values()) == 16, sizes
    even = cache_sim.simulate(tr, 8, "freq", interval=16, warmup=200)
    split = cache_sim.simulate(tr, 8, "freq", interval=16, warmup=200, layer_slots=sizes)
    assert split["hit_rate"] > even["hit_rate"] + 0.05, (split, even)
    out = tmp_path / "r.json"
    assert cache_sim.main([str(path), "--slots", "8", "--policy", "freq", "--by-layer", "--json", str(out)]) == 0
    assert "slots by layer, sized from the first 200 tokens" in capsys.readouterr().out
    by = [r for r in json.loads(out.read_text())["results"] if r.get("by_layer")]
    assert len(by) == 1 and by[0]["layer_slots"] == {"0": sizes[0], "1": sizes[1]}
    alike = cache_sim.load_trace(write_trace(tmp_path / "alike.jsonl"))
    assert max(cache_sim.layer_slots_from(alike, 6, 150).values()) - 6 <= 2
