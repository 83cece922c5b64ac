"""`moecache bench`'s plots (bench/plots.py) on a made-up run: the PNGs are written beside the .md and
linked from it; without matplotlib the report says how to get them and nothing fails."""

from __future__ import annotations

import builtins

import pytest

from moecache.bench import plots
from moecache.bench.report import write_results


def _stat(m):
    return {"median": m, "min": 0.9 * m, "max": 1.1 * m, "n": 3}


def made_up_run() -> dict:
    arms = [{"name": "stock", "baseline": True, "description": "", "args": [], "server_args": [], "env": {},
             "command": [], "error": None},
            {"name": "cache16", "baseline": False, "description": "", "args": [], "server_args": [], "env": {},
             "command": [], "error": None, "moe_cache": {"n_slots": 16, "hit_rate": 0.55}},
            {"name": "cache64", "baseline": False, "description": "", "args": [], "server_args": [], "env": {},
             "command": [], "error": None, "moe_cache": {"n_slots": 64, "hit_rate": 0.91}}]
    results = [{"arm": a["name"], "prompt": p, "length": n, "users": 1, "prefill_tps": _stat(1000.0 * (i + 1)),
                "decode_tps": _stat(30.0 * (i + 1))}
               for i, a in enumerate(arms) for p, n in (("code", 4096), ("prose", 512))]
    return {"date": "2026-12-04", "scenario": {"name": "made-up", "file": "x.toml", "max_tokens": 8,
                                               "repetitions": 3, "warmup": 0, "ignore_eos": True, "users": [1]},
            "moecache_commit": "abc1234", "llama_cpp_commit": "0c1e57098", "hardware": {}, "baseline": "stock",
            "model": {"description": "m", "path": "m.gguf"}, "started": "now", "arms": arms, "results": results}


def test_the_plots_are_written_and_linked(tmp_path):
    pytest.importorskip("matplotlib")
    md, js = write_results(made_up_run(), tmp_path, plots=True)
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted([f"{md.stem}-rates.png", f"{md.stem}-hit-rate.png"])
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"![{name}]({name})" in md.read_text()


def test_no_cache_arm_no_hit_rate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = made_up_run()
    for a in run["arms"]:
        a.pop("moe_cache", None)
    md, _ = write_results(run, tmp_path, plots=True)
    assert [p.name for p in tmp_path.glob("*.png")] == [f"{md.stem}-rates.png"]


def test_without_matplotlib_the_report_says_how(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    md, _ = write_results(made_up_run(), tmp_path, plots=True)
    assert not list(tmp_path.glob("*.png"))
    assert plots.PLOTS_MISSING in md.read_text()


def test_partial_writes_draw_nothing(tmp_path):
    write_results(made_up_run(), tmp_path)
    assert not list(tmp_path.glob("*.png"))
