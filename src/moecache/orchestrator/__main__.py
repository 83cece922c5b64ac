"""moecache-build: the patch-series orchestrator.

  fetch    download and verify the pinned upstream (cached), extract the pristine tree
  apply    vendor/llama.cpp = pristine tree + every patch in patches/series
  edit     vendor/llama.cpp as a git repo: tag 'upstream' + one commit per patch
  export   write the edit repo's commits back as patches/<topic>/<name>.patch + series
  verify   check every patch's header and file, apply the series from scratch, compare the tree
  status   what is pinned, the series per topic (patches, lines, size), the state of vendor/llama.cpp
  rebase   move the series onto another llama.cpp tree (3-way merge; --continue, --abort)
  options-reference  write docs/options.md from the option tables (--check: fail when it is stale)

moecache's own sources (native/) are not part of the series: edit them in place.
The layout, the header fields and the procedure for a new llama.cpp: docs/development.md.

environment:
  MOECACHE_CACHE_DIR          cache of the sdist and the pristine tree (default ~/.cache/moecache)
  MOECACHE_SDIST              a local copy of the pinned sdist, used instead of downloading
  MOECACHE_LLAMA_SRC          your own llama.cpp tree instead of the sdist's (must be the pinned commit)
  MOECACHE_LLAMA_SRC_FORCE=1  accept MOECACHE_LLAMA_SRC even when it is not the pinned commit
  MOECACHE_REPO               the moecache checkout (default: found from the current folder)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import rebase, reference, series, upstream
from .upstream import BuildError


def build_parser(prog: str = "moecache-build") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", help="the moecache checkout (default: found from the current folder, or MOECACHE_REPO)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    sub = p.add_subparsers(dest="command", metavar="command", required=True)
    sub.add_parser("fetch", help="download + verify the pinned upstream and extract the pristine tree")
    a = sub.add_parser("apply", help="fresh vendor/llama.cpp with every patch in series applied")
    a.add_argument("--force", action="store_true", help="discard an edit repository's unexported work")
    a.add_argument("--if-needed", action="store_true",
                   help="do nothing when vendor/llama.cpp already matches the series (used by the build)")
    e = sub.add_parser("edit", help="make vendor/llama.cpp a git repo with one commit per patch")
    e.add_argument("--force", action="store_true", help="recreate it even if it exists (discards unexported work)")
    sub.add_parser("export", help="write the edit repo's commits back to patches/ and series")
    sub.add_parser("verify", help="check that the series applied from scratch reproduces vendor/llama.cpp")
    sub.add_parser("status", help="show the pin, the series per topic and the state of vendor/llama.cpp")
    r = sub.add_parser("rebase", help="move the series onto another llama.cpp tree with a 3-way merge")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--onto", metavar="TREE", help="the llama.cpp source tree to move the series onto")
    g.add_argument("--continue", dest="cont", action="store_true",
                   help="go on after fixing a conflict in vendor/llama.cpp")
    g.add_argument("--abort", action="store_true", help="give up and go back to the series on the pin")
    o = sub.add_parser("options-reference",
                       help="write docs/options.md from moecache.options' tables and the launcher's flags")
    o.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when docs/options.md is stale or the tables and the series disagree")
    return p


def main(argv: list[str] | None = None, prog: str = "moecache-build") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.command == "fetch":
            tree = upstream.pristine_tree(quiet=args.quiet)
            if not args.quiet:
                print(f"moecache-build: pristine llama.cpp {upstream.PIN.commit} at {tree}")
            return 0
        repo = series.Repo(Path(args.repo).resolve()) if args.repo else series.find_repo()
        if args.command == "apply":
            series.apply(repo, force=args.force, if_needed=args.if_needed, quiet=args.quiet)
        elif args.command == "edit":
            series.edit(repo, force=args.force, quiet=args.quiet)
        elif args.command == "export":
            series.export(repo, quiet=args.quiet)
        elif args.command == "verify":
            series.verify(repo, quiet=args.quiet)
        elif args.command == "status":
            print(series.status(repo))
            line = rebase.state(repo)
            if line:
                print(line)
        elif args.command == "options-reference":
            problems = reference.drift(repo.patches)
            for p in problems:
                print(f"moecache-build: option tables and series disagree: {p}", file=sys.stderr)
            return max(reference.write(repo.root, check=args.check), 1 if problems else 0)
        elif args.command == "rebase":
            rebase.rebase(repo, onto=Path(args.onto) if args.onto else None, cont=args.cont,
                          abort=args.abort, quiet=args.quiet)
        return 0
    except BuildError as e:
        print(f"moecache-build: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
