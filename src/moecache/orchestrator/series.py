"""The patch series: apply it to the pinned tree, edit it as git commits, export it back, verify it.

patches/series lists the patches in order. `apply` makes vendor/llama.cpp a fresh copy of the
pristine upstream tree with every patch applied. `edit` makes vendor/llama.cpp a git repository
whose first commit is upstream (tag `upstream`) and which has one commit per patch, so C++ is
edited there with ordinary git. `export` writes those commits back as patches/NNNN-topic.patch
and series. `verify` applies the series from scratch and checks it reproduces the tree.
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
from .upstream import PIN, BuildError, pristine_tree

STAMP = ".moecache-series"  # written into an applied tree: what it was made from
GIT_ID = ["-c", "user.name=moecache", "-c", "user.email=moecache@localhost", "-c", "commit.gpgsign=false"]


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


def read_series(repo: Repo) -> list[str]:
    if not repo.series_file.is_file():
        raise BuildError(f"{repo.series_file} is missing. Create it (it may be empty) to start a patch series.")
    names = []
    for line in repo.series_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not (repo.patches / line).is_file():
            raise BuildError(f"patches/series names '{line}', but patches/{line} does not exist. "
                             "Add the file or remove the line.")
        names.append(line)
    return names


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
        raise BuildError(f"patch {patch.name} does not apply: {_hunk_failure(patch, msg)}.\n{msg}\n"
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
        _git(tree, "init", "-q", "-b", "main")
        _git(tree, "add", "-A", "-f")
        _git(tree, "commit", "-q", "-m", f"upstream llama.cpp {PIN.commit}",
             env={"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"})
        _git(tree, "tag", "upstream")
        for n in names:
            patch = repo.patches / n
            r = _git(tree, "am", "-q", "--keep-cr", "--whitespace=nowarn", str(patch), check=False)
            if r.returncode != 0:
                _git(tree, "am", "--abort", check=False)
                # Not a mail-formatted patch, or it does not apply: retry plainly for a clear error.
                apply_patch(tree, patch)
                _git(tree, "add", "-A", "-f")
                _git(tree, "commit", "-q", "-m", _topic_of(n))
        if repo.vendor.exists():
            shutil.rmtree(repo.vendor)
        os.replace(tree, repo.vendor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"moecache-build: {repo.vendor} is a git repo: tag 'upstream' + {len(names)} commit(s). "
              "Edit, commit (one commit per patch), then `moecache-build export`.")
    return repo.vendor


def _topic_of(name: str) -> str:
    stem = re.sub(r"^\d+-", "", name.removesuffix(".patch"))
    return stem.replace("-", " ")


def _export_names(repo: Repo) -> list[str]:
    """The patch names the edit repo's commits would export to."""
    r = _git(repo.vendor, "log", "--reverse", "--format=%s", "upstream..HEAD", check=False)
    names = []
    for i, subject in enumerate(s for s in r.stdout.splitlines() if s.strip()):
        slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52].rstrip("-") or "patch"
        names.append(f"{i + 1:04d}-{slug}.patch")
    return names


def _format_patches(repo: Repo, out: Path) -> list[Path]:
    _git(repo.vendor, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat",
         "--full-index", "-N", "-o", str(out), "upstream..HEAD")
    return sorted(out.glob("*.patch"))


def _exported_matches(repo: Repo) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        produced = _format_patches(repo, Path(tmp))
        names = _export_names(repo)
        current = read_series(repo)
        if names != current:
            return False
        return all(_patch_body(p) == _patch_body(repo.patches / n) for p, n in zip(produced, names))


def _patch_body(p: Path) -> str:
    # The Date: line changes on every export of a rebased commit; compare what matters.
    return "\n".join(l for l in p.read_text(errors="replace").splitlines() if not l.startswith("Date: "))


def export(repo: Repo, quiet: bool = False) -> list[str]:
    """Write the edit repo's commits back as patches/NNNN-topic.patch and series."""
    if applied_state(repo) != "edit":
        raise BuildError(f"{repo.vendor} is not an edit repository. Run `moecache-build edit` first, "
                         "commit your changes there, then export.")
    v = repo.vendor
    if _git(v, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip():
        raise BuildError(f"{v} has uncommitted changes. Commit them (one commit per patch topic) and export again.")
    if _git(v, "rev-parse", "-q", "--verify", "upstream", check=False).returncode != 0:
        raise BuildError(f"{v} has no 'upstream' tag. Recreate it with `moecache-build edit --force`.")
    with tempfile.TemporaryDirectory() as tmp:
        produced = _format_patches(repo, Path(tmp))
        names = _export_names(repo)
        old = read_series(repo)
        for n in old:
            if n not in names:
                (repo.patches / n).unlink()
        for p, n in zip(produced, names):
            target = repo.patches / n
            # Keep the old file when only the Date: line would change, so exports are quiet in git.
            if target.is_file() and _patch_body(target) == _patch_body(p):
                continue
            shutil.copyfile(p, target)
    header = [l for l in repo.series_file.read_text().splitlines() if l.startswith("#")]
    repo.series_file.write_text("\n".join(header + names) + "\n")
    if not quiet:
        print(f"moecache-build: exported {len(names)} patch(es) to {repo.patches}")
    return names


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
    """Apply the series from scratch and check it reproduces vendor/llama.cpp exactly."""
    names = read_series(repo)
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


def status(repo: Repo) -> str:
    names = read_series(repo)
    state = applied_state(repo)
    digest = series_digest(repo, names)
    src = os.environ.get("MOECACHE_LLAMA_SRC") or "pinned sdist (cache)"
    lines = [f"upstream: llama.cpp {PIN.commit} ({PIN.sdist_package}=={PIN.sdist_version}); source: {src}",
             f"series: {len(names)} patch(es)"]
    lines += [f"  {n}" for n in names]
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
