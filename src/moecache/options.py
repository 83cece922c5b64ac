"""Every option of moecache's features, mapped in one place: the llama-server flag, its environment
variable (llama.cpp's LLAMA_ARG_<FLAG> scheme, older names as aliases), the Python parameter, the
default and the range; and the reading of a llama-server command line (which flags and variables the
user set), which the launcher, `moecache plan` and `moecache tune` share.

Pure Python: the unit tests and the build import it without numpy or the native module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#
# the features' options: one table per feature, Python argument -> its option
#


def _check_int(name: str, value, minimum: int | None = None, maximum: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np  # numpy integers are fine

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise ValueError(f"{name} must be an integer{what} (got {value!r})") from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer{what} (got {value})")
    return value


MOE_CACHE_POLICIES = ("freq", "lru")
MOE_CACHE_MISS_VALUES = ("cpu", "gpu", "auto", "split")
PREFILL_SWAP_MODES = ("transaction", "bypass")

_INT32_MAX = 2**31 - 1

_TRUE_WORDS = ("on", "enabled", "true", "1")    # as llama.cpp's is_truthy / is_falsey
_FALSE_WORDS = ("off", "disabled", "false", "0")


@dataclass(frozen=True)
class FeatureOption:
    """One option as llama-server and the Python API both take it: the flag, its environment
    variable (llama.cpp's LLAMA_ARG_<FLAG> scheme), the older names that still set it (read only
    when `env` is unset: the new name wins), the default, the integer range (or the words it takes,
    or a boolean) and what it is."""

    flag: str
    env: str
    aliases: tuple[str, ...]
    default: object
    minimum: float | None
    maximum: float | None
    what: str
    choices: tuple[str, ...] = ()  # a word option: one of these, spelled exactly so
    boolean: bool = False
    # where the Python API takes it, by the table's key: "context" (Model.context(...)), "model"
    # (moecache.Model(...)), or None: llama-server only (slots, speculation and probes are the server's)
    python: str | None = "context"
    kind: str = "int"  # of a value that is neither a word nor a boolean: "int", "float" or "path"

    @property
    def env_names(self) -> tuple[str, ...]:
        """The variables that set it, the one that wins first."""
        return (self.env, *self.aliases)

    def from_environment(self, environ) -> tuple[str, str] | None:
        """(variable, value) of the first of env_names set to a non-blank value, or None."""
        for var in self.env_names:
            value = environ.get(var)
            if value is not None and value.strip() != "":
                return var, value
        return None

    def describe_variable(self, var: str) -> str:
        return f"environment variable {var}" + (f" (the old name of {self.env})" if var != self.env else "")

# Python argument -> its option: the one place that maps the cache's flags, variables and arguments
MOE_CACHE_OPTIONS: dict[str, FeatureOption] = {
    "moe_cache_slots": FeatureOption(
        "--moe-cache-slots", "LLAMA_ARG_MOE_CACHE_SLOTS", ("LLAMA_ARG_MOE_HOT_K",), 0, 0, _INT32_MAX,
        "slots per cached layer (0 = off unless moe_cache_size_mib is set)"),
    "moe_cache_size_mib": FeatureOption(
        "--moe-cache-size", "LLAMA_ARG_MOE_CACHE_SIZE", (), 0, 0, _INT32_MAX,
        "VRAM budget in MiB for all cached layers, used when moe_cache_slots is 0"),
    "moe_cache_policy": FeatureOption(
        "--moe-cache-policy", "LLAMA_ARG_MOE_CACHE_POLICY", (), "freq", None, None,
        "which experts hold the slots: 'freq' (the most routed, rebalanced every interval) or 'lru' (admitted "
        "after repeated misses)", choices=MOE_CACHE_POLICIES),
    "moe_cache_rebalance_interval": FeatureOption(
        "--moe-cache-rebalance-interval", "LLAMA_ARG_MOE_CACHE_REBALANCE_INTERVAL",
        ("LLAMA_ARG_MOE_HOT_REBALANCE_INTERVAL",), 40, 1, _INT32_MAX, "freq policy: tokens between rebalances"),
    "moe_cache_max_batch": FeatureOption(
        "--moe-cache-max-batch", "LLAMA_ARG_MOE_CACHE_MAX_BATCH", ("LLAMA_MOE_HOT_PP_BYPASS_N_TOKENS",), 8, 1, 64,
        "batches of up to this many tokens use the cache"),
    "moe_cache_admit_misses": FeatureOption(
        "--moe-cache-admit-misses", "LLAMA_ARG_MOE_CACHE_ADMIT_MISSES", (), 2, 1, _INT32_MAX,
        "lru policy: misses within the window before an expert is uploaded"),
    "moe_cache_admit_window": FeatureOption(
        "--moe-cache-admit-window", "LLAMA_ARG_MOE_CACHE_ADMIT_WINDOW", (), 16, 1, _INT32_MAX,
        "lru policy: the admission window in tokens"),
    "moe_cache_max_uploads": FeatureOption(
        "--moe-cache-max-uploads", "LLAMA_ARG_MOE_CACHE_MAX_UPLOADS", (), 2, 1, _INT32_MAX,
        "uploads per layer and step"),
    "moe_cache_headroom_mib": FeatureOption(
        "--moe-cache-headroom", "LLAMA_ARG_MOE_CACHE_HEADROOM", (), 512, 0, _INT32_MAX,
        "device memory in MiB left free after the slot banks, which take what the context leaves"),
    "moe_cache_miss": FeatureOption(
        "--moe-cache-miss", "LLAMA_ARG_MOE_CACHE_MISS", (), "cpu", None, None,
        "where misses run: 'cpu', 'gpu' (the GPU reads the host experts in place), 'auto' (per layer) or 'split' "
        "(per expert, the GPU and the CPU at once)",
        choices=MOE_CACHE_MISS_VALUES),
    "moe_cache_miss_auto_pct": FeatureOption(
        "--moe-cache-miss-auto-pct", "LLAMA_ARG_MOE_CACHE_MISS_AUTO_PCT", (), 25, 0, 100,
        "miss 'auto': a layer's misses run on the GPU while they are at most this % of its routed experts"),
    "moe_cache_miss_split_pct": FeatureOption(
        "--moe-cache-miss-split-pct", "LLAMA_ARG_MOE_CACHE_MISS_SPLIT_PCT", (), 50, 0, 100,
        "miss 'split': the share (%) of a layer's misses the GPU computes, those of its most-routed missed experts"),
    "moe_cache_warm_prompts": FeatureOption(
        "--moe-cache-warm-prompts", "LLAMA_ARG_MOE_CACHE_WARM_PROMPTS", (), False, None, None,
        "fill empty slots with the experts a prompt routed most, so the first tokens decode warm", boolean=True),
    "moe_cache_profile": FeatureOption(
        "--moe-cache-profile", "LLAMA_ARG_MOE_CACHE_PROFILE", (), "", None, None,
        "expert profile kept across restarts: read at start (its hottest experts fill the slots), written at "
        "shutdown with this run's routing added; a damaged or foreign file is ignored with a warning", kind="path"),
    "moe_cache_slots_by_layer": FeatureOption(
        "--moe-cache-slots-by-layer", "LLAMA_ARG_MOE_CACHE_SLOTS_BY_LAYER", (), False, None, None,
        "with a profile: each layer's slot count from the profile's routing (layers whose routing spreads over more "
        "experts get more, at least half the even share each), in the same memory", boolean=True),
}

# the prefill-phase swap's options (the public write-up's LLAMA_PHASE_PREFILL_* names are aliases)
PREFILL_SWAP_OPTIONS: dict[str, FeatureOption] = {
    "prefill_ubatch": FeatureOption(
        "--prefill-ubatch", "LLAMA_ARG_PREFILL_UBATCH", ("LLAMA_PHASE_PREFILL_UBATCH",), 0, 0, _INT32_MAX,
        "ubatch of long prompts, at most n_batch (0 = off)"),
    "prefill_min_tokens": FeatureOption(
        "--prefill-min-tokens", "LLAMA_ARG_PREFILL_MIN_TOKENS", ("LLAMA_PHASE_PREFILL_MIN_TOKENS",), 1024, 1,
        _INT32_MAX, "prompts of fewer tokens keep n_ubatch"),
    "prefill_swap_mode": FeatureOption(
        "--prefill-swap-mode", "LLAMA_ARG_PREFILL_SWAP_MODE", ("LLAMA_PHASE_PREFILL_MODE",), "transaction", None, None,
        "'transaction' or 'bypass'", choices=PREFILL_SWAP_MODES),
    "prefill_warm_restore": FeatureOption(
        "--prefill-warm-restore", "LLAMA_ARG_PREFILL_WARM_RESTORE", (), True, None, None,
        "refill the expert cache with the prompt's most-routed experts", boolean=True),
    "prefill_restore_wait_ms": FeatureOption(
        "--prefill-restore-wait", "LLAMA_ARG_PREFILL_RESTORE_WAIT", ("LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS",), 0, 0,
        600000, "ms the prompt's first token waits at most for the warm restore's copies (0 = decode at once)"),
}

# long-context attention: switches of the sparse paths
LONG_CONTEXT_OPTIONS: dict[str, FeatureOption] = {
    "qsa_sparse": FeatureOption(
        "--qsa-sparse", "LLAMA_ARG_QSA_SPARSE", (), False, None, None,
        "QSA layers (qwen4exp) attend only the cells their indexer selected (needs flash attention)", boolean=True),
    "kq_mask_device": FeatureOption(
        "--kq-mask-device", "LLAMA_ARG_KQ_MASK_DEVICE", (), False, None, None,
        "the attention mask built on the device from positions (where they alone decide it)", boolean=True),
    "qsa_block_topk": FeatureOption(
        "--qsa-block-topk", "LLAMA_ARG_QSA_BLOCK_TOPK", (), False, None, None,
        "QSA layers (qwen4exp) rank their blocks, then only the chosen blocks' cells (the same cells)", boolean=True),
}

# several devices: switches of the layer split
MULTI_GPU_OPTIONS: dict[str, FeatureOption] = {
    "pp_overrides": FeatureOption(
        "--pp-overrides", "LLAMA_ARG_PP_OVERRIDES", (), False, None, None,
        "keep pipeline parallelism with tensor overrides that put no weight on the host for a GPU op to copy",
        boolean=True),
}

# the CPU's experts at decode: how the CPU computes one token's experts, not what
CPU_EXPERT_OPTIONS: dict[str, FeatureOption] = {
    "cpu_experts_flat": FeatureOption(
        "--cpu-experts-flat", "LLAMA_ARG_CPU_EXPERTS_FLAT", (), False, None, None,
        "experts computed on the CPU one token at a time: one run of the experts' rows per thread", boolean=True),
    "cpu_experts_x4": FeatureOption(
        "--cpu-experts-x4", "LLAMA_ARG_CPU_EXPERTS_X4", (), False, None, None,
        "experts computed on the CPU one token at a time: four Q4_0 or MXFP4 rows' dot products at once", boolean=True),
    "cpu_experts_overlap": FeatureOption(
        "--cpu-experts-overlap", "LLAMA_ARG_CPU_EXPERTS_OVERLAP", (), False, None, None,
        "while the CPU computes experts, the GPU runs what needs nothing from them (the cache's hits, a shared expert)",
        boolean=True),
}

# --- llama-server only: the server's slots, speculation, probes (no Python parameter) ---

# n-gram speculation's gates (the first write-up's LLAMA_SERVER_SPEC_* names are aliases)
SPECULATION_OPTIONS: dict[str, FeatureOption] = {
    "spec_max_users": FeatureOption(
        "--spec-max-users", "LLAMA_ARG_SPEC_MAX_USERS", ("LLAMA_SERVER_SPEC_MAX_USERS",), 2, 0, _INT32_MAX,
        "while more slots than this generate, a slot drafts only at --spec-load-min-accept (0 = no load gate)",
        python=None),
    "spec_load_min_accept": FeatureOption(
        "--spec-load-min-accept", "LLAMA_ARG_SPEC_LOAD_MIN_ACCEPT", ("LLAMA_SERVER_SPEC_LOAD_MIN_ACCEPT",), 0.5, 0, 1,
        "under load, the acceptance average a slot needs to keep drafting (1 = no drafts under load)",
        python=None, kind="float"),
    "spec_min_accept": FeatureOption(
        "--spec-min-accept", "LLAMA_ARG_SPEC_MIN_ACCEPT", ("LLAMA_SERVER_SPEC_MIN_ACCEPT",), 0.1, 0, 1,
        "a slot pauses drafting while its acceptance average is below this (0 = off)",
        python=None, kind="float"),
    "spec_probe_interval": FeatureOption(
        "--spec-probe-interval", "LLAMA_ARG_SPEC_PROBE_INTERVAL", ("LLAMA_SERVER_SPEC_PROBE_INTERVAL",), 32, 1,
        _INT32_MAX, "generated tokens a paused slot waits before it drafts again", python=None),
    "spec_gates": FeatureOption(
        "--spec-gates", "LLAMA_ARG_SPEC_GATES", (), "ngram", None, None,
        "the drafters the gates apply to: 'ngram', 'all' (draft models, EAGLE3, MTP too) or 'none' (upstream)",
        choices=("ngram", "all", "none"), python=None),
}

# the server's slots on a layer split over several devices
SERVER_SLOT_OPTIONS: dict[str, FeatureOption] = {
    "seq_compact": FeatureOption(
        "--seq-compact", "LLAMA_ARG_SEQ_COMPACT", (), False, None, None,
        "with a KV cache per slot (-no-kvu), move a generating slot into a lower idle one so a decode step is "
        "one ubatch", boolean=True, python=None),
    "prefill_chunk": FeatureOption(
        "--prefill-chunk", "LLAMA_ARG_PREFILL_CHUNK", (), 0, 0, _INT32_MAX,
        "while slots generate, prompt tokens per step, all prompts together (0 = up to n_batch)", python=None),
    "decode_groups": FeatureOption(
        "--decode-groups", "LLAMA_ARG_DECODE_GROUPS", (), 0, 0, _INT32_MAX,
        "groups of generating slots decoded in flight at once over a pipelined layer split (0 or 1 = off)",
        python=None),
}

# host memory of the weights kept there
HOST_MEMORY_OPTIONS: dict[str, FeatureOption] = {
    "hugepages": FeatureOption(
        "--host-hugepages", "LLAMA_ARG_HOST_HUGEPAGES", (), False, None, None,
        "weights kept in host memory (not a file mapping) on transparent huge pages: the CPU reads them faster",
        boolean=True, python="model"),
}

# what the planner and the tuner read from a server
PROBE_OPTIONS: dict[str, FeatureOption] = {
    "memory_probe": FeatureOption(
        "--memory-probe", "LLAMA_ARG_MEMORY_PROBE", (), "", None, None,
        "write what the model and context would take per device as JSON to FNAME ('-': stdout) and exit",
        python=None, kind="path"),
    "moe_routing_trace": FeatureOption(
        "--moe-routing-trace", "LLAMA_ARG_MOE_ROUTING_TRACE", (), "", None, None,
        "append every accepted token's routed experts to FNAME as JSON lines (for `moecache tune`; "
        "Python: Context.record_routing(FNAME))", python=None, kind="path"),
}

# every option moecache adds to llama-server, by feature: (title, its docs page, table); the options
# reference (docs/options.md) is generated from this list
FEATURE_OPTION_TABLES: tuple[tuple[str, str, dict[str, FeatureOption]], ...] = (
    ("Hot-expert cache", "hot-expert-cache.md", MOE_CACHE_OPTIONS),
    ("Prefill-phase swap", "prefill-swap.md", PREFILL_SWAP_OPTIONS),
    ("The CPU's experts", "cpu-experts.md", {**CPU_EXPERT_OPTIONS, **HOST_MEMORY_OPTIONS}),
    ("N-gram speculation", "speculation.md", SPECULATION_OPTIONS),
    ("Long context", "long-context.md", LONG_CONTEXT_OPTIONS),
    ("Several GPUs", "multi-gpu.md", {**MULTI_GPU_OPTIONS, **SERVER_SLOT_OPTIONS}),
    ("Planning and tuning", "planning.md", PROBE_OPTIONS),
)


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if maximum is None or maximum == _INT32_MAX:
        return f" >= {minimum}"
    return f" in [{minimum}, {maximum}]"


def _choice(option: FeatureOption, value, source: str) -> str:
    """One of option.choices, spelled exactly so (as llama-server takes them); ValueError naming
    `source` otherwise."""
    if isinstance(value, str) and value in option.choices:
        return value
    raise ValueError(f"{source} must be one of {', '.join(repr(p) for p in option.choices)} (got {value!r})")


def _feature_options(table: dict[str, FeatureOption], feature: str, kwargs=None, environ=None) -> dict:
    """The checked settings of one feature, every option of `table`.

    `kwargs` maps option names to the values a caller passed (None = not passed); an option not
    passed takes its environment variable (`environ`, default os.environ; an empty value counts as
    unset), else an old name of that variable, else its default. A bad value raises ValueError that
    names the argument or the variable it came from; an unknown option name raises TypeError, as a
    misspelled keyword argument does.
    """
    kwargs = dict(kwargs or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(set(kwargs) - set(table))
    if unknown:
        raise TypeError(f"unknown {feature} option(s): {', '.join(unknown)} (known: {', '.join(table)})")
    out = {}
    for name, option in table.items():
        default, minimum, maximum, what = option.default, option.minimum, option.maximum, option.what
        value = kwargs.get(name)
        found = option.from_environment(environ) if value is None else None
        source = f"{option.describe_variable(found[0])} ({name})" if found else name
        if option.choices:
            out[name] = (_choice(option, value, name) if value is not None
                         else _choice(option, found[1].strip(), source) if found else default)
        elif option.boolean:
            if value is not None:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be True or False (got {value!r})")
                out[name] = value
            elif found:
                word = found[1].strip().lower()
                if word not in _TRUE_WORDS + _FALSE_WORDS:
                    raise ValueError(f"{source} must be one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)} "
                                     f"(got {found[1]!r})")
                out[name] = word in _TRUE_WORDS
            else:
                out[name] = default
        elif option.kind == "path":
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"{name} must be a path (got {value!r})")
                out[name] = value
            else:
                out[name] = found[1].strip() if found else default
        elif found:
            text = found[1].strip()
            number = int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None  # as C's strtol: no "1_000"
            if number is None or number < minimum or (maximum is not None and number > maximum):
                raise ValueError(f"{option.describe_variable(found[0])} ({name}: {what}) must be an integer"
                                 f"{_range_text(minimum, maximum)} (got {found[1]!r})")
            out[name] = number
        elif value is not None:
            out[name] = _check_int(name, value, minimum=minimum, maximum=maximum,
                                   what=_range_text(minimum, maximum) + f" ({what})")
        else:
            out[name] = default
    return out


def _moe_cache_options(kwargs=None, environ=None) -> dict:
    """The checked hot-expert cache settings of a context (see _feature_options)."""
    return _feature_options(MOE_CACHE_OPTIONS, "expert cache", kwargs, environ)


def _prefill_swap_options(kwargs=None, environ=None) -> dict:
    """The checked prefill-phase swap settings of a context (see _feature_options)."""
    return _feature_options(PREFILL_SWAP_OPTIONS, "prefill swap", kwargs, environ)


def _long_context_options(kwargs=None, environ=None) -> dict:
    """The checked long-context attention settings of a context (see _feature_options)."""
    return _feature_options(LONG_CONTEXT_OPTIONS, "long-context", kwargs, environ)


def _multi_gpu_options(kwargs=None, environ=None) -> dict:
    """The checked settings of a layer split over several devices (see _feature_options)."""
    return _feature_options(MULTI_GPU_OPTIONS, "multi-GPU", kwargs, environ)


def _cpu_expert_options(kwargs=None, environ=None) -> dict:
    """The checked settings of how the CPU computes a decode step's experts (see _feature_options)."""
    return _feature_options(CPU_EXPERT_OPTIONS, "CPU-experts", kwargs, environ)


#
# a llama-server command line: which settings the user's flags or environment decide
#


def find_flag_value(args: Sequence[str], names: Iterable[str]) -> str | None:
    """Value of the last occurrence of a flag in `args` (`-m X`, `--model X` or `--model=X`)."""
    names = tuple(names)
    value = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in names:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 2
            continue
        for n in names:
            if n.startswith("--") and a.startswith(n + "="):
                value = a[len(n) + 1:]
        i += 1
    return value


def has_flag(args: Sequence[str], names: Iterable[str]) -> bool:
    names = tuple(names)
    return any(a in names or any(n.startswith("--") and a.startswith(n + "=") for n in names)
               for a in args)

# each llama-server setting --demo touches: its flags and the environment variables that set it
# (llama-server's arg table, common/arg.cpp). llama-server reads the variables first and lets flags
# override them, so a flag the demo added would silently beat the user's environment: every
# setting below is added only when neither the user's flags nor their environment decide it.
MODEL_FLAGS = ("-m", "--model")
MODEL_ENV = ("LLAMA_ARG_MODEL",)
HOST_FLAGS = ("--host",)
HOST_ENV = ("LLAMA_ARG_HOST",)
PORT_FLAGS = ("--port",)
PORT_ENV = ("LLAMA_ARG_PORT",)
CTX_FLAGS = ("-c", "--ctx-size")
CTX_ENV = ("LLAMA_ARG_CTX_SIZE",)
CACHE_SIZE_OPTIONS = ("moe_cache_slots", "moe_cache_size_mib")  # the cache's other options tune it, not size it
CACHE_SIZE_FLAGS = tuple(MOE_CACHE_OPTIONS[o].flag for o in CACHE_SIZE_OPTIONS)
CACHE_SIZE_ENV = tuple(v for o in CACHE_SIZE_OPTIONS for v in MOE_CACHE_OPTIONS[o].env_names)
EXPERT_PLACEMENT_FLAGS = ("-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ot", "--override-tensor")
EXPERT_PLACEMENT_ENV = ("LLAMA_ARG_CPU_MOE", "LLAMA_ARG_N_CPU_MOE", "LLAMA_ARG_OVERRIDE_TENSOR")
REPACK_FLAGS = ("--repack", "-nr", "--no-repack")
REPACK_ENV = ("LLAMA_ARG_REPACK", "LLAMA_ARG_NO_REPACK")  # llama.cpp also reads LLAMA_ARG_NO_<X> of a negatable flag
METRICS_FLAGS = ("--metrics",)
METRICS_ENV = ("LLAMA_ARG_ENDPOINT_METRICS",)

# --plan auto: what a plan sets, as (the flags that set it, the variables that set it); the plan's flag is
# the first. A setting the user's flags or environment decide is left to them.
PARALLEL_FLAGS = ("-np", "--parallel")
PARALLEL_ENV = ("LLAMA_ARG_N_PARALLEL",)
UBATCH_FLAGS = ("-ub", "--ubatch-size")
UBATCH_ENV = ("LLAMA_ARG_UBATCH",)

BATCH_FLAGS = ("-b", "--batch-size")
BATCH_ENV = ("LLAMA_ARG_BATCH",)
THREADS_FLAGS = ("-t", "--threads")
THREADS_ENV = ("LLAMA_ARG_THREADS",)
GPU_LAYERS_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
GPU_LAYERS_ENV = ("LLAMA_ARG_N_GPU_LAYERS",)

# llama-server's basic settings the launcher checks before starting anything: (what, flags, variables,
# lowest, highest, words it also takes); a value out of range reached a GGML_ASSERT or a port llama-server
# bent to another one
BASIC_SETTINGS = (
    (PORT_FLAGS, PORT_ENV, 0, 65535, (), "a port is 1 to 65535, or 0 for any free port", "8080"),
    (CTX_FLAGS, CTX_ENV, 0, _INT32_MAX, (), "the context size is a token count >= 0 (0: the model's own)", "8192"),
    (BATCH_FLAGS, BATCH_ENV, 1, _INT32_MAX, (), "the batch size is a token count >= 1", "2048"),
    (UBATCH_FLAGS, UBATCH_ENV, 1, _INT32_MAX, (), "the micro-batch size is a token count >= 1", "512"),
    (PARALLEL_FLAGS, PARALLEL_ENV, -1, _INT32_MAX, (), "the slot count is >= 1, or -1 for auto", "4"),
    (THREADS_FLAGS, THREADS_ENV, -1, 4096, (), "the thread count is 1 to 4096, or 0 or -1 for every core", "8"),
    (GPU_LAYERS_FLAGS, GPU_LAYERS_ENV, -2, _INT32_MAX, ("auto", "all"),
     "the GPU layers are a layer count, 'auto' or 'all'", "99"),
)


def check_basic_settings(args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """None when llama-server's basic settings in `args` (and their LLAMA_ARG_* variables) are in range, else
    one message naming the flag or variable, its value, the range and the fix."""
    for flags, env, lo, hi, words, rule, example in BASIC_SETTINGS:
        value = find_flag_value(args, flags)
        if value is not None:
            flag = next((f for a in args for f in flags if a == f or a.startswith(f + "=")), flags[0])
            given, fix = f"{flag} {value}", f"{flag} {example}"
        else:
            name = next((n for n in env if environ.get(n, "").strip()), None)
            if name is None:
                continue
            value = environ[name].strip()
            given, fix = f"{name}={value}", f"{name}={example}"
        text = value.strip()
        if text in words or (re.fullmatch(r"[+-]?[0-9]+", text) and lo <= int(text) <= hi
                             and not (flags == PARALLEL_FLAGS and int(text) == 0)):  # llama-server refuses 0 slots
            continue
        return f"{given} is not valid: {rule}. Fix: e.g. {fix}."
    return None


PLAN_SETTINGS = {
    "-ngl": (("-ngl", "--gpu-layers", "--n-gpu-layers"), ("LLAMA_ARG_N_GPU_LAYERS",)),
    "-c": (CTX_FLAGS, CTX_ENV),
    "-np": (PARALLEL_FLAGS, PARALLEL_ENV),
    "-ub": (UBATCH_FLAGS, UBATCH_ENV),
    "-b": (("-b", "--batch-size"), ("LLAMA_ARG_BATCH",)),
    "--cpu-moe": (EXPERT_PLACEMENT_FLAGS, EXPERT_PLACEMENT_ENV),
    "--n-cpu-moe": (EXPERT_PLACEMENT_FLAGS, EXPERT_PLACEMENT_ENV),
    "--no-repack": (REPACK_FLAGS, REPACK_ENV),
    "-lm": (("-lm", "--load-mode"), ("LLAMA_ARG_LOAD_MODE",)),
    "--moe-cache-slots": (CACHE_SIZE_FLAGS, CACHE_SIZE_ENV),
    "--moe-cache-warm-prompts": (("--moe-cache-warm-prompts", "--no-moe-cache-warm-prompts"),
                                 MOE_CACHE_OPTIONS["moe_cache_warm_prompts"].env_names),
    "--moe-cache-profile": ((MOE_CACHE_OPTIONS["moe_cache_profile"].flag,), MOE_CACHE_OPTIONS["moe_cache_profile"].env_names),
    "--moe-cache-slots-by-layer": (("--moe-cache-slots-by-layer", "--no-moe-cache-slots-by-layer"),
                                   MOE_CACHE_OPTIONS["moe_cache_slots_by_layer"].env_names),
    # where the misses run and the shares of auto and split: a variable is yours as much as a flag (the plan's flag
    # would beat it in llama-server)
    **{MOE_CACHE_OPTIONS[k].flag: ((MOE_CACHE_OPTIONS[k].flag,), MOE_CACHE_OPTIONS[k].env_names)
       for k in ("moe_cache_miss", "moe_cache_miss_auto_pct", "moe_cache_miss_split_pct")},
    "--prefill-ubatch": ((PREFILL_SWAP_OPTIONS["prefill_ubatch"].flag,), PREFILL_SWAP_OPTIONS["prefill_ubatch"].env_names),
    "--prefill-restore-wait": ((PREFILL_SWAP_OPTIONS["prefill_restore_wait_ms"].flag,),
                               PREFILL_SWAP_OPTIONS["prefill_restore_wait_ms"].env_names),
    # the CPU's expert switches: ggml's own variables count as the user's setting too (a 0 there stays off)
    "--host-hugepages": (("--host-hugepages", "--no-host-hugepages"),
                         ("LLAMA_ARG_HOST_HUGEPAGES", "GGML_CUDA_HOST_HUGEPAGES")),
    "--cpu-experts-flat": (("--cpu-experts-flat", "--no-cpu-experts-flat"),
                           (*CPU_EXPERT_OPTIONS["cpu_experts_flat"].env_names, "GGML_CPU_MMID_FLAT")),
    "--cpu-experts-x4": (("--cpu-experts-x4", "--no-cpu-experts-x4"),
                         (*CPU_EXPERT_OPTIONS["cpu_experts_x4"].env_names, "GGML_CPU_DOT_X4")),
    "--cpu-experts-overlap": (("--cpu-experts-overlap", "--no-cpu-experts-overlap"),
                              (*CPU_EXPERT_OPTIONS["cpu_experts_overlap"].env_names, "GGML_SCHED_HOST_OVERLAP")),
}


def _env_set(environ: Mapping[str, str], names: Iterable[str]) -> bool:
    return any(environ.get(n, "").strip() for n in names)


def user_decides(args: Sequence[str], environ: Mapping[str, str], flags: Iterable[str], env: Iterable[str]) -> bool:
    """Whether the user's llama-server flags or environment set a setting."""
    return has_flag(args, flags) or _env_set(environ, env)


def setting_value(args: Sequence[str], environ: Mapping[str, str], flags: Iterable[str], env: Iterable[str],
                  default: str) -> str:
    """The value llama-server will use for a setting: the last flag, else the environment, else `default`."""
    value = find_flag_value(args, flags)
    if value is not None:
        return value
    for name in env:
        if environ.get(name, "").strip():
            return environ[name].strip()
    return default


def switch_setting(args: Sequence[str], environ: Mapping[str, str], flags: Sequence[str], env: Iterable[str],
                   default: bool) -> bool:
    """An on/off setting as llama-server will read it: the last of its flags (flags[0] on, flags[1] off), else
    its variable, else `default`."""
    last = next((a for a in reversed(args) if a in flags), None)
    if last is not None:
        return last == flags[0]
    for name in env:
        word = environ.get(name, "").strip().lower()
        if word:
            return word in _TRUE_WORDS
    return default


def planned_args(plan_args: Sequence[str], rest: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The plan's flags the user's own flags and environment leave open, in the plan's order."""
    out: list[str] = []
    i = 0
    while i < len(plan_args):
        flag = plan_args[i]
        takes_value = i + 1 < len(plan_args) and not plan_args[i + 1].startswith("-")
        pair = list(plan_args[i:i + 2]) if takes_value else [flag]
        flags, env = PLAN_SETTINGS.get(flag, ((flag,), ()))
        if not user_decides(rest, environ, flags, env):
            out += pair
        i += len(pair)
    return out
