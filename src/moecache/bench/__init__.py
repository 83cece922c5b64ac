"""`moecache bench`: run a benchmark scenario against llama-server on loopback.

Every arm of the scenario runs in one invocation, each against its own freshly started server,
so the ratio of each arm to the baseline (stock path) arm is measured side by side. Each
concurrency level of the scenario's `users` sends that many identical requests at once and adds
the aggregate throughput; the server's speculation counters (drafted, accepted, steps off) and
its prefill-phase swap (the ubatch a prompt ran at, the swap's cost, the cache's hit rate after
the restore) are kept where it reports them. A VRAM budget (--vram-budget, vram_budget_gib)
emulates a smaller GPU: a ballast process (moecache.bench.ballast) holds the rest of the GPU's
memory while each arm's server runs. Results go to <out>/<YYYY-MM-DD>-<scenario>.md and .json (a
later run on the same day: -2, -3, ...; never over an earlier run) with hardware, commits, model
and server args. The scenario format is described in moecache.bench.scenario.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .scenario import Arm, ModelSpec, PromptSet, Scenario, ScenarioError, load_scenario, parse_scenario
from .stats import add_ratios, ratio, summarize

__all__ = ["main", "load_scenario", "parse_scenario", "Scenario", "ScenarioError", "Arm", "ModelSpec",
           "PromptSet", "summarize", "ratio", "add_ratios", "default_out_dir"]


def default_out_dir(scenario_path: Path) -> Path:
    """benchmarks/results next to the scenario's folder (benchmarks/scenarios/x.toml), else ./benchmarks/results."""
    parent = Path(scenario_path).resolve().parent
    if parent.name == "scenarios":
        return parent.parent / "results"
    return Path.cwd() / "benchmarks" / "results"


def build_parser(prog: str = "moecache bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a benchmark scenario (a TOML file, see benchmarks/README.md): each arm against its "
                    "own llama-server on 127.0.0.1, real-text prompts (optionally in a template), prefill t/s, "
                    "time to first token, decode t/s and aggregate t/s at each concurrency level of `users` "
                    "(N identical requests at once), with the ratio of every arm to the baseline arm, and the "
                    "server's speculation counters (drafted, accepted, steps off) and prefill-phase swap (ubatch, "
                    "cost, hit rate after the restore) where it reports them. --vram-budget emulates a smaller GPU.",
    )
    p.add_argument("scenario", help="scenario file, e.g. benchmarks/scenarios/smoke.toml")
    p.add_argument("--arms", metavar="A,B",
                   help="run only these arms (comma-separated names); the baseline arm always runs")
    p.add_argument("--baseline", metavar="ARM",
                   help="take every ratio against this arm instead of the scenario's baseline (it runs first; "
                        "with --arms the scenario's own baseline then runs only if named)")
    p.add_argument("--depths", metavar="D,D",
                   help="run only these depths (comma-separated token counts) of the prompt sets that have them")
    p.add_argument("--reps", type=int, metavar="N", help="repetitions per arm and prompt (overrides the scenario)")
    p.add_argument("--warmup", type=int, metavar="N", help="untimed requests first (overrides the scenario)")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the .md and .json results (default: benchmarks/results next to the "
                        "scenarios folder)")
    p.add_argument("--vram-budget", type=float, metavar="GIB",
                   help="emulate a GPU with GIB GiB of memory: before each arm's server starts, a ballast process "
                        "(python -m moecache.bench.ballast) holds all but GIB GiB of every visible GPU's free "
                        "memory, and it is stopped after that server; the results record what it held. Overrides "
                        "the scenario's vram_budget_gib; 0 turns a scenario's budget off. Needs a CUDA GPU")
    p.add_argument("--server-logs", metavar="DIR",
                   help="keep each arm's llama-server log in DIR as <scenario>-<arm>.log (by default a log is "
                        "kept only when its arm failed), e.g. for GGML_SCHED_TIMES's per-backend times")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="write no plots (by default prefill/decode per arm and hit rate against slots are drawn "
                        "beside the tables as PNGs, where matplotlib is installed: pip install 'moecache[plots]')")
    p.add_argument("--dry-run", action="store_true",
                   help="check the scenario and print the commands, the prompts and the model; start nothing")
    p.add_argument("--model-only", action="store_true",
                   help="make (or find) the scenario's model, print its path and stop: a synthetic model made "
                        "ahead is cached for the real run (in q8_0, q4_0, f16 or f32 it needs no built binary, so "
                        "it can be made while the build runs)")
    return p


def _terminate_as_exit(signum, _frame):
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running arm's server is stopped
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str = "moecache bench") -> int:
    args = build_parser(prog).parse_args(argv)
    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _terminate_as_exit) if on_main else None
    try:
        return _run(args)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_term)


def _run(args: argparse.Namespace) -> int:
    from ..synth import SynthError
    from .runner import BenchError, resolve_model, run_scenario

    try:
        sc = load_scenario(args.scenario)
        if args.model_only:
            if args.dry_run:
                raise ScenarioError("--model-only makes the model, --dry-run makes nothing: pass one of them")
            try:
                path, _ = resolve_model(sc.model, sc.path, make=True)
            except SynthError as e:
                raise ScenarioError(f"model: {e}") from None
            print(path)
            return 0
        if args.baseline:
            sc.set_baseline(args.baseline.strip())
        if args.arms:
            sc.select_arms([a.strip() for a in args.arms.split(",") if a.strip()])
        if args.depths:
            try:
                depths = [int(d) for d in args.depths.split(",") if d.strip()]
            except ValueError:
                raise ScenarioError(f"--depths takes comma-separated token counts, got {args.depths!r}") from None
            sc.select_depths(depths)
        if args.reps is not None:
            if args.reps < 1:
                raise ScenarioError("--reps must be >= 1")
            sc.repetitions = args.reps
        if args.warmup is not None:
            if args.warmup < 0:
                raise ScenarioError("--warmup must be >= 0")
            sc.warmup = args.warmup
        if args.vram_budget is not None:
            if not args.vram_budget >= 0:
                raise ScenarioError(f"--vram-budget must be a number of GiB >= 0 (0: no budget), "
                                    f"got {args.vram_budget}")
            sc.vram_budget_gib = args.vram_budget or None
        out_dir = Path(args.out) if args.out else default_out_dir(sc.path)
        logs_dir = None
        if args.server_logs:
            logs_dir = Path(args.server_logs)
            try:
                logs_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ScenarioError(f"--server-logs: cannot make {logs_dir}: {e.strerror}") from None
        run, _ = run_scenario(sc, out_dir, dry_run=args.dry_run, logs_dir=logs_dir, plots=args.plots)
    except ScenarioError as e:
        print(f"moecache bench: {e}", file=sys.stderr)
        return 2
    except (BenchError, FileNotFoundError) as e:
        print(f"moecache bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moecache bench: interrupted; the servers were stopped.", file=sys.stderr)
        return 130
    if args.dry_run:
        return 0
    from .report import comparison_lines, target_lines

    table = comparison_lines(run)
    if table:
        # the ratios users ask for, on the terminal too (the result file has them with the rest)
        print(f"against the baseline arm '{run['baseline']}' (prefill, TTFT: speed-ups; decode t/s (ratio)):")
        print("\n".join(table))
        targets = target_lines(run)
        if targets:
            print("the scenario's targets (the worst case of each arm):")
            print("\n".join(targets))
    return 0 if run.get("ok") else 1
