"""llama-server as a child process: find the built binary, start it on a free loopback port, wait until
it is healthy, talk to it, stop it. The launcher (`moecache-server`), `moecache plan --measure`, the
benchmarks and the tests share it.

    with ServerProcess("model.gguf", args=["-c", "512", "-t", "2"]) as srv:
        status, body = srv.post("/completion", {"prompt": "def", "n_predict": 8})
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .gguf import check_model_file


DEFAULT_HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """llama-server could not be started or did not become healthy."""


def server_binary() -> Path:
    """The built llama-server (paths.binary: MOECACHE_BIN_DIR, the package, a checkout's build)."""
    from .paths import binary

    return binary("llama-server")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent_hook():
    """A preexec_fn for Popen that makes the child get SIGTERM when this process dies, even by
    SIGKILL (Linux: prctl(PR_SET_PDEATHSIG)), so no llama-server is left serving its port without
    its launcher. None where that is not available. The signal follows the thread that starts the
    child: call Popen from a thread that lives as long as the child (run_forwarding waits in it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook():
        if prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0)) != 0:
            return  # not allowed here: run without it, as before
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os._exit(1)

    return hook


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_request(url: str, method: str = "GET", body: object = None, timeout: float = 600.0
                 ) -> tuple[int, object]:
    """One HTTP request to a loopback server; returns (status, parsed JSON or text)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")
    finally:
        conn.close()


class ServerProcess:
    """llama-server on 127.0.0.1 for tests and benchmarks.

        with ServerProcess("model.gguf", args=["-c", "512", "-t", "2"]) as srv:
            status, body = srv.post("/completion", {"prompt": "def", "n_predict": 8})

    The server's stdout and stderr go to a log file (`.log_text()`); if the server exits or does
    not become healthy within `timeout` seconds, ServerError carries the last lines of that log.
    """

    def __init__(self, model: str | os.PathLike, args: Sequence[str] = (), port: int | None = None,
                 env: Mapping[str, str] | None = None, host: str = DEFAULT_HOST,
                 timeout: float = 120.0, log_path: str | os.PathLike | None = None):
        self.model = str(model)
        self.args = [str(a) for a in args]
        self.host = host
        self.port = port
        self.env = dict(env or {})
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else None
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [str(server_binary()), "-m", self.model, "--host", self.host, "--port", str(self.port),
                *self.args]

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _tail(self, n: int = 40) -> str:
        lines = self.log_text().splitlines()[-n:]
        return "\n".join("    " + line for line in lines) or "    (the log is empty)"

    def start(self) -> "ServerProcess":
        problem = check_model_file(self.model)
        if problem:
            raise ServerError(problem)
        fixed_port = self.port is not None
        for attempt in range(3):
            if not fixed_port:
                self.port = free_port(self.host)
            if self._own_log:
                self.cleanup()  # the log of a failed earlier attempt
                fd, name = tempfile.mkstemp(prefix="moecache-server-", suffix=".log")
                os.close(fd)
                self.log_path = Path(name)
            env = dict(os.environ)
            env.update(self.env)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=os.name == "posix")
            try:
                self._wait_healthy()
                return self
            except ServerError:
                bind_race = "couldn't bind" in self.log_text()
                if fixed_port or not bind_race or attempt == 2:
                    raise
            except BaseException:  # Ctrl-C while waiting: leave no server behind
                self.stop()
                raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        last = "no answer yet"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.returncode = rc
                raise ServerError(
                    f"llama-server exited with status {rc} before it became healthy.\n"
                    f"  command: {' '.join(self.command)}\n  last log lines:\n{self._tail()}")
            try:
                status, body = http_request(self.url + "/health", timeout=2.0)
                if status == 200:
                    return
                last = f"HTTP {status}: {body}"
            except (OSError, http.client.HTTPException) as e:
                last = str(e)
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"llama-server did not become healthy within {self.timeout:.0f} s (last /health: {last}).\n"
                    f"  command: {' '.join(self.command)}\n  last log lines:\n{self._tail()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait up to `timeout` seconds, then SIGKILL. Returns the exit status."""
        if self.proc is None:
            return self.returncode
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.returncode = self.proc.returncode
        return self.returncode

    def get(self, path: str, timeout: float = 600.0) -> tuple[int, object]:
        return http_request(self.url + path, "GET", None, timeout)

    def post(self, path: str, body: object, timeout: float = 600.0) -> tuple[int, object]:
        return http_request(self.url + path, "POST", body, timeout)

    def cleanup(self) -> None:
        """Remove the log file this object created."""
        if self._own_log and self.log_path is not None and self.log_path.exists():
            self.log_path.unlink()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is None:
            self.cleanup()
