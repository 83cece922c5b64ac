"""`moecache cache-sim`: replay a routing trace through the hot-expert cache's policies.

A trace is the JSONL that `--moe-routing-trace FILE` (server) or `ctx.record_routing(path)` (Python)
writes: one line per accepted token, {"seq", "pos", "cached", "layers": {"<layer>": [expert ids]}}.
The replay runs the library's own policy code (moecache._core.LayerPolicy) with the runtime's step
order: at each token the routing of the previous token is observed, uploads planned one step
earlier are published (a copy is assumed to take less than one token), new uploads are planned,
and the token's experts count as hits if their slot is published. So it answers "what hit rate would
S slots and this policy give on this text" without a GPU, and gives the routing statistics of the
text (distinct experts, the share the most-routed S experts take: a static upper bound).

    moecache cache-sim trace.jsonl --slots 16,32,64 --policy freq,lru
    moecache cache-sim trace.jsonl --by-layer     # slots sized per layer by the first half (as a profile would)
    moecache cache-sim --record model.gguf --text benchmarks/prompts/code/heapq.py --tokens 2048 trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    layers: list[int]                                   # layer indices present in every counted token
    tokens: list[dict[int, list[int]]] = field(default_factory=list)
    n_expert: int = 0
    n_used: int = 0


def load_trace(path: str | Path, seq: int | None = None) -> Trace:
    """Read a routing trace; only layers present in every token are kept (the last layer of a graph
    runs only the output tokens, so a prompt's tokens lack it)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"routing trace not found: {path}. Fix: record one with --moe-routing-trace FILE "
                         "(llama-server / moecache-server) or ctx.record_routing(path)")
    tokens: list[dict[int, list[int]]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                x = json.loads(line)
                layers = {int(k): [int(i) for i in v] for k, v in x["layers"].items()}
                s = int(x.get("seq", 0))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise TraceError(f"{path}:{n}: not a routing trace line ({e}): {line[:120]}") from None
            if seq is None or s == seq:
                tokens.append(layers)
    if not tokens:
        raise TraceError(f"{path}: no tokens" + (f" of sequence {seq}" if seq is not None else ""))
    common = set(tokens[0])
    for t in tokens[1:]:
        common &= set(t)
    if not common:
        raise TraceError(f"{path}: no layer is present in every token")
    layers = sorted(common)
    n_used = max(len(ids) for t in tokens for ids in t.values())
    n_expert = 1 + max(i for t in tokens for l in layers for i in t[l])
    return Trace(layers=layers, tokens=[{l: t[l] for l in layers} for t in tokens], n_expert=n_expert, n_used=n_used)


def routing_stats(trace: Trace, slots: list[int]) -> dict:
    """Distinct experts per layer and the share of the routing that the top-S experts of each layer
    take over the whole trace (what S pinned slots chosen with hindsight would hit)."""
    distinct, top_share = [], {s: [] for s in slots}
    for l in trace.layers:
        c = Counter(i for t in trace.tokens for i in t[l])
        total = sum(c.values())
        distinct.append(len(c))
        ranked = [n for _, n in c.most_common()]
        for s in slots:
            top_share[s].append(sum(ranked[:s]) / total if total else 0.0)
    # reuse distance: tokens since the same expert of the same layer was last routed
    dists: list[int] = []
    for l in trace.layers:
        last: dict[int, int] = {}
        for t, tok in enumerate(trace.tokens):
            for e in tok[l]:
                if e in last:
                    dists.append(t - last[e])
                last[e] = t
    dists.sort()
    n = len(trace.layers)
    return {
        "reuse_distance_median": dists[len(dists) // 2] if dists else None,
        "reuse_distance_p90": dists[int(len(dists) * 0.9)] if dists else None,
        "reuse_within_8": sum(1 for d in dists if d <= 8) / len(dists) if dists else 0.0,
        "tokens": len(trace.tokens),
        "layers": n,
        "n_expert": trace.n_expert,
        "n_used": trace.n_used,
        "distinct_experts_mean": sum(distinct) / n,
        "distinct_experts_min": min(distinct),
        "distinct_experts_max": max(distinct),
        "top_s_share": {s: sum(v) / n for s, v in top_share.items()},
    }


def slots_by_layer(counts: Sequence[Sequence[int]], slots: int, n_expert: int) -> list[int]:
    """Each layer's slots when the cache sizes them from a profile's counts (--moe-cache-slots-by-layer; the
    library's size_layers, for layers of one device and one expert size; the plan's expected hit rate uses it too): every layer starts at half the even
    share `slots` and the rest go, one at a time, to the layer whose next-hottest expert holds the largest share
    of its own routing (ties to the layer with fewer slots); a layer without counts keeps the even share, none
    gets more than `n_expert`."""
    even = min(slots, n_expert)
    if slots >= n_expert:
        return [even for _ in counts]
    floor = max(1, slots // 2)
    shares: list[list[float] | None] = []
    n = []
    for c in counts:
        total = sum(c)
        shares.append(sorted((x / total for x in c), reverse=True) if total > 0 else None)
        n.append(floor if total > 0 else even)
    left = slots * len(counts) - sum(n)
    while left > 0:
        best = None
        for i, s in enumerate(shares):
            if s is None or n[i] >= n_expert:
                continue
            if best is None or s[n[i]] > shares[best][n[best]] or (s[n[i]] == shares[best][n[best]] and n[i] < n[best]):
                best = i
        if best is None:
            break
        n[best] += 1
        left -= 1
    return n


def layer_slots_from(trace: Trace, slots: int, tokens: int) -> dict[int, int]:
    """Each layer's slots as --moe-cache-slots-by-layer sizes them from a profile holding the routing of the
    trace's first `tokens` tokens (an even share of `slots` a layer on average)."""
    counts = []
    for l in trace.layers:
        c = Counter(e for t in trace.tokens[:tokens] for e in t[l])
        counts.append([c.get(e, 0) for e in range(trace.n_expert)])
    return dict(zip(trace.layers, slots_by_layer(counts, slots, trace.n_expert)))


def simulate(trace: Trace, slots: int, policy: str = "freq", interval: int = 40, admit_misses: int = 2,
             admit_window: int = 16, max_uploads: int = 2, warmup: int = 0,
             layer_slots: dict[int, int] | None = None) -> dict:
    """Replay the trace through one policy per layer; the first `warmup` tokens are not counted. `layer_slots`:
    a slot count per layer instead of `slots` for each."""
    from .api import _core

    core = _core()
    hits = misses = uploads = evictions = 0
    for l in trace.layers:
        n_slots = min(layer_slots.get(l, slots) if layer_slots else slots, trace.n_expert)
        pol = core.LayerPolicy(trace.n_expert, n_slots, policy, interval, admit_misses, admit_window, max_uploads)
        published = [-1] * trace.n_expert       # expert -> slot, as the graph's map
        slot_published = [-1] * n_slots
        inflight: list[tuple[int, int]] = []
        prev = None
        for t, tok in enumerate(trace.tokens):
            ids = tok[l]
            if prev is not None:
                pol.observe(prev)
            for slot, e in inflight:
                pol.done(slot, True)
                if pol.expert_in(slot) == e:
                    old = slot_published[slot]
                    if old >= 0:
                        published[old] = -1
                    published[e] = slot
                    slot_published[slot] = e
            inflight = []
            for slot, e in pol.plan(False):
                old = slot_published[slot]
                if old >= 0:  # unpublished before the upload overwrites it
                    published[old] = -1
                    slot_published[slot] = -1
                    if t >= warmup:
                        evictions += 1
                inflight.append((slot, e))
                if t >= warmup:
                    uploads += 1
            if t >= warmup:
                h = sum(1 for e in ids if published[e] >= 0)
                hits += h
                misses += len(ids) - h
            prev = ids
    routed = hits + misses
    counted = max(0, len(trace.tokens) - warmup)
    return {
        "policy": policy, "slots": slots, "hits": hits, "misses": misses,
        "hit_rate": hits / routed if routed else 0.0,
        "uploads": uploads, "evictions": evictions,
        "uploads_per_token_layer": uploads / (counted * len(trace.layers)) if counted else 0.0,
    }


def record_trace(model: str, texts: list[Path], n_tokens: int, out: Path, threads: int | None = None,
                 n_ctx: int | None = None) -> int:
    """Run `n_tokens` of real text through `model` (CPU, prompt processing) while recording the routing."""
    from . import api

    text = "\n\n".join(p.read_text(errors="replace") for p in texts)
    m = api.Model(model, n_gpu_layers=0, repack=True)
    tokens = m.tokenize(text)[:n_tokens]
    if len(tokens) < n_tokens:
        raise TraceError(f"the texts give only {len(tokens)} tokens, fewer than --tokens {n_tokens}: add --text files")
    ctx = m.context(n_ctx=n_ctx or len(tokens) + 16, n_batch=512, n_ubatch=512, n_threads=threads)
    ctx.record_routing(str(out))
    ctx.generate(tokens, max_tokens=1)
    ctx.record_routing(None)
    return len(tokens)


def _int_list(text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not v or any(x < 0 for x in v):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return v


def _policies(text: str) -> list[str]:
    v = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in v if x not in ("freq", "lru")]
    if not v or bad:
        raise argparse.ArgumentTypeError(f"policies are 'freq' and 'lru' (got {text!r})")
    return v


def build_parser(prog: str = "moecache cache-sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="routing trace (JSONL); with --record, the file to write first")
    p.add_argument("--slots", type=_int_list, default=[16, 32, 64], help="slots per layer to try (default 16,32,64)")
    p.add_argument("--policy", type=_policies, default=["freq", "lru"], help="policies to try (default freq,lru)")
    p.add_argument("--interval", type=int, default=40, help="freq: tokens between rebalances (default 40)")
    p.add_argument("--admit-misses", type=int, default=2, help="lru: misses before admission (default 2)")
    p.add_argument("--admit-window", type=int, default=16, help="lru: window of those misses in tokens (default 16)")
    p.add_argument("--max-uploads", type=int, default=2, help="uploads per layer and step (default 2)")
    p.add_argument("--warmup", type=int, default=0, help="tokens at the start that are not counted (default 0)")
    p.add_argument("--seq", type=int, default=None, help="only this sequence of the trace")
    p.add_argument("--by-layer", action="store_true",
                   help="also replay with each layer's slots sized from the trace's first half, as "
                        "--moe-cache-slots-by-layer sizes them from a profile; both replays count the second half only")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON to this file")
    p.add_argument("--record", metavar="MODEL", default=None,
                   help="first record the trace: run --tokens of --text through MODEL on the CPU")
    p.add_argument("--text", action="append", type=Path, default=[], help="text file(s) for --record")
    p.add_argument("--tokens", type=int, default=2048, help="tokens to record (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for --record (default: physical cores)")
    return p


def main(argv: list[str] | None = None, prog: str = "moecache cache-sim") -> int:
    args = build_parser(prog).parse_args(argv)
    for name in ("interval", "admit_misses", "admit_window", "max_uploads"):
        if getattr(args, name) < 1:
            print(f"moecache cache-sim: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        if args.record:
            if not args.text:
                print("moecache cache-sim: --record needs at least one --text FILE", file=sys.stderr)
                return 2
            n = record_trace(args.record, args.text, args.tokens, Path(args.trace), threads=args.threads)
            print(f"recorded the routing of {n} tokens into {args.trace}")
        trace = load_trace(args.trace, args.seq)
    except TraceError as e:
        print(f"moecache cache-sim: {e}", file=sys.stderr)
        return 2
    stats = routing_stats(trace, args.slots)
    print(f"trace {args.trace}: {stats['tokens']} tokens, {stats['layers']} layers, {trace.n_expert} experts "
          f"(top-{trace.n_used}); distinct experts per layer {stats['distinct_experts_mean']:.1f} "
          f"(min {stats['distinct_experts_min']}, max {stats['distinct_experts_max']}); reuse distance median "
          f"{stats['reuse_distance_median']}, p90 {stats['reuse_distance_p90']} tokens, "
          f"{stats['reuse_within_8']:.0%} of reuses within 8 tokens")
    results = []
    print(f"{'policy':<6} {'slots':>5} {'hit rate':>9} {'top-S share':>11} {'uploads':>8} {'evictions':>9} {'uploads/token/layer':>19}")
    for pol in args.policy:
        for s in args.slots:
            r = simulate(trace, s, pol, args.interval, args.admit_misses, args.admit_window, args.max_uploads, args.warmup)
            r["top_s_share"] = stats["top_s_share"][s]
            results.append(r)
            print(f"{pol:<6} {s:>5} {r['hit_rate']:>9.1%} {r['top_s_share']:>11.1%} {r['uploads']:>8} "
                  f"{r['evictions']:>9} {r['uploads_per_token_layer']:>19.3f}")
    if args.by_layer:
        half = len(trace.tokens) // 2
        print(f"slots by layer, sized from the first {half} tokens, against the even share; "
              f"both count the last {len(trace.tokens) - half} tokens:")
        print(f"{'policy':<6} {'slots':>5} {'even':>7} {'by layer':>9} {'layers (min-max slots)':>23}")
        for pol in args.policy:
            for s in args.slots:
                sizes = layer_slots_from(trace, s, half)
                kw = dict(interval=args.interval, admit_misses=args.admit_misses, admit_window=args.admit_window,
                          max_uploads=args.max_uploads, warmup=half)
                even = simulate(trace, s, pol, **kw)
                split = simulate(trace, s, pol, layer_slots=sizes, **kw)
                results.append({**split, "by_layer": True, "layer_slots": {str(k): v for k, v in sizes.items()},
                                "even_hit_rate": even["hit_rate"], "held_out_from": half})
                print(f"{pol:<6} {s:>5} {even['hit_rate']:>7.1%} {split['hit_rate']:>9.1%} "
                      f"{min(sizes.values()):>19}-{max(sizes.values())}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"trace": str(args.trace), "routing": stats, "results": results,
                                                   "params": {k: getattr(args, k) for k in (
                                                       "interval", "admit_misses", "admit_window", "max_uploads",
                                                       "warmup")}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
