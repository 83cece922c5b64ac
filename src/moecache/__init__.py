"""moecache: very large Mixture-of-Experts models on GPUs far smaller than the model.

A patched, pinned llama.cpp, its server (`moecache-server`) and a Python API:

    import moecache
    m = moecache.Model("model.gguf", n_gpu_layers=-1, n_cpu_moe=24)
    g = m.context(n_ctx=8192).generate("Hello", max_tokens=32)

    model, ctx = moecache.load("model.gguf", n_ctx=8192)   # placed as moecache-server places it

Importing this package never loads the native module; the first call that needs it does.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import (  # noqa: E402  (pure Python: the native module loads on first use)
    Context,
    ExpertCache,
    PrefillSwap,
    Generation,
    Model,
    ModelLoadError,
    MoecacheError,
    OutOfMemoryError,
    buffer_types,
    devices,
    native_module,
    physical_cores,
    system_info,
)
from .plan import PlanError, load  # noqa: E402


__all__ = [
    "Context",
    "ExpertCache",
    "PrefillSwap",
    "Generation",
    "Model",
    "ModelLoadError",
    "MoecacheError",
    "OutOfMemoryError",
    "buffer_types",
    "devices",
    "native_module",
    "physical_cores",
    "system_info",
    "load",
    "PlanError",
    "__version__",
]
