"""Medians, spreads and ratios against the baseline arm."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

# metric -> True when larger is better. Ratios are always "speed-ups": > 1 means the arm is
# better than the baseline (arm / baseline for rates, baseline / arm for times).
METRICS = {
    "prefill_tps": True,
    "ttft_ms": False,
    "decode_tps": True,
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


def add_ratios(results: list[dict], baseline: str) -> None:
    """Fill result["ratios"] for every result row against the baseline arm's row of the same prompt."""
    base = {(r["prompt"], r["length"]): r for r in results if r["arm"] == baseline}
    for r in results:
        b = base.get((r["prompt"], r["length"]))
        ratios = {}
        for m in METRICS:
            am = (r.get(m) or {}).get("median")
            bm = ((b or {}).get(m) or {}).get("median")
            ratios[m] = ratio(m, am, bm)
        r["ratios"] = ratios
