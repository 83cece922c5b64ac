"""The patch series: apply it to the pinned tree, edit it as git commits, export it back, verify it.

patches/series lists the patches in order as `topic/name.patch`, in sections (a comment block, then
the topic's patches). The patches only change upstream files (hooks, fields, call sites); moecache's
own sources are in native/ and never go through the series. `apply` makes vendor/llama.cpp a fresh
copy of the pristine upstream tree with every patch applied. `edit` makes vendor/llama.cpp a git
repository whose first commit is upstream (tag `upstream`) and which has one commit per patch, so C++
is edited there with ordinary git. `export` writes those commits back, each to the file its header
names (headers.py), and series. `verify` checks every header and file and that the series applied
from scratch reproduces the tree. `rebase` moves the series onto another llama.cpp tree (rebase.py).
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..paths import is_checkout
from . import headers
from .upstream import PIN, BuildError, pristine_tree

STAMP = ".moecache-series"  # written into an applied tree: what it was made from
GIT_ID = ["-c", "user.name=moecache", "-c", "user.email=moecache@localhost", "-c", "commit.gpgsign=false",
          "-c", "core.autocrlf=false"]


@dataclass
class Repo:
    """The project checkout: where patches/ and vendor/llama.cpp are."""

    root: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    @property
    def vendor(self) -> Path:
        return self.root / "vendor" / "llama.cpp"


def find_repo(start: Path | None = None) -> Repo:
    env = os.environ.get("MOECACHE_REPO")
    if env:
        return Repo(Path(env).resolve())
    here = (start or Path.cwd()).resolve()
    for p in [here, *here.parents]:
        if is_checkout(p):
            return Repo(p)
    raise BuildError(f"no moecache checkout found at or above {here} (looked for patches/series). "
                     "Run this from the repository root, or set MOECACHE_REPO.")


@dataclass
class SeriesFile:
    """patches/series as written: a preamble of comments, then sections (comment lines, entries)."""

    preamble: list[str]
    sections: list[tuple[list[str], list[str]]]

    @property
    def entries(self) -> list[str]:
        return [e for _, entries in self.sections for e in entries]


def parse_series(text: str) -> SeriesFile:
    """Blocks are separated by blank lines; a first block of comments alone is the preamble; every
    other block is a section: its comments, then its entries."""
    preamble: list[str] = []
    sections: list[tuple[list[str], list[str]]] = []
    for i, block in enumerate(re.split(r"\n\s*\n", text.strip("\n"))):
        lines = [l.rstrip() for l in block.splitlines() if l.strip()]
        comments = [l for l in lines if l.lstrip().startswith("#")]
        entries = [l.strip() for l in lines if not l.lstrip().startswith("#")]
        if i == 0 and not entries:
            preamble = comments
        else:
            sections.append((comments, entries))
    return SeriesFile(preamble, sections)


def format_series(preamble: list[str], entries: list[str], old: SeriesFile | None = None) -> str:
    """series for these entries: each topic's section keeps its comment block from `old`; a new topic
    gets '# <topic>'. A topic's patches stay together, in their order."""
    kept: dict[str, list[str]] = {}
    for comments, es in (old.sections if old else []):
        if es:
            kept.setdefault(es[0].split("/")[0], comments)
    blocks = ["\n".join(preamble)] if preamble else []
    topic, current = None, []
    for e in entries + [None]:
        t = e.split("/")[0] if e else None
        if t != topic and current:
            blocks.append("\n".join(kept.get(topic, [f"# {topic}"]) + current))
            current = []
        topic = t
        if e:
            current.append(e)
    return "\n\n".join(blocks) + "\n"


ENTRY_RE = re.compile(r"^[a-z][a-z0-9-]*/[a-z0-9][a-z0-9-]*\.patch$")


def read_series(repo: Repo) -> list[str]:
    """The entries of patches/series, checked: each `topic/name.patch`, present, listed once."""
    if not repo.series_file.is_file():
        raise BuildError(f"{repo.series_file} is missing. Create it (it may be empty) to start a patch series.")
    names: list[str] = []
    for line in parse_series(repo.series_file.read_text()).entries:
        if not ENTRY_RE.match(line):
            raise BuildError(f"patches/series names '{line}', which is not 'topic/name.patch' "
                             "(a topic folder, a lower-case name). Move the file and fix the line.")
        if line in names:
            raise BuildError(f"patches/series names '{line}' twice. Remove one of the lines.")
        if not (repo.patches / line).is_file():
            raise BuildError(f"patches/series names '{line}', but patches/{line} does not exist. "
                             "Add the file or remove the line.")
        names.append(line)
    return names


def patch_files(repo: Repo) -> list[str]:
    """Every *.patch under patches/, as series entries would name them."""
    return sorted(p.relative_to(repo.patches).as_posix() for p in repo.patches.rglob("*.patch"))


def check_series(repo: Repo) -> list[str]:
    """Every problem of the series' files and headers, each naming its fix (empty: all good)."""
    names = read_series(repo)
    problems = [f"patches/{f} is not in patches/series: add it to its topic's section or delete it"
                for f in patch_files(repo) if f not in names]
    for n in names:
        problems += headers.check_patch(repo.root, n, headers.parse_patch(repo.patches / n))
    return problems


def topics(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        t = n.split("/")[0]
        if t not in out:
            out.append(t)
    return out


def series_digest(repo: Repo, names: list[str]) -> str:
    h = hashlib.sha256(PIN.commit.encode())
    for n in names:
        h.update(n.encode() + b"\0" + (repo.patches / n).read_bytes())
    return h.hexdigest()


def _git(cwd: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {cwd}:\n{r.stderr.strip() or r.stdout.strip()}")
    return r


def _hunk_failure(patch: Path, output: str) -> str:
    """Name the file and hunk of a failed `git apply` from its messages."""
    m = re.search(r"patch failed: (.+?):(\d+)", output)
    if m:
        path, line = m.group(1), int(m.group(2))
        hunk = _hunk_number(patch, path, line)
        where = f"file {path}, hunk #{hunk} (at line {line})" if hunk else f"file {path}, line {line}"
        return where
    m = re.search(r"(\S+): No such file or directory|error: (\S+): does not exist in index", output)
    if m:
        return f"file {m.group(1) or m.group(2)} (missing from the tree)"
    m = re.search(r"corrupt patch at line (\d+)", output)
    if m:
        return f"the patch file itself is corrupt at line {m.group(1)}"
    return "see git's message below"


def _hunk_number(patch: Path, path: str, line: int) -> int | None:
    current, n = None, 0
    for text in patch.read_text(errors="replace").splitlines():
        if text.startswith("+++ "):
            current = text[4:].split("\t")[0]
            current = current[2:] if current.startswith(("a/", "b/")) else current
            n = 0
        elif text.startswith("@@") and current == path:
            n += 1
            m = re.match(r"@@ -(\d+)", text)
            if m and int(m.group(1)) == line:
                return n
    return None


def _display(patch: Path) -> str:
    """topic/name.patch for a patch inside a patches/ folder, else its file name."""
    parts = patch.parts
    return "/".join(parts[parts.index("patches") + 1:]) if "patches" in parts[:-1] else patch.name


def apply_patch(tree: Path, patch: Path) -> None:
    """Apply one patch to a plain tree; fail naming the patch, the file and the hunk."""
    # Inside another repository (the project checkout holds vendor/) git apply would take paths
    # as relative to that repository and silently skip them: stop git from looking above the tree.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(tree).resolve().parent)}
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", str(patch)], cwd=tree,
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip()
        raise BuildError(f"patch {_display(patch)} does not apply: {_hunk_failure(patch, msg)}.\n{msg}\n"
                         "Fix it with `moecache-build edit` (rebase the commit there) and `moecache-build export`.")


def _copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".git", ".moecache-extracted", STAMP))


def _pristine_copy(dest: Path, quiet: bool) -> Path:
    """dest/llama.cpp = a copy of the pristine upstream tree."""
    tree = dest / "llama.cpp"
    _copy_tree(pristine_tree(quiet=quiet), tree)
    return tree


def _patched_copy(repo: Repo, dest: Path, names: list[str], quiet: bool) -> Path:
    """dest/llama.cpp = the pristine tree with the named patches applied."""
    tree = _pristine_copy(dest, quiet)
    for n in names:
        apply_patch(tree, repo.patches / n)
    return tree


def applied_state(repo: Repo) -> str:
    """'missing', 'applied:<digest>', 'edit' (a git repo made by `edit`), or 'unknown'."""
    v = repo.vendor
    if not v.exists():
        return "missing"
    if (v / ".git").exists():
        return "edit"
    stamp = v / STAMP
    if stamp.is_file():
        return "applied:" + stamp.read_text().strip()
    return "unknown"


def _guard_edits(repo: Repo, force: bool) -> None:
    """Never throw away work in an edit repo unless told to."""
    if force or applied_state(repo) != "edit":
        return
    v = repo.vendor
    dirty = _git(v, "status", "--porcelain", check=False).stdout.strip()
    ahead = _export_names(repo)
    current = read_series(repo)
    if dirty or ahead != current or not _exported_matches(repo):
        raise BuildError(f"{v} is an edit repository with work that is not exported "
                         f"({'uncommitted changes' if dirty else 'commits differ from patches/'}). "
                         "Commit and run `moecache-build export` first, or pass --force to discard it.")


def apply(repo: Repo, force: bool = False, if_needed: bool = False, quiet: bool = False) -> Path:
    """Make vendor/llama.cpp = pristine upstream + every patch in series."""
    names = read_series(repo)
    digest = series_digest(repo, names)
    state = applied_state(repo)
    if if_needed and state == "applied:" + digest:
        return repo.vendor
    if if_needed and state == "edit" and not force:
        # A developer's edit repo is the source of truth while editing: build what is there.
        if not quiet:
            print(f"moecache-build: {repo.vendor} is an edit repository; building it as it is.")
        return repo.vendor
    _guard_edits(repo, force)
    repo.vendor.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=repo.vendor.parent, prefix=".apply-"))
    try:
        tree = _patched_copy(repo, tmp, names, quiet)
        (tree / STAMP).write_text(digest + "\n")
        if repo.vendor.exists():
            _replace_tree(tree, repo.vendor)
        else:
            os.replace(tree, repo.vendor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"moecache-build: applied {len(names)} patch(es) on llama.cpp {PIN.commit} -> {repo.vendor}")
    return repo.vendor


def _replace_tree(new: Path, old: Path) -> None:
    """Swap a fresh tree in, rewriting only the files that changed.

    Unchanged files keep their timestamps, so an incremental build recompiles only what a
    patch touched.
    """
    for dirpath, dirnames, filenames in os.walk(old, topdown=False):
        rel = Path(dirpath).relative_to(old)
        for f in filenames:
            if not (new / rel / f).exists():
                (Path(dirpath) / f).unlink()
        for d in dirnames:
            p = Path(dirpath) / d
            if not (new / rel / d).exists():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for dirpath, dirnames, filenames in os.walk(new):
        rel = Path(dirpath).relative_to(new)
        (old / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            src, dst = Path(dirpath) / f, old / rel / f
            if dst.is_file() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False):
                continue
            if dst.exists() or dst.is_symlink():
                dst.unlink()
            shutil.copy2(src, dst, follow_symlinks=False)


def _am_date_env(patch: Path) -> dict:
    """Commit with the patch's own date, so that an edit repo made twice has the same commits."""
    m = re.search(r"^Date: (.+)$", patch.read_text(errors="replace").partition("\n\n")[0], flags=re.M)
    return {"GIT_COMMITTER_DATE": m.group(1)} if m else {}


def _pristine_commit(tree: Path) -> None:
    _git(tree, "init", "-q", "-b", "main")
    _git(tree, "add", "-A", "-f")
    _git(tree, "commit", "-q", "-m", f"upstream llama.cpp {PIN.commit}",
         env={"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"})
    _git(tree, "tag", "upstream")


def commit_series(repo: Repo, tree: Path, names: list[str]) -> None:
    """One commit per patch of the series on a tree that is a git repository at upstream."""
    for n in names:
        patch = repo.patches / n
        r = _git(tree, "am", "-q", "--keep-cr", "--whitespace=nowarn", str(patch), check=False,
                 env=_am_date_env(patch))
        if r.returncode != 0:
            _git(tree, "am", "--abort", check=False)
            # Not a mail-formatted patch, or it does not apply: retry plainly for a clear error.
            apply_patch(tree, patch)
            _git(tree, "add", "-A", "-f")
            _git(tree, "commit", "-q", "-m", f"{n}\n\nTopic: {n.split('/')[0]}")


def edit(repo: Repo, force: bool = False, quiet: bool = False) -> Path:
    """Make vendor/llama.cpp a git repo: upstream commit, then one commit per patch."""
    if applied_state(repo) == "edit" and not force:
        if not quiet:
            print(f"moecache-build: {repo.vendor} is already an edit repository (use --force to recreate it).")
        return repo.vendor
    _guard_edits(repo, force)
    names = read_series(repo)
    repo.vendor.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=repo.vendor.parent, prefix=".edit-"))
    try:
        tree = _pristine_copy(tmp, quiet)
        _pristine_commit(tree)
        commit_series(repo, tree, names)
        if repo.vendor.exists():
            shutil.rmtree(repo.vendor)
        os.replace(tree, repo.vendor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"moecache-build: {repo.vendor} is a git repo: tag 'upstream' + {len(names)} commit(s). "
              "Edit, commit (fixups folded into the commit of their topic: `git commit --fixup` + "
              "`git rebase -i --autosquash upstream`), then `moecache-build export`.")
    return repo.vendor


def _commit_entries(tree: Path) -> list[str]:
    """Where each commit upstream..HEAD exports to: its Topic: field and its subject."""
    r = _git(tree, "log", "--reverse", "--format=%H", "upstream..HEAD", check=False)
    out = []
    for sha in r.stdout.split():
        message = _git(tree, "log", "-1", "--format=%B", sha).stdout
        subject, _, fields = headers.parse_message(message)
        topic = fields.get("Topic", "")
        if not headers.TOPIC_RE.match(topic):
            raise BuildError(f"commit {sha[:9]} ('{subject}') has no valid 'Topic:' field. Add one as the "
                             "last paragraph of its message (`git commit --amend` or `git rebase -i`), "
                             "with the other fields: " + ", ".join(headers.FIELDS) + ".")
        out.append(headers.entry_for(topic, subject))
    dups = sorted({e for e in out if out.count(e) > 1})
    if dups:
        raise BuildError(f"two commits export to the same file: {', '.join(dups)}. Give one of them another "
                         "subject, or squash them into one patch.")
    return out


def _export_names(repo: Repo) -> list[str]:
    return _commit_entries(repo.vendor)


def _format_patches(tree: Path, out: Path) -> list[Path]:
    _git(tree, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat",
         "--full-index", "-N", "-o", str(out), "upstream..HEAD")
    return sorted(out.glob("*.patch"))


def _exported_matches(repo: Repo) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        produced = _format_patches(repo.vendor, Path(tmp))
        names = _export_names(repo)
        if names != read_series(repo):
            return False
        return all(p.read_bytes() == (repo.patches / n).read_bytes() for p, n in zip(produced, names))


def export_tree(repo: Repo, tree: Path, quiet: bool = False) -> list[str]:
    """Write a tree's commits upstream..HEAD back as patches/<topic>/<name>.patch and series."""
    with tempfile.TemporaryDirectory() as tmp:
        produced = _format_patches(tree, Path(tmp))
        names = _commit_entries(tree)
        for f in patch_files(repo):
            if f not in names:
                (repo.patches / f).unlink()
        for p, n in zip(produced, names):
            target = repo.patches / n
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (target.is_file() and target.read_bytes() == p.read_bytes()):
                shutil.copyfile(p, target)
    for d in sorted((d for d in repo.patches.iterdir() if d.is_dir()), reverse=True):
        if not any(d.rglob("*")):
            d.rmdir()
    old = parse_series(repo.series_file.read_text()) if repo.series_file.is_file() else None
    repo.series_file.write_text(format_series(old.preamble if old else [], names, old))
    if not quiet:
        print(f"moecache-build: exported {len(names)} patch(es) in {len(topics(names))} topic(s) to {repo.patches}")
    return names


def export(repo: Repo, quiet: bool = False) -> list[str]:
    """Write the edit repo's commits back to patches/ and series."""
    if applied_state(repo) != "edit":
        raise BuildError(f"{repo.vendor} is not an edit repository. Run `moecache-build edit` first, "
                         "commit your changes there, then export.")
    v = repo.vendor
    if (v / ".git" / "rebase-merge").exists() or (v / ".git" / "rebase-apply").exists():
        raise BuildError(f"{v} is in the middle of a rebase. Finish it (`moecache-build rebase --continue`) "
                         "or abort it (`moecache-build rebase --abort`) first.")
    if _git(v, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip():
        raise BuildError(f"{v} has uncommitted changes. Commit them (each to the patch of its topic) and export again.")
    if _git(v, "rev-parse", "-q", "--verify", "upstream", check=False).returncode != 0:
        raise BuildError(f"{v} has no 'upstream' tag. Recreate it with `moecache-build edit --force`.")
    return export_tree(repo, v, quiet)


def _tree_files(root: Path) -> dict[str, Path]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for f in filenames:
            p = Path(dirpath) / f
            rel = p.relative_to(root).as_posix()
            if rel in (STAMP, ".moecache-extracted"):
                continue
            out[rel] = p
    return out


def diff_trees(a: Path, b: Path) -> list[str]:
    fa, fb = _tree_files(a), _tree_files(b)
    diffs = [f"only in {a.name if a.name != b.name else 'first'}: {k}" for k in sorted(fa.keys() - fb.keys())]
    diffs += [f"only in {b.name if a.name != b.name else 'second'}: {k}" for k in sorted(fb.keys() - fa.keys())]
    for k in sorted(fa.keys() & fb.keys()):
        if not filecmp.cmp(fa[k], fb[k], shallow=False):
            diffs.append(f"differs: {k}")
    return diffs


def verify(repo: Repo, quiet: bool = False) -> None:
    """Check every patch's file and header, then apply the series from scratch and check it
    reproduces vendor/llama.cpp exactly."""
    names = read_series(repo)
    problems = check_series(repo)
    if problems:
        shown = "\n  ".join(problems[:30]) + (f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else "")
        raise BuildError(f"verify: {len(problems)} problem(s) in patches/:\n  {shown}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = _patched_copy(repo, Path(tmp), names, quiet)
        state = applied_state(repo)
        if state == "missing":
            if not quiet:
                print(f"moecache-build: verify: all {len(names)} patch(es) apply (no vendor tree to compare).")
            return
        if state == "edit":
            v = repo.vendor
            if _git(v, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip():
                raise BuildError(f"verify: {v} has uncommitted changes; commit and export them first.")
            if not _exported_matches(repo):
                raise BuildError("verify: the edit repository's commits differ from patches/. "
                                 "Run `moecache-build export`.")
            exported = Path(tmp) / "head"
            exported.mkdir()
            archive = subprocess.run(["git", "archive", "HEAD"], cwd=v, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(exported)], input=archive, check=True)
            diffs = diff_trees(tree, exported)
        else:
            diffs = diff_trees(tree, repo.vendor)
        if diffs:
            shown = "\n  ".join(diffs[:20]) + ("\n  ..." if len(diffs) > 20 else "")
            raise BuildError(f"verify: applying patches/series from scratch does not reproduce {repo.vendor}:\n  {shown}\n"
                             "Edit the tree only through `moecache-build edit` + `export`; `moecache-build apply --force` "
                             "resets it.")
    if not quiet:
        print(f"moecache-build: verify ok: {len(names)} patch(es) reproduce {repo.vendor} exactly.")


def _patch_size(path: Path) -> tuple[int, int]:
    """Lines a patch adds and removes."""
    plus = minus = 0
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("+") and not line.startswith("+++ "):
            plus += 1
        elif line.startswith("-") and not line.startswith("--- ") and line != "---":
            minus += 1
    return plus, minus


def status(repo: Repo) -> str:
    names = read_series(repo)
    state = applied_state(repo)
    digest = series_digest(repo, names)
    src = os.environ.get("MOECACHE_LLAMA_SRC") or "pinned sdist (cache)"
    sizes = {n: _patch_size(repo.patches / n) for n in names}
    ts = topics(names)
    lines = [f"upstream: llama.cpp {PIN.commit} ({PIN.sdist_package}=={PIN.sdist_version}); source: {src}",
             f"series: {len(names)} patch(es) in {len(ts)} topic(s), "
             f"+{sum(p for p, _ in sizes.values())} -{sum(m for _, m in sizes.values())} lines",
             f"  {'topic':<16} {'patches':>7} {'+lines':>7} {'-lines':>7} {'KiB':>6}"]
    for t in ts:
        mine = [n for n in names if n.split("/")[0] == t]
        kib = sum((repo.patches / n).stat().st_size for n in mine) / 1024
        lines.append(f"  {t:<16} {len(mine):>7} {sum(sizes[n][0] for n in mine):>7} "
                     f"{sum(sizes[n][1] for n in mine):>7} {kib:>6.1f}")
        lines += [f"      {n.split('/', 1)[1]}  (+{sizes[n][0]} -{sizes[n][1]})" for n in mine]
    if state == "missing":
        lines.append("vendor/llama.cpp: missing (run `moecache-build apply`)")
    elif state == "edit":
        v = repo.vendor
        n_commits = len(_export_names(repo))
        dirty = bool(_git(v, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip())
        exported = _exported_matches(repo) if not dirty else False
        lines.append(f"vendor/llama.cpp: edit repository, {n_commits} commit(s) on upstream"
                     f"{', uncommitted changes' if dirty else ''}"
                     f"{', exported' if exported else ', NOT exported (run `moecache-build export`)'}")
    elif state == "applied:" + digest:
        lines.append("vendor/llama.cpp: applied, up to date with patches/")
    elif state.startswith("applied:"):
        lines.append("vendor/llama.cpp: applied from an older series (run `moecache-build apply`)")
    else:
        lines.append("vendor/llama.cpp: present but not made by moecache-build (run `moecache-build apply --force`)")
    return "\n".join(lines)
