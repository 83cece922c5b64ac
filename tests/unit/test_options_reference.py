"""The options reference (docs/options.md) is generated from moecache.options' tables and the
launcher's flags; it must be current, and the tables must say what the series declares in
common/arg.cpp (every flag, its variable and its older names)."""

from __future__ import annotations

from pathlib import Path

from moecache.options import FEATURE_OPTION_TABLES
from moecache.orchestrator import reference

REPO = Path(__file__).resolve().parents[2]

ARG_PATCH = """\
From: moecache <moecache@localhost>
Subject: [PATCH] common: a flag

diff --git a/common/arg.cpp b/common/arg.cpp
--- a/common/arg.cpp
+++ b/common/arg.cpp
@@ -1,3 +1,12 @@
 context
+    add_opt(common_arg(
+        {{"{flag}"}}, "N",
+        "help",
+        [](common_params & params, int value) {{
+            params.x = value;
+        }}
+    ).set_env("{env}"){alias});
 context
"""


def write_patch(folder: Path, flag: str, env: str, alias: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = ARG_PATCH.format(flag=flag, env=env, alias=f'.set_env_alias("{alias}")' if alias else "")
    (folder / f"{flag.strip('-')}.patch").write_text(text)


def test_the_reference_is_current():
    current = (REPO / reference.REFERENCE).read_text()
    assert current == reference.reference_markdown(), \
        "docs/options.md is stale: run `moecache-build options-reference`"


def test_the_tables_say_what_the_series_declares():
    assert reference.drift(REPO / "patches") == []


def test_every_declared_option_is_read():
    declared = {f for o in reference.declared_options(REPO / "patches") for f in o.flags}
    assert "--moe-cache-slots" in declared and "--no-host-hugepages" in declared
    assert len(declared) >= len(reference.table_options())


def test_drift_names_a_flag_missing_from_the_tables(tmp_path):
    write_patch(tmp_path / "topic", "--moe-cache-slots", "LLAMA_ARG_MOE_CACHE_SLOTS", "LLAMA_ARG_MOE_HOT_K")
    write_patch(tmp_path / "topic", "--brand-new", "LLAMA_ARG_BRAND_NEW")
    problems = reference.drift(tmp_path)
    assert any(p.startswith("--brand-new (topic/brand-new.patch) is not in an option table") for p in problems)
    assert not any(p.startswith("--moe-cache-slots:") for p in problems)
    # and every table flag the fake series lacks
    assert any(p.startswith("--moe-cache-policy is in an option table but no patch declares it") for p in problems)


def test_drift_names_a_changed_variable_and_alias(tmp_path):
    write_patch(tmp_path / "topic", "--moe-cache-slots", "LLAMA_ARG_MOE_SLOTS")
    problems = reference.drift(tmp_path)
    assert "--moe-cache-slots: the series reads LLAMA_ARG_MOE_SLOTS, the table says LLAMA_ARG_MOE_CACHE_SLOTS" \
        in problems
    assert any(p.startswith("--moe-cache-slots: the series' older names []") for p in problems)


def test_every_option_and_launcher_flag_is_in_the_reference():
    text = reference.reference_markdown()
    for _, page, table in FEATURE_OPTION_TABLES:
        assert f"]({page})" in text
        assert (REPO / "docs" / page).is_file()
        for name, option in table.items():
            assert f"`{option.flag}`" in text
            assert f"`{option.env}`" in text
    for flag in ("--demo", "--dashboard", "--no-dashboard", "--tune-config FILE", "--plan {auto,off}",
                 "--plan-gpu-mem GIB[,GIB...]"):
        assert f"`{flag}`" in text
    assert "`LLAMA_ARG_PLAN_GPU_MEM`" in text
    assert "(env:" not in text


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / reference.REFERENCE).write_text("# old\n")
    assert reference.write(tmp_path, check=True) == 1
    assert "stale" in capsys.readouterr().out
    assert reference.write(tmp_path) == 0
    assert reference.write(tmp_path, check=True) == 0
