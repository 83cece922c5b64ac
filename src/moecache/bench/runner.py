"""Run a scenario: every arm against its own llama-server on loopback, one after the other."""

from __future__ import annotations

import datetime as _dt
import http.client
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TextIO

from ..server import ServerError, ServerProcess, _server_binary, check_model_file, ensure_synth_model
from .report import display_path, git_commit, hardware, llama_cpp_commit, write_results
from .scenario import Arm, ModelSpec, PromptSet, Scenario, ScenarioError
from .stats import add_ratios, summarize


class BenchError(RuntimeError):
    """A request that failed while measuring."""


# --------------------------------------------------------------------------- model


def synth_cache_path(spec: ModelSpec) -> Path:
    from ..orchestrator.upstream import cache_dir

    return cache_dir() / "models" / f"{spec.synth}-{spec.quant or 'default'}-seed{spec.seed}.gguf"


def resolve_model(spec: ModelSpec, scenario_path: Path, make: bool = True, out: TextIO | None = None
                  ) -> tuple[Path, dict]:
    """The GGUF file of a scenario's model (made and cached for a synth spec) and facts about it."""
    if spec.synth:
        path = synth_cache_path(spec)
        if make:
            ensure_synth_model(path, spec.synth, seed=spec.seed, quant=spec.quant, out=out)
        info = {"synth": spec.synth, "quant": spec.quant, "seed": spec.seed}
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
        "description": spec.describe(),
    })
    return path, info


# --------------------------------------------------------------------------- prompts


class PromptTokens:
    """Real-text prompts cut to exact token counts with the server's own tokenizer (cached)."""

    def __init__(self):
        self._tokens: dict[str, list[int]] = {}

    @staticmethod
    def text(ps: PromptSet) -> str:
        return "\n\n".join(f.read_text(errors="replace") for f in ps.files)

    def get(self, srv: ServerProcess, ps: PromptSet, length: int) -> list[int]:
        have = self._tokens.get(ps.name, [])
        if len(have) < length:
            text = self.text(ps)
            budget = length * 8
            while True:
                status, body = srv.post("/tokenize", {"content": text[:budget], "add_special": False})
                if status != 200 or not isinstance(body, dict) or "tokens" not in body:
                    raise BenchError(f"/tokenize failed (HTTP {status}): {body}")
                have = [t if isinstance(t, int) else t["id"] for t in body["tokens"]]
                if len(have) >= length or budget >= len(text):
                    break
                budget *= 2
            self._tokens[ps.name] = have
        if len(have) < length:
            raise ScenarioError(
                f"prompt set '{ps.name}' has only {len(have)} tokens of text "
                f"({', '.join(f.name for f in ps.files)}), fewer than the {length} asked for. "
                f"Fix: add files to the set or ask for a shorter prompt.")
        return have[:length]


# --------------------------------------------------------------------------- measuring


def _request_body(tokens: list[int], n_predict: int, ignore_eos: bool, stream: bool) -> dict:
    return {
        "prompt": tokens,
        "n_predict": n_predict,
        "temperature": 0.0,
        "cache_prompt": False,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "return_tokens": True,
    }


def measure_completion(srv: ServerProcess, tokens: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    """One non-streaming /completion: the server's timings of prefill and decode."""
    status, body = srv.post("/completion", _request_body(tokens, max_tokens, ignore_eos, stream=False))
    if status != 200 or not isinstance(body, dict) or "timings" not in body:
        raise BenchError(f"/completion failed (HTTP {status}): {str(body)[:500]}")
    t = body["timings"]
    return {
        "prompt_n": t.get("prompt_n"),
        "cache_n": t.get("cache_n"),
        "prompt_ms": t.get("prompt_ms"),
        "prefill_tps": t.get("prompt_per_second"),
        "predicted_n": t.get("predicted_n"),
        "predicted_ms": t.get("predicted_ms"),
        # one decoded token is not a rate
        "decode_tps": t.get("predicted_per_second") if (t.get("predicted_n") or 0) > 1 else None,
    }


def measure_ttft(srv: ServerProcess, tokens: list[int], ignore_eos: bool, timeout: float = 600.0) -> float:
    """Milliseconds from sending a streaming /completion to the first chunk that carries a token."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        body = json.dumps(_request_body(tokens, 1, ignore_eos, stream=True)).encode()
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


def server_n_ctx(srv: ServerProcess) -> int | None:
    try:
        status, props = srv.get("/props", timeout=30)
        if status == 200 and isinstance(props, dict):
            n = (props.get("default_generation_settings") or {}).get("n_ctx")
            if isinstance(n, int):
                return n
    except (OSError, http.client.HTTPException):
        pass
    return None


# the hot-expert cache's totals that a run records per arm (from the server's GET /moe-cache)
MOE_CACHE_FIELDS = ("hit_rate", "hit_rate_recent", "uploads", "bytes_uploaded", "evictions", "step_ms_max",
                    "n_slots", "bytes_vram")


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
        out[name] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out


def fetch_moe_cache(srv: ServerProcess) -> dict | None:
    """The server's expert cache totals (moe_cache_summary of GET /moe-cache), or None when it has no
    cache, no such endpoint, or does not answer."""
    try:
        status, body = srv.get("/moe-cache", timeout=30)
    except (OSError, http.client.HTTPException):
        return None
    return moe_cache_summary(body) if status == 200 else None


# --------------------------------------------------------------------------- the run


def _fmt(v, unit="") -> str:
    return "-" if v is None else f"{v:.1f}{unit}"


def shown_command(srv: ServerProcess) -> list[str]:
    """The command of an arm's server as results record it (tool name, paths without the machine's prefix)."""
    return ["llama-server", "-m", display_path(srv.model), "--host", srv.host, "--port", str(srv.port),
            *srv.args]


def arm_server_args(sc: Scenario, arm: Arm) -> list[str]:
    return [*sc.server_args, *arm.args]


def arm_env(sc: Scenario, arm: Arm) -> dict[str, str]:
    return {**sc.env, **arm.env}


def run_scenario(sc: Scenario, out_dir: Path | None, dry_run: bool = False, out: TextIO | None = None
                 ) -> tuple[dict, tuple[Path, Path] | None]:
    """Measure every arm of `sc`; write the md + json results to `out_dir` (unless dry_run)."""
    out = out or sys.stderr

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    started = _dt.datetime.now()
    model_path, model_info = resolve_model(sc.model, sc.path, make=not dry_run, out=out)
    cases = [(ps, n) for ps in sc.prompts for n in ps.lengths]
    run: dict = {
        "scenario": {
            "name": sc.name, "description": sc.description, "file": display_path(sc.path),
            "max_tokens": sc.max_tokens, "repetitions": sc.repetitions, "warmup": sc.warmup,
            "ignore_eos": sc.ignore_eos, "ttft": sc.ttft, "server_args": sc.server_args, "env": sc.env,
            "prompts": [{"name": p.name, "files": [f.name for f in p.files], "lengths": p.lengths}
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
                             timeout=sc.start_timeout) for a in sc.arms]
    for arm in sc.arms:
        run["arms"].append({"name": arm.name, "baseline": arm.baseline, "description": arm.description,
                            "args": arm.args, "server_args": arm_server_args(sc, arm),
                            "env": arm_env(sc, arm), "command": [], "error": None})

    made = "" if model_path.is_file() else ", made and cached on the first real run"
    say(f"moecache bench: scenario '{sc.name}' ({sc.path}), model {model_info['description']} "
        f"({model_path}{made}), {len(sc.arms)} arms x {len(cases)} prompts x {sc.repetitions} repetitions")
    if dry_run:
        try:
            exe = str(_server_binary())
        except FileNotFoundError:
            exe = "llama-server (not built yet)"
        for a in run["arms"]:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in a["env"].items())
            cmd = " ".join(shlex.quote(x) for x in [exe, "-m", str(model_path), "--host", "127.0.0.1",
                                                     "--port", "FREE_PORT", *a["server_args"]])
            say(f"  arm {a['name']}{' (baseline)' if a['baseline'] else ''}: {env + ' ' if env else ''}{cmd}")
        for ps, n in cases:
            say(f"  prompt '{ps.name}' {n} tokens from {', '.join(f.name for f in ps.files)}")
        say("dry run: nothing started.")
        return run, None

    prompts = PromptTokens()
    any_failed = False
    for ai, (arm, srv, rec) in enumerate(zip(sc.arms, servers, run["arms"])):
        say(f"[{ai + 1}/{len(sc.arms)}] arm '{arm.name}'{' (baseline)' if arm.baseline else ''}: starting "
            f"llama-server {' '.join(shlex.quote(x) for x in rec['server_args'])}")
        t0 = time.monotonic()
        try:
            srv.start()
        except (ServerError, FileNotFoundError) as e:
            any_failed = True
            rec["error"] = str(e).splitlines()[0]
            rec["command"] = shown_command(srv)
            say(f"  FAILED to start: {e}")
            for ps, n in cases:
                run["results"].append({"arm": arm.name, "prompt": ps.name, "length": n, "error": rec["error"]})
            srv.cleanup()
            continue
        rec["command"] = shown_command(srv)
        rec["start_s"] = round(time.monotonic() - t0, 2)
        say(f"  ready in {rec['start_s']:.1f} s at {srv.url}")
        try:
            n_ctx = server_n_ctx(srv)
            rec["n_ctx"] = n_ctx
            if n_ctx is not None and n_ctx < sc.max_context():
                raise ScenarioError(
                    f"arm '{arm.name}': the server's context is {n_ctx} tokens, but the longest prompt plus "
                    f"max_tokens needs {sc.max_context()}. Fix: add \"-c\", \"{sc.max_context()}\" to server_args.")
            for ps, n in cases:
                row = {"arm": arm.name, "prompt": ps.name, "length": n, "samples": []}
                run["results"].append(row)
                try:
                    tokens = prompts.get(srv, ps, n)
                    for _ in range(sc.warmup):
                        measure_completion(srv, tokens, min(sc.max_tokens, 16), sc.ignore_eos)
                    for rep in range(sc.repetitions):
                        s = measure_completion(srv, tokens, sc.max_tokens, sc.ignore_eos)
                        if sc.ttft:
                            s["ttft_ms"] = measure_ttft(srv, tokens, sc.ignore_eos)
                        row["samples"].append(s)
                        warn = ""
                        if s["prompt_n"] is not None and s["prompt_n"] < n:
                            warn = f"  (note: the server processed only {s['prompt_n']} prompt tokens)"
                        say(f"  {ps.name} {n} tok, rep {rep + 1}/{sc.repetitions}: prefill "
                            f"{_fmt(s['prefill_tps'])} t/s, TTFT {_fmt(s.get('ttft_ms'), ' ms')}, decode "
                            f"{_fmt(s['decode_tps'])} t/s ({s['predicted_n']} tokens){warn}")
                except (BenchError, OSError, http.client.HTTPException) as e:
                    any_failed = True
                    row["error"] = str(e)
                    say(f"  FAILED: {e}")
                    if srv.proc is not None and srv.proc.poll() is not None:
                        say(f"  the server exited (status {srv.proc.returncode}); last log lines:\n{srv._tail(20)}")
                        rec["error"] = f"server exited with status {srv.proc.returncode} during {ps.name} {n}"
                        break
                    continue
                row["prompt_n"] = row["samples"][0]["prompt_n"] if row["samples"] else None
                row["predicted_n"] = row["samples"][0]["predicted_n"] if row["samples"] else None
                for m in ("prefill_tps", "ttft_ms", "decode_tps"):
                    row[m] = summarize(s.get(m) for s in row["samples"])
            # the expert cache's counters over all of the arm's requests (warm-ups included)
            cache = fetch_moe_cache(srv) if srv.proc is not None and srv.proc.poll() is None else None
            if cache:
                rec["moe_cache"] = cache
                hr, mib = cache.get("hit_rate"), cache.get("bytes_vram")
                say(f"  expert cache: hit rate {'-' if hr is None else f'{hr:.3f}'}, "
                    f"{cache.get('uploads')} uploads, {cache.get('evictions')} evictions, "
                    f"{'-' if mib is None else f'{mib / 2**20:.1f}'} MiB of slots")
        finally:
            rc = srv.stop()
            rec["exit_status"] = rc
            if rec.get("error"):
                say(f"  server log kept at {srv.log_path}")
            else:
                srv.cleanup()
        # arms that broke off still list every prompt case, so tables stay complete
        have = {(r["prompt"], r["length"]) for r in run["results"] if r["arm"] == arm.name}
        for ps, n in cases:
            if (ps.name, n) not in have:
                run["results"].append({"arm": arm.name, "prompt": ps.name, "length": n,
                                       "error": rec.get("error") or "not measured"})

    add_ratios(run["results"], sc.baseline.name)
    run["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    run["ok"] = not any_failed
    paths = write_results(run, out_dir) if out_dir is not None else None
    if paths:
        say(f"results: {paths[0]}\n         {paths[1]}")
    return run, paths
