"""VRAM ballast: hold a GPU's memory down to a budget, so that a big GPU stands in for a smaller one.

    python -m moecache.bench.ballast --leave-gib 24

On every visible CUDA device (CUDA_VISIBLE_DEVICES applies; --devices picks some) the ballast
reads the free memory (cudaMemGetInfo) and allocates free - budget in chunks (1 GiB, the rest in
one piece rounded down to 2 MiB; when a chunk does not fit, the chunk size is halved and the plan
made again from the free memory then), until about `budget` bytes are left free. Then it prints
ONE line of JSON to stdout:

    {"ready": true, "budget_bytes": ..., "library": "libcudart.so.13", "api": "runtime",
     "devices": [{"device": 0, "name": "...", "total": ..., "free_before": ..., "held": ...,
                  "free_after": ..., "chunks": 115, "warning": null}]}

and waits until its stdin closes (the parent went away or closed the pipe) or it gets SIGTERM,
SIGINT or SIGHUP; it then frees the memory and exits 0. A device with less free memory than the
budget holds nothing and says so in "warning". On an error the one line is {"error": "...",
"kind": "no-cuda" | "failed"} (also on stderr), and the exit status is 2 for no CUDA (no runtime
library, no device) and 1 otherwise.

The CUDA runtime is loaded with ctypes (no torch, no build): MOECACHE_CUDART names the library to
use (a file name or a path; only that one is tried), else ctypes.util.find_library("cudart"), the
usual sonames (libcudart.so, .so.13, .so.12, .so.11.0) in the loader's paths, under CUDA_HOME /
CUDA_PATH / /usr/local/cuda, and in the nvidia-cuda-runtime wheels of sys.path; when no runtime
loads, the driver API (libcuda.so.1) does the same job.

`moecache bench --vram-budget GIB` (or a scenario's vram_budget_gib) runs one ballast per arm with
the `Ballast` class here: started before the arm's server, stopped after the server has stopped.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

GIB = 1 << 30
MIB = 1 << 20
ALIGN = 2 * MIB  # cudaMalloc hands out large blocks in 2 MiB pages
CHUNK = GIB
READY_TIMEOUT = 180.0  # seconds for the ballast to create its contexts and allocate (usually a few)

RUNTIME_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
DRIVER_NAMES = ("libcuda.so.1", "libcuda.so")
OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY


class BallastError(RuntimeError):
    """The ballast could not hold the memory. `no_cuda`: there is no CUDA runtime or no device."""

    def __init__(self, message: str, no_cuda: bool = False):
        super().__init__(message)
        self.no_cuda = no_cuda


# --------------------------------------------------------------------------- planning (pure)


def plan_chunks(free: int, budget: int, chunk: int = CHUNK, align: int = ALIGN) -> list[int]:
    """Allocation sizes that take `free` bytes down to about `budget`: whole chunks, then the rest
    rounded down to `align` (so at most `align` - 1 bytes above the budget stay free). Nothing when
    free is at or below the budget."""
    if chunk <= 0 or align <= 0:
        raise ValueError("chunk and align must be positive")
    excess = free - budget
    if excess < align:
        return []
    n, rest = divmod(excess, chunk)
    sizes = [chunk] * n
    rest -= rest % align
    if rest:
        sizes.append(rest)
    return sizes


# --------------------------------------------------------------------------- CUDA through ctypes


class CudaApi:
    """The few calls the ballast needs, from the CUDA runtime (libcudart) or the driver (libcuda)."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.lib = lib
        self.name = name
        self.api = "runtime" if hasattr(lib, "cudaMalloc") else "driver"
        self._ctx: dict[int, ctypes.c_void_p] = {}
        if self.api == "driver":
            self._check(lib.cuInit(0), "cuInit")

    def _error(self, code: int) -> str:
        try:
            if self.api == "runtime":
                f = self.lib.cudaGetErrorString
                f.restype = ctypes.c_char_p
                s = f(code)
            else:
                p = ctypes.c_char_p()
                s = p.value if self.lib.cuGetErrorString(code, ctypes.byref(p)) == 0 else None
            return f"{s.decode(errors='replace') if s else 'unknown error'} (error {code})"
        except (AttributeError, OSError):
            return f"error {code}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise BallastError(f"{what} failed: {self._error(code)}", no_cuda=what in ("cuInit", "device count"))

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        if self.api == "runtime":
            code = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        else:
            code = self.lib.cuDeviceGetCount(ctypes.byref(n))
        if code != 0:
            raise BallastError(f"the device count failed: {self._error(code)}", no_cuda=True)
        return n.value

    def use(self, device: int) -> None:
        """Make `device` current (creating its context)."""
        if self.api == "runtime":
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            self._check(self.lib.cudaFree(ctypes.c_void_p(0)), f"creating the context of device {device}")
            return
        if device not in self._ctx:
            dev = ctypes.c_int(0)
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
            ctx = ctypes.c_void_p()
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._ctx[device] = ctx
        self._check(self.lib.cuCtxSetCurrent(self._ctx[device]), "cuCtxSetCurrent")

    def name_of(self, device: int) -> str | None:
        try:
            if self.api == "driver":
                dev = ctypes.c_int(0)
                buf = ctypes.create_string_buffer(256)
                if self.lib.cuDeviceGet(ctypes.byref(dev), device) == 0 and \
                        self.lib.cuDeviceGetName(buf, 256, dev) == 0:
                    return buf.value.decode(errors="replace")
                return None
            # cudaDeviceProp starts with char name[256] in every CUDA version; the buffer is larger
            # than any version's struct
            buf = ctypes.create_string_buffer(16384)
            for sym in ("cudaGetDeviceProperties_v2", "cudaGetDeviceProperties"):
                f = getattr(self.lib, sym, None)
                if f is not None and f(buf, device) == 0:
                    return buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace") or None
        except (AttributeError, OSError):
            pass
        return None

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if self.api == "runtime":
            self._check(self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        else:
            self._check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def malloc(self, size: int):
        """A device pointer of `size` bytes, or None when the device is out of memory."""
        if self.api == "runtime":
            p = ctypes.c_void_p()
            code = self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size))
            if code == OUT_OF_MEMORY:
                self.lib.cudaGetLastError()  # clear it: out of memory is not sticky
                return None
            self._check(code, f"cudaMalloc({size})")
            return p
        p = ctypes.c_uint64(0)
        code = self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size))
        if code == OUT_OF_MEMORY:
            return None
        self._check(code, f"cuMemAlloc({size})")
        return p

    def free(self, ptr) -> None:
        if self.api == "runtime":
            self.lib.cudaFree(ptr)
        else:
            self.lib.cuMemFree_v2(ptr)


def library_candidates(environ=None) -> list[str]:
    """Where to look for the CUDA runtime, in order (MOECACHE_CUDART alone when it is set)."""
    environ = os.environ if environ is None else environ
    if environ.get("MOECACHE_CUDART"):
        return [environ["MOECACHE_CUDART"]]
    out: list[str] = []
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    out += RUNTIME_NAMES
    roots = [environ.get("CUDA_HOME"), environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            out += sorted(glob.glob(os.path.join(root, sub, "libcudart.so*")), reverse=True)
    for entry in sys.path:  # the runtime that pip's nvidia-cuda-runtime wheels ship (torch's, for one)
        if entry and os.path.isdir(os.path.join(entry, "nvidia")):
            out += sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "lib", "libcudart.so*")), reverse=True)
            out += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_runtime", "lib", "libcudart.so*")),
                          reverse=True)
    out += DRIVER_NAMES
    seen: set[str] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


def open_cuda(candidates: Sequence[str] | None = None) -> tuple[CudaApi, int]:
    """The first candidate library that loads, has the runtime's (or the driver's) calls and sees a
    device, with its device count. A library that loads but sees no device (no driver, a driver too
    old for that runtime, CUDA_VISIBLE_DEVICES empty) gives way to the next one."""
    candidates = library_candidates() if candidates is None else list(candidates)
    tried, unusable = [], []
    handles: set[int] = set()
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name} ({str(e).split(':')[-1].strip() or 'cannot load'})")
            continue
        if lib._handle in handles:
            continue  # a library already tried under another name
        handles.add(lib._handle)
        if not (hasattr(lib, "cudaMalloc") or hasattr(lib, "cuMemAlloc_v2")):
            tried.append(f"{name} (not a CUDA runtime or driver library)")
            continue
        try:
            cuda = CudaApi(lib, os.path.basename(name))
            count = cuda.device_count()
        except BallastError as e:
            unusable.append(f"{os.path.basename(name)}: {e}")
            continue
        if count < 1:
            unusable.append(f"{os.path.basename(name)}: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
            continue
        return cuda, count
    if unusable:
        raise BallastError(f"no usable CUDA device ({'; '.join(unusable)})", no_cuda=True)
    hint = ("MOECACHE_CUDART names the library to use" if os.environ.get("MOECACHE_CUDART")
            else "set MOECACHE_CUDART to the path of libcudart.so")
    raise BallastError(f"no CUDA runtime library could be loaded (tried {'; '.join(tried) or 'nothing'}). "
                       f"Fix: run on a machine with a CUDA GPU and its runtime, or {hint}", no_cuda=True)


# --------------------------------------------------------------------------- holding memory


def hold_device(cuda, device: int, budget: int, chunk: int = CHUNK, max_allocs: int = 1 << 16) -> tuple[dict, list]:
    """Allocate on `device` until about `budget` bytes are free; (its record, the pointers held).

    `cuda` has use(), mem_info(), malloc() (None when out of memory) and name_of(). Each round reads
    the free memory and allocates plan_chunks() of it; when an allocation does not fit (fragmentation,
    another process), the chunk size is halved and the next round plans again from the free memory
    then, until a round has nothing left to take or not even one 2 MiB page fits."""
    cuda.use(device)
    free_before, total = cuda.mem_info()
    ptrs: list = []
    held = 0
    warning = None
    if free_before <= budget:
        warning = (f"device {device}: only {free_before / GIB:.2f} GiB free, not more than the budget "
                   f"{budget / GIB:.2f} GiB: nothing held")
    else:
        size_now = chunk
        while len(ptrs) < max_allocs:
            free, _total = cuda.mem_info()
            sizes = plan_chunks(free, budget, size_now)
            if not sizes:
                break
            refused = None
            for size in sizes:
                p = cuda.malloc(size)
                if p is None:
                    refused = size
                    break
                ptrs.append(p)
                held += size
            if refused is not None:
                if refused <= ALIGN:
                    break  # not even a page fits
                size_now = max(ALIGN, refused // 2 - (refused // 2) % ALIGN)
    free_after, _ = cuda.mem_info()
    if warning is None and free_after >= budget + ALIGN:
        warning = (f"device {device}: {free_after / GIB:.2f} GiB still free after holding {held / GIB:.2f} GiB "
                   f"(budget {budget / GIB:.2f} GiB): the allocations stopped early")
    rec = {"device": device, "name": cuda.name_of(device), "total": total, "free_before": free_before,
           "held": held, "free_after": free_after, "chunks": len(ptrs), "warning": warning}
    return rec, ptrs


def parse_devices(text: str | None, count: int) -> list[int]:
    if not text:
        return list(range(count))
    try:
        devs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BallastError(f"--devices takes device numbers such as 0,1, got {text!r}") from None
    bad = [d for d in devs if not 0 <= d < count]
    if bad:
        raise BallastError(f"no device {', '.join(map(str, bad))}: {count} visible (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return devs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moecache.bench.ballast",
        description="Hold every visible GPU's memory down to a budget (emulate a smaller GPU on a big one): "
                    "allocate free - budget bytes in chunks, print one JSON line (device, total, free before, "
                    "held, free after), wait until stdin closes or SIGTERM/SIGINT, then free it and exit.")
    p.add_argument("--leave-gib", type=float, required=True, metavar="GIB",
                   help="GiB of device memory to leave free on each device (the emulated GPU's size)")
    p.add_argument("--devices", metavar="0,1",
                   help="only these devices (numbers as CUDA sees them after CUDA_VISIBLE_DEVICES; default: all)")
    p.add_argument("--chunk-mib", type=int, default=CHUNK // MIB, metavar="MIB",
                   help=f"size of one allocation (default {CHUNK // MIB}); the rest goes in one smaller piece")
    p.add_argument("--ignore-stdin", action="store_true",
                   help="wait for a signal only (for a ballast started in the background with no stdin)")
    return p


def _say_error(e: BallastError) -> int:
    print(json.dumps({"error": str(e), "kind": "no-cuda" if e.no_cuda else "failed"}), flush=True)
    print(f"moecache ballast: {e}", file=sys.stderr, flush=True)
    return 2 if e.no_cuda else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.leave_gib < 0 or args.chunk_mib < 2:
        return _say_error(BallastError("--leave-gib must be >= 0 and --chunk-mib >= 2"))
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if s is not None:
            signal.signal(s, lambda *_: stop.set())
    budget = int(args.leave_gib * GIB)
    held: list[tuple[CudaApi, int, list]] = []
    try:
        cuda, count = open_cuda()
        records = []
        for dev in parse_devices(args.devices, count):
            rec, ptrs = hold_device(cuda, dev, budget, args.chunk_mib * MIB)
            held.append((cuda, dev, ptrs))
            records.append(rec)
            if rec["warning"]:
                print(f"moecache ballast: warning: {rec['warning']}", file=sys.stderr, flush=True)
    except BallastError as e:
        return _say_error(e)
    print(json.dumps({"ready": True, "budget_bytes": budget, "library": cuda.name, "api": cuda.api,
                      "pid": os.getpid(), "devices": records}), flush=True)

    if not args.ignore_stdin:
        def watch_stdin():
            try:
                while sys.stdin.buffer.read(4096):
                    pass
            except (OSError, ValueError):
                pass
            stop.set()

        threading.Thread(target=watch_stdin, name="ballast-stdin", daemon=True).start()
    while not stop.wait(0.5):
        pass
    for api, dev, ptrs in held:
        try:
            api.use(dev)
            for p in ptrs:
                api.free(p)
        except BallastError:
            pass  # the process exit releases it anyway
    return 0


# --------------------------------------------------------------------------- the bench's side


def ballast_command(leave_gib: float) -> list[str]:
    """The command `moecache bench` runs for a budget of `leave_gib` GiB."""
    return [sys.executable, "-m", "moecache.bench.ballast", "--leave-gib", f"{leave_gib:g}"]


class Ballast:
    """One ballast process for one arm: start() waits for its ready line and returns it (with
    "budget_gib" and "ready_s" added); stop() closes its stdin, waits, then signals it.

        b = Ballast(24.0, env=arm_env)
        record = b.start()      # BallastError with a clear message on no CUDA, a timeout or a crash
        ...                     # start the server, measure, stop the server
        b.stop()
    """

    def __init__(self, leave_gib: float, env: dict[str, str] | None = None, timeout: float | None = None,
                 cmd: Sequence[str] | None = None):
        self.leave_gib = float(leave_gib)
        self.env = dict(env or {})
        self.timeout = timeout  # None: READY_TIMEOUT
        self.cmd = list(cmd) if cmd is not None else ballast_command(self.leave_gib)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def _stderr_tail(self, n: int = 12) -> str:
        if self._log is None:
            return ""
        try:
            lines = Path(self._log.name).read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines)

    def start(self) -> dict:
        from ..process import die_with_parent_hook

        env = dict(os.environ)
        env.update(self.env)
        self._log = tempfile.NamedTemporaryFile(prefix="moecache-ballast-", suffix=".log", delete=False)
        t0 = time.monotonic()
        # a session of its own (a terminal's Ctrl-C reaches the bench, which stops it in order); it
        # also ends when the bench dies: stdin closes, and SIGTERM where the system allows it
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, start_new_session=os.name == "posix",
                                     preexec_fn=die_with_parent_hook())
        lines: queue.Queue = queue.Queue()

        def read():
            try:
                lines.put(self.proc.stdout.readline())
            except (OSError, ValueError):
                lines.put(b"")

        threading.Thread(target=read, name="ballast-ready", daemon=True).start()
        timeout = READY_TIMEOUT if self.timeout is None else self.timeout
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            self.stop(timeout=5)
            raise BallastError(f"the VRAM ballast ({' '.join(self.cmd)}) did not report ready within "
                               f"{timeout:.0f} s; its stderr:\n{self._stderr_tail() or '    (empty)'}") from None
        except BaseException:
            self.stop()
            raise
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not (msg.get("ready") or msg.get("error")):
            rc = self.stop()
            raise BallastError(f"the VRAM ballast exited (status {rc}) without a ready line "
                               f"(got {line[:200]!r}); its stderr:\n{self._stderr_tail() or '    (empty)'}")
        if msg.get("error"):
            rc = self.stop()
            raise BallastError(str(msg["error"]), no_cuda=msg.get("kind") == "no-cuda" or rc == 2)
        msg["budget_gib"] = self.leave_gib
        msg["ready_s"] = round(time.monotonic() - t0, 2)
        return msg

    def stop(self, timeout: float = 30.0) -> int | None:
        """Close its stdin (it frees the memory and exits), then SIGTERM, then SIGKILL. Its exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in (p.stdin, p.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if self._log is not None:
            self._log.close()
            if p.returncode == 0:
                try:
                    os.unlink(self._log.name)
                except OSError:
                    pass
        return p.returncode


if __name__ == "__main__":
    sys.exit(main())
