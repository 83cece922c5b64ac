"""What a benchmark run records (hardware, commits, model, arms) and how it is written (md + json)."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
from pathlib import Path

from .stats import METRICS

METRIC_TITLES = {
    "prefill_tps": "prefill t/s",
    "ttft_ms": "TTFT ms",
    "decode_tps": "decode t/s",
    "aggregate_tps": "aggregate t/s",
}


# --------------------------------------------------------------------------- facts about the run


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _gpus() -> tuple[list[dict], str]:
    """GPUs from moecache.devices() when the compiled module loads, else nvidia-smi, else none."""
    try:
        import moecache

        out = []
        for d in moecache.devices():
            d = dict(d)
            if str(d.get("type", "gpu")).lower() not in ("gpu", "igpu"):
                continue  # the CPU (and accelerators such as BLAS) are not GPUs
            g = {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool))}
            if isinstance(d.get("memory_total"), int):
                g["total_mib"] = d["memory_total"] // 2**20
            out.append(g)
        return out, "moecache.devices()"
    except Exception:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            gpus = []
            for line in r.stdout.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) >= 2:
                    gpus.append({"name": parts[0], "total_mib": int(float(parts[1])),
                                 "driver": parts[2] if len(parts) > 2 else ""})
            return gpus, "nvidia-smi"
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return [], "none found"


def hardware() -> dict:
    cpu = ""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    ram = None
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            ram = int(line.split()[1]) * 1024
            break
    gpus, source = _gpus()
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "gpus": gpus,
        "gpu_source": source,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def git_commit(repo: Path | None = None) -> str:
    """`git rev-parse --short HEAD` of the checkout, with "+dirty" when tracked files changed.

    MOECACHE_COMMIT overrides it: a copy of the tree without git metadata (the GPU machine's)
    is told its commit by whoever sent it.
    """
    from ..paths import checkout_root

    if os.environ.get("MOECACHE_COMMIT"):
        return os.environ["MOECACHE_COMMIT"]

    repo = repo or checkout_root()
    if repo is None:
        return "unknown (not a git checkout)"
    repo = Path(repo)
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            return "unknown (not a git checkout)"
        commit = r.stdout.strip()
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True, timeout=30)
        return commit + ("+dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"


def display_path(path: str | Path) -> str:
    """A path as results files show it: relative to the checkout, under <moecache-cache>, or ~/...,
    so that committed results carry no absolute paths of the machine that made them."""
    from ..orchestrator.upstream import cache_dir
    from ..paths import checkout_root

    p = Path(path).expanduser()
    if not p.is_absolute():
        return str(path)
    p = p.resolve()
    bases = [(cache_dir(), "<moecache-cache>"), (checkout_root(), None), (Path.home(), "~")]
    for base, label in ((b, label) for b, label in bases if b is not None):
        try:
            rel = p.relative_to(Path(base).expanduser().resolve())
        except ValueError:
            continue
        return str(rel) if label is None else f"{label}/{rel}"
    return str(p)


def llama_cpp_commit() -> str:
    from ..orchestrator.upstream import PIN

    return PIN.commit


# --------------------------------------------------------------------------- formatting


def _fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _fmt_stat(s: dict | None) -> str:
    if not s:
        return "-"
    if s["n"] > 1:
        return f"{_fmt_num(s['median'])} ({_fmt_num(s['min'])}–{_fmt_num(s['max'])})"
    return _fmt_num(s["median"])


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


def _fmt_mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _fmt_count(n: int | float | None) -> str:
    return "-" if n is None else f"{n:g}" if isinstance(n, float) else str(n)


def _fmt_gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _reasons(d: dict | None) -> str:
    """Counters by reason: "0" when all are zero, else "reason N, ..." for the non-zero ones."""
    if not d or all(v is None for v in d.values()):
        return "-"
    nz = [f"{k} {_fmt_count(v)}" for k, v in d.items() if v]
    return ", ".join(nz) if nz else "0"


_SCHED_BACKEND = re.compile(r"ggml_sched_times: backend=(\S+) graphs=(\d+) splits_per_graph=([\d.]+) "
                            r"compute_ms_per_graph=([\d.]+) copy_ms_per_graph=([\d.]+)")
_SCHED_HOST = re.compile(r"ggml_sched_times: host graphs=(\d+) gaps=\d+ gap_ms_per_graph=([\d.]+)")
_HOST_TIMES = re.compile(r"llama_host_times: ubatches=(\d+) decode_ms=([\d.]+) .*?compute_ms=([\d.]+)")


def split_times(log: str, period: int) -> dict | None:
    """A server's GGML_SCHED_TIMES=`period` reports (the scheduler's, per backend and for the host's gaps between
    graphs, and the context's llama_host_times): the medians over its full windows of `period` graphs, per graph.
    With one user most windows are decode steps; the few that hold a prompt's ubatches move the medians little.
    None when the log has no full window."""
    import statistics

    backends: dict[str, dict[str, list[float]]] = {}
    gaps: list[float] = []
    decode: list[float] = []
    compute: list[float] = []
    for line in log.splitlines():
        if m := _SCHED_BACKEND.search(line):
            if int(m.group(2)) == period:
                b = backends.setdefault(m.group(1), {"splits": [], "compute_ms": [], "copy_ms": []})
                b["splits"].append(float(m.group(3)))
                b["compute_ms"].append(float(m.group(4)))
                b["copy_ms"].append(float(m.group(5)))
        elif m := _SCHED_HOST.search(line):
            if int(m.group(1)) == period:
                gaps.append(float(m.group(2)))
        elif m := _HOST_TIMES.search(line):
            if int(m.group(1)) == period:
                decode.append(float(m.group(2)))
                compute.append(float(m.group(3)))
    if not gaps:
        return None
    med = statistics.median
    return {"period": period, "windows": len(gaps), "gap_ms": med(gaps),
            "decode_ms": med(decode) if decode else None, "compute_ms": med(compute) if compute else None,
            "backends": {name: {k: med(v) for k, v in b.items()} for name, b in backends.items()}}


def _split_time_lines(run: dict) -> list[str]:
    timed = [a for a in run["arms"] if a.get("split_times")]
    if not timed:
        return []
    names = sorted({b for a in timed for b in a["split_times"]["backends"]})
    lines = ["", "### Split times", "",
             "Arms run with `GGML_SCHED_TIMES=N`: the scheduler's times per graph (one graph per ubatch; with one "
             "user mostly one decode step), the median over the server's windows of N graphs. Per backend the splits "
             "it computed, the time of their input copies and of their compute; the host's time between two graphs "
             "(the server's sampling, the library's work before and after a graph); llama_decode's whole time. Each "
             "split is synchronised before the next, so these arms' own rates are not the untimed ones.", "",
             "| arm | windows | " + " | ".join(f"{n} splits | {n} copy ms | {n} compute ms" for n in names)
             + " | host gap ms | llama_decode ms |",
             "| --- | ---: | " + " | ".join("---: | ---: | ---:" for _ in names) + " | ---: | ---: |"]
    for a in timed:
        st = a["split_times"]
        cells = []
        for n in names:
            b = st["backends"].get(n)
            cells.append(" | ".join(["-"] * 3) if b is None else
                         f"{b['splits']:.1f} | {b['copy_ms']:.3f} | {b['compute_ms']:.3f}")
        dec = st.get("decode_ms")
        lines.append(f"| {_md_cell(a['name'])} | {st['windows']} | {' | '.join(cells)} | {st['gap_ms']:.3f} "
                     f"| {'-' if dec is None else f'{dec:.3f}'} |")
    return lines


def swapped_run(run: dict) -> bool:
    """Whether any row of the run swapped its prompt or ran on a server with the swap enabled (then
    the report has the swap's columns and its section)."""
    for r in run["results"]:
        ps = r.get("prefill_swap") if not r.get("error") else None
        if ps and (ps.get("swapped") or (ps.get("server") or {}).get("swaps")
                   or (ps.get("server") or {}).get("enabled")):
            return True
    return False


def _swap_mode(server: dict | None) -> str:
    if not server:
        return "-"
    if server.get("enabled") is False:
        return "off"
    mode = server.get("mode") or "?"
    warm = server.get("warm_restore")
    return mode + ("" if warm is None else ", warm" if warm else ", cold")


def _median_of(rows: list[dict], key: str) -> float | None:
    values = sorted(r[key]["median"] for r in rows if isinstance(r.get(key), dict) and r[key].get("median"))
    return values[len(values) // 2] if values else None


def _plan_lines(run: dict) -> list[str]:
    """The arms `moecache plan` completed: what it planned, its rate bounds and (plan_measure) the rates its
    --measure got from the planned command, against what this run measured."""
    arms = [a for a in run["arms"] if a.get("plan")]
    if not arms:
        return []
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    ratio = lambda m, b: f"{m / b:.2f}" if m and b else "-"  # noqa: E731
    num = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
    lines = ["", "### Plans", "",
             "The arms whose flags `moecache plan` completed before their server started (after the ballast, "
             "from the memory then free): per GPU the budget, the weights on it, the KV cache, the decode "
             "compute buffer and the slot banks (GiB, the library's own figures from llama-server "
             "--memory-probe); the plan's rate bounds from the bandwidths it measured; where the arm has "
             "plan_measure, the rates `moecache plan --measure` got from the planned command just before (its "
             "own server, two requests after a warm-up); and the medians this run measured, with their ratios "
             "to the bound and to the plan's measurement (prefill against the swap's bound where the plan has "
             "a swap).", "",
             "| arm | flags added | GPU: budget / weights / KV / compute / banks | decode: bound / plan / run | "
             "run / bound | run / plan | prefill: bound / plan / run | run / bound | run / plan |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in arms:
        p = a["plan"]
        devs = "; ".join(f"{d['name']}: {gib(d['budget'])} / {gib(d['model'])} / {gib(d['context'])} / "
                         f"{gib(d['compute'])} / {gib(d['banks'])}" for d in p["devices"])
        rows = [r for r in run["results"] if r.get("arm") == a["name"] and not r.get("error")]
        dec, pre = _median_of(rows, "decode_tps"), _median_of(rows, "prefill_tps")
        r = p.get("rates") or {}
        m = p.get("measured") or {}
        dec_b, dec_m = r.get("decode_bound"), m.get("decode_tps")
        pre_b, pre_m = r.get("prefill_swap_bound") or r.get("prefill_bound"), m.get("prefill_tps")
        lines.append(f"| {_md_cell(a['name'])} | `{_md_cell(' '.join(p.get('added') or []))}` | {_md_cell(devs)} | "
                     f"{num(dec_b)} / {num(dec_m)} / {num(dec)} | {ratio(dec, dec_b)} | {ratio(dec, dec_m)} | "
                     f"{num(pre_b)} / {num(pre_m)} / {num(pre)} | {ratio(pre, pre_b)} | {ratio(pre, pre_m)} |")
    again = []
    for a in arms:
        rep = (a["plan"].get("measured") or {}).get("repeated") or {}
        if rep.get("decode_tps") or rep.get("prefill_tps"):
            # one request at a time, as --measure sends them: the arm's one-user rows
            rows = [r for r in run["results"] if r.get("arm") == a["name"] and not r.get("error")
                    and (r.get("users") or 1) == 1]
            dec, pre = _median_of(rows, "decode_tps"), _median_of(rows, "prefill_tps")
            again.append(f"{a['name']}: decode {num(rep.get('decode_tps'))} (run / it "
                         f"{ratio(dec, rep.get('decode_tps'))}), prefill {num(rep.get('prefill_tps'))} (run / it "
                         f"{ratio(pre, rep.get('prefill_tps'))})")
    if again:
        lines += ["", "The same `--measure` server then timed the arm's protocol too, its first prompt again for "
                      "each request (medians; run: the arm's rows of one user at a time): " + "; ".join(again) + "."]
    bw = next((a["plan"]["rates"]["bandwidth"] for a in arms if a["plan"].get("rates")), None)
    if bw:
        lines += ["", f"Bandwidths the plans measured: host read {bw['host_read'] / 1e9:.1f} GB/s, GPU memory "
                      f"{bw['device'] / 1e9:.0f} GB/s, host to GPU {bw['host_to_device'] / 1e9:.1f} GB/s "
                      f"({bw['source']}); hit rate of the decode bound: "
                      + "; ".join(f"{a['name']} {100 * a['plan']['rates']['hit_rate']:.1f}% "
                                  f"({a['plan']['rates']['hit_rate_source']})" for a in arms if a["plan"].get("rates"))]
    return lines


def _ballast_lines(run: dict) -> list[str]:
    """The VRAM ballast's table: per arm and device, what it held and what it left free."""
    arms = [a for a in run["arms"] if a.get("ballast")]
    if not arms:
        return []
    lines = ["", "### VRAM ballast", "",
             "Before each arm's server started, a ballast process (`python -m moecache.bench.ballast`) allocated "
             "all of every visible GPU's free memory but the budget and held it until that server had stopped, "
             "so the server saw a GPU of about the budget's size (its own CUDA context then takes its share, as "
             "on such a GPU).",
             "",
             "| arm | GPU | total GiB | free before GiB | held GiB | free after GiB | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for a in arms:
        b = a["ballast"]
        if b.get("error"):
            error = _md_cell(b["error"].splitlines()[0])
            lines.append(f"| {_md_cell(a['name'])} | - | - | - | - | - | FAILED: {error} |")
            continue
        for d in b.get("devices") or []:
            gpu = f"{d.get('device')}" + (f" ({d['name']})" if d.get("name") else "")
            lines.append(f"| {_md_cell(a['name'])} | {_md_cell(gpu)} | {_fmt_gib(d.get('total'))} "
                         f"| {_fmt_gib(d.get('free_before'))} | {_fmt_gib(d.get('held'))} "
                         f"| {_fmt_gib(d.get('free_after'))} | {_md_cell(d.get('warning') or '')} |")
    return lines


def _swap_lines(run: dict, concurrent: bool) -> list[str]:
    """The prefill swap's section: per row, what the timings and the server's counters said."""
    rows = [r for r in run["results"] if not r.get("error") and r.get("prefill_swap")]
    lines = [
        "## Prefill swap",
        "",
        "The prefill-phase swap per arm and prompt. From the timings of the timed requests: how many swapped "
        "(requests swapped / timed requests), the ubatch the prompt ran at and the swap's cost "
        "(`prefill_swap_ms`: release + reserve + restore, median). From the server's `/moe-cache` "
        "(`prefill_swap`), over this row's requests (its TTFT requests included): the swaps, the last swap's "
        "release / reserve / restore ms and the memory it released and restored, the experts the warm "
        "restore queued (and of them, those the next swap dropped before they were copied), the swaps that "
        "failed or were skipped (by reason), and the cache's hit rate over "
        "the first 64 decoded tokens after each restore.",
        "",
        "| arm | prompt | " + ("users | " if concurrent else "") + "mode | requests swapped | ubatch | swap ms "
        "| server swaps | release ms | reserve ms | restore ms | released GiB | restored GiB | warm uploads "
        "| failed | skipped | hit rate after restore |",
        "| --- | --- | " + ("---: | " if concurrent else "") + "--- | " + " | ".join(["---:"] * 10)
        + " | --- | --- | ---: |",
    ]
    for r in rows:
        ps = r["prefill_swap"]
        srv = ps.get("server") or {}
        last = srv.get("last") or {}
        after = srv.get("after_restore") or {}
        users = f"{r.get('users', 1)} | " if concurrent else ""
        swap_ms = (ps.get("swap_ms") or {}).get("median")
        lines.append(
            f"| {_md_cell(r['arm'])} | `{_md_cell(r['prompt'])}` {_length_short(r)} | {users}{_swap_mode(srv or None)} "
            f"| {ps.get('swapped', 0)}/{ps.get('requests', 0)} | {_fmt_count(ps.get('prefill_ubatch'))} "
            f"| {_fmt_ms(swap_ms)} | {_fmt_count(srv.get('swaps'))} | {_fmt_ms(last.get('release_ms'))} "
            f"| {_fmt_ms(last.get('reserve_ms'))} | {_fmt_ms(last.get('restore_ms'))} "
            f"| {_fmt_gib(last.get('bytes_released'))} | {_fmt_gib(last.get('bytes_restored'))} "
            f"| {_warm_uploads(srv)} | {_reasons(srv.get('failed'))} "
            f"| {_reasons(srv.get('skipped'))} | {_fmt_rate(after.get('hit_rate'))} |")
    lines.append("")
    return lines


def _warm_uploads(srv: dict) -> str:
    """The warm restores' uploads of a row, with those a following swap dropped (the prefill swap drops them)."""
    dropped = srv.get("warm_dropped")
    return _fmt_count(srv.get("warm_uploads")) + (f" ({dropped} dropped)" if dropped else "")


def _length_short(r: dict) -> str:
    """A row's prompt length for tables: the count, or "whole (N)" for a whole-text prompt."""
    if r["length"] is not None:
        return str(r["length"])
    return f"whole ({r['prompt_tokens']})" if r.get("prompt_tokens") else "whole"


def _length_title(length: int | None, rows: list[dict]) -> str:
    if length is not None:
        return f"{length} tokens"
    n = next((r["prompt_tokens"] for r in rows if r.get("prompt_tokens")), None)
    return "the whole text" + (f" ({n} tokens)" if n else "")


def _ballast_short(a: dict) -> str:
    b = a["ballast"]
    if b.get("error"):
        return f"{a['name']}: FAILED"
    devs = b.get("devices") or []
    return f"{a['name']}: " + ", ".join(
        f"held {_fmt_gib(d.get('held'))} GiB, {_fmt_gib(d.get('free_after'))} GiB free" for d in devs) \
        + (" (warning)" if b.get("warning") else "")


def _copy_note(fill: dict) -> str:
    """How a depth fill's other slots got the tokens when slot 0's cache was copied to them ("" otherwise)."""
    n = fill.get("slots") or 1
    if fill.get("fill") != "copy" or n < 2:
        return ""
    others = "slot 1" if n == 2 else f"slots 1–{n - 1}"
    return f" in slot 0, then {others} got slot 0's cache copied ({_fmt_ms(fill.get('copy_ms'))} ms)"


def _depth_lines(run: dict) -> list[str]:
    """Prefill against depth, per arm and prompt with two or more depths, by two measures: the whole
    prompt from an empty slot (the depth fill: how the public fork and its upstream figures measured
    "prefill at 250k") and the request's new tokens on top of the cached depth (the stricter one).
    Each ratio is the deepest depth's rate over the shallowest's, both from this run."""
    groups: dict[tuple[str, str, int | None], dict[int, dict]] = {}
    for r in run["results"]:
        depth = r.get("depth", 0)
        if not depth or r.get("error"):
            continue
        users = min(x.get("users", 1) for x in run["results"]
                    if x["arm"] == r["arm"] and x["prompt"] == r["prompt"] and x.get("depth", 0) == depth)
        if r.get("users", 1) == users:
            groups.setdefault((r["arm"], r["prompt"], r["length"]), {})[depth] = r
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return []
    lines = ["## Prefill against depth", "",
             "Two measures per arm, each the deepest depth's rate over the shallowest's from this run "
             "(1.00 is flat). Whole prompt: the depth itself prefilled from an empty slot, one request "
             "per depth, as the public fork measured prefill at depth (its requests with `cache_prompt` off). New tokens: "
             "the case's request on top of the cached depth, the median of its repetitions (the stricter "
             "measure: every new token attends over the whole depth).", "",
             "| arm | prompt | whole prompt t/s by depth | whole prompt ratio | new tokens t/s by depth "
             "| new tokens ratio |",
             "| --- | --- | --- | ---: | --- | ---: |"]
    for (arm, prompt, _), by_depth in groups.items():
        depths = sorted(by_depth)
        fills = [(by_depth[d].get("depth_fill") or {}).get("prefill_tps") for d in depths]
        news = [(by_depth[d].get("prefill_tps") or {}).get("median") for d in depths]

        def ratio(v: list) -> str:
            return "-" if v[0] in (None, 0) or v[-1] is None else f"{v[-1] / v[0]:.2f}"

        def by(v: list) -> str:
            return " / ".join(f"{d:,}: {_fmt_num(x)}" for d, x in zip(depths, v))
        lines.append(f"| {_md_cell(arm)} | `{_md_cell(prompt)}` | {by(fills)} | {ratio(fills)} | {by(news)} "
                     f"| {ratio(news)} |")
    warm = [(r.get("depth_fill") or {}).get("warm") for r in run["results"] if r.get("depth")]
    if warm and all(warm):
        lines += ["", "Each arm ran one request of the prompt's length on other tokens before its first fill, so "
                      "no fill pays the server's first request."]
    return lines + [""]


def _decoder_lines(run: dict) -> list[str]:
    """The decoders beside the timed requests (scenario `decoders`): their longest gap between two tokens
    during a timed request and their decode rate then, per case and arm, with the baseline's gap over the
    arm's (> 1: the arm's decoders waited less)."""
    n = (run.get("scenario") or {}).get("decoders") or 0
    rows = [r for r in run["results"] if r.get("decoder_gap_ms")]
    if not n or not rows:
        return []
    base = {(r["prompt"], r["length"], r.get("depth", 0), r.get("users", 1)): r for r in rows
            if r["arm"] == run["baseline"]}
    lines = ["## Decoders beside the timed requests", "",
             f"{n} other request(s) decoded on slots of their own while every timed repetition ran (started "
             f"before it, each with a token out, stopped after it). Longest gap: the longest interval between "
             f"two tokens of any decoder that overlaps the timed request, the median over the repetitions "
             f"(min-max); their rate: the decoders' tokens during the request per decoder and second. Gap "
             f"ratio: the baseline's gap / the arm's (> 1: shorter waits).", "",
             "| arm | prompt | users | longest gap ms | decoders' t/s during it | gap ratio |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = base.get((r["prompt"], r["length"], r.get("depth", 0), r.get("users", 1)))
        ratio = (b["decoder_gap_ms"]["median"] / r["decoder_gap_ms"]["median"]
                 if b and r["decoder_gap_ms"]["median"] else None)
        at = f" @{r['depth']:,}" if r.get("depth") else ""
        lines.append(f"| {_md_cell(r['arm'])} | `{_md_cell(r['prompt'])}` {_length_short(r)}{at} | {r.get('users', 1)} "
                     f"| {_fmt_stat(r['decoder_gap_ms'])} | {_fmt_stat(r.get('decoder_tps'))} | {_fmt_ratio(ratio)} |")
    return lines + [""]


def _over(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _comparison_rows(run: dict) -> list[dict]:
    """Each non-baseline arm's row of each case beside the baseline's row of the same case: the arm, the case's
    label, the row, the baseline's row (None where it has none), and the decode medians of both."""
    base = run.get("baseline")
    rows = {(r["arm"], r["prompt"], r["length"], r.get("depth", 0), r.get("users", 1)): r
            for r in run.get("results", [])}
    med = lambda r, k: ((r or {}).get(k) or {}).get("median")  # noqa: E731
    out = []
    for (arm, prompt, length, depth, users), r in rows.items():
        if arm == base:
            continue
        b = rows.get((base, prompt, length, depth, users))
        out.append({"arm": arm, "key": (prompt, length, depth, users), "row": r, "base": b,
                    "case": f"{prompt} {_length_short(r)}" + (f" @{depth}" if depth else "")
                            + (f", {users} users" if users > 1 else ""),
                    "ok": not (r.get("error") or b is None or b.get("error")),
                    "first": med(r, "first_decode_tps"), "bfirst": med(b, "first_decode_tps"),
                    "warm": med(r, "warm_decode_tps"), "bwarm": med(b, "warm_decode_tps")})
    return out


def comparison_lines(run: dict) -> list[str]:
    """The comparison users make, one row per arm and case against the baseline's row of the same case:
    prefill and TTFT as speed-ups, the decode of the first request (the server's first where warmup = 0) and
    of the later ones (warm), the arm's own first request over its warm rate (how warm it starts), and the
    first request after a restart where the arm had one. [] when the run has no other arm than its baseline."""
    base = run.get("baseline")
    if not [a for a in run.get("arms", []) if a["name"] != base]:
        return []
    restarts = {a["name"]: a["restart"] for a in run.get("arms", []) if a.get("restart")}
    lines = ["| case | arm | prefill | TTFT | first request decode t/s | warm decode t/s | first / warm "
             "| after a restart t/s | hits |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    r0 = run["results"][0] if run["results"] else {}
    first_case = (r0.get("prompt"), r0.get("length"), r0.get("depth", 0), 1)  # the case a restart asks
    for c in _comparison_rows(run):
        arm, r = c["arm"], c["row"]
        if not c["ok"]:
            lines.append(f"| {_md_cell(c['case'])} | {_md_cell(arm)} | - | - | - | - | - | - | - |")
            continue
        ratios = r.get("ratios") or {}
        first, warm = c["first"], c["warm"]
        restart = "-"
        rs = restarts.get(arm)
        if rs and c["key"] == first_case:
            brs = restarts.get(base) or {}
            restart = ("failed" if rs.get("error") else
                       f"{_fmt_num(rs.get('decode_tps'))} ({_over(rs.get('decode_tps'), brs.get('decode_tps') or c['bwarm'])})")
        lines.append(
            f"| {_md_cell(c['case'])} | {_md_cell(arm)} | {_fmt_ratio(ratios.get('prefill_tps'))} "
            f"| {_fmt_ratio(ratios.get('ttft_ms'))} | {_fmt_num(first)} ({_over(first, c['bfirst'])}) "
            f"| {_fmt_num(warm)} ({_over(warm, c['bwarm'])}) | {f'{first / warm:.2f}' if first and warm else '-'} | {restart} "
            f"| {_fmt_rate((r.get('moe_cache') or {}).get('hit_rate'))} |")
    return lines


def target_lines(run: dict) -> list[str]:
    """The scenario's targets (its `targets` table) checked for every moecache-server arm: per target, whether the
    worst case meets it, with that case's value. [] without targets or such arms."""
    t = (run.get("scenario") or {}).get("targets") or {}
    arms = [a["name"] for a in run.get("arms", []) if a.get("launcher") == "moecache-server" and not a.get("baseline")]
    if not t or not arms:
        return []
    checks = []  # (heading, the case values of one arm -> [(value, case)], the least that meets it)
    if "decode" in t:
        checks.append((f"warm decode >= {t['decode']:g}x", lambda cs: [(c["warm"] / c["bwarm"], c["case"])
                                                                      for c in cs if c["warm"] and c["bwarm"]], t["decode"]))
    if "decode_floor" in t:
        checks.append((f"decode never < {t['decode_floor']:g}x",
                       lambda cs: [(c[k] / c["b" + k], f"{c['case']}, {k}") for c in cs for k in ("first", "warm")
                                   if c[k] and c["b" + k]], t["decode_floor"]))
    if "first_over_warm" in t:
        checks.append((f"first / warm >= {t['first_over_warm']:g}",
                       lambda cs: [(c["first"] / c["warm"], c["case"]) for c in cs if c["first"] and c["warm"]],
                       t["first_over_warm"]))
    if "prefill" in t:
        least = int(t.get("prefill_min_tokens", 0))
        checks.append((f"prefill >= {t['prefill']:g}x" + (f" ({least}+ tokens)" if least else ""),
                       lambda cs: [(((c["row"].get("ratios") or {}).get("prefill_tps")), c["case"]) for c in cs
                                   if (c["row"].get("ratios") or {}).get("prefill_tps")
                                   and (c["row"].get("length") or 0) >= least], t["prefill"]))
    if not checks:
        return []
    rows = _comparison_rows(run)
    lines = ["| arm | " + " | ".join(h for h, _, _ in checks) + " |", "| --- |" + " --- |" * len(checks)]
    for arm in arms:
        cases = [c for c in rows if c["arm"] == arm and c["ok"]]
        cells = []
        for _, values, at_least in checks:
            got = values(cases)
            if not got:
                cells.append("-")
                continue
            worst, where = min(got, key=lambda v: v[0])
            cells.append(f"yes (worst {worst:.2f})" if worst >= at_least else f"**no** ({worst:.2f}: {where})")
        lines.append(f"| {_md_cell(arm)} | " + " | ".join(_md_cell(c) for c in cells) + " |")
    return lines


def render_markdown(run: dict) -> str:
    sc = run["scenario"]
    levels = sc.get("users") or sorted({r.get("users", 1) for r in run["results"]})
    concurrent = any(n > 1 for n in levels)
    hw = run["hardware"]
    model = run["model"]
    lines = [f"# Benchmark `{sc['name']}` — {run['date']}", ""]
    if sc.get("description"):
        lines += [sc["description"], ""]
    gpus = ", ".join(
        f"{g.get('description') or g.get('name', '?')}"
        + (f" ({g['total_mib'] / 1024:.0f} GiB)" if "total_mib" in g else "")
        for g in hw.get("gpus", [])) or "none"
    lines += [
        "## Setup",
        "",
        f"- scenario: `{sc['file']}` (max_tokens {sc['max_tokens']}, repetitions {sc['repetitions']}, "
        f"warmup {sc['warmup']}, ignore_eos {str(sc['ignore_eos']).lower()}"
        + (f", users {', '.join(map(str, levels))}" if concurrent else "")
        + (", depth_fill copy" if sc.get("depth_fill") == "copy" else "") + ")",
        f"- moecache commit: `{run['moecache_commit']}`; llama.cpp pin: `{run['llama_cpp_commit']}`",
        f"- hardware: {hw.get('cpu')} ({hw.get('cores')} logical cores), RAM {_fmt_bytes(hw.get('ram_bytes'))}; "
        f"GPUs: {gpus}",
        f"- os: {hw.get('os')}, Python {hw.get('python')}",
        f"- model: {model['description']}: `{model['path']}` ({_fmt_bytes(model.get('size_bytes'))})",
        *([f"- VRAM budget: {sc['vram_budget_gib']:g} GiB per GPU, emulated: a ballast process held the rest of "
           f"every visible GPU's memory while each arm's server ran ("
           + "; ".join(_ballast_short(a) for a in run["arms"] if a.get("ballast")) + ")"]
          if sc.get("vram_budget_gib") else []),
        f"- started {run['started']}, finished {run.get('finished', '?')}",
        *([f"- **partial results**: written after {run['partial']}; the run ended before the next arm "
           f"finished (the arms after it have no rows)"] if run.get("partial") else []),
        "",
        "## Arms",
        "",
        "Each arm ran against its own freshly started llama-server on loopback, one after the other in "
        "this run. Server arguments (shared ones first, then the arm's own):",
        "",
    ]
    # the expert cache's columns only when an arm had one
    cached = [a for a in run["arms"] if a.get("moe_cache")]
    if cached:
        lines += ["| arm | server args | env | hit rate | cache MiB | note |",
                  "| --- | --- | --- | ---: | ---: | --- |"]
    else:
        lines += ["| arm | server args | env | note |",
                  "| --- | --- | --- | --- |"]
    for a in run["arms"]:
        name = a["name"] + (" (baseline)" if a["baseline"] else "")
        args = " ".join(shlex.quote(x) for x in a["server_args"])
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in a["env"].items()) or "-"
        note = ("FAILED: " + a["error"]) if a.get("error") else (a.get("description") or "")
        cache = ""
        if cached:
            c = a.get("moe_cache") or {}
            cache = f" {_fmt_rate(c.get('hit_rate'))} | {_fmt_mib(c.get('bytes_vram'))} |"
        lines.append(f"| {_md_cell(name)} | `{_md_cell(args)}` | {_md_cell(env)} |{cache} {_md_cell(note)} |")
    lines += _ballast_lines(run)
    for a in run["arms"]:
        if a.get("launcher") == "moecache-server":
            said = a.get("plan_lines") or ["plan: none (llama-server's own placement)"]
            lines += ["", f"Arm `{a['name']}` started as moecache-server, which said:", "",
                      *(f"    {line}" for line in said)]
    lines += _plan_lines(run)
    if cached:
        lines += [
            "",
            "### Expert cache",
            "",
            "The hot-expert cache's counters over all of an arm's requests (warm-ups included), read from "
            "the server's `/moe-cache` after its last request: the share of routed (token, expert) pairs "
            "that a slot served (overall and over the last 256 tokens), experts uploaded into slots and "
            "the evictions among them, the slots per cached layer, the memory of the slot banks, the "
            "mean and the longest time of a cache step before a ubatch (the routed ids counted, uploads "
            "published and planned; it first waits for the previous ubatch's device work to finish, so "
            "on a GPU it includes that wait and is not host overhead alone), and the batches that ran through "
            "the cache or bypassed it for having more tokens than its max batch (prompts, and verify "
            "batches that did not fit).",
            "",
            "| arm | hit rate | recent hit rate | uploads | uploaded MiB | evictions | slots/layer | cache MiB "
            "| mean step ms | max step ms | batches cached | bypassed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for a in cached:
            c = a["moe_cache"]
            step = c.get("step_ms_max")
            total, n = c.get("step_ms_total"), c.get("n_steps")
            mean = total / n if total is not None and n else None
            lines.append(
                f"| {_md_cell(a['name'])} | {_fmt_rate(c.get('hit_rate'))} | {_fmt_rate(c.get('hit_rate_recent'))} "
                f"| {_fmt_count(c.get('uploads'))} | {_fmt_mib(c.get('bytes_uploaded'))} "
                f"| {_fmt_count(c.get('evictions'))} | {_fmt_count(c.get('n_slots'))} "
                f"| {_fmt_mib(c.get('bytes_vram'))} | {'-' if mean is None else f'{mean:.3f}'} "
                f"| {'-' if step is None else f'{step:.2f}'} "
                f"| {_fmt_count(c.get('batches_cached'))} | {_fmt_count(c.get('batches_bypassed'))} |")
    lines += _split_time_lines(run)
    if run.get("plots") or run.get("plots_note"):
        lines += ["", "## Plots", ""]
        lines += [f"![{name}]({name})" for name in run.get("plots") or []]
        if run.get("plots_note"):
            lines.append(run["plots_note"])
    lines += [
        "",
        "## Results",
        "",
        "Medians over the repetitions, (min–max) in brackets. Prefill and decode rates are the server's "
        "own timings of a non-streaming /completion request; TTFT is measured by the client: from sending "
        "a streaming request to the first chunk that carries a token. Aggregate t/s is the predicted tokens "
        "of a repetition over its wall time, from the first send to the last response (with one user that "
        "is one request, prefill included). Every ratio is a speed-up against the baseline arm of this run "
        "(> 1 is faster): arm / baseline for rates, baseline / arm for TTFT.",
        "",
    ]
    comparison = comparison_lines(run) if any(a.get("launcher") == "moecache-server" or a.get("restart")
                                              for a in run["arms"]) else []
    if comparison:
        lines += [
            f"### Against `{run['baseline']}`",
            "",
            "Prefill and TTFT as speed-ups over the baseline's row of the same case; decode as the arm's rate "
            "and, in brackets, its ratio to the baseline's: of the case's first timed request (with warmup 0 "
            "the server's first request, for the first case), of the later ones (warm), and of the first request "
            "after the server was stopped and started again (its expert profile read at start; against the "
            "baseline's own restart where it had one, else its warm rate). `first / warm`: the arm's first "
            "request's decode over its own warm rate (1.00: it starts warm). `hits`: the expert cache's hit rate "
            "over the row's requests.",
            "",
            *comparison,
            "",
        ]
        targets = target_lines(run)
        if targets:
            lines += [
                "### Targets",
                "",
                "The scenario's targets (`targets` in its file), checked for every moecache-server arm over the "
                "cases above: each cell gives the worst case's value, and where it misses the target, which case.",
                "",
                *targets,
                "",
            ]
    if concurrent:
        lines += [
            "With `users` N > 1 every repetition sent N identical requests at the same moment to the same "
            "server: prefill and decode t/s are per request (over all N requests of all repetitions), "
            "aggregate t/s is all N requests' tokens over the repetition's wall time, and TTFT is measured "
            "with one user only. Ratios compare rows with the same number of users.",
            "",
        ]
    cases: list[tuple[str, int | None, int]] = []
    for r in run["results"]:
        key = (r["prompt"], r["length"], r.get("depth", 0))
        if key not in cases:
            cases.append(key)
    if any(depth for _, _, depth in cases):
        lines += ["A case `at depth D` ran after every slot had cached D tokens of the text: its prefill is the "
                  "prompt's new tokens on top of them, and its decode runs at that depth. Below each such table, "
                  "the prefill of the D tokens themselves from an empty slot, per arm.", ""]
    users_head = "users | " if concurrent else ""
    swapped = swapped_run(run)
    if swapped:
        lines += ["The last two columns are the prefill swap's: the ubatch the prompt ran at (`-`: it did not "
                  "swap) and the swap's cost in ms (release + reserve + restore, included in TTFT); details "
                  "in [Prefill swap](#prefill-swap).", ""]
    swap_head = " prefill ub | swap ms |" if swapped else ""
    # the expert cache's hit rate over each row's own requests (not the arm's totals, which hold its warm-ups)
    row_hits = any((r.get("moe_cache") or {}).get("hit_rate") is not None for r in run["results"])
    if row_hits:
        lines += ["The column `hits` is the expert cache's hit rate over the row's own requests (its timed "
                  "repetitions and its TTFT request), from the server's counters before and after them; the "
                  "arm's totals above include its warm-ups and earlier prompts.", ""]
    hits_head = " hits |" if row_hits else ""
    for prompt, length, depth in cases:
        rows = [r for r in run["results"] if (r["prompt"], r["length"], r.get("depth", 0)) == (prompt, length, depth)]
        rows.sort(key=lambda r: r.get("users", 1))  # stable: the arms' order within each level
        at = f" at depth {depth:,}" if depth else ""
        lines += [f"### `{prompt}` prompt, {_length_title(length, rows)}{at}", "",
                  f"| arm | {users_head}" + " | ".join(METRIC_TITLES[m] for m in METRICS) + " | "
                  + " | ".join(f"{METRIC_TITLES[m].split()[0]} ratio" for m in METRICS) + " |" + swap_head + hits_head,
                  "| --- | " + ("---: | " if concurrent else "") + " | ".join(["---:"] * (2 * len(METRICS))) + " |"
                  + (" ---: | ---: |" if swapped else "") + (" ---: |" if row_hits else "")]
        for r in rows:
            name = r["arm"] + (" (baseline)" if r["arm"] == run["baseline"] else "")
            users = f"{r.get('users', 1)} | " if concurrent else ""
            if r.get("error"):
                lines.append(f"| {_md_cell(name)} | {users}" + " | ".join("-" for _ in METRICS) + " | "
                             + " | ".join("-" for _ in METRICS) + " |" + (" - | - |" if swapped else "")
                             + (" - |" if row_hits else ""))
                continue
            swap = ""
            if swapped:
                ps = r.get("prefill_swap") or {}
                swap = (f" {_fmt_count(ps.get('prefill_ubatch'))} "
                        f"| {_fmt_ms((ps.get('swap_ms') or {}).get('median'))} |")
            hits = f" {_fmt_rate((r.get('moe_cache') or {}).get('hit_rate'))} |" if row_hits else ""
            lines.append(f"| {_md_cell(name)} | {users}" + " | ".join(_fmt_stat(r.get(m)) for m in METRICS) + " | "
                         + " | ".join(_fmt_ratio(r.get("ratios", {}).get(m)) for m in METRICS) + " |" + swap + hits)
        lines.append("")
        if depth:
            fills = []
            for r in rows:
                f = r.get("depth_fill") or {}
                if r.get("users", 1) == min(x.get("users", 1) for x in rows) and f:
                    fills.append(f"{_md_cell(r['arm'])} {_fmt_num(f.get('prefill_tps'))} t/s{_copy_note(f)}")
            if fills:
                lines += [f"The {depth:,} cached tokens, prefilled from an empty slot: " + "; ".join(fills) + ".", ""]
    lines += _depth_lines(run)
    lines += _decoder_lines(run)
    if swapped:
        lines += _swap_lines(run, concurrent)
    spec_rows = [r for r in run["results"] if not r.get("error") and r.get("speculation")]
    if any((r["speculation"].get("drafted") or 0) > 0 for r in spec_rows):
        lines += [
            "## Speculation",
            "",
            "The server's speculation counters from the final timings of the timed requests, summed over "
            "the repetitions (and over the N requests of a repetition with N users): tokens drafted and "
            "accepted, acceptance = accepted / drafted, decode steps without a new draft because more "
            "slots were generating than the load gate allows (load) or because the acceptance gate had "
            "paused drafting (accept), and the times that gate paused a slot. Rows whose requests "
            "reported no speculation counters (no speculation, or no draft and no reason to be off) are "
            "left out.",
            "",
            "| arm | prompt | users | drafted | accepted | acceptance | steps off (load/accept) | pauses |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in spec_rows:
            sp = r["speculation"]
            lines.append(
                f"| {_md_cell(r['arm'])} | `{_md_cell(r['prompt'])}` {_length_short(r)} | {r.get('users', 1)} "
                f"| {_fmt_count(sp.get('drafted'))} | {_fmt_count(sp.get('accepted'))} "
                f"| {_fmt_rate(sp.get('acceptance'))} "
                f"| {_fmt_count(sp.get('off_load'))}/{_fmt_count(sp.get('off_accept'))} "
                f"| {_fmt_count(sp.get('pauses'))} |")
        lines.append("")
    errors = [r for r in run["results"] if r.get("error")]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- {r['arm']}, `{r['prompt']}` {_length_short(r)}"
                  + (f", {r['users']} users" if r.get("users", 1) > 1 else "")
                  + f": {_md_cell(r['error'])}" for r in errors]
        lines.append("")
    lines += ["## Commands", "", "```"]
    lines += [" ".join(shlex.quote(x) for x in a["command"]) for a in run["arms"]]
    lines += ["```", ""]
    return "\n".join(lines)


def result_paths(out_dir: Path, date: str, name: str, number: int = 1) -> tuple[Path, Path]:
    """The .md and .json of the `number`-th run of a scenario on a date: <date>-<name>.md for the
    first, <date>-<name>-2.md for the second, and so on."""
    stem = f"{date}-{name}" + (f"-{number}" if number > 1 else "")
    return out_dir / f"{stem}.md", out_dir / f"{stem}.json"


def new_result_paths(out_dir: Path, date: str, name: str) -> tuple[Path, Path]:
    """The files of a new run: the first number whose .md and .json do not exist yet. The .md is
    created empty at once, so a run started at the same moment takes the next number."""
    number = 1
    while True:
        md, js = result_paths(out_dir, date, name, number)
        if not js.exists():
            try:
                md.open("x").close()
                if not js.exists():
                    return md, js
                md.unlink()  # the .json appeared meanwhile: that number is taken
            except FileExistsError:
                pass
        number += 1


def write_results(run: dict, out_dir: str | Path, paths: tuple[Path, Path] | None = None,
                  plots: bool = False) -> tuple[Path, Path]:
    """Write a run's .md and .json and return their paths. Without `paths` the run gets files of
    its own (an earlier run of the same day is never overwritten); pass the paths a first call
    returned to rewrite the same run's files (the partial results after every arm). plots: draw the
    run's plots beside them first (bench/plots.py; a note instead where matplotlib is missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = paths if paths is not None else new_result_paths(out_dir, run["date"], run["scenario"]["name"])
    if plots:
        from .plots import PLOTS_MISSING, have_matplotlib, write_plots

        try:
            run["plots"] = write_plots(run, md)
            if not have_matplotlib():
                run["plots_note"] = PLOTS_MISSING
        except Exception as e:  # noqa: BLE001 - a plot that cannot be drawn must not cost the results
            run["plots"] = []
            run["plots_note"] = f"plots: drawing them failed ({type(e).__name__}: {e})"
    md.write_text(render_markdown(run))
    js.write_text(json.dumps(run, indent=2, sort_keys=False) + "\n")
    return md, js
