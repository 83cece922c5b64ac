"""What a patch of the series must say about itself, and the checks of it.

A patch is a `git format-patch` mail of one commit on the pinned tree:

    From: moecache <moecache@localhost>
    Subject: [PATCH] llama: hot-expert cache for routed experts in host memory

    Why upstream needs it, what it does, what it measured.

    Topic: moe-cache
    Upstream-Status: Pending
    Tests: tests/e2e/test_moe_cache.py, tests/gpu/test_moe_cache_gpu.py
    Docs: docs/hot-expert-cache.md

Its place in the series, `patches/<Topic>/<name>.patch`, follows from the header: the folder is the
`Topic:` and the name is the subject without its component prefix, so `export` writes every patch back
where it was and renaming one means changing its subject.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

AUTHOR = "moecache <moecache@localhost>"
FIELDS = ("Topic", "Upstream-Status", "Tests", "Docs")
NAME_MAX = 60

# `ggml:`, `ggml-cuda:`, `llama, common:` ... lower-case components, then the summary
SUBJECT_RE = re.compile(r"^(?P<prefix>[a-z][a-z0-9_.+-]*(?:, [a-z][a-z0-9_.+-]*)*): (?P<summary>\S.*)$")
STATUS_RE = re.compile(r"^(Pending|Submitted https?://\S+|Inappropriate \[[^\]]+\]|Backport [0-9a-f]{7,40})$")
TOPIC_RE = re.compile(r"^[a-z][a-z0-9-]*$")
TRAILER_RE = re.compile(r"^(?P<key>[A-Z][A-Za-z-]*): (?P<value>.*)$")


@dataclass
class PatchHeader:
    author: str = ""
    subject: str = ""
    body: list[str] = field(default_factory=list)  # message lines between the subject and the trailers
    fields: dict[str, str] = field(default_factory=dict)
    new_files: list[str] = field(default_factory=list)


def slug(summary: str) -> str:
    """A patch's file name from its summary: lower case, words joined by '-', at most NAME_MAX long."""
    text = re.sub(r"'s\b", "s", summary.lower())
    words = [w for w in re.split(r"[^a-z0-9]+", text) if w]
    out = ""
    for w in words:
        if out and len(out) + 1 + len(w) > NAME_MAX:
            break
        out = f"{out}-{w}" if out else w[:NAME_MAX]
    return out or "patch"


def entry_for(topic: str, subject: str) -> str:
    """`topic/name.patch`: where a commit with this topic and subject is exported."""
    m = SUBJECT_RE.match(subject)
    return f"{topic}/{slug(m.group('summary') if m else subject)}.patch"


def parse_message(message: str) -> tuple[str, list[str], dict[str, str]]:
    """A commit message's subject, body lines and trailers (the last paragraph of Key: value lines)."""
    lines = message.rstrip("\n").splitlines()
    subject = lines[0].strip() if lines else ""
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    fields: dict[str, str] = {}
    # the trailer block: the last paragraph, if every line of it is a Key: value
    end = len(rest)
    start = end
    while start > 0 and rest[start - 1].strip():
        start -= 1
    block = rest[start:end]
    if block and all(TRAILER_RE.match(l) for l in block):
        for l in block:
            m = TRAILER_RE.match(l)
            fields[m.group("key")] = m.group("value").strip()
        rest = rest[:start]
    while rest and not rest[-1].strip():
        rest = rest[:-1]
    return subject, rest, fields


def parse_patch(path: Path) -> PatchHeader:
    """The header of a format-patch mail: author, subject (unfolded, without [PATCH]), body, trailers."""
    text = path.read_text(errors="replace")
    head, _, rest = text.partition("\n\n")
    h = PatchHeader()
    headers: dict[str, str] = {}
    key = None
    for line in head.splitlines():
        if line.startswith((" ", "\t")) and key:
            headers[key] += " " + line.strip()
        elif ": " in line:
            key, value = line.split(": ", 1)
            headers[key] = value
    h.author = headers.get("From", "")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers.get("Subject", ""))
    # the message ends where the diff (or format-patch's '---' line before a diffstat) begins
    m = re.search(r"^(---$|diff --git )", rest, flags=re.M)
    message, diff = (rest[:m.start()], rest[m.start():]) if m else (rest, "")
    _, h.body, h.fields = parse_message("x\n\n" + message)
    h.subject = subject
    h.new_files = re.findall(r"^diff --git a/(\S+) b/\S+\nnew file mode", diff, flags=re.M)
    return h


def check_patch(root: Path, entry: str, h: PatchHeader) -> list[str]:
    """What is wrong with one patch's header, each problem with its fix."""
    problems = []
    where = f"patches/{entry}"
    topic = entry.split("/")[0]
    if h.author != AUTHOR:
        problems.append(f"{where}: author is '{h.author}', the series has one: '{AUTHOR}' "
                        "(set it in the edit repository's commit, or run `moecache-build export`)")
    if not SUBJECT_RE.match(h.subject):
        problems.append(f"{where}: subject '{h.subject}' has no component prefix: write it as "
                        "'llama: what it does' (components such as ggml, ggml-cuda, llama, common, server)")
    if not any(l.strip() for l in h.body):
        problems.append(f"{where}: the message has no body: say why upstream needs it and what it measured")
    for key in FIELDS:
        if key not in h.fields:
            problems.append(f"{where}: no '{key}:' field (the header needs {', '.join(FIELDS)})")
        elif not h.fields[key]:
            problems.append(f"{where}: '{key}:' is empty")
    status = h.fields.get("Upstream-Status")
    if status and not STATUS_RE.match(status):
        problems.append(f"{where}: 'Upstream-Status: {status}' is not one of Pending, Submitted <url>, "
                        "Inappropriate [why], Backport <commit>")
    got_topic = h.fields.get("Topic")
    if got_topic and got_topic != topic:
        problems.append(f"{where}: 'Topic: {got_topic}' but the file is in patches/{topic}/: "
                        "move the file or change the field")
    if got_topic and not TOPIC_RE.match(got_topic):
        problems.append(f"{where}: topic '{got_topic}' is not a lower-case name like 'moe-cache'")
    for key, prefix in (("Tests", "tests/"), ("Docs", "docs/")):
        for item in (v.strip() for v in h.fields.get(key, "").split(",")):
            if not item:
                continue
            rel = item.split("#")[0].split("::")[0]
            if not rel.startswith(prefix) or not (root / rel).exists():
                problems.append(f"{where}: '{key}:' names {item}, which is not a file under {prefix}")
    if h.subject and got_topic and SUBJECT_RE.match(h.subject):
        want = entry_for(got_topic, h.subject)
        if want != entry and got_topic == topic:
            problems.append(f"{where}: its subject makes it {want}: rename the file (and its series line) "
                            "or change the subject")
    for f in h.new_files:
        problems.append(f"{where}: creates {f}; moecache's own files live in native/ and are compiled into "
                        "the upstream targets: a patch only changes upstream files")
    return problems
