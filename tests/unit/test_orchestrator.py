"""The patch-series orchestrator: apply / edit / export / verify round trip and its errors.

These run on a small stand-in upstream tree (MOECACHE_LLAMA_SRC + force), so they are fast;
one test checks the real pinned tree and the project's own series.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moecache.orchestrator import series, upstream
from moecache.orchestrator.upstream import BuildError

REPO_ROOT = Path(__file__).resolve().parents[2]

UPSTREAM_FILES = {
    "CMakeLists.txt": "project(llama)\n",
    "include/llama.h": "#pragma once\nint llama_answer(void);\n",
    "src/llama-graph.cpp": "".join(f"// line {i}\n" for i in range(1, 41)) + "int llama_answer(void) { return 42; }\n",
    "ggml/src/ggml.c": "int ggml_one(void) { return 1; }\n",
}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *series.GIT_ID, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A moecache-like checkout (patches/series) and a stand-in upstream tree."""
    up = tmp_path / "upstream"
    for rel, text in UPSTREAM_FILES.items():
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_text(text)
    root = tmp_path / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("# series\n")
    (root / "pyproject.toml").write_text("[project]\nname='x'\n")
    monkeypatch.setenv("MOECACHE_LLAMA_SRC", str(up))
    monkeypatch.setenv("MOECACHE_LLAMA_SRC_FORCE", "1")
    return series.Repo(root), up


def commit_change(vendor: Path, rel: str, old: str, new: str, message: str) -> None:
    p = vendor / rel
    p.write_text(p.read_text().replace(old, new))
    git(vendor, "commit", "-q", "-am", message)


def test_round_trip_apply_edit_export_verify(project):
    repo, up = project
    series.apply(repo, quiet=True)
    assert (repo.vendor / "src/llama-graph.cpp").read_text() == UPSTREAM_FILES["src/llama-graph.cpp"]
    assert "applied, up to date" in series.status(repo)

    series.edit(repo, quiet=True)
    assert git(repo.vendor, "log", "--format=%s").strip().splitlines() == [f"upstream llama.cpp {upstream.PIN.commit}"]
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 43; /* skip ids */",
                  "ggml: mul mat id skip")
    commit_change(repo.vendor, "include/llama.h", "int llama_answer(void);",
                  "int llama_answer(void);\nint llama_moe_cache_slots(void);", "moe hot expert cache")
    assert "NOT exported" in series.status(repo)

    names = series.export(repo, quiet=True)
    assert names == ["0001-ggml-mul-mat-id-skip.patch", "0002-moe-hot-expert-cache.patch"]
    assert series.read_series(repo) == names
    assert "# series" in repo.series_file.read_text()  # comments survive an export
    assert "return 43;" in (repo.patches / names[0]).read_text()
    series.verify(repo, quiet=True)
    assert "exported" in series.status(repo) and "NOT exported" not in series.status(repo)

    # A plain apply from the exported series gives the same tree as the edit repo had.
    edited = (repo.vendor / "src/llama-graph.cpp").read_text()
    series.apply(repo, force=True, quiet=True)
    assert not (repo.vendor / ".git").exists()
    assert (repo.vendor / "src/llama-graph.cpp").read_text() == edited
    assert "llama_moe_cache_slots" in (repo.vendor / "include/llama.h").read_text()
    series.verify(repo, quiet=True)

    # And edit rebuilds the same commits from the patches.
    series.edit(repo, quiet=True)
    subjects = git(repo.vendor, "log", "--reverse", "--format=%s", "upstream..HEAD").split("\n")
    assert subjects[:2] == ["ggml: mul mat id skip", "moe hot expert cache"]
    series.verify(repo, quiet=True)


def test_apply_inside_a_git_checkout(project):
    """The project checkout is itself a git repository: patches must still land in vendor/."""
    repo, _ = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 44;", "answer")
    series.export(repo, quiet=True)
    git(repo.root, "init", "-q")
    git(repo.root, "add", "patches", "pyproject.toml")
    git(repo.root, "commit", "-q", "-m", "project")
    series.apply(repo, force=True, quiet=True)
    assert "return 44;" in (repo.vendor / "src/llama-graph.cpp").read_text()
    series.verify(repo, quiet=True)


def test_export_again_keeps_files_and_drops_removed_patches(project):
    repo, _ = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "ggml/src/ggml.c", "return 1;", "return 2;", "first topic")
    commit_change(repo.vendor, "include/llama.h", "#pragma once", "#pragma once // x", "second topic")
    series.export(repo, quiet=True)
    # Drop the second commit and export again: its patch file goes away.
    git(repo.vendor, "reset", "-q", "--hard", "HEAD~1")
    assert series.export(repo, quiet=True) == ["0001-first-topic.patch"]
    assert not (repo.patches / "0002-second-topic.patch").exists()
    series.verify(repo, quiet=True)


def test_corrupt_patch_names_patch_file_and_hunk(project):
    repo, up = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 7;", "change answer")
    [name] = series.export(repo, quiet=True)
    # Upstream moved under the patch: the context no longer matches.
    (up / "src/llama-graph.cpp").write_text(UPSTREAM_FILES["src/llama-graph.cpp"].replace("return 42;", "return 41;"))
    with pytest.raises(BuildError) as e:
        series.apply(repo, force=True, quiet=True)
    msg = str(e.value)
    assert name in msg and "src/llama-graph.cpp" in msg and "hunk #1" in msg


def test_garbage_patch_file_is_reported(project):
    repo, _ = project
    (repo.patches / "0001-broken.patch").write_text("--- a/include/llama.h\n+++ b/include/llama.h\n@@ -1,2 +1,2 @@\nnot a diff line\n")
    repo.series_file.write_text("0001-broken.patch\n")
    with pytest.raises(BuildError, match="0001-broken.patch does not apply"):
        series.apply(repo, quiet=True)
    assert not repo.vendor.exists()  # nothing half-applied left behind


def test_series_naming_a_missing_patch(project):
    repo, _ = project
    repo.series_file.write_text("0001-nope.patch\n")
    with pytest.raises(BuildError, match="patches/0001-nope.patch does not exist"):
        series.read_series(repo)


def test_hand_edit_of_applied_tree_fails_verify(project):
    repo, _ = project
    series.apply(repo, quiet=True)
    (repo.vendor / "ggml/src/ggml.c").write_text("tampered\n")
    with pytest.raises(BuildError, match="differs: ggml/src/ggml.c"):
        series.verify(repo, quiet=True)
    assert "applied" in series.status(repo)


def test_apply_refuses_to_discard_unexported_work(project):
    repo, _ = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "ggml/src/ggml.c", "return 1;", "return 3;", "unexported work")
    with pytest.raises(BuildError, match="not exported"):
        series.apply(repo, quiet=True)
    series.edit(repo, quiet=True)  # already an edit repo: left as it is
    assert "unexported work" in git(repo.vendor, "log", "-1", "--format=%s")
    (repo.vendor / "ggml/src/ggml.c").write_text("dirty\n")
    with pytest.raises(BuildError, match="uncommitted"):
        series.export(repo, quiet=True)
    series.apply(repo, force=True, quiet=True)
    assert (repo.vendor / "ggml/src/ggml.c").read_text() == UPSTREAM_FILES["ggml/src/ggml.c"]


def test_if_needed_skips_an_up_to_date_tree(project):
    repo, _ = project
    series.apply(repo, quiet=True)
    marker = repo.vendor / "src/llama-graph.cpp"
    before = marker.stat().st_mtime_ns
    series.apply(repo, if_needed=True, quiet=True)
    assert marker.stat().st_mtime_ns == before


def test_wrong_llama_src_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("MOECACHE_LLAMA_SRC_FORCE", raising=False)
    # Not a llama.cpp tree at all.
    monkeypatch.setenv("MOECACHE_LLAMA_SRC", str(tmp_path))
    with pytest.raises(BuildError, match="not a llama.cpp source tree"):
        upstream.pristine_tree(quiet=True)
    # A llama.cpp-looking tree with other sources.
    for rel, text in UPSTREAM_FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    with pytest.raises(BuildError, match="differ from the pinned release.*MOECACHE_LLAMA_SRC_FORCE"):
        upstream.pristine_tree(quiet=True)
    # A git checkout of another commit.
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "other")
    head = git(tmp_path, "rev-parse", "HEAD").strip()
    with pytest.raises(BuildError, match=f"is at commit {head[:9]}.*git checkout {upstream.PIN.commit}"):
        upstream.pristine_tree(quiet=True)
    monkeypatch.setenv("MOECACHE_LLAMA_SRC_FORCE", "1")
    assert upstream.pristine_tree(quiet=True) == tmp_path.resolve()


def test_bad_sdist_checksum(tmp_path, monkeypatch):
    fake = tmp_path / upstream.PIN.sdist_file
    fake.write_bytes(b"not the release")
    monkeypatch.setenv("MOECACHE_SDIST", str(fake))
    with pytest.raises(BuildError, match="sha256"):
        upstream.fetch_sdist(quiet=True)


def test_cli_reports_errors_without_traceback(project):
    repo, _ = project
    repo.series_file.write_text("0009-missing.patch\n")
    r = subprocess.run([sys.executable, "-m", "moecache.orchestrator", "--repo", str(repo.root), "apply"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    assert r.returncode == 1
    assert "error: patches/series names '0009-missing.patch'" in r.stderr and "Traceback" not in r.stderr


def test_pinned_tree_and_project_series_verify(monkeypatch):
    """The real pin: the pristine tree has the pinned fingerprint and the project's series applies."""
    monkeypatch.delenv("MOECACHE_LLAMA_SRC", raising=False)
    tree = upstream.pristine_tree(quiet=True)
    assert upstream.tree_fingerprint(tree) == upstream.PIN.fingerprint
    # The same tree given as MOECACHE_LLAMA_SRC is accepted by its fingerprint (it has no git history).
    monkeypatch.delenv("MOECACHE_LLAMA_SRC_FORCE", raising=False)
    monkeypatch.setenv("MOECACHE_LLAMA_SRC", str(tree))
    assert upstream.pristine_tree(quiet=True) == tree.resolve()
    monkeypatch.delenv("MOECACHE_LLAMA_SRC")
    repo = series.Repo(REPO_ROOT)
    names = series.read_series(repo)
    assert names == [n for n in names if (repo.patches / n).is_file()]
    if series.applied_state(repo) != "edit":
        series.verify(repo, quiet=True)


def test_orchestrator_runs_without_numpy():
    """CMake runs `python -m moecache.orchestrator` in the build environment, which has no numpy."""
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guarded(name, *a, **k):\n"
        "    if name.split('.')[0] == 'numpy':\n"
        "        raise ImportError('numpy is not there during the build')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guarded\n"
        "sys.argv = ['moecache-build', '--help']\n"
        "import runpy\n"
        "runpy.run_module('moecache.orchestrator', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    assert r.returncode == 0, r.stderr
    assert "apply" in r.stdout
