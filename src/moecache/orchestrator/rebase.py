"""Move the series onto another llama.cpp tree with git's 3-way merge.

`rebase --onto TREE` makes vendor/llama.cpp an edit repository of the series on the pinned tree,
commits TREE as a second upstream beside the pin (tag `onto`, its parent the pin, so git sees what
upstream changed) and rebases the patches' commits onto it. Each patch's hooks merge with upstream's
changes where they do not overlap. At the first conflict it stops and names the patch, the file and
the patch's hunk; the developer fixes the file in vendor/llama.cpp and runs `rebase --continue`.
When every commit is through, `onto` becomes the new `upstream` and the series is exported. A patch
whose changes upstream already holds ends up empty: git drops it, and the report says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import headers
from .series import (STAMP, Repo, _git, _guard_edits, _pristine_commit, _pristine_copy, applied_state,
                     commit_series, export_tree, read_series)
from .upstream import BuildError

ONTO_TAG = "onto"
NOTE = "moecache-rebase-onto"  # in .git: the tree the series is being moved onto


def _in_progress(v: Path) -> bool:
    return (v / ".git" / "rebase-merge").exists() or (v / ".git" / "rebase-apply").exists()


def _commit_onto(v: Path, tree: Path) -> str:
    """Commit TREE's files as a child of the pinned upstream commit, without touching the work tree."""
    env = {"GIT_INDEX_FILE": str(v / ".git" / "onto-index")}
    try:
        _git(v, "read-tree", "--empty", env=env)
        # the markers of a tree extracted or applied by moecache-build are not upstream's files
        _git(v, "--work-tree", str(tree), "add", "-A", "-f", "--", ".", ":(exclude).moecache-extracted",
             f":(exclude){STAMP}", env=env)
        tree_id = _git(v, "write-tree", env=env).stdout.strip()
    finally:
        Path(env["GIT_INDEX_FILE"]).unlink(missing_ok=True)
    commit = _git(v, "commit-tree", tree_id, "-p", "upstream", "-m", f"upstream llama.cpp at {tree}",
                  env={"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
                  ).stdout.strip()
    _git(v, "tag", "-f", ONTO_TAG, commit)
    return commit


def _conflict_report(repo: Repo) -> str:
    """Which patch stopped, in which files, at which of the patch's hunks."""
    v = repo.vendor
    stopped = _git(v, "rev-parse", "-q", "--verify", "REBASE_HEAD", check=False).stdout.strip()
    if not stopped:
        return "the rebase stopped (see git's message above)"
    message = _git(v, "log", "-1", "--format=%B", stopped).stdout
    subject, _, fields = headers.parse_message(message)
    entry = headers.entry_for(fields.get("Topic", "unknown"), subject)
    patch_text = _git(v, "format-patch", "-1", "--stdout", "--no-signature", "--full-index", stopped).stdout
    lines = [f"patch {entry} ('{subject}') does not apply onto the new tree:"]
    for code_path in _git(v, "status", "--porcelain").stdout.splitlines():
        code, path = code_path[:2], code_path[3:]
        if code in ("UU", "AA"):
            for where in _conflicts_in(v / path, path, patch_text):
                lines.append(f"  {path}: {where}")
        elif code in ("UD", "DU", "DD"):
            lines.append(f"  {path}: the file was deleted or renamed upstream; the patch changes it")
        elif code[0] == "U" or code[1] == "U":
            lines.append(f"  {path}: conflict ({code})")
    return "\n".join(lines)


def _hunks(patch_text: str, path: str) -> list[tuple[str, set[str], set[str]]]:
    """A patch's hunks of one file: (header, added lines, removed and context lines)."""
    out: list[tuple[str, set[str], set[str]]] = []
    current = None
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[-1]
        elif line.startswith("@@") and current == path:
            out.append((line.split(" @@")[0] + " @@", set(), set()))
        elif out and current == path and line[:1] in "+- " and not line.startswith(("+++", "---")):
            (out[-1][1] if line[0] == "+" else out[-1][2]).add(line[1:].strip())
    return out


def _conflicts_in(file: Path, path: str, patch_text: str) -> list[str]:
    """Each conflict region of a merged file, matched to the patch hunk whose lines it holds."""
    text = file.read_text(errors="replace").splitlines()
    hunks = _hunks(patch_text, path)
    found = []
    i = 0
    while i < len(text):
        if text[i].startswith("<<<<<<< "):
            start = i + 1
            ours: list[str] = []
            theirs: list[str] = []
            side = ours
            i += 1
            while i < len(text) and not text[i].startswith(">>>>>>> "):
                if text[i].startswith("======="):
                    side = theirs
                elif not text[i].startswith("||||||| "):
                    side.append(text[i].strip())
                i += 1
            best, score = None, 0
            for n, (hdr, added, kept) in enumerate(hunks, 1):
                s = len(added & set(theirs)) * 2 + len(kept & set(ours))
                if s > score:
                    best, score = (n, hdr), s
            what = f"hunk #{best[0]} ({best[1]})" if best else "a hunk"
            found.append(f"{what}, conflict at line {start}")
        i += 1
    return found or ["conflict (no markers: see `git status` in vendor/llama.cpp)"]


def _stopped(repo: Repo, output: str) -> BuildError:
    return BuildError(
        _conflict_report(repo) + "\n"
        f"Resolve it in {repo.vendor} (edit the file(s); keep the hook's intent, take upstream's new code), "
        "then run `moecache-build rebase --continue`; `moecache-build rebase --abort` goes back to the pin."
        + (f"\ngit said:\n{output.strip()[-1500:]}" if output.strip() else ""))


def _finish(repo: Repo, before: list[str], quiet: bool) -> list[str]:
    v = repo.vendor
    _git(v, "tag", "-f", "upstream", ONTO_TAG)
    _git(v, "tag", "-d", ONTO_TAG)
    onto = (v / ".git" / NOTE).read_text().strip() if (v / ".git" / NOTE).is_file() else "the new tree"
    (v / ".git" / NOTE).unlink(missing_ok=True)
    names = export_tree(repo, v, quiet=True)
    dropped = [n for n in before if n not in names]
    if not quiet:
        print(f"moecache-build: the series is on {onto}: {len(names)} patch(es) exported to {repo.patches}.")
        if dropped:
            print("  dropped (upstream holds their changes, or they came out empty): " + ", ".join(dropped))
        print("Next: move the pin to that tree (docs/development.md, 'Moving to a new llama.cpp'), build, "
              "run every test and re-measure.")
    return names


def rebase(repo: Repo, onto: Path | None = None, cont: bool = False, abort: bool = False,
           quiet: bool = False) -> list[str]:
    """Start (onto), continue (cont) or abort a rebase of the series onto another tree."""
    v = repo.vendor
    if abort:
        if not _in_progress(v):
            raise BuildError("no rebase is in progress in vendor/llama.cpp.")
        _git(v, "rebase", "--abort")
        _git(v, "tag", "-d", ONTO_TAG, check=False)
        (v / ".git" / NOTE).unlink(missing_ok=True)
        if not quiet:
            print("moecache-build: rebase aborted; vendor/llama.cpp is the series on the pin again.")
        return read_series(repo)
    before = read_series(repo)
    if cont:
        if not _in_progress(v):
            raise BuildError("no rebase is in progress in vendor/llama.cpp: start one with "
                             "`moecache-build rebase --onto TREE`.")
        _git(v, "add", "-A")
        r = _git(v, "rebase", "--continue", check=False, env={"GIT_EDITOR": "true"})
        if _in_progress(v):
            raise _stopped(repo, r.stdout + r.stderr)
        return _finish(repo, before, quiet)
    if onto is None:
        raise BuildError("say where to: `moecache-build rebase --onto TREE` (or --continue / --abort).")
    onto = onto.expanduser().resolve()
    if not (onto / "include" / "llama.h").is_file():
        raise BuildError(f"{onto} is not a llama.cpp source tree (no include/llama.h). "
                         "Point --onto at the root of the llama.cpp tree to move to.")
    if _in_progress(v):
        raise BuildError("a rebase is already in progress in vendor/llama.cpp: "
                         "`moecache-build rebase --continue` or `--abort` first.")
    _guard_edits(repo, force=False)
    # a fresh edit repository of the series on the pin (what is there was exported, or is discarded
    # only when it is an applied tree, which holds nothing of its own)
    repo.vendor.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=repo.vendor.parent, prefix=".rebase-") as tmp:
        tree = _pristine_copy(Path(tmp), quiet)
        _pristine_commit(tree)
        commit_series(repo, tree, before)
        if v.exists():
            shutil.rmtree(v)
        os.replace(tree, v)
    (v / ".git" / NOTE).write_text(str(onto) + "\n")
    _commit_onto(v, onto)
    r = _git(v, "rebase", "--onto", ONTO_TAG, "upstream", "main", check=False, env={"GIT_EDITOR": "true"})
    if _in_progress(v):
        raise _stopped(repo, r.stdout + r.stderr)
    if r.returncode != 0:
        raise BuildError(f"git rebase failed in {v}:\n{(r.stderr or r.stdout).strip()}")
    return _finish(repo, before, quiet)


def state(repo: Repo) -> str | None:
    """A line for `status` while a rebase is in progress."""
    v = repo.vendor
    if applied_state(repo) != "edit" or not _in_progress(v):
        return None
    onto = (v / ".git" / NOTE).read_text().strip() if (v / ".git" / NOTE).is_file() else "another tree"
    return (f"vendor/llama.cpp: rebasing the series onto {onto}, stopped at a conflict "
            "(`moecache-build rebase --continue` after fixing it, or `--abort`)")

