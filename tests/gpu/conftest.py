"""Fixtures of the GPU tests (tests/gpu, run on the H200 by benchmarks/gpu/run.sh)."""

from __future__ import annotations

import pytest

from moecache import synth


@pytest.fixture(scope="session")
def demo_and_qwen4exp(moecache_cache_dir, tmp_path_factory) -> dict:
    """The demo model (kept in the session's cache folder) and a tiny qwen4exp, by preset name."""
    demo = moecache_cache_dir / "models" / synth.cached_model_name("demo", seed=0)
    demo.parent.mkdir(parents=True, exist_ok=True)
    if not demo.exists():
        synth.write_model(demo, preset="demo", seed=0, progress=False)
    q4 = synth.write_model(tmp_path_factory.mktemp("qwen4exp") / "tiny-qwen4exp.gguf", preset="tiny-qwen4exp",
                           seed=0, progress=False)
    return {"demo": demo, "tiny-qwen4exp": q4}
