"""Native tests built with the patched tree (tests/native/*.cpp), run through pytest so CI runs them."""

from __future__ import annotations

import re
import subprocess

import pytest

from moecache.paths import binary


def run_native(name: str, *args: str, timeout: float = 600) -> str:
    try:
        exe = binary(name)
    except FileNotFoundError as e:
        pytest.fail(f"the native test {name} is not built: {e}")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{name} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    return r.stdout


def test_mul_mat_id_skip_ids_on_cpu():
    """MUL_MAT_ID rows with id < 0 are zero, the others unchanged (F32/F16/Q4_0/Q8_0/Q4_K, 1..64 tokens)."""
    out = run_native("test-mul-mat-id-skip", "2")
    assert "140 passed, 0 failed" in out, out[-2000:]
    # ggml_mul_mat_id_table: matrices through an address table equal the plain op bit for bit
    assert "table: 35 passed, 0 failed" in out, out[-2000:]


def test_top_k_ordered_on_cpu():
    """ggml_top_k_ordered takes ties at the k-th value from the lowest indices and returns the
    indices in increasing order (rows with long runs of ties and -inf), and the top k of a subsequence
    holding a row's top k, mapped back, is the row's (what QSA's block-level top-k rests on)."""
    out = run_native("test-top-k-ordered", "2")
    assert out.strip().endswith(" 0 failed"), out[-2000:]
    assert "248 passed" in out, out[-500:]


def test_moe_cache_policies():
    """The cache's policies: fill order, FREQ rebalance with hysteresis, LRU admission gate and victim,
    upload cap, busy slots, failed uploads, pins, the retarget of a kept layer, and the map invariants under
    random routing."""
    out = run_native("test-moe-cache-policy")
    assert out.strip().endswith("0 failed"), out[-2000:]
    assert " passed," in out


def test_the_qsa_indexer_bench_times_every_stage():
    """benchmarks/native/bench_qsa_indexer.cpp: one JSON line per stage and shape, each a
    positive median time, on the CPU here (the device phase runs it on the GPU at depth)."""
    import json

    out = run_native("bench-qsa-indexer", "-d", "CPU", "-k", "300,1000", "-t", "1,4", "-r", "2")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    stages = {"pool", "score", "expand", "top_k", "top_k_blocks", "top_k_ordered", "block_topk"}
    assert {(r["stage"], r["n_kv"], r["n_tps"]) for r in rows} == {
        (s, k, t) for s in stages for k in (300, 1000) for t in (1, 4)}
    assert all(r["ms"] > 0 and r["ms_min"] <= r["ms"] and r["device"] == "CPU" for r in rows), rows


def assert_usage_error(name: str, args: list[str], message: str) -> None:
    """The tool refuses the arguments with exit status 2 and says why."""
    r = subprocess.run([str(binary(name)), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr[-1000:])


def test_the_qsa_indexer_bench_names_a_bad_argument():
    assert_usage_error("bench-qsa-indexer", ["-k", "12,x"], "not a list of positive integers")
    assert_usage_error("bench-qsa-indexer", ["-d", "NoSuchDevice"], "no device named 'NoSuchDevice'")


def test_the_cpu_mmid_bench_reports_both_modes_and_the_flat_split_and_x4_dots_are_exact():
    """benchmarks/native/bench_cpu_mmid.cpp: one JSON line per mode and thread count, a positive
    time per token and the expert bytes a token reads (a small shape here: 2 layers, 16 experts, 2 used; the
    device phase runs the 30B shape). Its checksum of the outputs is the same with the flat split
    (GGML_CPU_MMID_FLAT=1) as with the stock one, in the GGUF layout and repacked for the CPU, and with
    huge pages: the flat split computes the same rows, bit for bit (checked to fail with rows left out).
    The same with the four-row dot products (GGML_CPU_DOT_X4=1), alone and with the flat split
    (checked to fail with two rows' results swapped and with the kernel's last block left out), and with
    both turned on for the tool's CPU backend alone by the per-context setters (--flat --x4), whose path the
    backend's line names (and the stock path's runs have no such line)."""
    import json
    import os

    exe = binary("bench-cpu-mmid")
    args = [str(exe), "-l", "2", "-e", "16", "-u", "2", "-f", "64", "-d", "256", "-n", "3", "-t", "1,2", "--gap-us", "10"]
    runs = {}
    said = {}
    arms = (("0", "0", ""), ("1", "0", ""), ("0", "0", "--repack"), ("1", "0", "--repack"), ("1", "0", "--hugepages"),
            ("0", "1", ""), ("1", "1", ""), ("0", "0", "--flat --x4"))
    for flat, x4, extra in arms:
        r = subprocess.run(args + extra.split(), capture_output=True, text=True, timeout=120,
                           env={**os.environ, "GGML_CPU_MMID_FLAT": flat, "GGML_CPU_DOT_X4": x4})
        assert r.returncode == 0, r.stderr[-2000:]
        runs[flat, x4, extra] = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        said[flat, x4, extra] = re.findall(r"one token's experts \(q4_0\): (\w+) split of rows, ([\w-]+) dot", r.stderr)
    rows = [row for out in runs.values() for row in out]
    assert all({(r["mode"], r["threads"]) for r in out} == {(m, t) for m in ("graph", "split") for t in (1, 2)}
               for out in runs.values()), runs
    assert [(r["mmid_flat"], r["dot_x4"], r["repack"], r["hugepages"]) for r in runs["1", "0", "--repack"]] == [(1, 0, 1, 0)] * 4
    assert [(r["mmid_flat"], r["dot_x4"]) for r in runs["1", "1", ""]] == [(1, 1)] * 4
    # 2 layers x 2 experts x 3 matrices of 64 x 256 Q4_0 (18 bytes per 32 weights)
    assert all(abs(r["gb_per_token"] - 2 * 2 * 3 * 64 * 256 / 32 * 18 / 1e9) < 1e-6 for r in rows), rows
    bad = [r for r in rows if not (0 < r["ms_min"] <= r["ms_per_token"] and r["gb_s"] > 0)]
    assert not bad, bad
    sums = {k: [r["checksum"] for r in out] for k, out in runs.items()}
    assert sums["0", "0", ""] == sums["1", "0", ""] == sums["1", "0", "--hugepages"], sums
    assert sums["0", "0", "--repack"] == sums["1", "0", "--repack"], sums
    assert sums["0", "0", ""] == sums["0", "1", ""] == sums["1", "1", ""] == sums["0", "0", "--flat --x4"], sums
    assert [(r["mmid_flat"], r["dot_x4"]) for r in runs["0", "0", "--flat --x4"]] == [(1, 1)] * 4
    assert said["0", "0", "--flat --x4"] == said["1", "1", ""] == [("flat", "four-row")], said
    assert said["0", "0", ""] == said["0", "0", "--repack"] == [], said


# the types real files keep their experts in: Q4_K_M / UD-Q4_K_XL mixes (q4_K, q5_K, q6_K), Q8_0, IQ4_XS,
# gpt-oss (mxfp4); bytes per block of 256 weights
FILE_TYPES = {"q4_K": 144, "q5_K": 176, "q6_K": 210, "q8_0": 8 * 34, "iq4_xs": 136, "mxfp4": 8 * 17}


def test_the_flat_split_is_exact_for_the_types_real_files_use():
    """The flat split (GGML_CPU_MMID_FLAT=1) hands each thread one contiguous run of rows and computes each
    row with the type's own one-row kernel: for every type that real files keep their experts in, the
    outputs' checksum is the stock split's, bit for bit, at one and two threads. The checksums differ from
    type to type (each run computed its own type's weights) and the bytes per token are the type's."""
    import json
    import os

    exe = binary("bench-cpu-mmid")
    sums = {}
    for t, block_bytes in FILE_TYPES.items():
        for flat in ("0", "1"):
            r = subprocess.run([str(exe), "-l", "2", "-e", "16", "-u", "2", "-f", "256", "-d", "512", "-n", "3",
                                "-t", "1,2", "-m", "graph", "--type", t], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "GGML_CPU_MMID_FLAT": flat, "GGML_CPU_DOT_X4": "0"})
            assert r.returncode == 0, r.stderr[-2000:]
            rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
            assert [(x["type"], x["mmid_flat"], x["threads"]) for x in rows] == [(t, int(flat), 1), (t, int(flat), 2)]
            # 2 layers x 2 experts x 3 matrices of 256 x 512 weights
            assert all(abs(x["gb_per_token"] - 2 * 2 * 3 * 256 * 512 / 256 * block_bytes / 1e9) < 1e-6 for x in rows)
            sums[t, flat] = [x["checksum"] for x in rows]
        assert sums[t, "0"] == sums[t, "1"], (t, sums[t, "0"], sums[t, "1"])
    assert len({tuple(v) for v in sums.values()}) == len(FILE_TYPES), sums


def test_flat_both_times_the_same_tokens_with_and_without_the_flat_split():
    """--flat-both (the plan's timing at start) runs each mode without and then with the flat split on the same
    weights: two lines, flat 0 then 1, and every run routes the same tokens, so the two checksums are equal
    (the flat split is exact); the same checksum as a run of its own with --flat."""
    import json
    import os

    exe = binary("bench-cpu-mmid")
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_CPU_MMID_FLAT", "GGML_CPU_DOT_X4")}
    base = [str(exe), "-l", "2", "-e", "16", "-u", "2", "-f", "256", "-d", "512", "-n", "3", "-t", "2",
            "-m", "graph,split", "--type", "q4_K"]
    r = subprocess.run(base + ["--flat-both"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["mode"], x["mmid_flat"]) for x in rows] == [("graph", 0), ("graph", 1), ("split", 0), ("split", 1)]
    assert len({x["checksum"] for x in rows}) == 1, rows
    alone = subprocess.run(base + ["--flat"], capture_output=True, text=True, timeout=120, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert {json.loads(line)["checksum"] for line in alone.stdout.splitlines() if line.startswith("{")} == {rows[0]["checksum"]}


def test_the_four_row_dots_are_exact_for_mxfp4():
    """gpt-oss's MXFP4 experts have a four-row kernel too (GGML_CPU_DOT_X4=1, x86 with AVX2): with it, alone and
    with the flat split, the outputs' checksum is the one-row kernel's, bit for bit, with an even count of
    blocks per row and an odd one (the scalar tail; checked to fail with two rows' results swapped), and the
    backend's line names the four-row dot for MXFP4 while other types (Q8_0) keep the one-row kernel."""
    import json
    import os
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the four-row MXFP4 kernel is x86's")
    exe = binary("bench-cpu-mmid")
    for d in ("512", "544"):  # 16 and 17 blocks of 32 per row
        sums, said = {}, {}
        for flat, x4 in (("0", "0"), ("0", "1"), ("1", "1")):
            r = subprocess.run([str(exe), "-l", "2", "-e", "16", "-u", "2", "-f", "256", "-d", d, "-n", "3",
                                "-t", "1,2", "-m", "graph", "--type", "mxfp4"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "GGML_CPU_MMID_FLAT": flat, "GGML_CPU_DOT_X4": x4})
            assert r.returncode == 0, r.stderr[-2000:]
            sums[flat, x4] = [json.loads(line)["checksum"] for line in r.stdout.splitlines() if line.startswith("{")]
            said[flat, x4] = re.findall(r"one token's experts \(mxfp4\): (\w+) split of rows, ([\w-]+) dot", r.stderr)
        assert len(sums["0", "0"]) == 2 and sums["0", "0"] == sums["0", "1"] == sums["1", "1"], (d, sums)
        assert said["0", "1"] == [("stock", "four-row")] and said["1", "1"] == [("flat", "four-row")], said
    r = subprocess.run([str(exe), "-l", "2", "-e", "16", "-u", "2", "-f", "256", "-d", "512", "-n", "3", "-t", "1",
                        "-m", "graph", "--type", "q8_0"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GGML_CPU_MMID_FLAT": "1", "GGML_CPU_DOT_X4": "1"})
    assert r.returncode == 0 and "(q8_0): flat split of rows, one-row dot" in r.stderr, r.stderr[-2000:]
    # x86 has no repacked layout for Q5_K: the tool says so (exit status 3) where it used to crash
    r = subprocess.run([str(exe), "-l", "1", "-n", "1", "-t", "1", "-m", "graph", "--type", "q5_K", "--repack"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "no repacked layout for q5_K" in r.stderr, (r.returncode, r.stderr[-2000:])


def test_the_cpu_mmid_bench_names_a_bad_argument():
    assert_usage_error("bench-cpu-mmid", ["-t", "4,x"], "not a list of positive integers")
    assert_usage_error("bench-cpu-mmid", ["-m", "graph,fast"], "'fast' is not a mode")
    assert_usage_error("bench-cpu-mmid", ["-u", "9", "-e", "8"], "n_used <= n_expert")
    assert_usage_error("bench-cpu-mmid", ["--type", "q3_K"], "'q3_K' is not one of")
    assert_usage_error("bench-cpu-mmid", ["--type", "q4_K", "-f", "96"], "multiples of 256")


def _dynamic_symbols(path) -> tuple[set[str], str]:
    """(defined dynamic symbols, the dynamic section) of a shared object, read with binutils."""
    nm = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    dyn = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}, dyn.stdout


def test_one_libstdcxx_per_process():
    """Every shipped library and the Python module use the shared libstdc++: none carries (and
    exports) a copy of its own. A copy per library crashed the first model load through `import
    moecache` on a toolchain that links libstdc++ statically (cmake/shared-libstdcxx.cmake)."""
    from pathlib import Path

    from moecache import native_module

    core = Path(native_module().__file__)
    libs = sorted(binary("llama-server").parent.glob("*.so")) + [core]
    assert any(p.name.startswith("libllama") for p in libs), libs
    problems = []
    for lib in libs:
        symbols, dynamic = _dynamic_symbols(lib)
        if "_ZNSt6locale7classicEv" in symbols:  # std::locale::classic(), only in libstdc++ itself
            problems.append(f"{lib.name} defines libstdc++'s own symbols (a static copy)")
        elif "libstdc++" not in dynamic and any(s.startswith("_ZNS") for s in symbols):
            problems.append(f"{lib.name} uses C++ but does not link libstdc++.so")
    assert not problems, "; ".join(problems)
