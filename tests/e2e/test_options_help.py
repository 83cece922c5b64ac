"""Every flag moecache adds shows in `moecache-server --help` (the launcher's own, then the built
llama-server's) and in the options reference: a flag the series declares or the launcher takes that
the reference lacks fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from moecache.orchestrator import reference
from moecache.server import build_parser

REPO = Path(__file__).resolve().parents[2]


def help_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))


def test_every_flag_of_ours_in_help_is_in_the_reference(llama_server_bin, subprocess_env):
    out = subprocess.run([sys.executable, "-m", "moecache.server", "--help"], env=subprocess_env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    shown = help_flags(out.stdout)
    ours = {f for o in reference.declared_options(REPO / "patches") for f in o.flags}
    ours |= {f for a in build_parser()._actions for f in a.option_strings if f.startswith("--") and f != "--help"}
    assert len(ours) > 40
    missing_in_help = sorted(ours - shown)
    assert not missing_in_help, f"flags of ours that moecache-server --help does not show: {missing_in_help}"
    documented = help_flags((REPO / reference.REFERENCE).read_text())
    missing = sorted((shown & ours) - documented)
    assert not missing, f"flags in moecache-server --help missing from {reference.REFERENCE}: {missing}"
