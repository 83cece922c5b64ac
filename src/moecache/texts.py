"""Real text to measure with: the repository's benchmark prompts, or the standard library's source."""

from __future__ import annotations


def default_texts() -> list[tuple[str, str]]:
    """(name, text) of real text for statistics: benchmarks/prompts/*.txt|*.py in a checkout, else
    the source of a few standard library modules."""
    from .paths import checkout_root

    found = []
    root = checkout_root()
    prompts = root / "benchmarks" / "prompts" if root else None
    if prompts and prompts.is_dir():
        for f in sorted(prompts.rglob("*")):
            if f.suffix in (".txt", ".py") and f.is_file():
                try:
                    found.append((str(f.relative_to(root)), f.read_text(encoding="utf-8")))
                except (OSError, UnicodeDecodeError):
                    continue
    if not found:
        import argparse as _argparse
        import inspect
        import textwrap as _textwrap

        found = [(f"stdlib:{m.__name__}", inspect.getsource(m)) for m in (_textwrap, _argparse)]
    return found
