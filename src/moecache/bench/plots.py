"""Plots of a `moecache bench` run beside its tables (matplotlib, an optional extra: moecache[plots]).

`<result>-rates.png`: per prompt case, prefill and decode t/s of every arm (median, min-max whiskers);
`<result>-hit-rate.png`: the hot-expert cache's hit rate against its slots per layer, where arms had a cache.
Without matplotlib nothing is drawn and the report says how to get them.
"""

from __future__ import annotations

from pathlib import Path

PLOTS_MISSING = "plots: matplotlib is not installed (pip install 'moecache[plots]')"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _case_label(r: dict) -> str:
    label = f"{r.get('prompt')} {r.get('length') or 'all'}"
    if r.get("depth"):
        label += f" @{r['depth']}"
    if r.get("users", 1) > 1:
        label += f" x{r['users']}"
    return label


def _stat(r: dict, key: str) -> tuple[float, float, float] | None:
    s = r.get(key)
    if not isinstance(s, dict) or not s.get("median"):
        return None
    return s["median"], s.get("min", s["median"]), s.get("max", s["median"])


def rates_figure(run: dict):
    """Grouped bars: a panel per rate (prefill, decode), a group per prompt case, a bar per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a["name"] for a in run["arms"]]
    rows = [r for r in run["results"] if not r.get("error")]
    cases = list(dict.fromkeys(_case_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.6 * len(cases) * max(1, len(arms)) / 2 + 3), 4.2))
    width = 0.8 / max(1, len(arms))
    drawn = 0
    for ax, key, title in ((axes[0], "prefill_tps", "prefill t/s"), (axes[1], "decode_tps", "decode t/s")):
        for ai, arm in enumerate(arms):
            xs, ys, lo, hi = [], [], [], []
            for ci, case in enumerate(cases):
                r = next((r for r in rows if r["arm"] == arm and _case_label(r) == case), None)
                st = _stat(r, key) if r else None
                if st:
                    xs.append(ci + (ai - (len(arms) - 1) / 2) * width)
                    ys.append(st[0])
                    lo.append(st[0] - st[1])
                    hi.append(st[2] - st[0])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=arm)
                drawn += len(xs)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    if drawn:
        axes[1].legend(fontsize=7)
    fig.suptitle(f"{run['scenario']['name']} ({run.get('moecache_commit', '?')})", fontsize=9)
    fig.tight_layout()
    return fig, drawn


def hit_rate_figure(run: dict):
    """The cache's hit rate against its slots per layer, one point per arm with a cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(a["moe_cache"]["n_slots"], a["moe_cache"]["hit_rate"], a["name"]) for a in run["arms"]
              if (a.get("moe_cache") or {}).get("n_slots") and a["moe_cache"].get("hit_rate") is not None]
    if not points:
        return None, 0
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for slots, hit, name in sorted(points):
        ax.scatter([slots], [100 * hit], label=name)
    ax.plot([p[0] for p in sorted(points)], [100 * p[1] for p in sorted(points)], color="grey", alpha=0.4)
    ax.set_xlabel("slots per cached layer")
    ax.set_ylabel("hit rate %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(run["scenario"]["name"], fontsize=9)
    fig.tight_layout()
    return fig, len(points)


def write_plots(run: dict, md_path: Path) -> list[str]:
    """Draw the run's plots beside its .md; the file names written (none without matplotlib or rows)."""
    if not have_matplotlib():
        return []
    import matplotlib.pyplot as plt

    written = []
    for suffix, make in (("rates", rates_figure), ("hit-rate", hit_rate_figure)):
        fig, n = make(run)
        if fig is None:
            continue
        if n:
            path = md_path.with_name(f"{md_path.stem}-{suffix}.png")
            fig.savefig(path, dpi=110)
            written.append(path.name)
        plt.close(fig)
    return written
