"""`moecache calibrate-routing`: the textbook LRU it replays, the least-squares choice, the CLI's
errors, and the Qwen3-Next-80B-A3B preset's shapes."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.synth import calibration as rc
from moecache import synth


def test_plain_lru_counts_as_the_textbook_does():
    # 2 slots: a b | a c | b a  ->  a,b miss; a hit, c miss (evicts b); b miss (evicts a), a miss (evicts c)
    ids = np.array([[0, 1], [0, 2], [1, 0]])
    assert rc.plain_lru_hits(ids, 2) == (1, 6)
    # every expert fits: only the first touch of each misses
    assert rc.plain_lru_hits(ids, 3) == (3, 6)


def test_calibrate_picks_the_least_squares_strength(monkeypatch):
    published = rc.PublishedLRU("m", "src", {4: 0.5, 8: 0.8})
    fake = {0.0: {4: 0.1, 8: 0.2}, 1.0: {4: 0.45, 8: 0.85}, 2.0: {4: 0.9, 8: 0.99}}
    monkeypatch.setattr(rc, "lru_hit_rates", lambda preset, tokens, st, slots, seed=0, warmup=0, context_mix=0.0: fake[st])
    r = rc.calibrate("tiny", [1, 2, 3], published, strengths=(0.0, 1.0, 2.0))
    assert r["best"]["routing_strength"] == 1.0
    assert [row["routing_strength"] for row in r["rows"]] == [0.0, 1.0, 2.0]
    assert abs(r["best"]["rms_error"] - 0.05) < 1e-12
    md = rc.report_markdown(r, ["t.txt"])
    assert "| 1 **(best)** | 0 | 45.0% | 85.0% | 5.0 |" in md


def test_lru_hit_rates_grow_with_the_cache():
    tokens = list(range(1000, 1400))
    rates = rc.lru_hit_rates("tiny", tokens, 1.0, [2, 8, 16])
    assert 0.0 <= rates[2] < rates[8] < rates[16] <= 1.0


def test_the_modelled_context_term_makes_routing_local():
    """context_mix 0 is the token-identity routing exactly; a context term (uniform attention over the
    earlier positions) makes consecutive tokens share experts, so a small LRU cache hits more."""
    from moecache import synth

    tokens = [int(t) for t in (list(range(2000, 2300)) * 2)]
    base = synth.predicted_trace("tiny", tokens)
    assert (synth.predicted_trace("tiny", tokens, context_mix=0.0) == base).all()
    mixed = synth.predicted_trace("tiny", tokens, context_mix=1.0)
    assert mixed.shape == base.shape and (mixed != base).any()
    plain = rc.lru_hit_rates("tiny", tokens, 1.0, [4])[4]
    local = rc.lru_hit_rates("tiny", tokens, 1.0, [4], context_mix=1.0)[4]
    assert local > plain + 0.05, (plain, local)


def test_cli_errors(tmp_path, capsys):
    assert rc.main(["qwen3-30b-a3b", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    assert rc.main(["qwen3-30b-a3b", "--text", str(short), "--tokens", "100"]) == 2
    assert "the text has only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rc.main(["qwen3-30b-a3b", "--text", str(short), "--strengths", "1,x"])
    with pytest.raises(SystemExit):
        rc.main(["qwen3-30b-a3b", "--text", str(short), "--context-mix", "-1"])


def test_the_qwen3_next_preset_has_its_shapes():
    p = synth.PRESETS["qwen3-next-80b-a3b"]
    assert (p.n_layer, p.n_embd, p.n_expert, p.n_expert_used, p.n_ff_exp) == (48, 2048, 512, 10, 512)
    assert (p.n_head, p.n_head_kv, p.head_dim) == (16, 2, 256)
    assert set(rc.PUBLISHED) <= set(synth.PRESETS)
