"""Where the built native pieces live.

In a wheel: moecache/bin (llama-server, llama-bench, llama-quantize, test-backend-ops, and the shared
libraries they load through $ORIGIN), moecache/data (tokenizer vocab files taken from the upstream tree).
In a developer checkout built with `pip install -e .`, bin/ and data/ are found inside the
scikit-build build directory (build/<tag>). MOECACHE_BIN_DIR / MOECACHE_DATA_DIR override both.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent  # only meaningful in a source checkout


def is_checkout(path: Path) -> bool:
    return (path / "patches" / "series").is_file() and (path / "pyproject.toml").is_file()


def checkout_root() -> Path | None:
    """The moecache source checkout in use: the one this package was imported from, else the one
    the current folder is in (an installed moecache run from a clone, as in CI); None if neither."""
    if is_checkout(REPO_ROOT):
        return REPO_ROOT
    here = Path.cwd().resolve()
    for p in (here, *here.parents):
        if is_checkout(p):
            return p
    return None


def build_dirs() -> list[Path]:
    """Developer build folders (build/<tag>, holding bin/ and data/), newest first."""
    build = REPO_ROOT / "build"
    if not build.is_dir():
        return []
    stages = [p for p in build.iterdir() if (p / "bin").is_dir()]
    return sorted(stages, key=lambda p: (p / "bin").stat().st_mtime, reverse=True)


def bin_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("MOECACHE_BIN_DIR"):
        dirs.append(Path(os.environ["MOECACHE_BIN_DIR"]))
    dirs.append(PACKAGE_DIR / "bin")
    dirs.extend(s / "bin" for s in build_dirs())
    return dirs


def binary(name: str) -> Path:
    """Path of a built tool (llama-server, llama-quantize, ...); a clear error when missing."""
    for d in bin_dirs():
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError(
        f"{name} was not found (looked in: {', '.join(str(d) for d in bin_dirs())}). "
        "Build moecache first: `pip install .` (or `pip install -e . --no-build-isolation` in a checkout), "
        "or set MOECACHE_BIN_DIR to the folder that holds it."
    )


def data_file(name: str) -> Path:
    """A data file installed with the package (e.g. ggml-vocab-qwen2.gguf)."""
    dirs = []
    if os.environ.get("MOECACHE_DATA_DIR"):
        dirs.append(Path(os.environ["MOECACHE_DATA_DIR"]))
    dirs.append(PACKAGE_DIR / "data")
    dirs.extend(s / "data" for s in build_dirs())
    dirs.append(REPO_ROOT / "vendor" / "llama.cpp" / "models")
    for d in dirs:
        p = d / name
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{name} was not found (looked in: {', '.join(str(d) for d in dirs)}). "
        "It is installed with moecache from the pinned llama.cpp tree: reinstall moecache, "
        "or set MOECACHE_DATA_DIR to a folder that holds it."
    )


def vocab_file(tokenizer: str) -> Path:
    """The upstream vocab GGUF of a tokenizer family ('qwen2', 'llama-bpe', ...)."""
    return data_file(f"ggml-vocab-{tokenizer}.gguf")


def cache_dir() -> Path:
    """moecache's cache: downloads, the pristine tree, synthetic models, expert profiles (MOECACHE_CACHE_DIR
    overrides; else XDG_CACHE_HOME or ~/.cache, then moecache)."""
    env = os.environ.get("MOECACHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moecache"


def profile_path(model: str | os.PathLike) -> Path:
    """Where moecache-server keeps a model's expert profile by default: one per model file (its name and size)."""
    m = Path(model)
    try:
        size = m.stat().st_size
    except OSError:
        size = 0
    return cache_dir() / "profiles" / f"{m.stem}-{size}.profile"
