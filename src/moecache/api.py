"""The Python API: load a GGUF model, make a context, generate, trace expert routing.

    import moecache
    m = moecache.Model("model.gguf", n_gpu_layers=99, n_cpu_moe=24)
    ctx = m.context(n_ctx=8192)
    g = ctx.generate("The capital of France is", max_tokens=32)
    print(g.text, g.timings["decode_tps"])

Everything here is a thin layer over the native module `moecache._core` (pybind11 over
llama.h). This file checks arguments and files before they reach C++, so mistakes come back as
Python exceptions that name the parameter or the file. It imports the native module only on
first use: `import moecache` works without it (the build orchestrator runs before it exists).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence


class MoecacheError(RuntimeError):
    """Base class of moecache's own errors."""


class ModelLoadError(MoecacheError):
    """A model file could not be loaded: not a GGUF, an unsupported architecture, or a failed load."""


class OutOfMemoryError(MoecacheError, MemoryError):
    """Not enough (device or host) memory for what was asked; also a MemoryError."""


#
# the native module, loaded on first use
#

_core_module = None


def _build_tree_modules() -> list[Path]:
    """Compiled _core modules in a checkout's build folders (build/<tag>/python/moecache), newest first."""
    from .paths import build_dirs

    return [p for d in build_dirs() for p in sorted((d / "python" / "moecache").glob("_core.*"))
            if p.suffix in (".so", ".pyd")]


def _core():
    """The native module; a MoecacheError that says how to build it when it is missing."""
    global _core_module
    if _core_module is not None:
        return _core_module
    problems = []
    module = None
    try:
        module = importlib.import_module("moecache._core")
        # In a source checkout src/moecache/_core/ holds the C++ and imports as an empty
        # namespace package: that is not the module.
        if getattr(module, "__file__", None) is None or not hasattr(module, "Model"):
            sys.modules.pop("moecache._core", None)
            # the import also bound the folder as the package's attribute: `from moecache import _core`
            # must find the compiled module loaded below instead
            package = sys.modules.get(__package__)
            if package is not None and getattr(package, "_core", None) is module:
                delattr(package, "_core")
            module = None
            problems.append("moecache/_core is the C++ source folder, not a compiled module")
    except ImportError as e:
        problems.append(str(e))
    if module is None:
        for path in _build_tree_modules():
            try:
                spec = importlib.util.spec_from_file_location("moecache._core", path)
                candidate = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(candidate)
            except ImportError as e:
                problems.append(f"{path}: {e}")
                continue
            sys.modules["moecache._core"] = candidate
            if sys.modules.get(__package__) is not None:
                setattr(sys.modules[__package__], "_core", candidate)
            module = candidate
            break
    if module is None:
        raise MoecacheError(
            "the native module moecache._core is not built (" + "; ".join(problems) + "). "
            "Install moecache with `pip install .`, or in a checkout `pip install -e . --no-build-isolation`."
        )
    _core_module = module
    return module


def native_module():
    """The loaded native module (moecache._core); raises MoecacheError when it is not built."""
    return _core()


#
# system
#


def devices() -> list[dict]:
    """The ggml devices: name, description, type ('cpu', 'gpu', 'igpu', 'accel'), memory_free,
    memory_total (bytes), device_id, host_buffer (whether it has a pinned host buffer type)."""
    return [dict(d) for d in _core().devices()]


def system_info() -> str:
    """llama.cpp's system info line (CPU features the build uses, backends)."""
    return _core().system_info()


def buffer_types() -> list[str]:
    """Buffer type names that tensor_overrides may use ('CPU', 'CUDA0', 'CUDA_Host', ...)."""
    return list(_core().buffer_types())


def physical_cores() -> int:
    """Physical CPU cores this process may use (llama.cpp's default thread count)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    cores = set()
    try:
        physical_id = core_id = None
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    physical_id = value.strip()
                elif key == "core id":
                    core_id = value.strip()
                elif not key and core_id is not None:
                    cores.add((physical_id, core_id))
                    physical_id = core_id = None
        if core_id is not None:
            cores.add((physical_id, core_id))
    except OSError:
        pass
    n = len(cores) if cores else allowed
    return max(1, min(n, allowed))


#
# argument checks
#


def _check_float(name: str, value, what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number{what} (got {value!r})")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number{what} (got {value!r})") from None


def _parse_tensor_overrides(overrides) -> list[tuple[str, str]]:
    """(regex, buffer type) pairs from a list of pairs, a dict, or llama-server's -ot syntax
    "regex=TYPE,regex=TYPE"."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        pairs = []
        for item in overrides.split(","):
            pattern, sep, buft = item.partition("=")
            if not sep or not pattern:
                raise ValueError(f"tensor_overrides: '{item}' is not of the form <regex>=<buffer type>")
            pairs.append((pattern, buft))
        return pairs
    if isinstance(overrides, dict):
        overrides = list(overrides.items())
    pairs = []
    for item in overrides:
        if isinstance(item, str) or len(item) != 2 or not all(isinstance(x, str) for x in item):
            raise ValueError(f"tensor_overrides: each entry must be a (regex, buffer type) pair of strings, got {item!r}")
        pairs.append((item[0], item[1]))
    return pairs


def _check_gguf_file(path: Path) -> None:
    from .gguf import check_model_file  # not at import time: the build imports this package without numpy

    problem = check_model_file(path)
    if problem is None:
        return
    if not path.exists():
        raise FileNotFoundError(problem)
    raise ModelLoadError(problem)


# the features' options live in options.py (one table per feature); their names stay importable from here
from .options import (CPU_EXPERT_OPTIONS, LONG_CONTEXT_OPTIONS, MOE_CACHE_OPTIONS, MULTI_GPU_OPTIONS,  # noqa: E402,F401
                      PREFILL_SWAP_OPTIONS, FeatureOption, _check_int, _cpu_expert_options, _feature_options,
                      _long_context_options, _moe_cache_options, _multi_gpu_options, _prefill_swap_options)

FLASH_ATTN_VALUES = ("auto", "on", "off")


#
# model, context, generation
#


@dataclass
class Generation:
    """What Context.generate returns. `tokens` are the generated tokens (the end-of-generation
    token is not included); `finish_reason` is "stop" (end-of-generation token or a stop string)
    or "length" (max_tokens or the context is full)."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str
    timings: dict = field(default_factory=dict)
    # with generate(top_logprobs=N): before each generated token, the N most likely tokens as (id, log-probability)
    # of the model's own distribution (before top-k/top-p/temperature), best first; empty otherwise
    top_logprobs: list = field(default_factory=list)


class Model:
    """A GGUF model loaded by llama.cpp.

    Placement: `n_gpu_layers` layers go to the GPU (-1 = all); `cpu_moe=True` keeps the routed
    experts of every layer in host memory (llama-server's --cpu-moe), `n_cpu_moe` those of the
    first N layers (--n-cpu-moe); `tensor_overrides`
    places tensors by regex, as llama-server's -ot: [("exps", "CPU")] or "exps=CPU" (first match
    wins; the cpu_moe and n_cpu_moe rules come first). `pinned=True` keeps the host-resident weights in the
    GPU's pinned host memory (faster uploads; it implies no mmap); without a GPU it is ignored with a
    warning. `pinned=False, use_mmap=False` is llama-server's `--no-mmap --no-host`. `hugepages=True` puts
    the host-resident weights on transparent huge pages, pinned or loaded (not a file mapping; llama-server's
    --host-hugepages): the CPU computed with pinned experts 11-15% faster on the H200 machine, same bytes.
    `repack=False` is llama-server's --no-repack (no CPU weight repacking: AMX, interleaved quants);
    the hot-expert cache (Context's moe_cache_* options) needs it for host experts, since it cannot
    copy repacked experts into its slots.
    `verbose=True` lets llama.cpp's log through to stderr (otherwise it is kept for error messages).
    """

    def __init__(
        self,
        path,
        n_gpu_layers: int = 0,
        n_cpu_moe: int = 0,
        tensor_overrides=None,
        use_mmap: bool = True,
        use_mlock: bool = False,
        pinned: bool = False,
        verbose: bool = False,
        repack: bool = True,
        cpu_moe: bool = False,
        hugepages: bool = False,
    ):
        path = Path(os.fspath(path)).expanduser()
        _check_gguf_file(path)
        n_gpu_layers = _check_int("n_gpu_layers", n_gpu_layers, minimum=-1, what=" >= -1 (-1 = all layers)")
        n_cpu_moe = _check_int("n_cpu_moe", n_cpu_moe, minimum=0, what=" >= 0")
        overrides = _parse_tensor_overrides(tensor_overrides)
        core = _core()
        if overrides:
            known = list(core.buffer_types())
            for pattern, buft in overrides:
                if buft not in known:
                    raise ValueError(
                        f"tensor_overrides: unknown buffer type '{buft}' for '{pattern}' (allowed: {', '.join(known)})"
                    )
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"tensor_overrides: invalid regex '{pattern}': {e}") from None
        self.notes: list[str] = []
        if pinned and not core.have_gpu():
            note = "pinned=True is ignored: there is no GPU, so there is no pinned host memory to use"
            self.notes.append(note)
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        if hugepages and use_mmap and not repack and not (pinned and core.have_gpu()):
            note = ("hugepages=True is ignored: the host-resident weights are a mapping of the file; it applies to "
                    "the GPU's pinned host memory (pinned=True), to loaded weights (use_mmap=False) and to repacked "
                    "ones (repack=True)")
            self.notes.append(note)
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        self._m = core.Model(
            str(path),
            n_gpu_layers=n_gpu_layers,
            n_cpu_moe=n_cpu_moe,
            cpu_moe=bool(cpu_moe),
            tensor_overrides=overrides,
            use_mmap=bool(use_mmap),
            use_mlock=bool(use_mlock),
            pinned=bool(pinned),
            repack=bool(repack),
            verbose=bool(verbose),
            hugepages=bool(hugepages),
        )
        self.path = str(path)
        self.arch = self._m.arch
        self.n_layer = self._m.n_layer
        self.n_embd = self._m.n_embd
        self.n_vocab = self._m.n_vocab
        self.n_ctx_train = self._m.n_ctx_train
        self.n_params = self._m.n_params
        self.size = self._m.size
        self.desc = self._m.desc
        self.metadata: dict[str, str] = dict(self._m.metadata())
        self.n_expert = int(self.metadata.get(f"{self.arch}.expert_count", "0") or 0)
        self.n_expert_used = int(self.metadata.get(f"{self.arch}.expert_used_count", "0") or 0)
        self.placement = {
            "n_gpu_layers": n_gpu_layers,
            "n_cpu_moe": n_cpu_moe,
            "cpu_moe": bool(cpu_moe),
            "tensor_overrides": overrides,
            "use_mmap": bool(use_mmap),
            "use_mlock": bool(use_mlock),
            "pinned": bool(pinned),
            "repack": bool(repack),
            "hugepages": bool(hugepages),
        }

    def __repr__(self) -> str:
        return (f"moecache.Model('{self.path}', arch={self.arch}, n_layer={self.n_layer}, "
                f"n_expert={self.n_expert}, n_expert_used={self.n_expert_used}, size={self.size})")

    # tokens

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str (got {type(text).__name__})")
        return list(self._m.tokenize(text, add_special=add_special, parse_special=parse_special))

    def detokenize(self, tokens: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        data = self._m.detokenize(self._tokens(tokens, "tokens"), remove_special, unparse_special)
        return data.decode("utf-8", errors="replace")

    def token_to_piece(self, token: int, special: bool = False) -> str:
        return self.token_bytes(token, special).decode("utf-8", errors="replace")

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of a token (a piece may hold part of a UTF-8 character)."""
        return self._m.token_to_piece(self._token(token), special)

    def is_eog(self, token: int) -> bool:
        return self._m.is_eog(self._token(token))

    def _token(self, token) -> int:
        return _check_int("token", token, minimum=0, maximum=self.n_vocab - 1, what=f" in [0, {self.n_vocab})")

    def _tokens(self, tokens, name: str) -> list[int]:
        if isinstance(tokens, (str, bytes)):
            raise ValueError(f"{name} must be a list of token ids (got {type(tokens).__name__})")
        try:
            out = [_check_int(name, t) for t in tokens]
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a list of integer token ids (got {tokens!r:.80})") from None
        bad = [t for t in out if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is out of range [0, {self.n_vocab})")
        return out

    # contexts

    def context(self, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512, n_threads: int | None = None,
                flash_attn: str = "auto", **features) -> "Context":
        """A Context of this model; `features` takes Context's moe_cache_* and prefill_* options."""
        return Context(self, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads, flash_attn=flash_attn,
                       **features)


class Context:
    """A llama.cpp context (KV cache and compute buffers) of one sequence.

    llama.cpp caps n_batch at n_ctx and n_ubatch at n_batch; the attributes say what it uses.

    Hot-expert cache (off by default): for MoE layers whose routed experts live in host memory
    (Model(cpu_moe=True) or n_cpu_moe, with repack=False), a bank of slots on the layer's device
    holds the most-routed experts; batches of up to `moe_cache_max_batch` tokens run the cached
    experts there and the others on the CPU, larger batches (prompts) take the stock path.
    `moe_cache_slots` slots per cached layer, or `moe_cache_size_mib` MiB for all of them (used when
    slots is 0); `moe_cache_policy` "freq" (routing frequency over a window, rebalanced every
    `moe_cache_rebalance_interval` tokens) or "lru" (an expert is uploaded after
    `moe_cache_admit_misses` misses within `moe_cache_admit_window` tokens); at most
    `moe_cache_max_uploads` uploads per layer and step while the link is busy (up to 8x that while
    the last step's uploads were done in time and more were wanted); the banks are sized after the KV cache and
    the compute buffers, from the device memory then free minus `moe_cache_headroom_mib`.
    `moe_cache_miss` says where the misses run: "cpu" (a round trip to the CPU per cached layer),
    "gpu" (the layer's GPU reads the missed experts in host memory in place, pinned at start-up),
    "auto" (per layer, on the GPU while its recent misses are at most `moe_cache_miss_auto_pct` % of
    its routed experts) or "split" (per expert, at once: the GPU the most-routed missed experts, about
    `moe_cache_miss_split_pct` % of the misses, the CPU the others). `moe_cache_warm_prompts` fills empty slots with the experts a prompt routed most
    before its tokens decode; `moe_cache_profile` names an expert profile kept across restarts: read when
    the context is made (its hottest experts fill the slots; a damaged or foreign file is ignored with a
    warning) and written when the context is freed, this run's routing added; with
    `moe_cache_slots_by_layer` the profile also sizes each layer's slots from its routing (layers whose routing
    spreads over more experts get more, at least half the even share each, in the same memory). An option
    left as None takes its environment variable (MOE_CACHE_OPTIONS: LLAMA_ARG_MOE_CACHE_SLOTS,
    LLAMA_ARG_MOE_CACHE_SIZE, ..., or their old names such as LLAMA_ARG_MOE_HOT_K), else its default
    (0, 0, "freq", 40, 8, 2, 16, 2, 512, "cpu", 25, 50).
    `self.expert_cache` reports and steers the cache.

    Prefill-phase swap (off by default, PREFILL_SWAP_OPTIONS): with `prefill_ubatch` set (at most
    n_batch, larger than n_ubatch), a prompt of at least `prefill_min_tokens` tokens runs at that
    ubatch: the expert cache's slot banks, the compute buffers and the GPU pools are released for
    it and restored before the first token is sampled (`prefill_warm_restore`: the slots are refilled
    with the experts the prompt routed most; `prefill_restore_wait_ms`: the first token waits at most that
    long for those copies, so decode does not share the link with them). `prefill_swap_mode` "bypass" makes
    every decision and keeps n_ubatch (a control arm). Environment: LLAMA_ARG_PREFILL_UBATCH,
    LLAMA_ARG_PREFILL_MIN_TOKENS, LLAMA_ARG_PREFILL_SWAP_MODE, LLAMA_ARG_PREFILL_WARM_RESTORE,
    LLAMA_ARG_PREFILL_RESTORE_WAIT (or the LLAMA_PHASE_PREFILL_* names).
    `self.prefill_swap` holds the settings and the counters.

    Long context (off by default, LONG_CONTEXT_OPTIONS): `qsa_sparse` makes the QSA layers of qwen4exp
    models attend only the cells their indexer selected, gathered from the KV cache, where that reads
    fewer rows than the masked attention over every cell (needs flash attention; environment:
    LLAMA_ARG_QSA_SPARSE). `kq_mask_device` builds the attention mask on the device from the cells' and
    the tokens' positions instead of uploading n_kv x n_tokens values per ubatch, where positions alone
    decide it (LLAMA_ARG_KQ_MASK_DEVICE). `qsa_block_topk` makes the QSA layers rank their blocks first and
    then only the chosen blocks' cells, which selects the cells the ranking of every cell does (ties at
    the cut to the lowest cells) where the cache layout allows it (LLAMA_ARG_QSA_BLOCK_TOPK).

    Several devices (off by default, MULTI_GPU_OPTIONS): `pp_overrides` keeps pipeline parallelism of a
    layer split when the model has tensor overrides, as long as none puts a weight on the host that a GPU
    op would copy per ubatch (LLAMA_ARG_PP_OVERRIDES); upstream turns it off for any override.

    The CPU's experts at decode (off by default, CPU_EXPERT_OPTIONS; the same results either way): with
    `cpu_experts_flat` each CPU thread computes one run of a token's experts' rows instead of a slice of every
    expert (LLAMA_ARG_CPU_EXPERTS_FLAT); with `cpu_experts_x4` it computes four Q4_0 or MXFP4 rows' dot products at once
    (LLAMA_ARG_CPU_EXPERTS_X4), where the experts keep the GGUF layout (`pinned=True` or `repack=False`; repacked
    experts keep their own kernels). Both apply to experts computed on the CPU (in host memory, the expert
    cache's misses); together they read those experts up to twice as fast. With `cpu_experts_overlap`
    (LLAMA_ARG_CPU_EXPERTS_OVERLAP) the GPU runs the nodes that need nothing from the CPU's experts (the expert
    cache's hits, a shared expert) while the CPU computes them.
    """

    def __init__(self, model: Model, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None, flash_attn: str = "auto", *,
                 moe_cache_slots: int | None = None, moe_cache_size_mib: int | None = None,
                 moe_cache_policy: str | None = None, moe_cache_rebalance_interval: int | None = None,
                 moe_cache_max_batch: int | None = None, moe_cache_admit_misses: int | None = None,
                 moe_cache_admit_window: int | None = None, moe_cache_max_uploads: int | None = None,
                 moe_cache_headroom_mib: int | None = None, moe_cache_miss: str | None = None,
                 moe_cache_miss_auto_pct: int | None = None, moe_cache_miss_split_pct: int | None = None,
                 moe_cache_warm_prompts: bool | None = None,
                 moe_cache_profile: str | os.PathLike | None = None,
                 moe_cache_slots_by_layer: bool | None = None,
                 prefill_ubatch: int | None = None, prefill_min_tokens: int | None = None,
                 prefill_swap_mode: str | None = None, prefill_warm_restore: bool | None = None,
                 prefill_restore_wait_ms: int | None = None,
                 qsa_sparse: bool | None = None, kq_mask_device: bool | None = None,
                 qsa_block_topk: bool | None = None, pp_overrides: bool | None = None,
                 cpu_experts_flat: bool | None = None, cpu_experts_x4: bool | None = None,
                 cpu_experts_overlap: bool | None = None):
        if not isinstance(model, Model):
            raise ValueError(f"model must be a moecache.Model (got {type(model).__name__})")
        n_ctx = _check_int("n_ctx", n_ctx, minimum=1, what=" > 0")
        n_batch = _check_int("n_batch", n_batch, minimum=1, what=" > 0")
        n_ubatch = _check_int("n_ubatch", n_ubatch, minimum=1, maximum=n_batch, what=f" in [1, n_batch={n_batch}]")
        if n_threads is None:
            n_threads = physical_cores()
        n_threads = _check_int("n_threads", n_threads, minimum=1, what=" > 0 (or None for the physical cores)")
        if flash_attn is True or flash_attn is False:
            flash_attn = "on" if flash_attn else "off"
        if flash_attn not in FLASH_ATTN_VALUES:
            raise ValueError(f"flash_attn must be one of {', '.join(repr(v) for v in FLASH_ATTN_VALUES)} (got {flash_attn!r})")
        moe_cache = _moe_cache_options({
            "moe_cache_slots": moe_cache_slots,
            "moe_cache_size_mib": moe_cache_size_mib,
            "moe_cache_policy": moe_cache_policy,
            "moe_cache_rebalance_interval": moe_cache_rebalance_interval,
            "moe_cache_max_batch": moe_cache_max_batch,
            "moe_cache_admit_misses": moe_cache_admit_misses,
            "moe_cache_admit_window": moe_cache_admit_window,
            "moe_cache_max_uploads": moe_cache_max_uploads,
            "moe_cache_headroom_mib": moe_cache_headroom_mib,
            "moe_cache_miss": moe_cache_miss,
            "moe_cache_miss_auto_pct": moe_cache_miss_auto_pct,
            "moe_cache_miss_split_pct": moe_cache_miss_split_pct,
            "moe_cache_warm_prompts": moe_cache_warm_prompts,
            "moe_cache_profile": os.fspath(moe_cache_profile) if moe_cache_profile is not None else None,
            "moe_cache_slots_by_layer": moe_cache_slots_by_layer,
        })
        prefill_swap = _prefill_swap_options({
            "prefill_ubatch": prefill_ubatch,
            "prefill_min_tokens": prefill_min_tokens,
            "prefill_swap_mode": prefill_swap_mode,
            "prefill_warm_restore": prefill_warm_restore,
            "prefill_restore_wait_ms": prefill_restore_wait_ms,
        })
        long_context = _long_context_options({"qsa_sparse": qsa_sparse, "kq_mask_device": kq_mask_device,
                                              "qsa_block_topk": qsa_block_topk})
        multi_gpu = _multi_gpu_options({"pp_overrides": pp_overrides})
        cpu_experts = _cpu_expert_options({"cpu_experts_flat": cpu_experts_flat, "cpu_experts_x4": cpu_experts_x4,
                                           "cpu_experts_overlap": cpu_experts_overlap})
        self.model = model
        self._c = _core().Context(model._m, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                                  flash_attn=flash_attn, **moe_cache, **prefill_swap, **long_context,
                                  **multi_gpu, **cpu_experts)
        self.n_ctx = self._c.n_ctx
        self.n_batch = self._c.n_batch
        self.n_ubatch = self._c.n_ubatch
        self.n_threads = self._c.n_threads
        self.flash_attn = flash_attn
        self.moe_cache_options = moe_cache  # the checked settings the context was made with
        self.long_context_options = long_context
        self.multi_gpu_options = multi_gpu
        self.cpu_expert_options = cpu_experts
        self.expert_cache = ExpertCache(self._c, model, moe_cache)
        self.prefill_swap = PrefillSwap(self._c, prefill_swap)
        self.routing_trace_path: str | None = None  # where record_routing writes, while it does
        self.moe_layers: list[int] | None = None  # layer index of each trace_routing column, after a trace

    def __repr__(self) -> str:
        cache = ""
        if self.moe_cache_options["moe_cache_slots"] or self.moe_cache_options["moe_cache_size_mib"]:
            cache = f", expert_cache={self.expert_cache!r}"
        return (f"moecache.Context(n_ctx={self.n_ctx}, n_batch={self.n_batch}, n_ubatch={self.n_ubatch}, "
                f"n_threads={self.n_threads}, flash_attn={self.flash_attn!r}{cache})")

    def reset(self) -> None:
        """Clear the KV cache."""
        self._c.reset()

    def record_routing(self, path, append: bool = False) -> None:
        """Write the experts routed for every accepted token into `path` as JSONL, one line a token
        ({"seq": .., "pos": .., "layers": {"<layer>": [expert ids]}}), from now on, with or without the
        expert cache; `record_routing(None)` stops and closes the file. The file is started afresh
        unless `append`. OSError (naming the path) when the file cannot be opened."""
        if path is None:
            self._c.record_routing(None)
            self.routing_trace_path = None
            return
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a str or os.PathLike, or None to stop (got {type(path).__name__})")
        text = str(Path(os.fspath(path)).expanduser())
        if not text:
            raise ValueError("path is empty (None stops recording)")
        if not append:
            with open(text, "w"):
                pass  # the library appends, so that a context made again keeps what was written
        self._c.record_routing(text)
        self.routing_trace_path = text

    def _prompt_tokens(self, prompt, name: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            # as llama-server's /completion: special tokens added and parsed
            tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        else:
            tokens = self.model._tokens(prompt, name)
        if not tokens:
            raise ValueError(f"{name} is empty")
        return tokens

    def generate(self, prompt, max_tokens: int = 128, temperature: float = 0.0, seed: int | None = 0,
                 top_k: int = 40, top_p: float = 0.95, stop: str | Sequence[str] | None = None,
                 top_logprobs: int = 0) -> Generation:
        """Generate from a cleared KV cache. `prompt` is a str (tokenized as llama-server's
        /completion does) or a list of token ids. temperature 0 is greedy (top_k, top_p and seed do
        not matter then); otherwise top_k -> top_p -> temperature -> a random draw seeded by `seed`
        (None = a random seed). Stops at an end-of-generation token, a stop string (cut from the
        text), max_tokens, or a full context. `top_logprobs` N > 0: Generation.top_logprobs holds the N most
        likely tokens and their log-probabilities before each generated token (a pass over the vocabulary per
        token: leave it 0 when timing)."""
        tokens = self._prompt_tokens(prompt)
        max_tokens = _check_int("max_tokens", max_tokens, minimum=0, what=" >= 0")
        temperature = _check_float("temperature", temperature, " >= 0 (0 = greedy)")
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy) (got {temperature})")
        top_k = _check_int("top_k", top_k, minimum=0, what=" >= 0 (0 = off)")
        top_p = _check_float("top_p", top_p, " in (0, 1]")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1] (got {top_p})")
        top_logprobs = _check_int("top_logprobs", top_logprobs, minimum=0, what=" >= 0 (0 = none)")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        seed = _check_int("seed", seed, minimum=0, maximum=2**32 - 1, what=" in [0, 2**32) or None")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        else:
            stops = list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them (got {s!r})")
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, the context holds {self.n_ctx}: "
                             "make a context with a larger n_ctx")
        r = self._c.generate(tokens, max_tokens=max_tokens, temperature=temperature, seed=seed, top_k=top_k,
                             top_p=top_p, stop=[s.encode("utf-8") for s in stops], n_probs=top_logprobs)
        prefill_s, decode_s = r["prefill_s"], r["decode_s"]
        timings = {
            "prefill_tokens": r["prefill_tokens"],
            "prefill_s": prefill_s,
            "prefill_tps": r["prefill_tokens"] / prefill_s if prefill_s > 0 else 0.0,
            "decode_tokens": r["decode_tokens"],
            "decode_s": decode_s,
            "decode_tps": r["decode_tokens"] / decode_s if decode_s > 0 else 0.0,
            "prefill_ubatch": r["prefill_ubatch"],    # the ubatch the prompt ran at
            "prefill_swap_ms": r["prefill_swap_ms"],  # the prefill-phase swap's cost, 0 without a swap
        }
        return Generation(
            tokens=list(r["tokens"]),
            text=r["text"].decode("utf-8", errors="replace"),
            prompt_tokens=len(tokens),
            finish_reason=r["finish_reason"],
            timings=timings,
            # one entry per generated token (the native side also has the step that sampled the end token)
            top_logprobs=[[(int(t), float(lp)) for t, lp in step] for step in r["top_logprobs"][:len(r["tokens"])]],
        )

    def trace_routing(self, tokens):
        """The experts every MoE layer selects for each token: an int32 numpy array of shape
        (n_tokens, n_moe_layers, n_expert_used), the top-k ids in the model's order (best first).
        Runs the tokens from a cleared KV cache of a separate tracing context (the recording slows
        the graph down, so the generation context never carries it). A str is tokenized as in
        generate. Only MoE layers are columns; `self.moe_layers` gives their layer indices."""
        tokens = self._prompt_tokens(tokens, "tokens")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit in n_ctx={self.n_ctx}: trace in pieces or use a larger context")
        ids, layers = self._c.trace_routing(tokens)
        self.moe_layers = list(layers)
        return ids


class PrefillSwap:
    """The prefill-phase swap of a Context (`ctx.prefill_swap`): its settings and its counters."""

    def __init__(self, native_context, options: dict):
        self._c = native_context
        self.options = dict(options)  # the checked settings the context was made with

    @property
    def enabled(self) -> bool:
        """True when long prompts swap: a prefill ubatch larger than n_ubatch (llama.cpp turns a
        smaller one off, with a log line)."""
        return self._c.prefill_swap_stats()["n_ubatch"] > 0

    def stats(self) -> dict:
        """n_ubatch (in use, 0 = off), n_ubatch_last (of the last long prompt), swaps, skipped
        ({"short", "others_generating", "bypass"}), failed ({"reserve", "restore", "banks", "upload"}:
        each failure left a working context), release_ms / reserve_ms / restore_ms (the last swap),
        total_ms, bytes_released / bytes_restored (device memory, the last swap), n_slots (the
        cache's slots after the last restore), warm_uploads (queued by warm restores), warm_dropped (of
        them, dropped by the next swap before they were copied), partial (swaps that freed only the banks
        their prompt needed), partial_fallbacks (of those tried, the ones that freed every bank after all),
        bytes_kept (bank bytes the last swap kept), and the expert cache's
        routing over the first 64 decoded tokens after each restore: after_restore_tokens, _hits,
        _misses, _hit_rate."""
        return dict(self._c.prefill_swap_stats())

    def __repr__(self) -> str:
        o = self.options
        if not o["prefill_ubatch"]:
            return "moecache.PrefillSwap(off)"
        return (f"moecache.PrefillSwap(prefill_ubatch={o['prefill_ubatch']}, prefill_min_tokens={o['prefill_min_tokens']}, "
                f"mode={o['prefill_swap_mode']!r}, warm_restore={o['prefill_warm_restore']}, "
                f"restore_wait_ms={o['prefill_restore_wait_ms']})")


class ExpertCache:
    """The hot-expert cache of a Context (`ctx.expert_cache`): what it holds, how it does, and
    a few levers for tests and tools. Every method waits for a generation running in another
    thread to finish; layer indices are the model's block indices (0 .. n_layer - 1)."""

    def __init__(self, native_context, model: Model, options: dict):
        self._c = native_context  # the native context only: no reference cycle with the Context
        self._model = model
        self.options = dict(options)

    @property
    def enabled(self) -> bool:
        """True when the context has a cache with at least one cached layer."""
        return bool(self._c.moe_cache_enabled())

    @property
    def layers(self) -> list[int]:
        """The cached layers."""
        return [il for il in range(self._model.n_layer) if self._c.moe_cache_layer_reason(il) is None]

    def _layer(self, layer) -> int:
        n = self._model.n_layer
        return _check_int("layer", layer, minimum=0, maximum=n - 1, what=f" in [0, n_layer={n})")

    def stats(self, layer: int | None = None) -> dict:
        """Counters of one cached layer, or (None) the total over all cached layers: n_tokens,
        hits, misses, hit_rate, hit_rate_recent (the last 256 tokens), uploads, bytes_uploaded,
        evictions, batches_cached, batches_bypassed ({"batch": .., "warmup": ..}), rebalances,
        step_ms_max, step_ms_total, n_slots, n_resident, n_layers_cached, bytes_vram, n_miss_device
        (layers whose misses run on their GPU now: moe_cache_miss), route_switches (miss "auto").
        ValueError (saying why) when there is no cache there."""
        il = -1 if layer is None else self._layer(layer)
        return dict(self._c.moe_cache_stats(il))

    def resident(self, layer: int) -> list[int]:
        """The experts published in a cached layer's slots."""
        return list(self._c.moe_cache_resident(self._layer(layer)))

    def layer_reason(self, layer: int) -> str | None:
        """Why a layer has no cache (e.g. its experts are not in host memory), or None when it has one."""
        return self._c.moe_cache_layer_reason(self._layer(layer))

    def reset_stats(self) -> None:
        """Zero the counters (the residency stays)."""
        self._c.moe_cache_reset_stats()

    def pin(self, layer: int, expert: int) -> None:
        """Keep `expert` resident in a cached layer: uploaded at the next step (or rebalance()),
        never evicted. ValueError for a layer without a cache, an expert out of range, or a layer
        whose slots are all pinned already."""
        il = self._layer(layer)
        n_expert = self._model.n_expert
        if n_expert > 0:
            expert = _check_int("expert", expert, minimum=0, maximum=n_expert - 1, what=f" in [0, n_expert={n_expert})")
        else:
            expert = _check_int("expert", expert, minimum=0, what=" >= 0")
        self._c.moe_cache_pin(il, expert)

    def rebalance(self) -> None:
        """Run the policy now, wait for its uploads and publish them (blocks; for tests and tools)."""
        self._c.moe_cache_rebalance()

    def stats_json(self) -> dict:
        """Every stat (total, per layer, configuration) as the library reports it, parsed."""
        import json

        return json.loads(self._c.moe_cache_stats_json())

    def __repr__(self) -> str:
        o = self.options
        if not (o["moe_cache_slots"] or o["moe_cache_size_mib"]):
            return "ExpertCache(off)"
        size = (f"slots={o['moe_cache_slots']}" if o["moe_cache_slots"]
                else f"size_mib={o['moe_cache_size_mib']}")
        try:
            if not self.enabled:
                return f"ExpertCache(configured {size}, policy={o['moe_cache_policy']!r}, but no layer is cached)"
            t = self.stats()
        except Exception as e:  # a repr must not raise
            return f"ExpertCache({size}, policy={o['moe_cache_policy']!r}, stats unavailable: {e})"
        return (f"ExpertCache({size}, policy={o['moe_cache_policy']!r}, layers={t['n_layers_cached']}, "
                f"n_slots={t['n_slots']}, hit_rate={t['hit_rate']:.3f}, uploads={t['uploads']}, "
                f"vram={t['bytes_vram'] / 2**20:.1f} MiB)")
