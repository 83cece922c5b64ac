"""`moecache tune`: the hot-expert cache's policy, its parameters and its size from the user's own routing.

A routing trace of the user's traffic (llama-server's --moe-routing-trace, or `moecache cache-sim --record`)
is replayed through the cache's own policy code (the library's, through _core, as `moecache cache-sim`
does) for every policy setting of a grid and every slot count asked for. Per slot count the best setting
(the highest hit rate; fewer uploads break a tie) gives the hit-rate curve; the recommendation is the best
setting at the slot count the user's VRAM allows (--slots-budget, by default the largest one tried). It is
written as a config that moecache-server reads (--tune-config FILE) and as the flags to paste.

With --swap-bench RESULT.json (a `moecache bench` result with an arm that swapped and one without), the
prefill-phase swap's minimum prompt length comes from the measured costs too: a swap of cost c (its
restore, in the swapped arm's prefill time) at a prompt rate R1 pays against the rate r0 without it from
n > c / (1/r0 - 1/R1) tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .cache_sim import TraceError, _policies, load_trace, simulate

CONFIG_KIND = "moecache-tune"
CONFIG_VERSION = 1

# the grid: each policy's parameters around the library's defaults (freq 40; lru 2 misses in 16 tokens)
FREQ_INTERVALS = (10, 20, 40, 80, 160)
LRU_ADMIT_MISSES = (1, 2, 3)
LRU_ADMIT_WINDOWS = (8, 16, 32)


@dataclass(frozen=True)
class Setting:
    policy: str
    interval: int = 40
    admit_misses: int = 2
    admit_window: int = 16

    def options(self) -> dict:
        """The setting as moecache's Python options (api.MOE_CACHE_OPTIONS names)."""
        if self.policy == "freq":
            return {"moe_cache_policy": "freq", "moe_cache_rebalance_interval": self.interval}
        return {"moe_cache_policy": "lru", "moe_cache_admit_misses": self.admit_misses,
                "moe_cache_admit_window": self.admit_window}

    def label(self) -> str:
        if self.policy == "freq":
            return f"freq interval {self.interval}"
        return f"lru {self.admit_misses} miss{'es' if self.admit_misses != 1 else ''} in {self.admit_window}"


def grid(policies=("freq", "lru")) -> list[Setting]:
    out = []
    if "freq" in policies:
        out += [Setting("freq", interval=i) for i in FREQ_INTERVALS]
    if "lru" in policies:
        out += [Setting("lru", admit_misses=m, admit_window=w) for m in LRU_ADMIT_MISSES for w in LRU_ADMIT_WINDOWS]
    return out


def replay(trace, slots: int, s: Setting, max_uploads: int = 2, warmup: int = 0) -> dict:
    return simulate(trace, slots, s.policy, s.interval, s.admit_misses, s.admit_window, max_uploads, warmup)


def better(a: dict, b: dict | None) -> bool:
    """a beats b: a higher hit rate, or the same with fewer uploads."""
    return b is None or (a["hit_rate"], -a["uploads"]) > (b["hit_rate"], -b["uploads"])


def neighbours(s: Setting) -> list[Setting]:
    """Settings around s, finer than the grid: the second pass looks there."""
    if s.policy == "freq":
        return [Setting("freq", interval=i) for i in sorted({max(1, round(s.interval * f)) for f in
                (0.5, 0.625, 0.75, 0.875, 1.125, 1.25, 1.5, 1.75)} - {s.interval})]
    out = []
    for m in (s.admit_misses - 1, s.admit_misses, s.admit_misses + 1):
        for f in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0):
            w = max(1, round(s.admit_window * f))
            if m >= 1 and (m, w) != (s.admit_misses, s.admit_window):
                out.append(Setting("lru", admit_misses=m, admit_window=w))
    return sorted(set(out), key=lambda x: (x.admit_misses, x.admit_window))


def tune(trace, slots: list[int], settings: list[Setting], max_uploads: int = 2, warmup: int = 0,
         progress=None) -> list[dict]:
    """Per slot count: the best setting and its replay, with every setting's hit rate. Two passes: the
    grid, then the neighbours of each policy's best grid setting."""
    curve = []
    for n in slots:
        best = best_setting = None
        tried = []
        best_of: dict[str, tuple[dict, Setting]] = {}

        def run(s: Setting):
            nonlocal best, best_setting
            r = replay(trace, n, s, max_uploads, warmup)
            tried.append({"setting": s.label(), "hit_rate": r["hit_rate"], "uploads": r["uploads"]})
            if better(r, best):
                best, best_setting = r, s
            if s.policy not in best_of or better(r, best_of[s.policy][0]):
                best_of[s.policy] = (r, s)
            if progress:
                progress.update()

        for s in settings:
            run(s)
        done = set(settings)
        for _, s in list(best_of.values()):
            for x in neighbours(s):
                if x not in done:
                    done.add(x)
                    run(x)
        curve.append({"slots": n, "best": best_setting, "result": best, "tried": tried})
    return curve


def config_for(curve: list[dict], slots_budget: int, trace_path: str, max_uploads: int) -> dict:
    point = max((p for p in curve if p["slots"] <= slots_budget), key=lambda p: p["slots"])
    s: Setting = point["best"]
    return {
        "kind": CONFIG_KIND,
        "version": CONFIG_VERSION,
        "trace": Path(trace_path).name,
        "options": {"moe_cache_slots": point["slots"], **s.options(), "moe_cache_max_uploads": max_uploads},
        "expected_hit_rate": point["result"]["hit_rate"],
        "curve": [{"slots": p["slots"], "setting": p["best"].label(), "hit_rate": p["result"]["hit_rate"],
                   "uploads": p["result"]["uploads"]} for p in curve],
    }


class ConfigError(ValueError):
    pass


class SwapBenchError(ValueError):
    pass


def _median(x):
    return x["median"] if isinstance(x, dict) else x


def swap_break_even(result: dict, baseline: str | None = None) -> list[dict]:
    """From a bench result: per swapped arm and prompt length, the swap's cost c (ms), the prompt rate
    without a swap r0 (the baseline arm, or `baseline`), the swapped arm's rate net of the swap R1, and the
    length from which the swap pays, c / (1/r0 - 1/R1) (None where it never does)."""
    rows = result.get("results")
    if not isinstance(rows, list):
        raise SwapBenchError("not a moecache bench result (no \"results\" list)")
    base = baseline or result.get("baseline")
    r0 = {(r["prompt"], r["length"]): _median(r["prefill_tps"]) for r in rows
          if r.get("arm") == base and r.get("users", 1) == 1 and not ((r.get("prefill_swap") or {}).get("swapped"))}
    if not r0:
        raise SwapBenchError(f"no unswapped one-user rows of the baseline arm {base!r}. Fix: name an arm without "
                             "the swap with --swap-baseline")
    out = []
    for r in rows:
        sw = r.get("prefill_swap") or {}
        if r.get("users", 1) != 1 or not sw.get("swapped") or not sw.get("swap_ms"):
            continue
        key = (r["prompt"], r["length"])
        if key not in r0:
            continue
        n = r["prompt_tokens"]
        c = _median(sw["swap_ms"]) / 1000.0
        t1 = n / _median(r["prefill_tps"])  # the server's prompt time includes the swap's
        net = t1 - c
        if net <= 0:
            continue
        gain = 1.0 / r0[key] - net / n  # seconds saved per prompt token once swapped
        out.append({"arm": r["arm"], "prompt": r["prompt"], "length": n, "swap_ms": c * 1000.0,
                    "r0": r0[key], "r1_net": n / net, "prefill_ubatch": sw.get("prefill_ubatch"),
                    "break_even": (c / gain) if gain > 0 else None})
    if not out:
        raise SwapBenchError("no one-user row of an arm that swapped (prefill_swap.swapped > 0 with its swap_ms). "
                             "Fix: run a scenario with a --prefill-ubatch arm and a baseline without it")
    return out


def swap_options(rows: list[dict], round_to: int = 64) -> dict:
    """The swap's options from the break-even rows: the swapped arm's ubatch, and the largest break-even
    (rounded up), but not below that ubatch: the rates were measured on prompts that fill it many times,
    and a shorter prompt runs in one ubatch either way, so the linear model does not reach below it."""
    paying = [r for r in rows if r["break_even"] is not None]
    if not paying:
        return {}
    n = max(r["break_even"] for r in paying)
    n = max(round_to, -(-int(n) // round_to) * round_to)
    ubatch = max((r["prefill_ubatch"] or 0) for r in paying)
    if not ubatch:
        return {"prefill_min_tokens": n}
    return {"prefill_ubatch": ubatch, "prefill_min_tokens": max(n, ubatch)}


def _tables() -> dict:
    from .options import MOE_CACHE_OPTIONS, PREFILL_SWAP_OPTIONS

    return {"expert cache": MOE_CACHE_OPTIONS, "prefill swap": PREFILL_SWAP_OPTIONS}


def _option_table() -> dict:
    """Option name -> its FeatureOption, over the features a tune config sets."""
    return {name: opt for t in _tables().values() for name, opt in t.items()}


def load_config(path: str | Path) -> dict:
    """A config written by `moecache tune`: its options (the API's cache and swap option names), checked."""

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"tune config not found: {path}. Fix: write one with `moecache tune TRACE --write-config "
                          f"{path}`") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a tune config ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != CONFIG_KIND or not isinstance(data.get("options"), dict):
        raise ConfigError(f"{path}: not a tune config (no \"kind\": \"{CONFIG_KIND}\" with \"options\"). Fix: write "
                          "it with `moecache tune TRACE --write-config FILE`")
    if data.get("version") != CONFIG_VERSION:
        raise ConfigError(f"{path}: tune config version {data.get('version')!r}, this moecache reads "
                          f"{CONFIG_VERSION}. Fix: run `moecache tune` again")
    from .options import _feature_options

    tables = _tables()
    known = {name for t in tables.values() for name in t}
    unknown = sorted(set(data["options"]) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:  # the API's own checks: types, ranges, words (no environment: the file's values alone)
        for feature, table in tables.items():
            _feature_options(table, feature, kwargs={k: v for k, v in data["options"].items() if k in table},
                             environ={})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return data["options"]


def config_args(options: dict, user_args, environ) -> list[str]:
    """The llama-server flags of a tune config's options that neither the user's flags nor their environment
    already set (theirs win; llama-server lets a flag beat a variable, so ours would beat their variable)."""
    from .options import has_flag

    table = _option_table()
    out = []
    for name, value in options.items():
        opt = table[name]
        if has_flag(user_args, (opt.flag,)) or opt.from_environment(environ) is not None:
            continue
        out += [opt.flag, str(value)]
    return out


PROFILE_MAGIC = "moecache-expert-profile 1"  # the hot-expert cache's profile format (llama-moe-cache.cpp)


def profile_fingerprint(model: str | Path) -> tuple[str, int, int]:
    """The line that ties a profile to its model, as the library writes it: the architecture, the layer count,
    the experts per layer, the weights' element count and bytes; with the layers that have routed experts."""
    from .gguf import GGUFReader

    with GGUFReader(model) as g:
        arch = g.get("general.architecture")
        n_layer = g.get(f"{arch}.block_count")
        n_expert = g.get(f"{arch}.expert_count")
        if not arch or not n_layer or not n_expert:
            raise ValueError(f"{model} declares no routed experts ({arch}.expert_count): a profile is for a MoE")
        n_elements = sum(t.n_elements for t in g.tensors)
        n_bytes = sum(t.nbytes for t in g.tensors)
        moe = sorted({int(t.name.split(".")[1]) for t in g.tensors
                      if t.name.startswith("blk.") and "_exps." in t.name})
    return f"{arch} {int(n_layer)} {int(n_expert)} {n_elements} {n_bytes}", int(n_expert), moe


def trace_counts(path: str | Path, seq: int | None = None, warmup: int = 0) -> dict[int, Counter]:
    """How often each expert of each layer was routed in a trace (every layer a token has, after `warmup`
    tokens)."""
    counts: dict[int, Counter] = {}
    n = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            x = json.loads(line)
            if seq is not None and int(x.get("seq", 0)) != seq:
                continue
            n += 1
            if n <= warmup:
                continue
            for layer, ids in x["layers"].items():
                counts.setdefault(int(layer), Counter()).update(int(i) for i in ids)
    return counts


def write_profile(path: Path, model: str | Path, counts: dict[int, Counter]) -> int:
    """The routing counts as the cache's expert profile of `model` (read at start by moecache-server
    --moe-cache-profile FILE, which keeps adding to it); written whole or not at all. The layers written."""
    fingerprint, n_expert, moe_layers = profile_fingerprint(model)
    bad = [(l, e) for l, c in counts.items() for e in c if not 0 <= e < n_expert]
    if bad:
        raise ValueError(f"the trace routes to expert {bad[0][1]} of layer {bad[0][0]}, but {model} has {n_expert} "
                         f"experts per layer: it was recorded with another model")
    lines = [PROFILE_MAGIC, f"model {fingerprint}"]
    for il in moe_layers:
        c = counts.get(il, Counter())
        lines.append(f"layer {il} " + " ".join(str(c.get(e, 0)) for e in range(n_expert)))
    lines.append("end")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return len(moe_layers)


def _int_list(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated slot counts, e.g. 16,32,64; got {text!r}")
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"slot counts must be >= 1; got {text!r}")
    return out


def build_parser(prog: str = "moecache tune") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("trace", help="routing trace (JSONL) of your own traffic: llama-server --moe-routing-trace FILE")
    p.add_argument("--slots", type=_int_list, default=None,
                   help="slot counts per layer to try (default: powers of two from 8 up to the expert count)")
    p.add_argument("--slots-budget", type=int, default=None,
                   help="the slots per layer your VRAM allows: the recommendation is the best setting at the "
                        "largest tried count within it (default: the largest tried)")
    p.add_argument("--policy", default="freq,lru", help="policies to try (default freq,lru)")
    p.add_argument("--max-uploads", type=int, default=2, help="uploads per layer and step (default 2)")
    p.add_argument("--warmup", type=int, default=0, help="tokens at the start not counted (default 0)")
    p.add_argument("--seq", type=int, default=None, help="only this sequence of the trace")
    p.add_argument("--swap-bench", metavar="RESULT.json", default=None,
                   help="a moecache bench result with an arm that swapped (--prefill-ubatch) and a baseline without: "
                        "the swap's ubatch and minimum prompt length from its measured costs")
    p.add_argument("--swap-baseline", metavar="ARM", default=None,
                   help="the --swap-bench arm without the swap to compare with (default: the result's baseline)")
    p.add_argument("--write-config", metavar="FILE", default=None,
                   help="write the recommendation as a config for moecache-server --tune-config FILE")
    p.add_argument("--json", dest="json_out", default=None, help="also write the whole curve as JSON")
    p.add_argument("--write-profile", metavar="FILE", nargs="?", const="", default=None,
                   help="write the trace's routing counts as the cache's expert profile of --model, which "
                        "moecache-server reads at start to fill the cache's slots before the first request; without "
                        "FILE, where moecache-server keeps that model's profile by default")
    p.add_argument("--model", metavar="MODEL.gguf", default=None,
                   help="the model the trace was recorded with (for --write-profile)")
    return p


def main(argv: list[str] | None = None, prog: str = "moecache tune") -> int:
    from ._progress import Progress

    args = build_parser(prog).parse_args(argv)
    try:
        policies = _policies(args.policy)
    except argparse.ArgumentTypeError as e:
        print(f"{prog}: --policy: {e}", file=sys.stderr)
        return 2
    if args.max_uploads < 1:
        print(f"{prog}: --max-uploads must be >= 1", file=sys.stderr)
        return 2
    if args.write_profile is not None and not args.model:
        print(f"{prog}: --write-profile needs --model MODEL.gguf (the profile names the model it belongs to)",
              file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, args.seq)
    except TraceError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.write_profile is not None:
        from .paths import profile_path

        where = Path(args.write_profile) if args.write_profile else profile_path(args.model)
        try:
            n = write_profile(where, args.model, trace_counts(args.trace, args.seq, args.warmup))
        except (OSError, ValueError) as e:
            print(f"{prog}: --write-profile: {e}", file=sys.stderr)
            return 2
        print(f"wrote {where}: the routing of {len(trace.tokens)} tokens over {n} layers; moecache-server reads it "
              f"at start" + ("" if not args.write_profile else f" with --moe-cache-profile {where}"))
    swap_rows = None
    if args.swap_bench:
        try:
            swap_rows = swap_break_even(json.loads(Path(args.swap_bench).read_text()), args.swap_baseline)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{prog}: --swap-bench {args.swap_bench}: {e}", file=sys.stderr)
            return 2
    slots = args.slots or [s for s in (8, 16, 32, 64, 128, 256, 512) if s < trace.n_expert] + [trace.n_expert]
    slots = [min(s, trace.n_expert) for s in slots]
    slots = sorted(set(slots))
    budget = args.slots_budget if args.slots_budget is not None else slots[-1]
    if budget < slots[0]:
        print(f"{prog}: --slots-budget {budget} is below every tried slot count ({slots[0]}). Fix: try smaller "
              f"counts with --slots", file=sys.stderr)
        return 2
    settings = grid(policies)
    print(f"trace {args.trace}: {len(trace.tokens)} tokens, {len(trace.layers)} layers, {trace.n_expert} experts "
          f"(top-{trace.n_used}); {len(settings)} settings x {len(slots)} slot counts")
    n_around = (8 if "freq" in policies else 0) + (17 if "lru" in policies else 0)  # neighbours(), at most
    progress = Progress((len(settings) + n_around) * len(slots), "replaying (the grid, then around its best)",
                        unit="replays")
    curve = tune(trace, slots, settings, args.max_uploads, args.warmup, progress=progress)
    progress.close()
    print(f"{'slots':>5}  {'best setting':<24} {'hit rate':>8} {'uploads':>8}  {'freq 40 (default)':>17}")
    default = Setting("freq", interval=40).label()
    for p in curve:
        d = next((t["hit_rate"] for t in p["tried"] if t["setting"] == default), None)
        print(f"{p['slots']:>5}  {p['best'].label():<24} {p['result']['hit_rate']:>8.1%} {p['result']['uploads']:>8}  "
              f"{'-' if d is None else format(d, '.1%'):>17}")
    cfg = config_for(curve, budget, args.trace, args.max_uploads)
    if swap_rows is not None:
        print(f"{'swap arm':<14} {'tokens':>7} {'swap ms':>8} {'t/s without':>11} {'t/s swapped':>11} {'pays from':>10}")
        for r in swap_rows:
            pays = "never" if r["break_even"] is None else f"{r['break_even']:.0f}"
            print(f"{r['arm']:<14} {r['length']:>7} {r['swap_ms']:>8.1f} {r['r0']:>11.0f} {r['r1_net']:>11.0f} {pays:>10}")
        sw = swap_options(swap_rows)
        if sw:
            cfg["options"].update(sw)
            cfg["swap_break_even"] = [{k: r[k] for k in ("arm", "length", "swap_ms", "break_even")} for r in swap_rows]
        else:
            print("the swap paid at no measured length: the config leaves it off")
    table = _option_table()
    flags = " ".join(f"{table[k].flag} {v}" for k, v in cfg["options"].items())
    print(f"recommended at {cfg['options']['moe_cache_slots']} slots: {flags} "
          f"(expected hit rate {cfg['expected_hit_rate']:.1%} on this trace)")
    if args.write_config:
        Path(args.write_config).write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"wrote {args.write_config}: moecache-server --tune-config {args.write_config} -m MODEL ...")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"trace": str(args.trace), "config": cfg,
             "curve": [{"slots": p["slots"], "best": p["best"].label(), "result": p["result"], "tried": p["tried"]}
                       for p in curve]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
