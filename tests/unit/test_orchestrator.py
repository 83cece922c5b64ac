"""The patch-series orchestrator: apply / edit / export / verify / rebase and their errors.

These run on a small stand-in upstream tree (MOECACHE_LLAMA_SRC + force), so they are fast; the last
tests check the real pinned tree and the project's own series: its headers, the edit/export round trip
byte for byte, and a rebase onto a copy of the pin with one hook's context changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moecache.orchestrator import headers, rebase, series, upstream
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
    # what the patches' Tests: and Docs: fields name
    for rel in ("tests/test_answer.py", "docs/answer.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    monkeypatch.setenv("MOECACHE_LLAMA_SRC", str(up))
    monkeypatch.setenv("MOECACHE_LLAMA_SRC_FORCE", "1")
    return series.Repo(root), up


def message(subject: str, topic: str = "answer", status: str = "Pending") -> str:
    return (f"{subject}\n\nWhy and what it measured.\n\nTopic: {topic}\nUpstream-Status: {status}\n"
            "Tests: tests/test_answer.py\nDocs: docs/answer.md\n")


def commit_change(vendor: Path, rel: str, old: str, new: str, subject: str, topic: str = "answer") -> None:
    p = vendor / rel
    p.write_text(p.read_text().replace(old, new))
    git(vendor, "commit", "-q", "-am", message(subject, topic))


def test_round_trip_apply_edit_export_verify(project):
    repo, up = project
    series.apply(repo, quiet=True)
    assert (repo.vendor / "src/llama-graph.cpp").read_text() == UPSTREAM_FILES["src/llama-graph.cpp"]
    assert "applied, up to date" in series.status(repo)

    series.edit(repo, quiet=True)
    assert git(repo.vendor, "log", "--format=%s").strip().splitlines() == [f"upstream llama.cpp {upstream.PIN.commit}"]
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 43; /* skip ids */",
                  "ggml: MUL_MAT_ID skip ids", topic="ggml-ops")
    commit_change(repo.vendor, "include/llama.h", "int llama_answer(void);",
                  "int llama_answer(void);\nint llama_moe_cache_slots(void);", "llama: hot-expert cache",
                  topic="moe-cache")
    assert "NOT exported" in series.status(repo)

    names = series.export(repo, quiet=True)
    assert names == ["ggml-ops/mul-mat-id-skip-ids.patch", "moe-cache/hot-expert-cache.patch"]
    assert series.read_series(repo) == names
    assert "# series" in repo.series_file.read_text()  # comments survive an export
    assert "# moe-cache\nmoe-cache/hot-expert-cache.patch" in repo.series_file.read_text()  # a section per topic
    st = series.status(repo)
    assert "2 patch(es) in 2 topic(s)" in st and "ggml-ops" in st and "hot-expert-cache" in st
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
    assert subjects[:2] == ["ggml: MUL_MAT_ID skip ids", "llama: hot-expert cache"]
    series.verify(repo, quiet=True)
    # ... and exporting them again changes no byte
    before = {n: (repo.patches / n).read_bytes() for n in names}
    series.export(repo, quiet=True)
    assert {n: (repo.patches / n).read_bytes() for n in names} == before


def test_apply_inside_a_git_checkout(project):
    """The project checkout is itself a git repository: patches must still land in vendor/."""
    repo, _ = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 44;", "llama: answer")
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
    commit_change(repo.vendor, "ggml/src/ggml.c", "return 1;", "return 2;", "ggml: first change", topic="first")
    commit_change(repo.vendor, "include/llama.h", "#pragma once", "#pragma once // x", "llama: second", topic="second")
    series.export(repo, quiet=True)
    # Drop the second commit and export again: its patch file and its topic folder go away.
    git(repo.vendor, "reset", "-q", "--hard", "HEAD~1")
    assert series.export(repo, quiet=True) == ["first/first-change.patch"]
    assert not (repo.patches / "second").exists()
    series.verify(repo, quiet=True)


def test_corrupt_patch_names_patch_file_and_hunk(project):
    repo, up = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "src/llama-graph.cpp", "return 42;", "return 7;", "llama: change answer")
    [name] = series.export(repo, quiet=True)
    # Upstream moved under the patch: the context no longer matches.
    (up / "src/llama-graph.cpp").write_text(UPSTREAM_FILES["src/llama-graph.cpp"].replace("return 42;", "return 41;"))
    with pytest.raises(BuildError) as e:
        series.apply(repo, force=True, quiet=True)
    msg = str(e.value)
    assert name in msg and "src/llama-graph.cpp" in msg and "hunk #1" in msg


def test_garbage_patch_file_is_reported(project):
    repo, _ = project
    (repo.patches / "t").mkdir()
    (repo.patches / "t/broken.patch").write_text("--- a/include/llama.h\n+++ b/include/llama.h\n@@ -1,2 +1,2 @@\nnot a diff line\n")
    repo.series_file.write_text("t/broken.patch\n")
    with pytest.raises(BuildError, match="t/broken.patch does not apply"):
        series.apply(repo, quiet=True)
    assert not repo.vendor.exists()  # nothing half-applied left behind


def test_series_naming_a_missing_patch(project):
    repo, _ = project
    repo.series_file.write_text("t/nope.patch\n")
    with pytest.raises(BuildError, match="patches/t/nope.patch does not exist"):
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
    commit_change(repo.vendor, "ggml/src/ggml.c", "return 1;", "return 3;", "ggml: unexported work")
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
    repo.series_file.write_text("t/missing.patch\n")
    r = subprocess.run([sys.executable, "-m", "moecache.orchestrator", "--repo", str(repo.root), "apply"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    assert r.returncode == 1
    assert "error: patches/series names 't/missing.patch'" in r.stderr and "Traceback" not in r.stderr


def exported_project(project, n: int = 2):
    """The stand-in project with a series of n exported patches in two topics."""
    repo, up = project
    series.edit(repo, quiet=True)
    commit_change(repo.vendor, "src/llama-graph.cpp", "// line 20\n", "// line 20 hooked\n", "llama: a hook", "hooks")
    if n > 1:
        commit_change(repo.vendor, "ggml/src/ggml.c", "return 1;", "return 11;", "ggml: a kernel", "kernels")
    series.export(repo, quiet=True)
    series.apply(repo, force=True, quiet=True)
    return repo, up


def rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (old, text[:400])
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("damage, expect", [
    (("Upstream-Status: Pending", "Upstream-Status: maybe"), "'Upstream-Status: maybe' is not one of"),
    (("Topic: hooks\n", ""), "no 'Topic:' field"),
    (("Tests: tests/test_answer.py\n", ""), "no 'Tests:' field"),
    (("Docs: docs/answer.md", "Docs: docs/nowhere.md"), "'Docs:' names docs/nowhere.md, which is not a file"),
    (("Tests: tests/test_answer.py", "Tests: tests/test_gone.py"), "'Tests:' names tests/test_gone.py"),
    (("Topic: hooks", "Topic: kernels"), "'Topic: kernels' but the file is in patches/hooks/"),
    (("Subject: [PATCH] llama: a hook", "Subject: [PATCH] a hook"), "has no component prefix"),
    (("Subject: [PATCH] llama: a hook", "Subject: [PATCH] llama: another hook"),
     "its subject makes it hooks/another-hook.patch"),
    (("From: moecache <moecache@localhost>", "From: someone <x@y>"), "the series has one: 'moecache <moecache@localhost>'"),
    (("Why and what it measured.\n", ""), "the message has no body"),
])
def test_verify_fails_on_a_bad_header(project, damage, expect):
    repo, _ = exported_project(project, n=1)
    series.verify(repo, quiet=True)
    rewrite(repo.patches / "hooks/a-hook.patch", *damage)
    with pytest.raises(BuildError, match=re.escape(expect)):
        series.verify(repo, quiet=True)


def test_verify_fails_on_files_the_series_does_not_match(project):
    repo, _ = exported_project(project)
    text = repo.series_file.read_text()
    # a patch file that series does not list
    (repo.patches / "hooks/stray.patch").write_text((repo.patches / "hooks/a-hook.patch").read_text())
    with pytest.raises(BuildError, match=r"patches/hooks/stray.patch is not in patches/series"):
        series.verify(repo, quiet=True)
    (repo.patches / "hooks/stray.patch").unlink()
    # a series entry twice
    repo.series_file.write_text(text + "hooks/a-hook.patch\n")
    with pytest.raises(BuildError, match="names 'hooks/a-hook.patch' twice"):
        series.verify(repo, quiet=True)
    # an entry without its file
    repo.series_file.write_text(text + "hooks/gone.patch\n")
    with pytest.raises(BuildError, match="patches/hooks/gone.patch does not exist"):
        series.verify(repo, quiet=True)
    # an entry outside a topic folder
    repo.series_file.write_text(text + "0001-old-style.patch\n")
    with pytest.raises(BuildError, match="not 'topic/name.patch'"):
        series.verify(repo, quiet=True)
    repo.series_file.write_text(text)
    series.verify(repo, quiet=True)


def test_verify_refuses_a_patch_that_creates_a_file(project):
    repo, _ = project
    series.edit(repo, quiet=True)
    (repo.vendor / "src/llama-new.cpp").write_text("int x;\n")
    git(repo.vendor, "add", "src/llama-new.cpp")
    git(repo.vendor, "commit", "-q", "-m", message("llama: a new file", "hooks"))
    series.export(repo, quiet=True)
    with pytest.raises(BuildError, match="creates src/llama-new.cpp; moecache's own files live in native/"):
        series.verify(repo, quiet=True)


def test_export_needs_a_topic(project):
    repo, _ = project
    series.edit(repo, quiet=True)
    (repo.vendor / "ggml/src/ggml.c").write_text("int ggml_one(void) { return 5; }\n")
    git(repo.vendor, "commit", "-q", "-am", "ggml: no fields")
    with pytest.raises(BuildError, match="has no valid 'Topic:' field"):
        series.export(repo, quiet=True)


def test_rebase_onto_a_clean_tree_keeps_every_patch(project, tmp_path):
    repo, up = exported_project(project)
    new = tmp_path / "new-upstream"
    shutil.copytree(up, new)
    rewrite(new / "src/llama-graph.cpp", "// line 1\n", "// line 1, upstream moved on\n")
    before = {n: (repo.patches / n).read_text() for n in series.read_series(repo)}
    names = rebase.rebase(repo, onto=new, quiet=True)
    assert names == list(before)
    assert "// line 20 hooked" in (repo.vendor / "src/llama-graph.cpp").read_text()
    assert "upstream moved on" in (repo.vendor / "src/llama-graph.cpp").read_text()
    # the patches now carry the new tree's context; the tag upstream is the new tree
    assert git(repo.vendor, "show", "upstream:src/llama-graph.cpp").startswith("// line 1, upstream moved on")


def test_rebase_stops_at_a_conflict_and_continues(project, tmp_path):
    repo, up = exported_project(project)
    new = tmp_path / "new-upstream"
    shutil.copytree(up, new)
    # upstream rewrote the line the hook changes, and the kernel's patch is upstream's now
    rewrite(new / "src/llama-graph.cpp", "// line 20\n", "// line 20, rewritten upstream\n")
    rewrite(new / "ggml/src/ggml.c", "return 1;", "return 11;")
    with pytest.raises(BuildError) as e:
        rebase.rebase(repo, onto=new, quiet=True)
    msg = str(e.value)
    assert "patch hooks/a-hook.patch ('llama: a hook') does not apply" in msg
    assert "src/llama-graph.cpp: hunk #1 (@@ -17,7 +17,7 @@), conflict at line" in msg
    assert "moecache-build rebase --continue" in msg
    assert "rebasing the series onto" in rebase.state(repo)
    with pytest.raises(BuildError, match="middle of a rebase"):
        series.export(repo, quiet=True)
    # the developer resolves it: upstream's new line, with the hook
    f = repo.vendor / "src/llama-graph.cpp"
    text = f.read_text()
    start, end = text.index("<<<<<<< "), text.index(">>>>>>> ")
    end = text.index("\n", end) + 1
    f.write_text(text[:start] + "// line 20, rewritten upstream, hooked\n" + text[end:])
    out = subprocess.run([sys.executable, "-m", "moecache.orchestrator", "--repo", str(repo.root),
                          "rebase", "--continue"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert "dropped (upstream holds their changes" in out.stdout and "kernels/a-kernel.patch" in out.stdout
    assert series.read_series(repo) == ["hooks/a-hook.patch"]
    assert not (repo.patches / "kernels").exists()
    assert "rewritten upstream, hooked" in (repo.patches / "hooks/a-hook.patch").read_text()
    assert rebase.state(repo) is None
    # the exported series applies to the new tree as it is
    tree = tmp_path / "check"
    shutil.copytree(new, tree)
    for n in series.read_series(repo):
        series.apply_patch(tree, repo.patches / n)
    assert (tree / "src/llama-graph.cpp").read_text() == f.read_text()


def test_rebase_abort_goes_back_to_the_pin(project, tmp_path):
    repo, up = exported_project(project)
    before = {n: (repo.patches / n).read_bytes() for n in series.read_series(repo)}
    new = tmp_path / "new-upstream"
    shutil.copytree(up, new)
    rewrite(new / "src/llama-graph.cpp", "// line 20\n", "// line 20, rewritten upstream\n")
    with pytest.raises(BuildError):
        rebase.rebase(repo, onto=new, quiet=True)
    rebase.rebase(repo, abort=True, quiet=True)
    assert rebase.state(repo) is None
    assert {n: (repo.patches / n).read_bytes() for n in series.read_series(repo)} == before
    series.verify(repo, quiet=True)
    with pytest.raises(BuildError, match="no rebase is in progress"):
        rebase.rebase(repo, cont=True, quiet=True)


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


def project_copy(tmp_path: Path) -> series.Repo:
    """The project's own series (and the files its headers name) in a scratch checkout."""
    root = tmp_path / "proj"
    root.mkdir()
    for rel in ("patches", "tests", "docs"):
        shutil.copytree(REPO_ROOT / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__", ".models"))
    shutil.copy(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    return series.Repo(root)


def test_project_series_headers_and_files(monkeypatch):
    """Every patch of the project has a complete header, lives in its topic's folder and creates no file."""
    repo = series.Repo(REPO_ROOT)
    assert series.check_series(repo) == []
    names = series.read_series(repo)
    assert len(series.topics(names)) >= 5 and all("/" in n for n in names)
    for n in names:
        assert not headers.parse_patch(repo.patches / n).new_files, n


def test_project_series_edit_export_round_trip(tmp_path, monkeypatch):
    """edit then export reproduces patches/ (and series) byte for byte."""
    monkeypatch.delenv("MOECACHE_LLAMA_SRC", raising=False)
    monkeypatch.delenv("MOECACHE_LLAMA_SRC_FORCE", raising=False)
    repo = project_copy(tmp_path)
    before = {p.relative_to(repo.patches).as_posix(): p.read_bytes() for p in repo.patches.rglob("*") if p.is_file()}
    series.edit(repo, quiet=True)
    series.export(repo, quiet=True)
    after = {p.relative_to(repo.patches).as_posix(): p.read_bytes() for p in repo.patches.rglob("*") if p.is_file()}
    assert after.keys() == before.keys()
    assert [k for k in before if before[k] != after[k]] == []
    series.verify(repo, quiet=True)


def _hook_line(repo: series.Repo, names: list[str]) -> tuple[str, str, int, str]:
    """A context line right beside a hook's added lines that no other patch touches:
    (patch, file, hunk number, the line)."""
    touched: dict[str, list[tuple[str, int, int]]] = {}
    parsed = []
    for n in names:
        file = None
        hunk = 0
        for line in (repo.patches / n).read_text().splitlines():
            if line.startswith("diff --git "):
                file, hunk = line.split(" b/", 1)[1], 0
            elif line.startswith("@@"):
                hunk += 1
                m = re.match(r"@@ -(\d+),?(\d*)", line)
                start, count = int(m.group(1)), int(m.group(2) or 1)
                touched.setdefault(file, []).append((n, start, start + count))
                parsed.append([n, file, hunk, []])
            elif parsed and line[:1] in " +-" and not line.startswith(("+++", "---")):
                parsed[-1][3].append(line)
    for n, file, hunk, body in parsed:
        if not file.startswith("src/llama-graph") or len([t for t in touched[file] if t[0] != n]) > 20:
            continue
        for i in range(1, len(body)):
            if body[i].startswith("+") and body[i - 1].startswith(" ") and len(body[i - 1].strip()) > 12:
                others = [t for t in touched[file] if t[0] != n]
                text = body[i - 1][1:]
                if all(text not in (repo.patches / o).read_text() for o, _, _ in others):
                    return n, file, hunk, text
    raise AssertionError("no hook context line found")


def test_project_series_rebase_onto_a_changed_pin(tmp_path, monkeypatch):
    """A copy of the pin with one hook's context changed: the rebase stops naming the patch, the file
    and the hunk; after the fix, --continue exports a series that applies to the changed tree."""
    monkeypatch.delenv("MOECACHE_LLAMA_SRC", raising=False)
    monkeypatch.delenv("MOECACHE_LLAMA_SRC_FORCE", raising=False)
    repo = project_copy(tmp_path)
    names = series.read_series(repo)
    patch, file, hunk, line = _hook_line(repo, names)
    new = tmp_path / "llama.cpp-next"
    shutil.copytree(upstream.pristine_tree(quiet=True), new, ignore=shutil.ignore_patterns(".moecache-extracted"))
    changed = line.rstrip() + " // changed upstream"
    text = (new / file).read_text()
    assert text.count(line + "\n") >= 1
    (new / file).write_text(text.replace(line + "\n", changed + "\n", 1))
    with pytest.raises(BuildError) as e:
        rebase.rebase(repo, onto=new, quiet=True)
    msg = str(e.value)
    assert f"patch {patch} (" in msg and f"{file}: hunk #{hunk} (@@ " in msg, msg
    # resolve: upstream's changed line and the patch's hook
    f = repo.vendor / file
    lines = f.read_text().splitlines(keepends=True)
    out, side = [], None
    for l in lines:
        if l.startswith("<<<<<<< "):
            side = "ours"
        elif l.startswith("||||||| ") and side:
            side = "base"
        elif l.startswith("=======") and side:
            side = "theirs"
        elif l.startswith(">>>>>>> ") and side:
            side = None
        elif side in (None, "theirs"):
            out.append(changed + "\n" if l == line + "\n" else l)
    f.write_text("".join(out))
    assert rebase.rebase(repo, cont=True, quiet=True) == names
    check = tmp_path / "check"
    shutil.copytree(new, check)
    for n in names:
        series.apply_patch(check, repo.patches / n)
    assert changed in (check / file).read_text()
