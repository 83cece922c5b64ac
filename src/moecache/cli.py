"""`moecache` command: one entry point, a subcommand per job."""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "synth": ("moecache.synth", "write a synthetic MoE GGUF (or report its routing statistics)"),
    "bench": ("moecache.bench", "run benchmark scenarios against moecache-server"),
    "results-index": ("moecache.bench.index", "write a results folder's index (benchmarks/results/README.md)"),
    "build": ("moecache.orchestrator.__main__", "the patch-series orchestrator (fetch, apply, edit, export, verify, status)"),
    "server": ("moecache.server", "run moecache-server (same as the moecache-server command)"),
    "info": ("moecache.info", "show the build, the devices and the system info"),
    "check": ("moecache.check", "read every tensor of a GGUF file and tell whether it is damaged"),
    "cache-sim": ("moecache.cache_sim", "replay a routing trace through the hot-expert cache's policies"),
    "plan": ("moecache.plan", "plan each GPU's memory for a model, a context and its users; print the server command"),
    "tune": ("moecache.tune", "choose the cache's policy, settings and slots from a routing trace of your traffic"),
    "calibrate-routing": ("moecache.synth.calibration", "fit a synthetic preset's routing strength to published LRU hit rates"),
}


def usage() -> str:
    lines = ["usage: moecache <command> [options]", "       moecache --version", "", "commands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<17} {text}")
    lines += ["", "options:", f"  {'--version':<10} print the moecache version and the llama.cpp pin, then exit",
              "", "Run `moecache <command> --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from .info import version_line

        print(version_line())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"moecache: unknown command '{name}'.\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(SUBCOMMANDS[name][0])
    # the subcommand's usage and messages name it as it was reached: `moecache build`, not moecache-build
    return int(module.main(rest, prog=f"moecache {name}") or 0)


if __name__ == "__main__":
    sys.exit(main())
