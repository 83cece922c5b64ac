"""Shared by the hot-expert cache's server tests (tests/e2e on the CPU, tests/gpu on CUDA)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
import re
import time
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The committee met on Tuesday to discuss the budget for the coming year, and",
]
N_EXPERT, N_USED, N_LAYER = 16, 4, 4  # the tiny preset


def real_text(per_file: int, total: int) -> str:
    """Up to `per_file` characters of each benchmark prompt file, `total` in all: real text read from the
    checkout (synth.default_texts falls back to two stdlib modules where the package is installed
    outside it, as on the GPU machine, which is too short for a depth)."""
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"
    files = sorted(f for f in root.rglob("*") if f.suffix in (".txt", ".py") and f.is_file())
    return "\n\n".join(f.read_text(encoding="utf-8")[:per_file] for f in files)[:total]


def complete(srv, prompt, n_predict=32, **extra):
    """Greedy /completion with the tokens and the top-4 log-probabilities of every step (`extra`:
    more fields of the request, e.g. cache_prompt=True)."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, "n_probs": 4, **extra}
    status, out = srv.post("/completion", body, timeout=300)
    assert status == 200, out
    return out


def wait_generating(srv, ended, id_slot=None, n_decoded=1, timeout=60.0) -> bool:
    """Until slot id_slot (or any slot) has decoded n_decoded tokens of its request: True. False when
    ended() says the request is over before a poll saw it generating: a client starved on a loaded 2-core
    machine can miss the whole of a short request, and the caller sends it again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, slots = srv.get("/slots")
        assert status == 200, slots
        for s in slots:
            if id_slot is not None and s["id"] != id_slot:
                continue
            if s.get("is_processing") and s.get("next_token", [{}])[0].get("n_decoded", 0) >= n_decoded:
                return True
        if ended():
            return False
        time.sleep(0.01)
    raise AssertionError(f"no slot decoded {n_decoded} tokens in {timeout} s")


def slot_server_args(n_slots, *args, rpc_ports=()):
    """llama-server arguments for n_slots sessions, each with a KV cache of its own (-no-kvu), over the
    rpc-servers at rpc_ports if any."""
    rpc = ["--rpc", ",".join(f"127.0.0.1:{p}" for p in rpc_ports)] if rpc_ports else []
    return ["-t", "2", "-c", str(512 * n_slots), "-np", str(n_slots), "-no-kvu", "-ngl", "99", "-ub", "32",
            "--cache-ram", "0", "--metrics", *rpc, *args]


def session_prompts(n):
    """n prompts of different lengths, one per slot."""
    return [PROMPTS[i % len(PROMPTS)] * (i + 2) for i in range(n)]


def solo_and_together(srv, n_predict):
    """Request i (session_prompts' i-th prompt, n_predict[i] tokens) on slot i: first each alone, then all
    at once."""
    reqs = list(zip(session_prompts(len(n_predict)), n_predict, range(len(n_predict))))
    solo = [complete(srv, p, n_predict=n, id_slot=s) for p, n, s in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: complete(srv, r[0], n_predict=r[1], id_slot=r[2]), reqs))
    return solo, together


def assert_same_tokens(solo, together, bound=2e-2):
    """The same tokens, log-probabilities within the bound of a batch's other shapes."""
    for a, b in zip(solo, together):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a, b) < bound


def metric_values(srv, prefix):
    """{name: value} of the llamacpp:<prefix>... series in /metrics (empty where none is reported)."""
    status, text = srv.get("/metrics")
    assert status == 200, text
    out = {}
    for line in str(text).splitlines():
        if line.startswith("llamacpp:" + prefix):
            name, value = line.split()
            out[name.split(":", 1)[1]] = int(float(value))
    return out


def complete_requests(srv, requests, n_parallel=1, concurrent=False):
    """Greedy completions of (prompt, n_predict) pairs with the prompt cache on: one after the other
    (with several slots, on the slots in turn), or n_parallel at a time."""
    if not concurrent:
        return [complete(srv, p, n_predict=n, cache_prompt=True, id_slot=i % n_parallel)
                for i, (p, n) in enumerate(requests)]
    with ThreadPoolExecutor(n_parallel) as pool:
        return list(pool.map(lambda r: complete(srv, r[0], n_predict=r[1], cache_prompt=True), requests))


def server_help(llama_server_bin) -> str:
    """llama-server's --help text."""
    import subprocess

    return subprocess.run([str(llama_server_bin), "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60).stdout


def assert_refused(llama_server_bin, model, args, message):
    """llama-server exits with an error that says `message` for these arguments."""
    import subprocess

    r = subprocess.run([str(llama_server_bin), "-m", str(model), *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stdout, r.stdout[-2000:]


def assert_options_in_help(help_text: str, table) -> None:
    """Every flag and LLAMA_ARG_ variable of an option table (api.*_OPTIONS), and the --no- form of its
    boolean flags, are in the help."""
    for option in table.values():
        assert option.flag in help_text and option.env in help_text, option.flag
        if option.boolean:
            assert "--no-" + option.flag[2:] in help_text, option.flag


def host_context_mib(log: str) -> float:
    """KV + compute buffers on the CPU before the banks were added, from llama.cpp's load log at -lv 4 (what
    the context holds on the host test device)."""
    kv = sum(float(m) for m in re.findall(r"CPU KV buffer size =\s+([0-9.]+) MiB", log))
    compute = re.findall(r"CPU compute buffer size =\s+([0-9.]+) MiB", log)
    assert compute, log[-3000:]
    return kv + float(compute[0])  # the first reservation, made before the banks


def token_steps(out):
    """A completion's top log-probabilities per generated token, aligned with its tokens: llama-server gives
    none for a token that leaves a character's UTF-8 bytes incomplete (None there)."""
    steps, entries = [], iter(out["completion_probabilities"])
    entry = next(entries, None)
    for t in out["tokens"]:
        if entry is not None and entry["id"] == t:
            steps.append([(p["id"], p["logprob"]) for p in entry["top_logprobs"]])
            entry = next(entries, None)
        else:
            steps.append(None)
    assert entry is None, "log-probabilities left over: they do not follow the tokens"
    return steps


def logprobs(out):
    return [[(p["id"], p["logprob"]) for p in t["top_logprobs"]] for t in out["completion_probabilities"]]


def assert_same_outputs(ref, outs):
    """Each completion's tokens and top log-probabilities equal the reference's bit for bit."""
    assert len(ref) == len(outs)
    for a, b in zip(ref, outs):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)  # exact


def max_logprob_diff(a, b):
    """Largest difference of the chosen token's log-probability; the chosen tokens must agree."""
    d = 0.0
    for pa, pb in zip(logprobs(a), logprobs(b)):
        assert pa[0][0] == pb[0][0]
        d = max(d, abs(pa[0][1] - pb[0][1]))
    return d


def assert_close_tokens(ref_tokens, ref_steps, tokens, steps=None, bound=5e-2, near_tie=0.1):
    """Another device's rounding against a reference: the same tokens up to a step where the reference's two
    most likely tokens were within `near_tie` (log-probability) of each other, which rounding may break the other
    way (the comparison ends there, the other token being one of those); before it, the chosen
    token's log-probability within `bound` where `steps` are given. Steps: per token, [(id, logprob), ...] best
    first (token_steps() of a completion, Generation.top_logprobs), None where a step has none. Returns the
    steps compared."""
    assert len(ref_steps) == len(ref_tokens), (len(ref_steps), len(ref_tokens))
    for i, (a, b) in enumerate(zip(ref_tokens, tokens)):
        ra = ref_steps[i]
        if a != b and ra is None:
            raise AssertionError(f"step {i}: token {b} instead of {a}, at a step without log-probabilities")
        if a != b:
            tied = [t for t, lp in ra[1:] if ra[0][1] - lp < near_tie]
            assert b in tied, (f"step {i}: token {b} instead of {a}, which the reference did not have within "
                               f"{near_tie} of its best ({ra}): more than rounding")
            return i
        if steps is not None and ra is not None and steps[i] is not None:
            assert abs(ra[0][1] - steps[i][0][1]) < bound, f"step {i}: log-probability {steps[i][0]} against {ra[0]}"
    assert len(tokens) == len(ref_tokens), f"{len(tokens)} tokens against the reference's {len(ref_tokens)}"
    return len(ref_tokens)


def cache_stats(srv):
    status, body = srv.get("/moe-cache")
    assert status == 200, body
    return body if isinstance(body, dict) else json.loads(body)


_OP_HEAD = re.compile(r"ggml_sched_op_times: backend=(\S+) graphs=(\d+) first=(\S*)\[(-?\d+),(-?\d+)\] entries=\d+ "
                      r"ms_per_graph=([\d.]+)")
_OP_ROW = re.compile(r"ggml_sched_op_times: backend=(\S+) op=(.+) ms_per_graph=([\d.]+) n_per_graph=([\d.]+)")


def op_time_reports(log: str) -> list[dict]:
    """GGML_SCHED_OP_TIMES's reports in a log, in order: one dict per backend and window with
    backend, graphs, first (the first node's name), tokens (its ne1: a ubatch's tokens), ms per graph and
    rows {"OP name [ne0,ne1,ne2,ne3]": (ms per graph, count per graph)}."""
    reports = []
    for line in log.splitlines():
        if m := _OP_HEAD.search(line):
            reports.append({"backend": m[1], "graphs": int(m[2]), "first": m[3], "tokens": int(m[5]),
                            "ms": float(m[6]), "rows": {}})
        elif (m := _OP_ROW.search(line)) and reports and reports[-1]["backend"] == m[1]:
            reports[-1]["rows"][m[2]] = (float(m[3]), float(m[4]))
    return reports


def op_shape(entry: str) -> list[int]:
    """The shape at the end of an op-times entry ("GET_ROWS node [32,520,1,1]")."""
    return [int(x) for x in entry.rsplit("[", 1)[1].rstrip("]").split(",")]


# QSA's mask at the selected cells: the flag sets its tests run with (CPU and CUDA), each
# with LLAMA_QSA_MASK_SELECTED=0 as the reference
QSA_MASK_SELECTED_CASES = {
    "device-block": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk"],
    "device-cell": ["--qsa-sparse", "--kq-mask-device"],
    "host": ["--qsa-sparse"],
    "device-block-q8_0": ["--qsa-sparse", "--kq-mask-device", "--qsa-block-topk", "-ctk", "q8_0", "-ctv", "q8_0"],
}


def full_kq_mask_ops(log: str, backend: str, n_tokens: int) -> list[str]:
    """The ops over a whole [n_kv, n_tokens] KQ mask (n_kv: a multiple of 256) in the n_tokens-token ubatches
    that take QSA's block level, by GGML_SCHED_OP_TIMES: the device mask's log and its f16 cast."""
    return [e for r in op_time_reports(log) if r["backend"] == backend and r["tokens"] == n_tokens
            and any("qsa_topk_blocks" in e for e in r["rows"]) for e in r["rows"]
            if (e.startswith("LOG ") or e.startswith("CPY attn_inp_kq_mask")) and op_shape(e)[0] % 256 == 0
            and op_shape(e)[1] == n_tokens]


def anon_huge_kb(pid: int) -> int:
    """kB of transparent huge pages a process holds (AnonHugePages of /proc/PID/smaps_rollup)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1:text.index("]")]


def last_graph_splits(log: str) -> list[tuple[str, list[str]]]:
    """The splits of the last graph the scheduler dumped: (backend, input names), in order."""
    lines = [l for l in log.splitlines() if "## SPLIT #" in l]
    graphs, cur = [], []
    for l in lines:
        m = re.search(r"## SPLIT #(\d+): (\S+) # \d+ inputs", l)
        if not m:
            continue
        if m.group(1) == "0" and cur:
            graphs.append(cur)
            cur = []
        # the dump's items are logged one by one: each has its own log prefix (time, level) in the line
        items = re.sub(r"\d+\.\d+\.\d+\.\d+ [A-Z] ", "", l[m.end():])
        cur.append((m.group(2), re.findall(r"\[(.+?) \(\s*\d+[KMG]?\)\]", items)))
    if cur:
        graphs.append(cur)
    return graphs[-1] if graphs else []
