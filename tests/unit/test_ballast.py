"""moecache.bench.ballast: the chunk plan, holding memory on a simulated device, the clear error without
a CUDA runtime, and the bench's side (ready line, stop). One test holds 1 GiB on a real GPU when there is
one (skipped elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moecache.bench import ballast
from moecache.bench.ballast import ALIGN, GIB, MIB, Ballast, BallastError, hold_device, open_cuda, plan_chunks


# --------------------------------------------------------------------------- the plan


def test_plan_chunks_takes_free_down_to_the_budget():
    free, budget = 139 * GIB + 700 * MIB + 12345, 24 * GIB
    sizes = plan_chunks(free, budget)
    assert sizes[:-1] == [GIB] * 115 and sizes[-1] == 700 * MIB
    left = free - sum(sizes)
    assert budget <= left < budget + ALIGN
    assert all(s % ALIGN == 0 for s in sizes)


@pytest.mark.parametrize("free,budget", [(80 * GIB, 24 * GIB), (24 * GIB + 3 * MIB, 24 * GIB),
                                         (25 * GIB - 1, 24 * GIB), (3 * GIB + 5, 0), (GIB, GIB // 3)])
def test_plan_chunks_leaves_less_than_one_page_above_the_budget(free, budget):
    sizes = plan_chunks(free, budget)
    assert all(0 < s <= GIB and s % ALIGN == 0 for s in sizes)
    assert budget <= free - sum(sizes) < budget + ALIGN


def test_plan_chunks_holds_nothing_at_or_below_the_budget():
    assert plan_chunks(20 * GIB, 24 * GIB) == []
    assert plan_chunks(24 * GIB, 24 * GIB) == []
    assert plan_chunks(24 * GIB + ALIGN - 1, 24 * GIB) == []  # less than one page to take
    assert plan_chunks(10 * GIB, 7 * GIB, chunk=4 * GIB) == [3 * GIB]
    with pytest.raises(ValueError):
        plan_chunks(GIB, 0, chunk=0)


# --------------------------------------------------------------------------- holding, on a simulated device


class FakeCuda:
    """A device with `free` bytes free of `total`; allocations above `largest` (fragmentation) or above
    the free memory fail (None), as cudaMalloc's out-of-memory does."""

    def __init__(self, total: int, free: int, largest: int | None = None):
        self.total, self.free_bytes, self.largest = total, free, largest
        self.current = None
        self.calls = []

    def use(self, device):
        self.current = device

    def mem_info(self):
        return self.free_bytes, self.total

    def malloc(self, size):
        self.calls.append(size)
        if size > self.free_bytes or (self.largest is not None and size > self.largest):
            return None
        self.free_bytes -= size
        return object()

    def name_of(self, device):
        return "Fake GPU"


def test_hold_device_leaves_the_budget():
    cuda = FakeCuda(total=140 * GIB, free=139 * GIB + 300 * MIB)
    rec, ptrs = hold_device(cuda, 0, 24 * GIB)
    assert cuda.current == 0
    assert rec["free_before"] == 139 * GIB + 300 * MIB and rec["total"] == 140 * GIB
    assert 24 * GIB <= rec["free_after"] < 24 * GIB + ALIGN
    assert rec["held"] == rec["free_before"] - rec["free_after"] == 115 * GIB + 300 * MIB
    assert rec["chunks"] == len(ptrs) == 116 and rec["warning"] is None and rec["name"] == "Fake GPU"


def test_hold_device_halves_chunks_that_do_not_fit():
    cuda = FakeCuda(total=80 * GIB, free=70 * GIB, largest=300 * MIB)
    rec, ptrs = hold_device(cuda, 1, 24 * GIB)
    assert 24 * GIB <= rec["free_after"] < 24 * GIB + ALIGN
    assert rec["held"] == 46 * GIB and rec["warning"] is None
    assert cuda.calls[:3] == [GIB, 512 * MIB, 256 * MIB]  # halved until a chunk fit, then kept at that size
    assert set(cuda.calls[2:]) == {256 * MIB} and len(ptrs) == 46 * 4


def test_hold_device_holds_nothing_when_the_budget_is_larger_than_the_free_memory():
    cuda = FakeCuda(total=24 * GIB, free=22 * GIB)
    rec, ptrs = hold_device(cuda, 0, 24 * GIB)
    assert ptrs == [] and rec["held"] == 0 and rec["free_after"] == 22 * GIB and cuda.calls == []
    assert "only 22.00 GiB free" in rec["warning"] and "nothing held" in rec["warning"]


def test_hold_device_warns_when_it_stops_early():
    class Stuck(FakeCuda):
        def malloc(self, size):
            self.calls.append(size)
            return None  # out of memory for every size, although memory is reported free

    rec, ptrs = hold_device(Stuck(total=80 * GIB, free=70 * GIB), 0, 24 * GIB)
    assert rec["held"] == 0 and "stopped early" in rec["warning"]


# --------------------------------------------------------------------------- no CUDA


def test_no_cuda_runtime_is_a_clear_error():
    with pytest.raises(BallastError) as e:
        open_cuda(["libmoecache-no-such-cudart.so", "libmoecache-no-such-cuda.so.1"])
    assert e.value.no_cuda
    msg = str(e.value)
    assert msg.startswith("no CUDA runtime library could be loaded")
    assert "libmoecache-no-such-cudart.so" in msg and "libmoecache-no-such-cuda.so.1" in msg and "Fix:" in msg


def test_a_library_that_is_not_cuda_is_skipped():
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no libc to load")
    with pytest.raises(BallastError, match="not a CUDA runtime or driver library"):
        open_cuda([libc])


def test_library_candidates(monkeypatch):
    assert ballast.library_candidates({"MOECACHE_CUDART": "/opt/x/libcudart.so.12"}) == ["/opt/x/libcudart.so.12"]
    c = ballast.library_candidates({})
    assert {"libcudart.so", "libcudart.so.13", "libcudart.so.12"} <= set(c)
    assert c[-2:] == ["libcuda.so.1", "libcuda.so"]  # the driver API last
    assert len(c) == len(set(c))


def _module_env(**extra) -> dict:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(ballast.__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_module_without_a_cuda_runtime_prints_the_error_line():
    r = subprocess.run([sys.executable, "-m", "moecache.bench.ballast", "--leave-gib", "24"],
                       env=_module_env(MOECACHE_CUDART="libmoecache-no-such-cudart.so"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    [line] = r.stdout.splitlines()
    msg = json.loads(line)
    assert msg["kind"] == "no-cuda" and "no CUDA runtime library could be loaded" in msg["error"]
    assert "libmoecache-no-such-cudart.so" in r.stderr


def test_module_help():
    r = subprocess.run([sys.executable, "-m", "moecache.bench.ballast", "--help"], env=_module_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--leave-gib", "--devices", "--chunk-mib", "--ignore-stdin"):
        assert flag in r.stdout


def test_the_bench_side_of_no_cuda():
    b = Ballast(24, env={"MOECACHE_CUDART": "libmoecache-no-such-cudart.so",
                         "PYTHONPATH": _module_env()["PYTHONPATH"]})
    with pytest.raises(BallastError) as e:
        b.start()
    assert e.value.no_cuda and "no CUDA runtime library could be loaded" in str(e.value)
    assert b.proc.returncode == 2


# --------------------------------------------------------------------------- the bench's side, with a stand-in


STAND_IN = textwrap.dedent('''
    import json, sys
    mode, flag = sys.argv[1], sys.argv[2]
    if mode == "ready":
        print(json.dumps({"ready": True, "budget_bytes": 1, "devices": [{"device": 0, "held": 5}]}), flush=True)
        sys.stdin.read()
        open(flag, "w").write("released")
    elif mode == "garbage":
        print("hello", flush=True)
        sys.exit(3)
    elif mode == "crash":
        print("Traceback: boom", file=sys.stderr, flush=True)
        sys.exit(1)
    elif mode == "hang":
        sys.stdin.read()
''')


def stand_in(tmp_path, mode):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return [sys.executable, str(script), mode, str(tmp_path / "released")]


def test_ballast_start_and_stop(tmp_path):
    b = Ballast(24, cmd=stand_in(tmp_path, "ready"))
    rec = b.start()
    assert rec["ready"] is True and rec["devices"] == [{"device": 0, "held": 5}]
    assert rec["budget_gib"] == 24.0 and rec["ready_s"] >= 0
    assert b.proc.poll() is None  # it holds until stopped
    assert b.stop() == 0
    assert (tmp_path / "released").read_text() == "released"  # it saw its stdin close
    assert b.stop() == 0  # twice is harmless


def test_ballast_errors_are_clear(tmp_path):
    with pytest.raises(BallastError, match="without a ready line") as e:
        Ballast(24, cmd=stand_in(tmp_path, "garbage")).start()
    assert not e.value.no_cuda
    with pytest.raises(BallastError, match="Traceback: boom"):
        Ballast(24, cmd=stand_in(tmp_path, "crash")).start()
    b = Ballast(24, cmd=stand_in(tmp_path, "hang"), timeout=0.5)
    with pytest.raises(BallastError, match="did not report ready within 0 s|did not report ready within 1 s"):
        b.start()
    assert b.proc.poll() is not None  # stopped, not left behind


def test_ballast_command_runs_this_module():
    cmd = ballast.ballast_command(24.0)
    assert cmd[0] == sys.executable and cmd[1:] == ["-m", "moecache.bench.ballast", "--leave-gib", "24"]
    assert ballast.ballast_command(7.5)[-1] == "7.5"


# --------------------------------------------------------------------------- a real GPU, where there is one


def _usable_gpu() -> bool:
    r = subprocess.run([sys.executable, "-c", "from moecache.bench.ballast import open_cuda; open_cuda()"],
                       env=_module_env(), capture_output=True, timeout=120)
    return r.returncode == 0


@pytest.mark.skipif(not _usable_gpu(), reason="no usable CUDA device")
def test_real_gpu_holds_one_gib(tmp_path):
    """On a GPU: a ballast that leaves free - 1 GiB holds about 1 GiB, and a second process (as the
    server would be) sees the budget free; after stop() the memory is back."""
    probe = [sys.executable, "-c", "from moecache.bench.ballast import open_cuda; c, n = open_cuda(); c.use(0); "
                                   "print(c.mem_info()[0])"]
    env = _module_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    free0 = int(subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=True).stdout)
    budget_gib = (free0 - GIB) / GIB
    b = Ballast(budget_gib, env=env)
    rec = b.start()
    try:
        [d] = rec["devices"]
        assert d["held"] >= GIB - 700 * MIB and abs(d["free_after"] - budget_gib * GIB) < 64 * MIB
        seen = int(subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=True).stdout)
        assert seen < free0 - GIB // 2
    finally:
        assert b.stop() == 0
    after = int(subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=True).stdout)
    assert after > free0 - 256 * MIB
