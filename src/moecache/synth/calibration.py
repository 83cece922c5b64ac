"""`moecache calibrate-routing`: fit a synthetic preset's routing to the LRU hit rates published for
the real model.

A synthetic model routes by token identity (moecache.synth); how concentrated that routing is
depends on its routing strength. Cache numbers measured on a synthetic model are only as good as its
routing, so this command sweeps the strength, predicts the routing of real text for each value
(synth.predicted_trace: embedding -> RMS norm -> router -> top-k, from the generator's float weights,
without writing a model), replays it through a textbook LRU cache per layer (a miss is inserted at
once, the least recently used expert goes) at the published cache sizes, and reports the strength
whose hit rates are closest to the published ones (least squares).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PublishedLRU:
    """LRU hit rates published for a real model: cache size in slots per layer -> hit rate."""

    model: str
    source: str
    hit_rates: dict[int, float]


# per preset. kekzl/imp PR #1374 sized its LRU pool as 5/15/30/50% of free VRAM, which it reports as
# 24/73/146/244 slots per layer over 256 cold decode tokens (36.6/74.1/89.4/96.2%); the last two hold
# more than the model's 128 experts per layer, so only the first two are a per-layer LRU curve. Replay
# 256 tokens with no warm-up to compare (calibrate-routing --tokens 256).
PUBLISHED: dict[str, PublishedLRU] = {
    "qwen3-30b-a3b": PublishedLRU(
        "Qwen3-30B-A3B", "kekzl/imp PR #1374 (LRU, 24 and 73 slots per layer, 256 cold decode tokens)",
        {24: 0.366, 73: 0.741}),
    "qwen3-next-80b-a3b": PublishedLRU(
        "Qwen3.8-Flash-Next (512 experts)", "llama.cpp PR #27861 (LRU-64 ~67%, LRU-128 ~81%)",
        {64: 0.67, 128: 0.81}),
}

DEFAULT_STRENGTHS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def plain_lru_hits(ids, slots: int) -> tuple[int, int]:
    """(hits, routed) of a textbook LRU cache of `slots` experts over one layer's routing `ids`
    [n_tokens, n_used]: a hit moves the expert to the front, a miss inserts it there and evicts the
    least recently used; what one token routes is looked up before it is inserted."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hits = routed = 0
    for row in ids:
        for e in row:
            e = int(e)
            routed += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits, routed


def lru_hit_rates(preset: str, tokens: list[int], strength: float, slots: list[int], seed: int = 0,
                  warmup: int = 0, context_mix: float = 0.0) -> dict[int, float]:
    """Hit rate of a plain LRU cache of each size (per layer) over the routing `preset` predicts for
    `tokens` (with the modelled context term, synth.predicted_trace); the first `warmup` tokens fill
    the caches without being counted."""
    from .. import synth

    p = synth.get_preset(preset)
    ids = synth.predicted_trace(p, tokens, seed=seed, routing_strength=strength, context_mix=context_mix)
    out = {}
    for s in slots:
        hits = routed = 0
        for il in range(p.n_layer):
            h0, r0 = plain_lru_hits(ids[:warmup, il, :], s) if warmup else (0, 0)
            h, r = plain_lru_hits(ids[:, il, :], s)
            hits += h - h0
            routed += r - r0
        out[s] = hits / routed if routed else 0.0
    return out


def calibrate(preset: str, tokens: list[int], published: PublishedLRU, strengths=DEFAULT_STRENGTHS,
              seed: int = 0, warmup: int = 0, progress=None, context_mixes=(0.0,)) -> dict:
    """Sweep `strengths` x `context_mixes`; returns every row and the best one (least squares against
    `published`)."""
    slots = sorted(published.hit_rates)
    rows = []
    for mix in context_mixes:
        for st in strengths:
            rates = lru_hit_rates(preset, tokens, st, slots, seed=seed, warmup=warmup, context_mix=mix)
            err = math.sqrt(sum((rates[s] - published.hit_rates[s]) ** 2 for s in slots) / len(slots))
            rows.append({"routing_strength": st, "context_mix": mix, "hit_rates": {str(s): rates[s] for s in slots},
                         "rms_error": err})
            if progress:
                progress(rows[-1])
    best = min(rows, key=lambda r: r["rms_error"])
    from . import SYNTH_VERSION

    return {"preset": preset, "synth_version": SYNTH_VERSION, "model": published.model, "source": published.source,
            "published": {str(s): v for s, v in published.hit_rates.items()}, "tokens": len(tokens), "seed": seed,
            "warmup": warmup, "rows": rows, "best": best}


def report_markdown(result: dict, texts: list[str]) -> str:
    slots = list(result["published"])
    head = "| routing strength | context mix | " + " | ".join(f"LRU-{s}" for s in slots) + " | RMS error |"
    lines = [f"# Routing calibration: `{result['preset']}`", "",
             f"Textbook LRU hit rates per layer (a miss is inserted at once) over the routing that the synthetic preset predicts for "
             f"{result['tokens']} tokens of {', '.join(texts)} (seed {result['seed']}, {result['warmup']} tokens of "
             f"warm-up not counted; synth generator v{result.get('synth_version', '?')}), against those published for "
             f"{result['model']}: {result['source']}.", "",
             head, "| ---: | ---: | " + " | ".join("---:" for _ in slots) + " | ---: |",
             "| published | - | " + " | ".join(f"{100 * result['published'][s]:.1f}%" for s in slots) + " | - |"]
    for r in result["rows"]:
        mark = " **(best)**" if r is result["best"] or r == result["best"] else ""
        lines.append(f"| {r['routing_strength']:g}{mark} | {r.get('context_mix', 0.0):g} | " +
                     " | ".join(f"{100 * r['hit_rates'][s]:.1f}%" for s in slots) + f" | {100 * r['rms_error']:.1f} |")
    lines += ["", f"Best: routing strength {result['best']['routing_strength']:g}, context mix "
                  f"{result['best'].get('context_mix', 0.0):g} "
                  f"(RMS error {100 * result['best']['rms_error']:.1f} points).", ""]
    return "\n".join(lines)


def _strengths(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in 0..10, got {text!r}") from None
    if not vals or any(not (0.0 <= v <= 10.0) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in 0..10, got {text!r}")
    return vals


def _mixes(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r}") from None
    if not vals or any(not (math.isfinite(v) and v >= 0.0) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r}")
    return vals


def build_parser(prog: str = "moecache calibrate-routing") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(PUBLISHED), help="the synthetic preset to calibrate")
    ap.add_argument("--text", action="append", type=Path, required=True,
                    help="text file(s) whose routing is replayed (e.g. benchmarks/prompts/prose/*.txt)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of text (default 2048)")
    ap.add_argument("--warmup", type=int, default=0, help="tokens at the start that are not counted (default 0)")
    ap.add_argument("--strengths", type=_strengths, default=DEFAULT_STRENGTHS,
                    help=f"routing strengths to try (default {','.join(f'{s:g}' for s in DEFAULT_STRENGTHS)})")
    ap.add_argument("--context-mix", type=_mixes, default=(0.0,),
                    help="strengths of the modelled context term to try (uniform attention carrying the mean of the "
                         "earlier positions, as `moecache synth --context-mix` writes it), comma-separated, >= 0 (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="the preset's seed (default 0)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as OUT.json and OUT.md")
    return ap


def main(argv: list[str] | None = None, prog: str = "moecache calibrate-routing") -> int:
    args = build_parser(prog).parse_args(argv)
    from . import reference_tokenizer

    for t in args.text:
        if not t.is_file():
            print(f"{prog}: text file not found: {t}", file=sys.stderr)
            return 2
    if args.tokens < 1 or args.warmup < 0 or args.warmup >= args.tokens:
        print(f"{prog}: need --tokens >= 1 and 0 <= --warmup < --tokens", file=sys.stderr)
        return 2
    text = "\n\n".join(t.read_text(encoding="utf-8", errors="replace") for t in args.text)
    tokens = reference_tokenizer().encode(text)[:args.tokens]
    if len(tokens) < args.tokens:
        print(f"{prog}: the text has only {len(tokens)} tokens (asked for {args.tokens}): give more --text", file=sys.stderr)
        return 2

    def progress(row):
        rates = ", ".join(f"LRU-{s} {100 * v:.1f}%" for s, v in row["hit_rates"].items())
        print(f"strength {row['routing_strength']:g}, context mix {row['context_mix']:g}: {rates} "
              f"(RMS error {100 * row['rms_error']:.1f})", flush=True)

    result = calibrate(args.preset, tokens, PUBLISHED[args.preset], args.strengths, seed=args.seed,
                       warmup=args.warmup, progress=progress, context_mixes=args.context_mix)
    md = report_markdown(result, [t.name for t in args.text])
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({**result, "texts": [t.name for t in args.text]}, indent=1))
        args.out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
