"""Medians, spreads and ratios against the baseline arm; speculation counters of a result row."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

# metric -> True when larger is better. Ratios are always "speed-ups": > 1 means the arm is
# better than the baseline (arm / baseline for rates, baseline / arm for times).
METRICS = {
    "prefill_tps": True,
    "ttft_ms": False,
    "decode_tps": True,
    # all predicted tokens of a repetition / its wall time (first send to last response); with one
    # user that is one request, prefill included
    "aggregate_tps": True,
}

# speculation counters that llama-server's final timings carry when drafting was on (moecache's
# patch adds the off/pause/cap reasons); a sample keeps the ones the server reported
SPEC_KEYS = ("draft_n", "draft_n_accepted", "draft_acceptance_rate", "draft_off_load", "draft_off_accept",
             "draft_pauses", "draft_capped")
# a row's speculation summary: name -> the sample key that is summed over its repetitions
SPEC_SUMS = {
    "drafted": "draft_n",
    "accepted": "draft_n_accepted",
    "off_load": "draft_off_load",
    "off_accept": "draft_off_accept",
    "pauses": "draft_pauses",
    "capped": "draft_capped",
}


def summarize(values: Iterable[float | None]) -> dict | None:
    """Median, min, max and the spread ((max - min) / median) of the measured values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    med = statistics.median(vals)
    return {
        "median": med,
        "min": min(vals),
        "max": max(vals),
        "spread": (max(vals) - min(vals)) / med if med else 0.0,
        "n": len(vals),
        "values": vals,
    }


def ratio(metric: str, arm_median: float | None, base_median: float | None) -> float | None:
    """Speed-up of an arm against the baseline for `metric` (None when either is missing or zero)."""
    if not arm_median or not base_median:
        return None
    return arm_median / base_median if METRICS[metric] else base_median / arm_median


def summarize_speculation(samples: Iterable[dict]) -> dict | None:
    """Speculation counters of a row: each summed over the repetitions (None where no sample has it),
    and acceptance = accepted / drafted. None when no sample carries any of SPEC_KEYS."""
    samples = [s for s in samples if any(s.get(k) is not None for k in SPEC_KEYS)]
    if not samples:
        return None
    out: dict = {}
    for name, key in SPEC_SUMS.items():
        vals = [s[key] for s in samples if s.get(key) is not None]
        out[name] = sum(vals) if vals else None
    drafted, accepted = out["drafted"], out["accepted"]
    out["acceptance"] = accepted / drafted if drafted and accepted is not None else None
    return out


def _case(r: dict) -> tuple:
    """What a row is compared on: its prompt, length, depth and concurrency level."""
    return r["prompt"], r["length"], r.get("depth", 0), r.get("users", 1)


def add_ratios(results: list[dict], baseline: str) -> None:
    """Fill result["ratios"] for every result row against the baseline arm's row of the same prompt,
    length and number of users."""
    base = {_case(r): r for r in results if r["arm"] == baseline}
    for r in results:
        b = base.get(_case(r))
        ratios = {}
        for m in METRICS:
            am = (r.get(m) or {}).get("median")
            bm = ((b or {}).get(m) or {}).get("median")
            ratios[m] = ratio(m, am, bm)
        r["ratios"] = ratios
