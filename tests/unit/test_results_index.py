"""benchmarks/results/README.md lists every result, newest first, with what its files say (date,
hardware, commit, scenario, headline ratio); it is generated and must be current."""

from __future__ import annotations

import json
from pathlib import Path

from moecache.bench import index

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_the_index_is_current():
    assert index.write_index(RESULTS, check=True) == 0, \
        "benchmarks/results/README.md is stale: run `moecache results-index`"


def test_every_result_is_listed_and_no_title_names_a_patch_number():
    text = (RESULTS / "README.md").read_text()
    for md in RESULTS.glob("*.md"):
        if md.name != "README.md":
            assert f"]({md.name})" in text, md.name
    for e in index.entries(RESULTS):
        assert "patch 0" not in index._short(e.title), e.title


def _bench_json(folder: Path, stem: str, ratios: dict[str, float]) -> None:
    results = [{"arm": "base", "prompt": "code", "length": 512, "ratios": {"decode_tps": 1.0, "prefill_tps": 1.0}}]
    results += [{"arm": arm, "prompt": "code", "length": 512, "ratios": {"decode_tps": r, "prefill_tps": 0.9}}
                for arm, r in ratios.items()]
    data = {"scenario": {"name": "cache-h200", "description": "The cache against the CPU; three budgets."},
            "moecache_commit": "abcdef1", "baseline": "base", "results": results,
            "hardware": {"cpu": "Xeon", "cores": 16, "gpus": [{"description": "NVIDIA H100"}]}}
    (folder / f"{stem}.json").write_text(json.dumps(data))
    (folder / f"{stem}.md").write_text("# Benchmark `cache-h200` — 2026-12-06\n")


def test_a_run_s_row_says_its_hardware_commit_and_best_ratio(tmp_path):
    _bench_json(tmp_path, "2026-12-06-cache-h200", {"small": 1.5, "big": 2.25})
    _bench_json(tmp_path, "2026-12-07-cache-lru-h200", {"small": 1.25})
    (tmp_path / "2026-12-05-analysis-cpu.md").write_text("# Where the time goes (patch 0077) — 2026-12-05\n")
    rows = [line for line in index.index_markdown(tmp_path).splitlines() if line.startswith("| 2026")]
    assert [r.split("|")[1].strip() for r in rows] == ["2026-12-07", "2026-12-06", "2026-12-05"]
    assert rows[0].startswith("| 2026-12-07 | [The cache against the CPU [lru]](2026-12-07-cache-lru-h200.md) "
                              "| NVIDIA H100 | `abcdef1` | `cache-h200` | decode 1.25x, prefill 0.90x")
    assert "decode 2.25x, prefill 0.90x (big, code 512 vs base)" in rows[1]
    assert "[Where the time goes](2026-12-05-analysis-cpu.md) | development CPU" in rows[2]


def test_check_fails_when_stale_and_bench_updates_an_index(tmp_path, capsys):
    _bench_json(tmp_path, "2026-12-06-cache-h200", {"small": 1.5})
    assert index.write_index(tmp_path, check=True) == 1  # no index yet
    index.update_if_indexed(tmp_path)  # a folder without an index gets none
    assert not (tmp_path / "README.md").exists()
    assert index.write_index(tmp_path) == 0 and index.write_index(tmp_path, check=True) == 0
    _bench_json(tmp_path, "2026-12-07-cache-h200", {"small": 1.5})
    assert index.write_index(tmp_path, check=True) == 1
    index.update_if_indexed(tmp_path)
    assert index.write_index(tmp_path, check=True) == 0
    assert "stale" in capsys.readouterr().out
