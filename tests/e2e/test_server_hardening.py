"""llama-server (patched) where users break it: bodies that are not JSON, token ids out of range,
a shutdown while requests run, GGUF files with corrupt MoE hyperparameters, bad benchmark flags.
The real server on loopback with the tiny synthetic model."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import struct
import threading
import time

import pytest

import moecache
from moecache.server import ServerError, ServerProcess

ARGS = ["-t", "2", "-c", "512", "-np", "1", "-ngl", "0"]


def raw_post(srv, path: str, body: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def srv(tiny_model, llama_server_bin):
    with ServerProcess(tiny_model, args=ARGS, timeout=120) as s:
        yield s


@pytest.mark.parametrize("body,expect", [
    (b"{not json", b"not valid JSON"),
    (b'{"prompt": "abc", "n_predict": 4', b"not valid JSON"),
    (b'{"prompt": "\xff\xfe\xfd", "n_predict": 4}', b"not valid UTF-8"),  # was answered, or 500
    (b'{"prompt": "ab\xc3", "n_predict": 4}', b"not valid UTF-8"),
    (b'{"prompt": [1099511627776], "n_predict": 4}', b"out of range"),     # 2^40, was read as token 0
    (b'{"prompt": [-5], "n_predict": 4}', b"out of range"),
    (b'{"prompt": ["a", 1099511627776], "n_predict": 4}', b"out of range"),  # mixed strings and ids
    (b'{"prompt": ["a", 1.5], "n_predict": 4}', b"must be a string"),
])
def test_client_errors_are_400_and_the_server_keeps_answering(srv, body, expect):
    status, text = raw_post(srv, "/completion", body)
    assert status == 400, (status, text)
    assert expect in text, text
    status, _ = raw_post(srv, "/completion", b'{"prompt": "def f():", "n_predict": 2}')
    assert status == 200


def _long_request(srv, results, key, stream=False):
    body = {"prompt": "def f():", "n_predict": 20000, "ignore_eos": True, "temperature": 0.0, "stream": stream}
    t0 = time.monotonic()
    try:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
        conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        results[key] = (resp.status, data, time.monotonic() - t0)
    except Exception as e:  # a connection reset is a failure of the test, recorded
        results[key] = (None, repr(e).encode(), time.monotonic() - t0)


@pytest.mark.parametrize("sig,stream,n_clients", [(signal.SIGTERM, False, 1), (signal.SIGINT, True, 2)])
def test_shutdown_ends_running_requests_cleanly(tiny_model, llama_server_bin, sig, stream, n_clients):
    """A signal while requests generate: each client gets a clean end (503 with a JSON error, or a final
    error event on a stream) within seconds, and the process exits; before, it waited for the
    clients to disconnect (SIGTERM: forever, with 0 bytes for the client)."""
    srv = ServerProcess(tiny_model, args=["-t", "2", "-c", "32768", "-np", str(n_clients), "-ngl", "0"], timeout=120)
    srv.start()
    try:
        results: dict = {}
        threads = [threading.Thread(target=_long_request, args=(srv, results, i, stream)) for i in range(n_clients)]
        for th in threads:
            th.start()
        time.sleep(2.0)  # generating now
        assert not results, results
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        for th in threads:
            th.join(timeout=30)
        rc = srv.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    assert took < 15, f"shutdown took {took:.1f} s"
    assert rc == 0, srv.log_text()[-2000:]
    assert len(results) == n_clients
    for status, data, _ in results.values():
        if stream:
            assert status == 200, data[-500:]
            events = [line[6:] for line in data.decode(errors="replace").splitlines() if line.startswith("data: ")]
            assert events, data[-500:]
            assert "shutting down" in events[-1], events[-1]
        else:
            assert status == 503, (status, data[-500:])
            assert "shutting down" in json.loads(data)["error"]["message"]


def _patch_u32(src, dst, key: str, value: int) -> None:
    """Copy a GGUF and overwrite one UINT32 key's value in place."""
    shutil.copyfile(src, dst)
    data = bytearray(dst.read_bytes())
    needle = struct.pack("<Q", len(key)) + key.encode()
    i = data.find(needle)
    assert i > 0, key
    j = i + len(needle)
    vtype = struct.unpack_from("<I", data, j)[0]
    assert vtype == 4, f"{key} is not a UINT32 ({vtype})"
    struct.pack_into("<I", data, j + 4, value)
    dst.write_bytes(bytes(data))


CORRUPT = [
    ("qwen3moe.expert_used_count", 64, "expert_used_count (64) exceeds expert_count (16)"),
    ("qwen3moe.expert_used_count", 0, "expert_used_count is 0"),
    ("qwen3moe.expert_count", 0, "expert_used_count (4) exceeds expert_count (0)"),
    ("qwen3moe.expert_count", 1 << 24, "expert_count is 16777216"),
    ("qwen3moe.block_count", 1000, "block_count is 1000"),
]


@pytest.mark.parametrize("key,value,expect", CORRUPT)
def test_corrupt_moe_hyperparameters_are_load_errors(tiny_model, llama_server_bin, tmp_path, key, value, expect):
    bad = tmp_path / "bad.gguf"
    _patch_u32(tiny_model, bad, key, value)
    # the server exits with an error instead of an abort (exit 134 / SIGABRT)
    with pytest.raises(ServerError) as e:
        with ServerProcess(bad, args=ARGS, timeout=60):
            pass
    assert "invalid hyperparameters" in str(e.value) and expect in str(e.value)
    assert "status -6" not in str(e.value) and "status 134" not in str(e.value)
    # the Python API raises instead of killing the interpreter
    with pytest.raises(moecache.ModelLoadError) as e2:
        moecache.Model(bad)
    assert expect in str(e2.value)


@pytest.mark.parametrize("flag,value", [("--spec-synth-rates", "abc"), ("--spec-synth-rates", "0.5,x"),
                                        ("--spec-synth-len", "long")])
def test_bad_synthetic_acceptance_flags_name_the_value(tiny_model, llama_server_bin, flag, value):
    with pytest.raises(ServerError) as e:
        with ServerProcess(tiny_model, args=ARGS + [flag, value], timeout=60):
            pass
    assert flag in str(e.value) and "expected" in str(e.value)


@pytest.mark.parametrize("args,env,expect", [
    (["-c", "-5"], {}, "-c/--ctx-size must be >= 0"),
    (["-ub", "0"], {}, "-ub/--ubatch-size must be >= 1"),
    (["-b", "-1"], {}, "-b/--batch-size must be >= 1"),
    (["--port", "99999"], {}, "--port must be 1 to 65535"),
    ([], {"LLAMA_ARG_PORT": "70000"}, "--port must be 1 to 65535"),
])
def test_llama_server_refuses_basic_values_out_of_range(tiny_model, llama_server_bin, args, env, expect):
    """llama-server itself, without the launcher: -c -5 reached a GGML_ASSERT (exit 134) and --port 99999
    listened on another port than its log said; now the argument parser names the flag and exits."""
    import os
    import subprocess

    r = subprocess.run([str(llama_server_bin), "-m", str(tiny_model), *args], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode not in (0, -6, 134), r.returncode
    assert expect in r.stderr + r.stdout, (r.stderr + r.stdout)[-2000:]
    assert "GGML_ASSERT" not in r.stderr
