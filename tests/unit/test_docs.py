"""The README's and docs/' links: every relative link names a file that exists and, with #anchor, a
heading of that file (as GitHub makes anchors from headings)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to '-',
    a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"^#{1,6} ", line):
            continue
        text = re.sub(r"`", "", line.lstrip("#").strip()).lower()
        a = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(md: Path) -> list[tuple[int, str]]:
    out = []
    in_code = False
    for i, line in enumerate(md.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        out += [(i, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def broken_links(md: Path, root: Path = REPO) -> list[str]:
    bad = []
    for line, target in links(md):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.relative_to(root)}:{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.relative_to(root)}:{line}: {target} (no such heading in {dest.name})")
    return bad


def test_every_relative_link_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
    assert [b for p in pages for b in broken_links(p)] == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n\n[ok](#two-words) [ok](b.md) [x](#nope) [y](c.md)\n"
                                   "`[not a link](d.md)`\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links(tmp_path / "a.md", tmp_path) == ["a.md:5: #nope (no such heading in a.md)",
                                               "a.md:5: c.md (no such file)"]


FEATURE_PAGES = ("hot-expert-cache", "prefill-swap", "cpu-experts", "speculation", "long-context", "multi-gpu",
                 "planning", "dashboard", "server")
PATCH_NUMBER = re.compile(r"\b(?:patch(?:es)?|issue) \d{1,4}\b", re.IGNORECASE)


def test_the_readme_is_short_and_links_every_feature_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for page in FEATURE_PAGES + ("options", "python-api", "troubleshooting", "benchmarks", "development", "design"):
        assert f"docs/{page}.md" in text, page


def test_headings_and_links_name_features_not_patch_numbers():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = []
    for md in pages:
        for n, line in enumerate(md.read_text().splitlines(), 1):
            if line.startswith("#") or "](" in line:
                bad += [f"{md.name}:{n}: {m.group(0)}" for m in PATCH_NUMBER.finditer(line)]
    assert bad == []
