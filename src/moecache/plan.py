"""`moecache plan`: one VRAM budget per GPU for a model, a context size and a number of users.

The figures are the library's own: llama-server --memory-probe makes the model and the context of the
planned arguments without reading a weight (llama.cpp's no_alloc load, as its --fit does) and reports
per device the weights, the KV cache, the compute buffers and what one hot-expert cache slot per cached
layer costs (the memory-plan topic). The plan adds nothing of its own but the arithmetic of the budget:

    slots = (budget - weights - KV - compute - headroom) / slot bytes        (per GPU, the smallest wins)

the same sum the library does when it sizes the banks at start (it reads the device's free memory; the
plan reads the budget you give). The prefill-phase swap's ubatch is the largest of 4x, 2x the decode
ubatch whose compute buffer fits where the banks and the decode buffers were (they are released for the
prompt). A plan that cannot fit says what to change. `moecache-server --plan auto` applies it at start.

On a machine without a GPU, LLAMA_MOE_CACHE_HOST_DEVICE=1 plans for the library's host test device (its
budget: LLAMA_MOE_CACHE_HOST_DEVICE_MIB or --gpu-mem), which is how the plan is tested in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from .cache_sim import TraceError

MiB = 1 << 20
GiB = 1 << 30


def size_text(b: int) -> str:
    """Bytes as GiB, or MiB below one GiB (small models and test devices)."""
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / MiB:.1f} MiB"
HOST_DEVICE_ENV = "LLAMA_MOE_CACHE_HOST_DEVICE"
HOST_DEVICE_MIB_ENV = "LLAMA_MOE_CACHE_HOST_DEVICE_MIB"
PROBE_TIMEOUT_S = 600  # a probe reads only the GGUF's metadata: seconds even for large models
# for experts on the CPU; the overlap: the GPU's work that needs nothing from the CPU's experts runs beside them
# (H100, 2026-12-07: never clearly slower, 1.10x -> 1.45x and 1.23x -> 1.55x llama-server's decode in two of five)
CPU_EXPERT_FLAGS = ["--host-hugepages", "--cpu-experts-flat", "--cpu-experts-x4", "--cpu-experts-overlap"]
SWAP_FACTORS = (4, 2)  # the prefill ubatch tried, as multiples of the decode ubatch, largest first
# the most the first token after a swap waits for the warm restore's copies into the cache: decode then finds the
# prompt's experts in the slots instead of sharing the link with their copies (H100, 2026-12-07: first request
# 0.67x -> 0.95x llama-server on the 30B at 16 GiB, gpt-oss code 1.16x -> 1.62x; the longest restore took ~0.5 s)
RESTORE_WAIT_MS = 1000


class PlanError(Exception):
    """The plan cannot be made, or does not fit; the message says what to change."""


@dataclass
class Request:
    model: Path
    ctx: int = 8192                  # tokens of context per user
    users: int = 1                   # sessions at once (llama-server -np)
    ubatch: int = 512                # the decode ubatch (-ub)
    gpu_mem_gib: list[float] | None = None  # budget per GPU; None: what each device has free now
    prompt_tokens: int | None = None  # typical prompt length: the swap is planned where prompts reach its ubatch
    swap: bool = True
    extra_args: list[str] = field(default_factory=list)  # other llama-server flags, probed with the plan's
    probe_args: list[str] = field(default_factory=list)  # flags probed last but left out of the command (the
    # command line --plan auto completes)
    bandwidth: "Bandwidth | None" = None  # for the rate bounds; None: none printed
    trace: Path | None = None  # a routing trace of the user's traffic: the hit rate at the planned slots
    profile: Path | None = None  # the cache's expert profile of earlier runs: the hit rate where no trace is given
    slots_by_layer: bool = True  # the profile sizes each layer's slots (--moe-cache-slots-by-layer, the server's plan)
    n_cpu_moe: int | None = None  # the routed experts of layers 0..N-1 in host memory, the later layers' whole in
    # VRAM (--n-cpu-moe N); None: every layer's in host memory (--cpu-moe)

    def check(self) -> None:
        for name in ("ctx", "users", "ubatch"):
            if int(getattr(self, name)) < 1:
                raise PlanError(f"--{name} must be >= 1 (got {getattr(self, name)})")
        if self.gpu_mem_gib is not None and any(g <= 0 for g in self.gpu_mem_gib):
            raise PlanError(f"--gpu-mem must be > 0 GiB per GPU (got {self.gpu_mem_gib})")
        if not Path(self.model).is_file():
            raise PlanError(f"model file not found: {self.model}")


def server_args(req: Request, *, experts_on_host: bool = True, ubatch: int | None = None,
                slots: int | None = None, prefill_ubatch: int | None = None,
                miss: Sequence[str] = ()) -> list[str]:
    """The llama-server arguments of a plan (without -m): every layer on the GPU, the routed experts in
    host memory (unrepacked, as the cache needs; with req.n_cpu_moe, those of the first N layers only), one KV
    stream of --ctx tokens per user."""
    ub = ubatch or req.ubatch
    batch = max(2048, ub, prefill_ubatch or 0)
    args = ["-ngl", "99", "-c", str(req.ctx * req.users), "-np", str(req.users), "-ub", str(ub), "-b", str(batch)]
    if experts_on_host:
        # unrepacked, as the cache needs; read into the GPU's pinned host memory (-lm none): the prompts'
        # ubatches stream them over PCIe and the cache uploads them, both at the pinned rate
        placement = ["--cpu-moe"] if req.n_cpu_moe is None else ["--n-cpu-moe", str(req.n_cpu_moe)]
        args += [*placement, "--no-repack", "-lm", "none"]
        # the misses (all of the routed experts without a cache) are computed on the CPU one token at a time:
        # on huge pages, one run of rows per thread and four Q4_0 rows at once they stream up to twice as fast,
        # with the same results (huge pages, the flat split, the four-row dots); the user's own setting of each stays
        # (the flat split only where the CPU's timing at start found it faster for this model's types)
        flat = req.bandwidth is None or req.bandwidth.cpu_experts_flat
        args += [f for f in CPU_EXPERT_FLAGS if flat or f != "--cpu-experts-flat"]
    if slots:
        # a prompt's most-routed experts fill the empty slots before its tokens decode: the first request warm
        args += ["--moe-cache-slots", str(slots), "--moe-cache-warm-prompts", *miss]
    if prefill_ubatch:
        args += ["--prefill-ubatch", str(prefill_ubatch)]
        if slots:
            args += ["--prefill-restore-wait", str(RESTORE_WAIT_MS)]
    return args + list(req.extra_args)


def probe(model: Path, args: Sequence[str], env: Mapping[str, str] | None = None, binary: Path | None = None,
          routing_readback: bool = False) -> dict:
    """What llama-server with these arguments would allocate, from its --memory-probe. routing_readback:
    with the read-back of the routed experts that a prompt's warm restore (or a routing trace) adds to the
    graphs, through a routing trace into a file of the probe's own."""
    if binary is None:
        from .paths import binary as find_binary

        binary = find_binary("llama-server")
    with tempfile.TemporaryDirectory(prefix="moecache-plan-") as d:
        out = Path(d) / "probe.json"
        trace = ["--moe-routing-trace", str(Path(d) / "routing.jsonl")] if routing_readback else []
        cmd = [str(binary), "-m", str(model), *args, *trace, "--memory-probe", str(out)]
        try:
            r = subprocess.run(cmd, env=dict(env) if env is not None else None, capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PlanError(f"llama-server --memory-probe did not answer within {PROBE_TIMEOUT_S} s "
                            f"({' '.join(args)})") from None
        if r.returncode != 0 or not out.is_file():
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-12:])
            raise PlanError(f"llama-server could not make the model and context of {' '.join(args)} "
                            f"(exit status {r.returncode}). It said:\n{tail}")
        try:
            return json.loads(out.read_text())
        except ValueError as e:
            raise PlanError(f"llama-server --memory-probe wrote what is not JSON: {e}") from None


@dataclass
class Device:
    """One GPU of the plan (or the host test device), its budget and the probe's figures for it."""
    name: str
    description: str
    budget: int        # bytes the plan may use
    model: int         # weights on it
    context: int       # KV cache
    compute: int       # compute buffers at the decode ubatch
    slot: int          # one cache slot of every cached layer on it
    n_moe_layers: int
    headroom: int
    counts_model: bool = True  # the host test device: the weights are host memory the banks do not share
    prefill_compute: int | None = None  # compute buffers at the swap's ubatch

    @property
    def fixed(self) -> int:
        return (self.model if self.counts_model else 0) + self.context + self.compute + self.headroom

    def slots_fit(self) -> int:
        if self.slot <= 0:
            return 0
        return max(0, (self.budget - self.fixed) // self.slot)

    def prefill_fits(self, compute: int) -> bool:
        return (self.model if self.counts_model else 0) + self.context + compute + self.headroom <= self.budget


@dataclass
class Bandwidth:
    """Bytes per second: host memory read by the CPU threads, a GPU's own memory, pinned host to GPU; and, where
    measured (measure_cpu_experts), the rate at which the CPU's kernels stream this model's experts at decode in
    moecache's layout (the GGUF layout with the CPU's switches) and in the layout llama-server's defaults run
    its CPU layers in (repacked where the CPU has a repacked layout for the type). 0: not measured, the host
    read stands for them."""
    host_read: float
    device: float
    host_to_device: float
    source: str = "given"
    cpu_experts: float = 0.0
    cpu_experts_stock: float = 0.0
    cpu_experts_flat: bool = True  # whether the flat split streams this model's experts faster (timed, else on)

    def usable(self) -> bool:
        return min(self.host_read, self.device, self.host_to_device) > 0

    def cpu_read(self) -> float:
        """How fast the CPU computes the experts moecache leaves it (its misses, its CPU layers)."""
        return min(self.host_read, self.cpu_experts) if self.cpu_experts > 0 else self.host_read

    def cpu_read_stock(self) -> float:
        """How fast llama-server's defaults compute the experts of their CPU layers."""
        return min(self.host_read, self.cpu_experts_stock) if self.cpu_experts_stock > 0 else self.cpu_read()

    def text(self) -> str:
        cpu = (f", the CPU's experts {self.cpu_experts / 1e9:.1f} GB/s (llama-server's layout "
               f"{self.cpu_experts_stock / 1e9:.1f})" if self.cpu_experts > 0 else "")
        return (f"host read {self.host_read / 1e9:.1f} GB/s, GPU memory {self.device / 1e9:.0f} GB/s, "
                f"host to GPU {self.host_to_device / 1e9:.1f} GB/s{cpu} ({self.source})")


def measure_bandwidth(device: str, mib: int = 1024, reps: int = 3, threads: int | None = None) -> Bandwidth:
    """The bandwidths of this machine (_core.measure_bandwidth: a parallel host read, a copy within the
    device, a copy from pinned host memory to it)."""
    from .api import _core, physical_cores

    threads = threads or physical_cores()
    m = _core().measure_bandwidth(device, mib, reps, threads)
    return Bandwidth(m["host_read"], m["device_copy"], m["host_to_device"],
                     f"measured: {mib} MiB, best of {reps}, {threads} threads, {device or 'no device'}")


def measure_bandwidth_apart(device: str) -> Bandwidth:
    """measure_bandwidth in a child process: the CUDA context it makes (about 0.5 GiB) goes with it, instead
    of staying in this process beside a server that is sized from the memory left."""
    code = ("import json, sys; from dataclasses import asdict; from moecache.plan import measure_bandwidth; "
            "print(json.dumps(asdict(measure_bandwidth(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True)
    if r.returncode != 0:
        raise PlanError(f"measuring the bandwidths of {device or 'the host'} failed: {r.stderr.strip()[-500:]}")
    return Bandwidth(**json.loads(r.stdout.strip().splitlines()[-1]))


def add_bandwidth(plan: "Plan", spec: str | None = "auto") -> None:
    """Give a plan with a cache the bandwidths its miss placement is chosen from: measured on this machine
    (spec "auto" or None, a few seconds, only where none were given), given (host=GB/s,device=GB/s,h2d=GB/s), or
    none ("none": the misses stay on the CPU). A measurement that fails leaves them on the CPU, in a note."""
    spec = (spec or "auto").strip()
    if spec == "none" or not plan.slots:
        return
    if spec != "auto":
        plan.request.bandwidth = parse_bandwidth(spec)
        return
    if plan.request.bandwidth is not None or plan.host_test_device:
        return  # given; or the host test device, which has no link to measure (its misses stay on the CPU)
    try:
        plan.request.bandwidth = measure_bandwidth_apart("CPU" if plan.host_test_device else plan.devices[0].name)
    except PlanError as e:
        plan.notes.append(f"the bandwidths could not be measured, so the misses stay on the CPU: {e}")
        return
    add_cpu_experts(plan.request.bandwidth, plan.request.model, plan.notes)


def add_cpu_experts(bw: Bandwidth, model: Path, notes: list[str] | None = None) -> None:
    """Measure how fast this CPU's kernels stream the model's experts (measure_cpu_experts) into `bw`; where that
    cannot be measured, a note says so and the host read stands for it."""
    try:
        ce = measure_cpu_experts(model)
    except (PlanError, OSError, ValueError) as e:  # ValueError: a GGUF the reader refuses
        if notes is not None:
            notes.append(f"the CPU's expert kernels were not timed, so the host read stands for them: {e}")
        return
    bw.cpu_experts, bw.cpu_experts_stock, bw.cpu_experts_flat = ce.ours, ce.stock, ce.flat
    bw.source += f"; the CPU's experts: {ce.text}"


# The types bench-cpu-mmid builds experts of (the types real files keep their experts in)
CPU_EXPERT_TYPES = ("q4_0", "q8_0", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4")
CPU_EXPERTS_BENCH_BYTES = 2 << 30  # the experts the timing allocates, at most (random, so read from DRAM)


@dataclass
class CpuExperts:
    ours: float    # bytes/s: the GGUF layout with the CPU's switches (huge pages, four-row dots, the flat split if `flat`)
    stock: float   # bytes/s: llama-server's defaults (repacked where this CPU has a layout for the type)
    text: str
    flat: bool = True  # the flat split is faster for this model's experts (by their bytes)


def expert_shapes(model: "Path | GGUFReader") -> dict[str, tuple[int, int, int, int]]:
    """The routed experts' tensors of a GGUF (ffn_{gate,up,down,gate_up}_exps) by type: {type name: (bytes over all
    layers, n_embd, n_ff, n_expert)}, the dimensions those of the type's first tensor. `model`: a path, or a
    reader already open on it."""
    from .gguf import GGUFReader, GGMLType

    r = model if isinstance(model, GGUFReader) else GGUFReader(model)
    shapes: dict[str, tuple[int, int, int, int]] = {}
    for t in r.tensors:
        kind = t.name.rsplit(".", 2)[-2] if t.name.count(".") >= 2 else ""
        if kind not in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps") or len(t.shape) != 3:
            continue
        name = GGMLType(t.type).name.lower().replace("_k", "_K")
        n_embd, n_ff = (t.shape[1], t.shape[0]) if kind == "ffn_down_exps" else (t.shape[0], t.shape[1])
        if kind == "ffn_gate_up_exps":
            n_ff //= 2
        had = shapes.get(name)
        shapes[name] = (t.nbytes + (had[0] if had else 0), *(had[1:] if had else (n_embd, n_ff, t.shape[2])))
    return shapes


def measure_cpu_experts(model: Path, threads: int | None = None, n_used: int | None = None,
                        binary_path: Path | None = None) -> CpuExperts:
    """Time this CPU's kernels on the model's expert shapes and types at decode (bench-cpu-mmid: random experts
    of one token, 16 tokens, in one graph), as moecache runs them (GGUF layout, huge pages, flat split,
    four-row dots) and as llama-server's defaults do (repacked where the CPU has a layout for the type, else
    the GGUF layout and the stock split). A model of several expert types (Q4_K_M's Q4_K and Q6_K) takes the
    bytes-weighted time of each. About a second per type and layout; PlanError where it cannot be timed."""
    from .api import physical_cores
    from .gguf import GGUFReader

    r = GGUFReader(model)
    shapes = expert_shapes(r)
    if not shapes:
        raise PlanError("no routed experts' tensors found in the model")
    unknown = sorted(set(shapes) - set(CPU_EXPERT_TYPES))
    if unknown:
        raise PlanError(f"no CPU expert timing for {', '.join(unknown)} (timed: {', '.join(CPU_EXPERT_TYPES)})")
    if n_used is None:
        n_used = next((int(kv.value) for k, kv in r.kv.items() if k.endswith(".expert_used_count")), 8)
    exe = binary_path or _bench_binary()
    threads = threads or physical_cores()
    total = sum(b for b, *_ in shapes.values())
    t_flat = t_split = t_stock = 0.0
    parts = []
    for name, (nbytes, n_embd, n_ff, n_expert) in sorted(shapes.items(), key=lambda kv: -kv[1][0]):
        per_expert = 3 * n_embd * n_ff * _type_bytes_per_weight(name)
        e = n_expert if 2 * n_expert * per_expert <= CPU_EXPERTS_BENCH_BYTES else \
            max(min(n_expert, 4 * n_used), int(CPU_EXPERTS_BENCH_BYTES // (2 * per_expert)))
        layers = int(max(2, min(8, CPU_EXPERTS_BENCH_BYTES // max(1.0, e * per_expert))))
        base = [str(exe), "-l", str(layers), "-e", str(e), "-u", str(min(n_used, e)), "-f", str(n_ff), "-d", str(n_embd),
                "-n", "16", "-t", str(threads), "-m", "graph", "--type", name]
        # the flat split (one run of rows per thread) wins for Q4_0 and Q8_0 and loses for Q5_K, Q6_K and IQ4_XS
        # on an H100 machine's Xeon: timed both ways, the model's bytes choose one setting for all its types
        # one run, the same weights and tokens timed without and with it
        by_flat = _bench_gb_s_by_flat(base + ["--hugepages", "--x4", "--flat-both"])
        split, flat = by_flat[0], by_flat[1]
        stock = _bench_gb_s(base + ["--repack"], repack=True)
        repacked = stock is not None
        if stock is None:
            stock = _bench_gb_s(base)
        share = nbytes / total
        t_flat += share / flat
        t_split += share / split
        t_stock += share / stock
        parts.append(f"{name} {flat / 1e9:.1f} GB/s with the flat split, {split / 1e9:.1f} without "
                     f"(llama-server's {'repacked' if repacked else 'GGUF'} layout {stock / 1e9:.1f})")
    use_flat = t_flat <= t_split
    return CpuExperts(1.0 / min(t_flat, t_split), 1.0 / t_stock,
                      f"{', '.join(parts)}, {threads} threads: the flat split {'on' if use_flat else 'off'}", use_flat)


def _type_bytes_per_weight(name: str) -> float:
    from .gguf import GGMLType, tensor_nbytes

    t = GGMLType[name.upper()]
    return tensor_nbytes((256,), t) / 256


def _bench_binary() -> Path:
    from .paths import binary

    try:
        return binary("bench-cpu-mmid")
    except FileNotFoundError as e:
        raise PlanError(str(e)) from None


def _bench_gb_s_by_flat(args: list[str]) -> dict[int, float]:
    """bench-cpu-mmid --flat-both: the rate (bytes/s) at the fastest token without (0) and with (1) the flat split."""
    rows = _bench_rows(args)
    rates = {f: max((_row_rate(x) for x in rows if int(x.get("mmid_flat", -1)) == f), default=0.0) for f in (0, 1)}
    if not all(rates.values()):
        raise PlanError(f"{Path(args[0]).name} --flat-both gave no line for each setting of the flat split")
    return rates


def _row_rate(row: dict) -> float:
    return float(row["gb_per_token"]) * 1e9 / (float(row["ms_min"]) * 1e-3)


def _bench_rows(args: list[str], repack: bool = False) -> list[dict] | None:
    """bench-cpu-mmid's result lines; None for --repack where the CPU has no repacked layout (exit status 3)."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise PlanError(f"{Path(args[0]).name} took more than 120 s") from None
    if repack and r.returncode == 3:
        return None
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")] if r.returncode == 0 else []
    if not rows or not all(float(x.get("ms_min", 0)) > 0 and float(x.get("gb_per_token", 0)) > 0 for x in rows):
        raise PlanError(f"{Path(args[0]).name} failed (exit status {r.returncode}): {r.stderr.strip()[-300:]}")
    return rows


def _bench_gb_s(args: list[str], repack: bool = False) -> float | None:
    """The rate (bytes/s) of one bench-cpu-mmid run at its fastest token (the best of its tokens, as the host read
    is the best of its repetitions: what the machine does when nothing else runs); None for --repack where the
    CPU has no repacked layout for the type (exit status 3)."""
    rows = _bench_rows(args, repack)
    return None if rows is None else max(_row_rate(x) for x in rows)


def parse_bandwidth(text: str) -> Bandwidth:
    """host=GB/s,device=GB/s,h2d=GB/s[,cpu=GB/s[,cpu-stock=GB/s]] (cpu: the CPU's expert kernels in moecache's
    layout; cpu-stock: in llama-server's; see Bandwidth)"""
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("host", "device", "h2d", "cpu", "cpu-stock") or not value:
            raise ValueError(f"expected host=GB/s,device=GB/s,h2d=GB/s[,cpu=GB/s[,cpu-stock=GB/s]] (got {text!r})")
        values[key] = float(value) * 1e9
    missing = {"host", "device", "h2d"} - set(values)
    if missing:
        raise ValueError(f"--bandwidth needs host, device and h2d (missing: {', '.join(sorted(missing))})")
    return Bandwidth(values["host"], values["device"], values["h2d"], cpu_experts=values.get("cpu", 0.0),
                     cpu_experts_stock=values.get("cpu-stock", 0.0))


# The decode cost model. A layer whose routed experts (or a cached layer's misses) run on the CPU costs per
# decode step a fixed CPU_LAYER_S (the graph splits there: the copies into and out of the CPU's split, the
# GPU waiting for the hand-over) plus its experts read at the CPU kernels' measured rate; a layer with its
# experts whole in VRAM costs nothing beyond the GPU's own step. Fitted on an H100 (30B shape, 24 GiB, one
# user, tree 53b2b06, benchmarks/results/2026-12-07-decode-handover-30b-24gib-h100.md): with the scheduler's
# split times, 29 CPU splits of the plan took 4.48 ms of CPU compute where their misses' reads at the kernels'
# 69.2 GB/s come to 3.16 ms, and 0.57 ms of copies: 65 us a CPU layer (142 us before the hand-over changes).
CPU_LAYER_S = 65e-6
# The GPU reading missed experts in mapped host memory, against a pinned copy's rate: every layer cached with
# its misses on the GPU decoded 123-125 t/s (84% hits, 162 MB of misses a token) where the GPU's own step
# takes about 4.5 ms, 45-55 GB/s of 55.4 (2026-12-07-vs-llama-server-30b-restore-24gib-h100.md). 0.48 was
# fitted while every prompt's swap released all slots and the warm restore shared the link with the misses;
# the partial release restores only what the prompt took.
LINK_EXPERT_READ_SHARE = 0.86
MISS_GPU_MIN_PCT = 2  # a crossover below this: the misses stay on the CPU
# The link's share of its pinned rate while the CPU streams the other misses beside it (--moe-cache-miss split):
# both read host memory. Fitted on an H100 with gpt-oss-120b's layers at 49% hits (a42d54e,
# 2026-12-07-misses-split-h100-analysis.md): with 30% of a layer's misses on the GPU a layer's misses took about
# 300 us where the CPU alone took about 400, with 50% about 450: the link moved 27-30 GB/s of its 55 beside the CPU.
LINK_SPLIT_READ_SHARE = 0.5
# The split is chosen only where the misses would run on the CPU and it takes at least this share off their time
# there (on the 30B at 76% hits, misses on the GPU, no share of the split changed the rate).
SPLIT_MIN_GAIN = 0.10


@dataclass
class MissPlacement:
    """Where the cache's misses run, from the cost of a decode step: on the CPU, a cached layer costs a CPU
    layer (CPU_LAYER_S) plus its missed experts read from host memory; on the GPU, the missed experts read
    over the link (mapped host memory). With a share f of a layer's routed experts missing, the GPU is faster
    while f < crossover = CPU layer / (its routed bytes x (1/link - 1/host)):
    `gpu` when that holds for any f, `cpu` when it holds for almost none, else `auto` with the crossover as
    --moe-cache-miss-auto-pct (the library moves each layer by its own recent misses)."""
    mode: str                   # "cpu", "gpu", "auto" or "split"
    auto_pct: int | None        # auto's threshold
    crossover: float | None     # the share of misses below which the GPU is faster (None: at any share)
    why: str
    split_pct: int | None = None  # split: the share of a layer's misses on the GPU

    def args(self) -> list[str]:
        if self.mode == "auto":
            return ["--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", str(self.auto_pct)]
        if self.mode == "split":
            return ["--moe-cache-miss", "split", "--moe-cache-miss-split-pct", str(self.split_pct)]
        return ["--moe-cache-miss", self.mode] if self.mode != "cpu" else []

    def on_cpu_at(self, miss_share: float) -> bool:
        """Whether a layer with this share of its routed experts missing runs its misses on the CPU."""
        return self.mode == "cpu" or (self.mode == "auto" and self.crossover is not None and miss_share > self.crossover)


def miss_placement(bw: "Bandwidth | None", layer_routed_bytes: float, layer_s: float = CPU_LAYER_S) -> MissPlacement:
    """The cost model's choice for one token's routed experts of a layer (`layer_routed_bytes`: n_expert_used
    experts' bytes) on a machine with bandwidths `bw` (None: not measured, the misses stay on the CPU)."""
    if bw is None or not bw.usable():
        return MissPlacement("cpu", None, None, "misses on the CPU (no link bandwidth measured to weigh the GPU's "
                                                "path against)")
    link, cpu = bw.host_to_device * LINK_EXPERT_READ_SHARE, bw.cpu_read()
    extra = layer_routed_bytes * (1.0 / link - 1.0 / cpu)  # s per layer, all of its routed experts missed
    if extra <= 0 or layer_s / extra >= 1.0:
        return MissPlacement("gpu", None, None if extra <= 0 else layer_s / extra,
                             f"misses on the GPU: over the link ({bw.host_to_device / 1e9:.1f} GB/s) a layer's "
                             f"missed experts cost less than a CPU layer ({layer_s * 1e6:.0f} us) and its "
                             f"read ({cpu / 1e9:.1f} GB/s), at any hit rate")
    crossover = layer_s / extra
    pct = int(round(100 * crossover))
    if pct < MISS_GPU_MIN_PCT:
        return MissPlacement("cpu", None, crossover,
                             f"misses on the CPU: it reads their experts at {cpu / 1e9:.1f} GB/s against the "
                             f"link's {bw.host_to_device / 1e9:.1f} GB/s")
    return MissPlacement("auto", pct, crossover,
                         f"a layer's misses on the GPU while at most {pct}% of its routed experts miss, else on the "
                         f"CPU (link {bw.host_to_device / 1e9:.1f} GB/s, the CPU's experts {cpu / 1e9:.1f} GB/s, "
                         f"a CPU layer {layer_s * 1e6:.0f} us)")


def split_share(bw: "Bandwidth", missed_bytes: float, layer_s: float = CPU_LAYER_S) -> tuple[float, float]:
    """--moe-cache-miss split by the cost model: the share s of a layer's missed bytes (`missed_bytes` a step) on
    the GPU over the link, the rest on the CPU at the same time (a CPU layer plus its read), so the layer's misses
    take max(s M / link, CPU layer + (1 - s) M / cpu); the two are equal at s = (CPU layer + M / cpu) /
    (M / link + M / cpu), capped at 1. The link beside the CPU moves LINK_SPLIT_READ_SHARE of its rate (both read
    host memory). Returns (s, the modelled seconds)."""
    link, cpu = bw.host_to_device * LINK_SPLIT_READ_SHARE, bw.cpu_read()
    if missed_bytes <= 0:
        return 0.0, 0.0
    on_link, on_cpu = missed_bytes / link, missed_bytes / cpu
    s = min(1.0, (layer_s + on_cpu) / (on_link + on_cpu))
    return s, max(s * on_link, layer_s + (1.0 - s) * on_cpu if s < 1.0 else 0.0)


def split_if_it_pays(bw: "Bandwidth", missed_bytes: float) -> tuple[float, float] | None:
    """split_share's (share, seconds) where the split of these missed bytes takes at least SPLIT_MIN_GAIN off the
    CPU's time for them (and leaves each side a share), else None."""
    if missed_bytes <= 0:
        return None
    s, t = split_share(bw, missed_bytes)
    if 0 < round(100 * s) < 100 and t <= (1.0 - SPLIT_MIN_GAIN) * (CPU_LAYER_S + missed_bytes / bw.cpu_read()):
        return s, t
    return None


def split_placement(bw: "Bandwidth | None", base: MissPlacement, layer_routed_bytes: float,
                    hit: float) -> MissPlacement | None:
    """--moe-cache-miss split where the cost model expects it to pay: a layer whose misses (the share 1 - `hit` of
    its routed experts' bytes `layer_routed_bytes`) would run on the CPU by `base`, and the split takes at least
    SPLIT_MIN_GAIN off their time there. None: keep `base`."""
    if bw is None or not bw.usable() or not base.on_cpu_at(1.0 - hit):
        return None
    missed = layer_routed_bytes * (1.0 - hit)
    pays = split_if_it_pays(bw, missed)
    if pays is None:
        return None
    s, t = pays
    cpu = CPU_LAYER_S + missed / bw.cpu_read()
    pct = int(round(100 * s))
    return MissPlacement("split", None, base.crossover,
                         f"a layer's misses split: its most-routed missed experts, {pct}% of its misses, on the GPU "
                         f"over the link, the others on the CPU at once: {t * 1e6:.0f} us a layer by the model at "
                         f"{100 * hit:.0f}% hits against {cpu * 1e6:.0f} on the CPU alone (link "
                         f"{bw.host_to_device / 1e9:.1f} GB/s, {LINK_SPLIT_READ_SHARE:.0%} of it beside the CPU; the "
                         f"CPU's experts {bw.cpu_read() / 1e9:.1f} GB/s, a CPU layer {CPU_LAYER_S * 1e6:.0f} us)",
                         split_pct=pct)


@dataclass
class Rates:
    """Bounds from the bandwidths: decode reads the dense weights and the hits from VRAM and the misses from
    host memory, one after the other (a layer's experts wait for its attention); a prompt ubatch streams
    every expert in host memory to the GPU once (the stock path's op offload). Compute, latency and the
    per-layer round trips are not in them: measured rates sit below (see the README's numbers)."""
    hit_rate: float
    hit_source: str
    decode: float
    prefill: float
    prefill_swap: float | None


def rate_bounds(plan: "Plan", bw: Bandwidth) -> Rates | None:
    if not bw.usable() or plan.all_in_vram:
        return None
    expert_token = plan.n_expert_used * sum(d.slot for d in plan.devices)  # one expert of every cached layer
    dense = sum(d.model for d in plan.devices if d.counts_model)
    h, source = plan.hit_rate()
    miss = plan.miss()
    if miss.mode == "split":  # both halves read host memory at once
        miss_rate = min(bw.host_read, bw.host_to_device + bw.cpu_read())
    else:
        miss_rate = bw.cpu_read() if miss.on_cpu_at(1 - h) else bw.host_to_device
    t_decode = dense / bw.device + h * expert_token / bw.device + (1 - h) * expert_token / miss_rate
    t_ubatch = plan.host_model / bw.host_to_device
    return Rates(h, source, 1.0 / t_decode, plan.request.ubatch / t_ubatch,
                 plan.prefill_ubatch / t_ubatch if plan.prefill_ubatch else None)


def profile_hit_rate(path: Path, slots: int, n_expert: int, below_layer: int | None = None,
                     by_layer: bool = False) -> float | None:
    """The share of the routings in a hot-expert cache profile (moecache-expert-profile 1: a line of counts per
    layer) that each layer's `slots` most-routed experts took, over all layers (those before `below_layer`
    where given): what slots holding the hot set serve on that traffic; with `by_layer`, each layer at the
    slots slots_by_layer gives it. None for a missing, damaged or other-shaped file, or one without counts yet."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if len(lines) < 3 or lines[0] != "moecache-expert-profile 1" or lines[-1] != "end":
        return None
    layers = []
    for line in lines[2:-1]:
        words = line.split()
        if len(words) != 2 + n_expert or words[0] != "layer":
            return None
        try:
            layer = int(words[1])
            counts = sorted((int(w) for w in words[2:]), reverse=True)
        except ValueError:
            return None
        if below_layer is not None and layer >= below_layer:
            continue
        layers.append(counts)
    from .cache_sim import slots_by_layer

    sizes = slots_by_layer(layers, slots, n_expert) if by_layer else [slots] * len(layers)
    hit = sum(sum(c[:k]) for c, k in zip(layers, sizes))
    total = sum(map(sum, layers))
    return hit / total if total > 0 else None


PRIOR_SOURCE = "a prior: the square root of the slots' share"


def prior_hit_rate(slots: int, n_expert: int) -> float:
    """The hit rate of `slots` of `n_expert` per layer where neither a trace nor a profile tells: sqrt(slots /
    experts), which meets the LRU hit rates published for Qwen3-30B-A3B (36.6% at 24 of 128 slots, 74.1% at
    73) and the 82% measured at 80 (the users' comparison on an H100). Real routing is skewed; how much
    differs by model."""
    return min(1.0, (max(0, slots) / max(1, n_expert)) ** 0.5)


def expected_hit_rate(req: Request, slots: int, n_expert: int, below_layer: int | None = None,
                      replayed: dict | None = None) -> tuple[float, str]:
    """The share of routed experts `slots` per layer hold, and where it comes from: replayed from the user's
    trace (all layers; `replayed` keeps replays by (trace, slots)), else the expert profile of earlier runs
    (over the layers before `below_layer`), else the prior."""
    if req.trace is not None:
        key = (str(req.trace), slots)
        replayed = {} if replayed is None else replayed
        if key not in replayed:
            from .cache_sim import load_trace, simulate

            replayed[key] = float(simulate(load_trace(req.trace), slots)["hit_rate"])
        return replayed[key], f"replayed {req.trace}"
    if req.profile is not None:
        h = profile_hit_rate(req.profile, slots, n_expert, below_layer, by_layer=req.slots_by_layer)
        if h is not None:
            if req.slots_by_layer:
                return h, f"the expert profile of earlier runs (its top experts in {slots} slots a layer on average, " \
                          "each layer's count from its routing)"
            return h, f"the expert profile of earlier runs (the top-{slots} share per layer)"
    return prior_hit_rate(slots, n_expert), PRIOR_SOURCE


@dataclass
class Residency:
    """Per layer, whole experts in VRAM against cache slots, by the decode cost model (CPU_LAYER_S): the last
    `resident` MoE layers keep their experts in VRAM (no split, no miss), the others' routed experts stay in
    host memory with `slots` cache slots each. The modelled cost per decode step of the layers with experts in
    host memory (the GPU's own step is common to all placements), against every layer cached and against
    llama-server's --fit placement (as many layers whole as fit, the rest on the CPU, no cache)."""
    resident: int
    slots: int
    n_moe: int
    step_s: float
    all_cached_s: float
    fit_s: float
    hit_rate: float
    hit_source: str
    candidates: list = field(default_factory=list)  # (whole layers, slots, hit rate, modelled s) of every placement

    def text(self) -> str:
        return (f"{self.step_s * 1e3:.2f} ms per token in the layers with experts in host memory by the cost model, "
                f"against {self.fit_s * 1e3:.2f} with llama-server's --fit placement and {self.all_cached_s * 1e3:.2f} "
                f"with every layer cached")


def layer_step_s(bw: Bandwidth, expert_bytes: float, experts: float, hit: float) -> float:
    """One decode step of a layer whose routed experts are in host memory: `experts` routed (distinct, over the
    step's tokens), `hit` of them in slots; the misses where they cost less: the CPU (a CPU layer plus their
    read) or the GPU (their read over the link), and where the CPU is the cheaper, split between the two when
    that takes SPLIT_MIN_GAIN off (as the plan then places them: split_placement)."""
    missed = experts * (1.0 - hit) * expert_bytes
    cpu = CPU_LAYER_S + missed / bw.cpu_read()
    gpu = missed / (bw.host_to_device * LINK_EXPERT_READ_SHARE)
    pays = split_if_it_pays(bw, missed) if cpu < gpu else None
    return pays[1] if pays else min(cpu, gpu)


def routed_per_step(n_expert: int, n_used: int, users: int) -> float:
    """The distinct experts a layer routes in a decode step of `users` tokens (routing taken as uniform)."""
    return n_expert * (1.0 - (1.0 - n_used / max(1, n_expert)) ** max(1, users))


def choose_residency(d: "Device", n_expert: int, n_used: int, users: int, bw: Bandwidth, hit_at,
                     bank_min: int = 0, n_layer: int | None = None) -> Residency | None:
    """The placement of least modelled decode cost on one GPU `d` (planned with every layer's experts in host
    memory): r of its MoE layers whole in VRAM, the slots of the others from what is left, at least `bank_min`
    bytes of slots (what the prefill-phase swap gives back to its compute buffers). `hit_at(slots, below_layer)`:
    the hit rate and its source at that many slots over the layers cached. None where nothing can be cached."""
    n = d.n_moe_layers
    if n <= 0 or d.slot <= 0 or n_expert <= 0:
        return None
    n_layer = n_layer or n
    per = d.slot / n                         # one expert of one layer
    layer = per * n_expert                   # a layer's routed experts
    free = d.budget - d.fixed
    routed = routed_per_step(n_expert, n_used, users)
    best = all_cached = None
    tried: list = []
    for r in range(0, n):
        left = free - r * layer
        if left < per * (n - r):
            break                            # not one slot per cached layer
        c = n - r
        slots = min(n_expert, int(left // (per * c)))
        if slots * per * c < bank_min:
            continue
        hit, source = hit_at(slots, n_layer - r)
        step = c * layer_step_s(bw, per, routed, hit)
        tried.append((r, slots, hit, step))
        cand = Residency(r, slots, n, step, 0.0, 0.0, hit, source)
        if r == 0:
            all_cached = step
        if best is None or step < best.step_s - 1e-12:
            best = cand
    if best is None:
        return None
    fit_resident = min(n, int(max(0, free) // layer))
    # its CPU layers: no cache, no GPU misses, its own layout of the experts (repacked where the CPU has one)
    fit = (n - fit_resident) * (CPU_LAYER_S + routed * per / bw.cpu_read_stock())
    best.all_cached_s = all_cached if all_cached is not None else best.step_s
    best.fit_s = fit
    best.candidates = tried
    return best


@dataclass
class Plan:
    request: Request
    devices: list[Device]
    host_model: int            # weights in host memory (the routed experts)
    n_expert: int
    n_expert_used: int
    n_layer: int
    slots: int                 # per cached layer (0: no cache)
    all_in_vram: bool          # the whole model fits: no experts in host memory, no cache
    prefill_ubatch: int | None
    notes: list[str]
    host_test_device: bool = False
    measured: dict | None = None  # measure_rates(): the planned server's own prefill and decode here
    residency: Residency | None = None  # place_layers(): whole experts in VRAM against slots, per layer
    _replayed: dict = field(default_factory=dict, repr=False, compare=False)  # (trace, slots) -> hit rate

    @property
    def whole_layers(self) -> int:
        """The MoE layers whose experts this plan keeps whole in VRAM (place_layers' --n-cpu-moe), else 0."""
        return self.residency.resident if self.residency and self.request.n_cpu_moe is not None else 0

    def hit_rate(self) -> tuple[float, str]:
        """The share of routed experts the slots hold (expected_hit_rate, over the cached layers)."""
        if self.slots <= 0:
            return 0.0, "no cache"
        # rates() runs for the table and the JSON: a trace is replayed once per slot count
        return expected_hit_rate(self.request, self.slots, self.n_expert, self.request.n_cpu_moe, self._replayed)

    def rates(self) -> Rates | None:
        return rate_bounds(self, self.request.bandwidth) if self.request.bandwidth else None

    def miss(self) -> MissPlacement:
        """Where the cache's misses run (the cost model of MissPlacement, from the request's bandwidths)."""
        if self.all_in_vram or not self.slots:
            return MissPlacement("cpu", None, None, "no cache")
        layer_routed = self._layer_routed_bytes()
        if layer_routed is None:
            return MissPlacement("cpu", None, None, "no cached layer")
        base = miss_placement(self.request.bandwidth, layer_routed)
        h, _ = self.hit_rate()
        return split_placement(self.request.bandwidth, base, layer_routed, h) or base

    def _layer_routed_bytes(self) -> float | None:
        """A token's routed experts of one cached layer, in bytes (the largest over the GPUs); None: no cached layer."""
        cached = [d for d in self.devices if d.slot > 0 and d.n_moe_layers > 0]
        return self.n_expert_used * max(d.slot / d.n_moe_layers for d in cached) if cached else None

    def split_text(self) -> str | None:
        """What the cost model expects of --moe-cache-miss split at the plan's hit rate where the plan did not choose
        it (a line of the rendered plan; None without bandwidths or a cache, or where the split is the plan's)."""
        bw = self.request.bandwidth
        layer_routed = self._layer_routed_bytes()
        if bw is None or not bw.usable() or layer_routed is None or self.all_in_vram:
            return None
        miss = self.miss()
        h, _ = self.hit_rate()
        missed = layer_routed * (1.0 - h)
        if missed <= 0 or miss.mode == "split":
            return None
        s, t = split_share(bw, missed)
        cpu = CPU_LAYER_S + missed / bw.cpu_read()
        gpu = missed / (bw.host_to_device * LINK_EXPERT_READ_SHARE)
        why = ("the misses run on the GPU at this hit rate" if not miss.on_cpu_at(1.0 - h) else
               f"it takes less than {SPLIT_MIN_GAIN:.0%} off the CPU's time")
        return (f"misses split (--moe-cache-miss split --moe-cache-miss-split-pct {round(100 * s)}), by the model at "
                f"{100 * h:.0f}% hits: {t * 1e6:.0f} us a cached layer, against {cpu * 1e6:.0f} on the CPU and "
                f"{gpu * 1e6:.0f} on the GPU (not chosen: {why})")

    def args(self) -> list[str]:
        if self.all_in_vram:
            return server_args(self.request, experts_on_host=False)
        return server_args(self.request, slots=self.slots or None, prefill_ubatch=self.prefill_ubatch,
                           miss=self.miss().args() if self.slots else ())

    def command(self) -> str:
        return shlex.join(["moecache-server", "-m", str(self.request.model), *self.args()])

    def to_json(self) -> dict:
        return {
            "model": str(self.request.model), "ctx": self.request.ctx, "users": self.request.users,
            "ubatch": self.request.ubatch, "slots": self.slots, "all_in_vram": self.all_in_vram,
            "prefill_ubatch": self.prefill_ubatch, "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
            "host_model_bytes": self.host_model, "host_test_device": self.host_test_device,
            "devices": [{
                "name": d.name, "description": d.description, "budget": d.budget, "model": d.model,
                "context": d.context, "compute": d.compute, "prefill_compute": d.prefill_compute,
                "slot": d.slot, "banks": d.slot * self.slots, "headroom": d.headroom,
                "counts_model": d.counts_model, "n_moe_layers": d.n_moe_layers,
                "left": d.budget - d.fixed - d.slot * self.slots,
            } for d in self.devices],
            "miss": {k: v for k, v in vars(self.miss()).items()} if self.slots else None,
            "args": self.args(), "command": self.command(), "notes": self.notes,
            "rates": self._rates_json(), "measured": self.measured, "n_cpu_moe": self.request.n_cpu_moe,
            "residency": vars(self.residency) if self.residency else None,
        }

    def _rates_json(self) -> dict | None:
        r = self.rates()
        if r is None:
            return None
        bw = self.request.bandwidth
        return {"decode_bound": r.decode, "prefill_bound": r.prefill, "prefill_swap_bound": r.prefill_swap,
                "hit_rate": r.hit_rate, "hit_rate_source": r.hit_source,
                "bandwidth": {"host_read": bw.host_read, "device": bw.device, "host_to_device": bw.host_to_device,
                              "cpu_experts": bw.cpu_experts, "cpu_experts_stock": bw.cpu_experts_stock,
                              "source": bw.source}}

    def summary(self) -> tuple[str, str]:
        """What was planned and why, one line each (moecache-server's start)."""
        if self.all_in_vram:
            return ("every layer and expert on the GPUs (-ngl 99), no hot-expert cache",
                    "the whole model fits the budget")
        r, whole = self.residency, self.whole_layers
        if whole:
            what = [f"the experts of the last {whole} of {r.n_moe} MoE layers whole in VRAM, the other layers' "
                    f"routed experts in host memory ({size_text(self.host_model)})"]
        else:
            what = [f"routed experts in host memory ({size_text(self.host_model)})"]
        if self.slots:
            h, source = self.hit_rate()
            seen = f" (expected hits {100 * h:.0f}%, from {source})" if source.startswith("the expert profile") else ""
            what.append(f"hot-expert cache of {self.slots} of {self.n_expert} experts per layer in VRAM{seen}")
        else:
            what.append("no hot-expert cache (no room for a slot)")
        if self.slots:
            miss = self.miss()
            what.append({"cpu": "misses on the CPU", "gpu": "misses on the GPU",
                         "split": f"misses split, {miss.split_pct}% on the GPU and the rest on the CPU"}.get(
                miss.mode, f"misses on the GPU up to {miss.auto_pct}% per layer"))
        if self.prefill_ubatch:
            what.append(f"prompts at -ub {self.prefill_ubatch} (prefill-phase swap)")
        dense = sum(d.model for d in self.devices if d.counts_model)
        total = dense + self.host_model
        budget = sum(d.budget for d in self.devices)
        where = ", ".join(f"{d.name} {size_text(d.budget)}" for d in self.devices)
        why = (f"the model ({size_text(total)}) and the context do not fit the budget ({where}): the "
               f"{'weights of the dense part and the whole layers' if whole else 'dense weights'} ({size_text(dense)}) "
               f"and the KV cache go to the GPU, the cache holds the most-routed experts in the "
               f"{size_text(max(0, budget - sum(d.fixed for d in self.devices)))} left")
        if r is not None:
            placed = f"the last {whole} layers' experts whole in VRAM" if whole else "every layer cached"
            why += f"; per layer, {placed}: {r.text()} (hit rates from {r.hit_source})"
        if self.slots:
            why += f"; {self.miss().why}"
        return ", ".join(what), why

    def render(self) -> str:
        unit, scale = ("GiB", GiB) if max(d.budget for d in self.devices) >= 4 * GiB else ("MiB", MiB)
        g = lambda b: f"{b / scale:.2f}"  # noqa: E731
        lines = [f"plan for {self.request.model}: {self.request.users} user(s) x {self.request.ctx} tokens, "
                 f"-ub {self.request.ubatch}", ""]
        head = f"{unit:<26}" + "".join(f"{d.name[:14]:>16}" for d in self.devices)
        lines.append(head)
        rows = [("budget", [d.budget for d in self.devices])]
        whole = self.whole_layers
        label = "weights" if self.all_in_vram else (f"weights, {whole} layers whole" if whole else
                                                   "weights (no routed experts)")
        rows.append((label, [d.model if d.counts_model else 0 for d in self.devices]))
        rows += [("KV cache", [d.context for d in self.devices]),
                 (f"compute (-ub {self.request.ubatch})", [d.compute for d in self.devices])]
        if not self.all_in_vram:
            rows.append((f"cache: {self.slots} slots x layers", [d.slot * self.slots for d in self.devices]))
        rows += [("headroom", [d.headroom for d in self.devices]),
                 ("left", [d.budget - d.fixed - d.slot * self.slots for d in self.devices])]
        for label, values in rows:
            lines.append(f"{label:<26}" + "".join(f"{g(v):>16}" for v in values))
        if self.prefill_ubatch:
            lines.append(f"{'prefill (-ub ' + str(self.prefill_ubatch) + ')':<26}" +
                         "".join(f"{g(d.prefill_compute or 0):>16}" for d in self.devices) +
                         "   compute while a prompt runs, in place of the banks and the decode buffers")
        if self.slots:
            lines.append(f"misses: {self.miss().why}")
            split = self.split_text()
            if split:
                lines.append(split)
        if self.residency is not None:
            res = self.residency
            lines.append(f"per layer: {'the last ' + str(whole) + ' layers whole in VRAM' if whole else 'every layer cached'}, "
                         f"{res.text()} (hit rates from {res.hit_source})")
            # the model's other placements, to check it against (-ncmoe N places them by hand)
            step = max(1, len(res.candidates) // 8)
            shown = [c for i, c in enumerate(res.candidates) if i % step == 0 or c[0] == res.resident]
            lines.append("  whole layers  -ncmoe  slots   hits  modelled ms/token")
            lines += [f"  {r:>12}  {self.n_layer - r:>6}  {s:>5}  "
                      f"{100 * h:4.0f}%  {ms * 1e3:8.2f}{'  <-' if r == res.resident else ''}" for r, s, h, ms in shown]
        lines.append("")
        if self.all_in_vram:
            lines.append("The whole model fits: every expert in VRAM, no hot-expert cache needed.")
        else:
            lines.append(f"host memory: {size_text(self.host_model)} of weights, the routed experts among them ({self.n_expert} per layer, "
                         f"{self.n_expert_used} used per token)")
            if self.slots:
                lines.append(f"hot-expert cache: {self.slots} of {self.n_expert} experts per layer in VRAM "
                             f"({100.0 * self.slots / max(1, self.n_expert):.0f}%)")
        r = self.rates()
        if r is not None:
            lines += ["", f"rate bounds from {self.request.bandwidth.text()}:",
                      f"  decode  <= {r.decode:7.1f} tokens/s at {100 * r.hit_rate:.1f}% hits ({r.hit_source})",
                      f"  prefill <= {r.prefill:7.1f} tokens/s at -ub {self.request.ubatch}" +
                      (f", <= {r.prefill_swap:.1f} with the swap's -ub {self.prefill_ubatch}" if r.prefill_swap else ""),
                      "  (bandwidth alone: compute and the per-layer round trips come on top)"]
        m = self.measured
        if m:
            hits = f", {100 * m['hit_rate']:.1f}% hits" if m.get("hit_rate") is not None else ""
            lines += ["", f"measured here with the planned command (real text, medians of {m['reps']}):",
                      f"  prefill {m['prefill_tps']:9.1f} tokens/s ({m['prompt_tokens']} tokens"
                      f"{', swapped to -ub ' + str(m['prefill_ubatch']) if m.get('prefill_ubatch') else ''})",
                      f"  decode  {m['decode_tps']:9.1f} tokens/s ({m['decode_tokens']} tokens after it{hits})"]
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", "command:", "  " + self.command()]
        return "\n".join(lines)


def _gpu_rows(p: dict, environ: Mapping[str, str]) -> tuple[list[dict], bool]:
    gpus = [d for d in p.get("devices", []) if d.get("type") == "gpu"]
    if gpus:
        return gpus, False
    if environ.get(HOST_DEVICE_ENV, "").strip() not in ("", "0"):
        return [{**p["host"], "name": "host test device", "description": HOST_DEVICE_ENV, "total": 0, "free": 0}], True
    raise PlanError("no GPU device: this build or machine has none, and the plan sizes GPU memory. Run "
                    "`moecache plan` on the machine that runs the server, with a CUDA build "
                    "(CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install moecache).")


def _budgets(req: Request, rows: list[dict], host_test: bool, environ: Mapping[str, str]) -> list[int]:
    if req.gpu_mem_gib is not None:
        mem = list(req.gpu_mem_gib)
        if len(mem) == 1:
            mem *= len(rows)
        if len(mem) != len(rows):
            raise PlanError(f"--gpu-mem gives {len(mem)} budgets for {len(rows)} GPU(s): give one per GPU "
                            f"({', '.join(r['name'] for r in rows)}) or one for all")
        return [int(m * GiB) for m in mem]
    if host_test:
        mib = environ.get(HOST_DEVICE_MIB_ENV, "").strip()
        if not mib:
            raise PlanError(f"the host test device has no size: give --gpu-mem or set {HOST_DEVICE_MIB_ENV}")
        try:
            return [int(float(mib) * MiB)]
        except ValueError:
            raise PlanError(f"{HOST_DEVICE_MIB_ENV} must be a number of MiB (got {mib!r})") from None
    return [int(r["free"]) for r in rows]  # nothing is loaded yet: what the server will find free


def _idle(row: dict) -> bool:
    """A device the split gives nothing (-ts 1,0): its budget does not bind."""
    return int(row["model"]) + int(row["context"]) + int(row["compute"]) == 0


def _idle_device(d: Device) -> bool:
    return d.model + d.context + d.compute == 0 and d.slot == 0


def make_plan(req: Request, environ: Mapping[str, str] | None = None, binary: Path | None = None,
              whole_checked: bool = False) -> Plan:
    environ = os.environ if environ is None else environ
    req.check()

    notes: list[str] = []
    env = dict(environ)
    user_places_experts = False
    if req.probe_args:
        from .options import EXPERT_PLACEMENT_ENV, EXPERT_PLACEMENT_FLAGS, user_decides

        user_places_experts = user_decides(req.probe_args, environ, EXPERT_PLACEMENT_FLAGS, EXPERT_PLACEMENT_ENV)

    def probe_with(args: list[str], last: Sequence[str] = (), routing_readback: bool = False) -> dict:
        if req.probe_args:
            # what the server will run: the plan's flags the command line leaves open, then the command line
            # (--cpu-moe, -ncmoe and -ot add up rather than the last one winning, so no plan flag may stay
            # beside one of the user's)
            from .options import planned_args

            args = planned_args(args, req.probe_args, environ) + list(req.probe_args)
        return probe(req.model, args + list(last), env, binary, routing_readback)

    # 1. the whole model on the GPUs: no cache needed where it fits (your own expert placement stays yours)
    # (whole_checked: a caller that already found it does not fit)
    if environ.get(HOST_DEVICE_ENV, "").strip() in ("", "0") and not user_places_experts and not whole_checked:
        whole = probe_with(server_args(req, experts_on_host=False))
        rows, host_test = _gpu_rows(whole, environ)
        budgets = _budgets(req, rows, host_test, environ)
        headroom = int(whole.get("moe_cache_headroom_mib", 512)) * MiB
        if all(_idle(r) or int(r["model"]) + int(r["context"]) + int(r["compute"]) + headroom <= b
               for r, b in zip(rows, budgets)):
            devices = [Device(r["name"], r.get("description", ""), b, int(r["model"]), int(r["context"]),
                              int(r["compute"]), 0, 0, headroom) for r, b in zip(rows, budgets)]
            return Plan(req, devices, int(whole["host"]["model"]), int(whole["n_expert"]), int(whole.get("n_expert_used", 0)),
                        int(whole["n_layer"]), 0, True, None, notes)

    # 2. the routed experts in host memory, the cache's slots in what is left
    p = probe_with(server_args(req, slots=1))
    if int(p["n_ctx"]) != req.ctx * req.users and int(p["n_ctx"]) > 0:
        # -c 0 (the model's own context) or a context llama.cpp rounded: the plan is of what it will get
        notes.append(f"the context is {p['n_ctx']} tokens in all (asked: {req.ctx * req.users})")
        req.ctx = max(1, int(p["n_ctx"]) // req.users)
    if user_places_experts:
        notes.append("your -ot / --cpu-moe / -ncmoe place the experts; the plan keeps them")
    if int(p["n_expert"]) == 0:
        raise PlanError(f"{req.model} has no routed experts: nothing for the hot-expert cache to hold. Serve it "
                        "with -ngl 99 if it fits, or plan with llama.cpp's --fit.")
    rows, host_test = _gpu_rows(p, environ)
    budgets = _budgets(req, rows, host_test, environ)
    headroom = int(p.get("moe_cache_headroom_mib", 512)) * MiB
    devices = [Device(r["name"], r.get("description", ""), b, int(r["model"]), int(r["context"]), int(r["compute"]),
                      int(r["moe_slot"]), int(r["n_moe_layers"]), headroom, counts_model=not host_test)
               for r, b in zip(rows, budgets)]
    over = [d for d in devices if d.fixed > d.budget and not _idle_device(d)]
    if over:
        d = over[0]
        kv_per_1k = d.context / max(1, req.ctx * req.users) * 1000
        raise PlanError(
            f"{d.name}: {('the weights on it (' if user_places_experts else 'the weights without the routed experts (') + size_text(d.model) + '), ' if d.counts_model else ''}"
            f"the KV cache ({size_text(d.context)} for {req.users} x {req.ctx} tokens), the compute buffers "
            f"({size_text(d.compute)} at -ub {req.ubatch}) and the headroom kept free ({d.headroom // MiB} MiB) need "
            f"{size_text(d.fixed)}, over the {size_text(d.budget)} budget. Fix: lower --ctx or --users (the KV cache "
            f"takes {size_text(int(kv_per_1k))} per 1000 tokens), lower --ubatch, lower the headroom "
            f"(--server-arg=--moe-cache-headroom=MiB; with --fit, --server-arg=-fitt=MiB too) or plan for a larger "
            f"GPU (--gpu-mem).")
    cached = [d for d in devices if d.slot > 0]
    n_expert = int(p["n_expert"])
    slots = min((d.slots_fit() for d in cached), default=0)
    if not cached:
        notes.append("no layer can be cached on these devices (see llama-server's log for the reason): "
                     "every routed expert runs on the CPU")
    elif slots == 0:
        d = min(cached, key=lambda x: x.slots_fit())
        notes.append(f"no room for one cache slot on {d.name} ({d.slot / MiB:.1f} MiB per slot, "
                     f"{(d.budget - d.fixed) / MiB:.1f} MiB left): every routed expert runs on the CPU. "
                     "Fix: lower --ctx, --users or --ubatch to make room.")
    if slots > n_expert:
        slots = n_expert
        notes.append(f"every expert fits: {n_expert} slots per layer hold them all")

    # 3. the prefill-phase swap's ubatch: its compute buffer in place of the banks and the decode buffers
    prefill_ubatch = None
    if req.swap and slots > 0:
        for f in SWAP_FACTORS:
            ub = req.ubatch * f
            if req.prompt_tokens is not None and req.prompt_tokens < ub:
                continue
            # over a -ub of the command line; a swapped prompt's graphs read its routing back for the warm restore
            pp = probe_with(server_args(req, ubatch=ub), last=["-ub", str(ub)], routing_readback=True)
            if int(pp["n_ubatch"]) < ub:
                continue  # the batch (-b) caps it
            prow, _ = _gpu_rows(pp, environ)
            if all(d.prefill_fits(int(r["compute"])) for d, r in zip(devices, prow)):
                for d, r in zip(devices, prow):
                    d.prefill_compute = int(r["compute"])
                prefill_ubatch = ub
                break
        if prefill_ubatch is None:
            why = (f"prompts of {req.prompt_tokens} tokens are shorter than {2 * req.ubatch}" if req.prompt_tokens
                   is not None and req.prompt_tokens < 2 * req.ubatch else
                   f"the compute buffers of -ub {2 * req.ubatch} do not fit beside the weights and the KV cache")
            notes.append(f"no prefill-phase swap: {why}")
    return Plan(req, devices, int(p["host"]["model"]), n_expert, int(p.get("n_expert_used", 0)),
                int(p["n_layer"]), slots, False, prefill_ubatch, notes, host_test_device=host_test)


def place_layers(plan: Plan, environ: Mapping[str, str] | None = None, binary: Path | None = None) -> Plan:
    """Per layer, whole experts in VRAM against cache slots: the plan of least modelled decode cost
    (choose_residency, from the plan's bandwidths and hit rates), re-probed with --n-cpu-moe where it keeps
    some layers whole; the plan as it was where that does not apply (no bandwidths, no cache, several GPUs,
    your own expert placement) or does not pay. Keeps the prefill-phase swap: the slots left
    can always give back what its compute buffers need."""
    req = plan.request
    bw = req.bandwidth
    if (plan.all_in_vram or not plan.slots or bw is None or not bw.usable() or plan.host_test_device
            or len(plan.devices) != 1 or req.n_cpu_moe is not None):
        return plan
    if req.probe_args:
        from .options import EXPERT_PLACEMENT_ENV, EXPERT_PLACEMENT_FLAGS, user_decides

        if user_decides(req.probe_args, os.environ if environ is None else environ, EXPERT_PLACEMENT_FLAGS,
                        EXPERT_PLACEMENT_ENV):
            return plan
    d = plan.devices[0]
    bank_min = max(0, (d.prefill_compute or d.compute) - d.compute) if plan.prefill_ubatch else 0

    replayed: dict = {}

    def hit_at(slots: int, below_layer: int) -> tuple[float, str]:
        return expected_hit_rate(req, slots, plan.n_expert, below_layer, replayed)

    r = choose_residency(d, plan.n_expert, plan.n_expert_used, req.users, bw, hit_at, bank_min, plan.n_layer)
    if r is None or r.resident == 0:
        plan.residency = r  # every layer cached is the model's choice
        return plan
    try:
        placed = make_plan(replace(req, n_cpu_moe=plan.n_layer - r.resident), environ, binary, whole_checked=True)
    except PlanError as e:
        plan.notes.append(f"every layer cached: the placement with {r.resident} layers whole could not be probed ({e})")
        return plan
    lost_swap = bool(plan.prefill_ubatch) and not placed.prefill_ubatch
    if not placed.slots or lost_swap:
        plan.notes.append(f"every layer cached: with {r.resident} layers whole the probe left {placed.slots} slots"
                          + (" and no prefill-phase swap" if lost_swap else ""))
        return plan
    placed.residency = r
    return placed


def measure_rates(plan: Plan, prompt_tokens: int | None = None, decode_tokens: int = 64, reps: int = 2,
                  env: Mapping[str, str] | None = None, timeout: float = 900.0, text: str | None = None,
                  repeated_reps: int = 0) -> dict:
    """Start the planned server and time it: a warm-up, then `reps` requests of `prompt_tokens` tokens of real
    text (a new slice each, no prompt cache) and `decode_tokens` decoded tokens; the medians of the server's
    own timings, with the cache's hit rate over them. What the plan's command gives on this machine. `text`:
    the text to slice (yours: the routing, so the hit rate, follows it); by default the bundled texts.
    `repeated_reps`: then as many requests of the warm-up's prompt again (a benchmark's protocol: the same
    prompt each repetition), whose medians go under "repeated"."""
    import statistics

    from .process import ServerError, ServerProcess
    from .texts import default_texts

    n_ctx = plan.request.ctx
    n = prompt_tokens or plan.request.prompt_tokens or min(4096, n_ctx - decode_tokens - 16)
    if n < 1 or n + decode_tokens > n_ctx:
        raise PlanError(f"--measure: a prompt of {n} tokens and {decode_tokens} decoded ones do not fit in "
                        f"{n_ctx} tokens of context per user: lower --prompt-tokens or raise --ctx")
    given = bool(text and text.strip())
    if not given:
        text = "\n\n".join(t for _, t in default_texts())
    srv = ServerProcess(plan.request.model, args=[*plan.args(), "--cache-ram", "0"], env=dict(env or {}),
                        timeout=timeout)
    try:
        srv.start()
    except ServerError as e:
        raise PlanError(f"--measure: the planned server did not start: {e}") from None
    try:
        status, tok = srv.post("/tokenize", {"content": text})
        if status != 200:
            raise PlanError(f"--measure: /tokenize answered {status}: {tok}")
        tokens = list(tok["tokens"])
        if not tokens:
            raise PlanError("--measure: the text has no tokens to make prompts of")
        while len(tokens) < 2 * n + reps * 97:
            tokens += tokens
        def timings(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "n_predict": decode_tokens, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False}
            status, out = srv.post("/completion", body, timeout=timeout)
            if status != 200:
                raise PlanError(f"--measure: /completion answered {status}: {out}")
            return out["timings"]

        prefill, decode, ubatch = [], [], None
        before = after = None
        for i in range(reps + 1):  # the first is a warm-up
            if i == 1:
                before = _cache_counts(srv)
            t = timings(tokens[i * 97:i * 97 + n])
            if i == 0:
                continue
            prefill.append(float(t["prompt_per_second"]))
            decode.append(float(t["predicted_per_second"]))
            ubatch = t.get("prefill_ubatch") or ubatch
        after = _cache_counts(srv)
        repeated: dict[str, list[float]] = {"prefill_tps": [], "decode_tps": []}
        for _ in range(repeated_reps):
            t = timings(tokens[:n])
            repeated["prefill_tps"].append(float(t["prompt_per_second"]))
            repeated["decode_tps"].append(float(t["predicted_per_second"]))
    finally:
        srv.stop()
        srv.cleanup()
    hit = None
    if before and after and after[0] + after[1] > before[0] + before[1]:
        hit = (after[0] - before[0]) / ((after[0] - before[0]) + (after[1] - before[1]))
    result = {"prefill_tps": statistics.median(prefill), "decode_tps": statistics.median(decode), "reps": reps,
            "prompt_tokens": n, "decode_tokens": decode_tokens, "hit_rate": hit, "prefill_ubatch": ubatch,
            "text": "given" if given else "bundled",
            "samples": {"prefill_tps": prefill, "decode_tps": decode}}
    if repeated_reps > 0:
        result["repeated"] = {"prefill_tps": statistics.median(repeated["prefill_tps"]),
                              "decode_tps": statistics.median(repeated["decode_tps"]), "samples": repeated}
    return result


def _cache_counts(srv) -> tuple[int, int] | None:
    """(hits, misses) of the hot-expert cache so far, or None without one."""
    try:
        status, body = srv.get("/moe-cache", timeout=30)
    except OSError:
        return None
    if status != 200 or not isinstance(body, dict) or not body.get("enabled"):
        return None
    total = body.get("total") or {}
    return int(total.get("hits", 0)), int(total.get("misses", 0))


# --------------------------------------------------------------------------- command line


def _gib_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB per GPU, e.g. 24 or 24,24 (got {text!r})") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one budget in GiB")
    return values


def build_parser(prog: str = "moecache plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Plan the VRAM of each GPU for a model, a context and its users: the weights without the "
                    "routed experts, the KV cache, the compute buffers, the prefill-phase swap's ubatch and the "
                    "hot-expert cache's slots in what is left, from the figures the library itself allocates "
                    "(llama-server --memory-probe). Prints the plan and the moecache-server command.")
    p.add_argument("model", type=Path, help="the GGUF model")
    p.add_argument("--gpu-mem", type=_gib_list, default=None, metavar="GIB[,GIB...]",
                   help="the budget of each GPU in GiB (one for all, or one per GPU; default: what each has free now): "
                        "the memory the server may use, so on a card of 24 GiB with a display or another CUDA "
                        "process on it give what is free there, less about 0.5 GiB for the server's CUDA context")
    p.add_argument("--ctx", type=int, default=8192, help="tokens of context per user (default: 8192)")
    p.add_argument("--users", type=int, default=1, help="sessions served at once, llama-server's -np (default: 1)")
    p.add_argument("--ubatch", type=int, default=512, help="the decode ubatch, llama-server's -ub (default: 512)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="a typical prompt's length: the swap's ubatch is planned no larger than it")
    p.add_argument("--no-swap", dest="swap", action="store_false", help="plan without the prefill-phase swap")
    p.add_argument("--bandwidth", default="auto", metavar="auto|none|host=GB/s,device=GB/s,h2d=GB/s",
                   help="the bandwidths of the decode cost model (per layer, whole experts against slots; where "
                        "the misses run) and of the rate bounds: measured on this machine (auto, a few seconds: "
                        "the host's read, the link, and the CPU's kernels on the model's expert types), given "
                        "(add cpu=GB/s and cpu-stock=GB/s for the CPU's expert kernels in moecache's layout and in "
                        "llama-server's), or none (every layer cached, misses on the CPU, no rates)")
    p.add_argument("--trace", type=Path, default=None,
                   help="a routing trace of your traffic (--moe-routing-trace): the hit rate at the planned slots "
                        "is replayed from it (default: the expert profile of earlier runs, else a prior: the "
                        "square root of the slots' share)")
    p.add_argument("--measure", action="store_true",
                   help="start the planned server and time it here: a prompt of --prompt-tokens tokens of real "
                        "text (default: up to 4096) and 64 decoded tokens, twice after a warm-up; the medians are "
                        "printed beside the bounds (a minute or two on a large model)")
    p.add_argument("--measure-text", metavar="FILE",
                   help="with --measure: time prompts cut from this text (yours: the experts it routes decide the "
                        "hit rate) instead of the bundled texts")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="another llama-server argument the plan must hold (repeat; e.g. --server-arg=-fa "
                        "--server-arg=on): probed together with the plan's")
    return p


def main(argv: list[str] | None = None, prog: str = "moecache plan") -> int:
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    text = None
    if a.measure_text:
        if not a.measure:
            parser.error("--measure-text is the text of --measure: give --measure too")
        try:
            text = Path(a.measure_text).read_text(errors="replace")
        except OSError as e:
            parser.error(f"--measure-text: cannot read {a.measure_text}: {e.strerror}")
        if not text.strip():
            parser.error(f"--measure-text: {a.measure_text} has no text to time prompts from")
    req = Request(a.model, ctx=a.ctx, users=a.users, ubatch=a.ubatch, gpu_mem_gib=a.gpu_mem,
                  prompt_tokens=a.prompt_tokens, swap=a.swap, extra_args=a.server_arg, trace=a.trace)
    try:
        plan = make_plan(req)
        if a.bandwidth == "auto":
            if not plan.all_in_vram:
                device = "CPU" if plan.host_test_device else plan.devices[0].name
                print(f"{prog}: measuring bandwidths ({device or 'host only'}) ...", file=sys.stderr, flush=True)
                req.bandwidth = measure_bandwidth_apart(device)  # its CUDA context must not stay beside --measure's server
                if not plan.host_test_device:
                    print(f"{prog}: timing the CPU's expert kernels ...", file=sys.stderr, flush=True)
                    add_cpu_experts(req.bandwidth, req.model, plan.notes)
        elif a.bandwidth != "none":
            req.bandwidth = parse_bandwidth(a.bandwidth)
        plan = place_layers(plan)  # per layer, whole experts against slots, where bandwidths weigh them
        plan.rates()  # a trace that cannot be read fails here, not in the middle of the table
        if a.measure:
            print(f"{prog}: starting the planned server to measure it ...", file=sys.stderr, flush=True)
            plan.measured = measure_rates(plan, a.prompt_tokens, text=text)
    except (PlanError, FileNotFoundError, ValueError, TraceError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(plan.to_json(), indent=1) if a.json else plan.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())


#
# the Python API's planned model and context
#


def _api_settings(args: Sequence[str]) -> tuple[dict, dict]:
    """A plan's llama-server arguments as moecache.Model(...) and Model.context(...) keyword arguments."""
    model_kw: dict = {}
    ctx_kw: dict = {}
    valued = {"-ngl": ("model", "n_gpu_layers"), "-c": ("ctx", "n_ctx"), "-ub": ("ctx", "n_ubatch"),
              "-b": ("ctx", "n_batch"), "--moe-cache-slots": ("ctx", "moe_cache_slots"),
              "--prefill-ubatch": ("ctx", "prefill_ubatch"), "-np": (None, None), "-lm": (None, None),
              "--prefill-restore-wait": ("ctx", "prefill_restore_wait_ms"),
              "--moe-cache-miss": ("ctx", "moe_cache_miss"), "--moe-cache-miss-auto-pct": ("ctx", "moe_cache_miss_auto_pct"),
              "--moe-cache-miss-split-pct": ("ctx", "moe_cache_miss_split_pct"),
              "--n-cpu-moe": ("model", "n_cpu_moe")}
    # (the profile is the server's: a context of the Python API keeps none unless asked, moe_cache_profile=)
    switches = {"--cpu-moe": ("model", "cpu_moe", True), "--no-repack": ("model", "repack", False),
                "--host-hugepages": ("model", "hugepages", True),
                "--moe-cache-warm-prompts": ("ctx", "moe_cache_warm_prompts", True),
                "--cpu-experts-flat": ("ctx", "cpu_experts_flat", True),
                "--cpu-experts-x4": ("ctx", "cpu_experts_x4", True),
                "--cpu-experts-overlap": ("ctx", "cpu_experts_overlap", True)}
    i = 0
    while i < len(args):
        a = args[i]
        if a in valued:
            where, name = valued[a]
            value = args[i + 1]
            if a == "-lm":
                if value == "none":  # read into the GPU's pinned host memory
                    model_kw["pinned"] = True
            elif a == "--moe-cache-miss":
                ctx_kw[name] = value
            elif where is not None:
                n = int(value)
                if a == "-ngl" and n >= 99:
                    n = -1
                (model_kw if where == "model" else ctx_kw)[name] = n
            i += 2
        elif a in switches:
            where, name, value = switches[a]
            (model_kw if where == "model" else ctx_kw)[name] = value
            i += 1
        else:
            raise PlanError(f"the plan's flag {a} has no Python setting (a moecache bug: please report it)")
    return model_kw, ctx_kw


def load(path, n_ctx: int = 8192, n_ubatch: int = 512, gpu_mem_gib: float | Sequence[float] | None = None,
         plan: str = "auto", verbose: bool = False, **context_options):
    """A model and a context of `n_ctx` tokens for one sequence, placed as `moecache-server` places them by
    default: a MoE that does not fit the GPUs gets the plan (`moecache plan`: the routed experts in host memory,
    or, where the decode cost model says so, those of the last layers whole in VRAM (n_cpu_moe), the hot-expert
    cache's slots in the VRAM left, the prefill-phase swap's ubatch, the CPU's fast expert switches); a model that fits gets every layer on the GPU; without a GPU, the model loads on the CPU with a
    warning. `gpu_mem_gib`: each GPU's budget (default: what each has free). `context_options` are
    Model.context's options (moe_cache_*, prefill_*, ...) and win over the plan's. plan="off": no plan
    (Model's defaults). Returns (model, context); `context.plan` is the Plan, or None where none was made.
    PlanError when a GPU is there but the context does not fit it (the message says what to change)."""
    import warnings

    from .api import Model

    if plan not in ("auto", "off"):
        raise ValueError(f"plan must be 'auto' or 'off' (got {plan!r})")
    budgets = None
    if gpu_mem_gib is not None:
        budgets = [float(gpu_mem_gib)] if isinstance(gpu_mem_gib, (int, float)) else [float(g) for g in gpu_mem_gib]
    made = None
    model_kw: dict = {}
    ctx_kw: dict = {"n_ctx": n_ctx, "n_ubatch": n_ubatch}
    if plan == "auto":
        try:
            made = make_plan(Request(Path(os.fspath(path)), ctx=n_ctx, users=1, ubatch=n_ubatch, gpu_mem_gib=budgets))
        except PlanError as e:
            if not str(e).startswith("no GPU device"):
                raise
            warnings.warn("moecache.load: no GPU, so nothing to plan: the model loads on the CPU", RuntimeWarning,
                          stacklevel=2)
        if made is not None:
            add_bandwidth(made, os.environ.get("LLAMA_ARG_PLAN_BANDWIDTH"))
            made = place_layers(made)
            model_kw, planned_ctx = _api_settings(made.args())
            ctx_kw.update(planned_ctx)
    ctx_kw.update(context_options)
    model = Model(path, verbose=verbose, **model_kw)
    context = model.context(**ctx_kw)
    context.plan = made
    return model, context
