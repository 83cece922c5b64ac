"""The GGUF reader/writer: KV and tensor round trips, quantization error bounds, clear errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from moecache import gguf
from moecache.gguf import GGMLType, GGUFReader, GGUFWriter, ValueType


def _write(path, kvs, tensors, alignment=32):
    w = GGUFWriter(path, alignment=alignment)
    for k, v, t in kvs:
        w.add(k, v, t)
    for name, shape, gtype, _ in tensors:
        w.add_tensor_info(name, shape, gtype)
    w.write_header()
    for name, _, _, data in tensors:
        w.write_tensor_data(name, data)
    w.close()


def test_kv_round_trip_every_type(tmp_path):
    strings = ["a", "", "ĠĠ", "日本語", "tab\tnew\nline", "x" * 1000]
    kvs = [
        ("u8", 255, ValueType.UINT8), ("i8", -128, ValueType.INT8),
        ("u16", 65535, ValueType.UINT16), ("i16", -32768, ValueType.INT16),
        ("u32", 2**32 - 1, ValueType.UINT32), ("i32", -2**31, ValueType.INT32),
        ("u64", 2**64 - 1, ValueType.UINT64), ("i64", -2**63, ValueType.INT64),
        ("f32", 1e-6, ValueType.FLOAT32), ("f64", 1e300, ValueType.FLOAT64),
        ("b1", True, ValueType.BOOL), ("b0", False, ValueType.BOOL),
        ("s", "qwen3moe ünïcode", ValueType.STRING),
        ("arr.str", strings, None),
        ("arr.i32", np.arange(-5, 100_000, dtype=np.int32), None),
        ("arr.f32", np.linspace(-1, 1, 7, dtype=np.float32), None),
        ("arr.u8", np.array([0, 1, 255], dtype=np.uint8), None),
    ]
    p = tmp_path / "kv.gguf"
    _write(p, kvs, [])
    with GGUFReader(p) as r:
        assert r.version == 3
        assert r.tensors == []
        assert r["general.alignment"] == 32 and r.kv["general.alignment"].type == ValueType.UINT32
        assert list(r.kv)[1:] == [k for k, _, _ in kvs]  # order kept, alignment first
        for k, v, t in kvs:
            kv = r.kv[k]
            if t is not None:
                assert kv.type == t
            if isinstance(v, np.ndarray):
                assert kv.type == ValueType.ARRAY
                assert r[k].dtype == v.dtype and np.array_equal(r[k], v)
            elif k == "f32":
                assert r[k] == pytest.approx(1e-6, rel=1e-6)
            else:
                assert r[k] == v
        assert r.kv["arr.str"].array_type == ValueType.STRING


def test_value_out_of_range_is_an_error(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    with pytest.raises(gguf.GGUFError, match="300 does not fit UINT8"):
        w.add("bad", 300, ValueType.UINT8)
    with pytest.raises(gguf.GGUFError, match="does not fit UINT32"):
        w.add("neg", -1, ValueType.UINT32)
    with pytest.raises(gguf.GGUFError, match="cannot infer"):
        w.add("obj", object())


def test_tensor_round_trip_layout_and_data(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)  # ggml shape (5, 3)
    f16 = rng.standard_normal((7,)).astype(np.float16)
    x8 = rng.standard_normal((4, 64)).astype(np.float32)
    x4 = rng.standard_normal((2, 3, 32)).astype(np.float32)
    tensors = [
        ("a.f32", (5, 3), GGMLType.F32, f32.view(np.uint8)),
        ("b.f16", (7,), GGMLType.F16, f16.tobytes()),
        ("c.q8", (64, 4), GGMLType.Q8_0, gguf.quantize_q8_0(x8)),
        ("d.q4", (32, 3, 2), GGMLType.Q4_0, [gguf.quantize_q4_0(x4[0]), gguf.quantize_q4_0(x4[1])]),  # 2 chunks
    ]
    p = tmp_path / "t.gguf"
    _write(p, [("general.architecture", "test", None)], tensors)
    raw = p.read_bytes()
    assert raw[:4] == b"GGUF" and struct.unpack_from("<Iqq", raw, 4) == (3, 4, 2)
    with GGUFReader(p) as r:
        assert [t.name for t in r.tensors] == ["a.f32", "b.f16", "c.q8", "d.q4"]
        assert [t.shape for t in r.tensors] == [(5, 3), (7,), (64, 4), (32, 3, 2)]
        assert [t.type for t in r.tensors] == [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0]
        assert [t.nbytes for t in r.tensors] == [60, 14, 4 * 2 * 34, 6 * 18]
        assert r.data_offset % 32 == 0
        for t in r.tensors:
            assert t.offset % 32 == 0
        # each tensor starts where the previous one ends, padded to the alignment
        for a, b in zip(r.tensors, r.tensors[1:]):
            assert b.offset == (a.offset + a.nbytes + 31) // 32 * 32
        assert np.array_equal(r.tensor_rows("a.f32"), f32)
        assert np.array_equal(r.tensor_rows("b.f16"), f16.astype(np.float32))
        assert np.array_equal(r.tensor_rows("c.q8"), gguf.dequantize_q8_0(gguf.quantize_q8_0(x8)).reshape(4, 64))
        assert r.tensor_rows("d.q4").shape == (2, 3, 32)
        rows = r.tensor_rows("c.q8", np.array([3, 1]))
        assert np.array_equal(rows, r.tensor_rows("c.q8")[[3, 1]])
        # the file ends right after the last tensor's padding
        last = r.tensors[-1]
        assert len(raw) == r.data_offset + (last.offset + last.nbytes + 31) // 32 * 32


def test_alignment_other_than_32(tmp_path):
    p = tmp_path / "a64.gguf"
    _write(p, [], [("x", (3,), GGMLType.F32, np.ones(3, np.float32)), ("y", (1,), GGMLType.F32, np.zeros(1, np.float32))],
           alignment=64)
    with GGUFReader(p) as r:
        assert r.alignment == 64 and r.data_offset % 64 == 0
        assert r.tensor("y").offset == 64
        assert r.tensor_rows("y")[0] == 0.0


def test_q8_0_error_bound_and_known_block():
    x = (np.arange(32, dtype=np.float32) - 16.0)
    b = gguf.quantize_q8_0(x)
    assert b.shape == (1, 34)
    d = np.frombuffer(b[0, :2].tobytes(), dtype=np.float16)[0]
    assert float(d) == pytest.approx(16 / 127, rel=1e-3)
    assert np.frombuffer(b[0, 2:].tobytes(), dtype=np.int8)[0] == -127
    rng = np.random.default_rng(1)
    y = rng.standard_normal((64, 256)).astype(np.float32) * 3
    deq = gguf.dequantize_q8_0(gguf.quantize_q8_0(y)).reshape(y.shape)
    blocks = y.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1) / 127
    err = np.abs(deq.reshape(-1, 32) - blocks)
    assert np.all(err <= step[:, None] * 0.5 * 1.01 + 1e-3 * np.abs(blocks))  # half a step (+ f16 scale rounding)
    assert err.mean() < 0.3 * step.mean()


def test_q4_0_error_bound_and_layout():
    x = np.zeros(32, np.float32)
    x[0], x[16] = -8.0, 7.0  # d = max/-8 = 1: q = x + 8
    b = gguf.quantize_q4_0(x)
    assert b.shape == (1, 18)
    assert np.frombuffer(b[0, :2].tobytes(), dtype=np.float16)[0] == 1.0
    assert b[0, 2] == 0x0 | (15 << 4)  # element 0 in the low nibble, element 16 in the high one
    assert np.array_equal(gguf.dequantize_q4_0(b), x)
    rng = np.random.default_rng(2)
    y = rng.standard_normal((32, 512)).astype(np.float32)
    deq = gguf.dequantize_q4_0(gguf.quantize_q4_0(y)).reshape(-1, 32)
    blocks = y.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 8
    err = np.abs(deq - blocks)
    assert np.all(err <= d[:, None] * 1.01)  # the far side of the range clamps at +7 d: at most one step
    assert err.mean() < 0.3 * d.mean()
    rel = np.linalg.norm(deq - blocks) / np.linalg.norm(blocks)
    assert 0.05 < rel < 0.15


@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.F16])
def test_random_blocks_have_the_chosen_scale(gtype):
    rng = np.random.default_rng(3)
    blocks = gguf.random_blocks(rng, 20000, gtype, std=0.05)
    assert blocks.dtype == np.uint8 and blocks.shape[0] == 20000
    vals = gguf.dequantize(blocks.reshape(-1), gtype)
    assert vals.std() == pytest.approx(0.05, rel=0.03)
    # mean 0 within sampling error: a bias, repeated in every weight, would add the same direction
    # to every token's hidden state, layer after layer (see gguf.zero_mean_quants)
    standard_error = vals.std() / np.sqrt(vals.size)
    assert abs(vals.mean()) < 4 * standard_error, f"mean {vals.mean():.3g}, standard error {standard_error:.3g}"


@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.Q4_0])
def test_zero_mean_quants_mirror_every_value(gtype):
    # every byte value once among the quant bytes: what uniform random bytes give on average
    qs = np.arange(256, dtype=np.uint8).reshape(-1, gguf.BLOCK_SIZES[gtype][1] - 2)
    scale = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    raw = np.concatenate([np.tile(scale, (len(qs), 1)), qs], axis=1)
    quants = gguf.dequantize(gguf.zero_mean_quants(raw.copy(), gtype).reshape(-1), gtype)
    values, counts = np.unique(quants, return_counts=True)
    by_value = dict(zip(values.tolist(), counts.tolist()))
    assert all(by_value.get(-v) == c for v, c in by_value.items() if v != 0)  # symmetric around 0
    assert min(by_value) == -max(by_value)


def test_writer_checks_sizes_order_and_blocks(tmp_path):
    with pytest.raises(gguf.GGUFError, match="multiple of the Q8_0 block size 32"):
        GGUFWriter(tmp_path / "x.gguf").add_tensor_info("x", (48, 2), GGMLType.Q8_0)
    w = GGUFWriter(tmp_path / "y.gguf")
    w.add_tensor_info("a", (4,), GGMLType.F32)
    w.add_tensor_info("b", (4,), GGMLType.F32)
    with pytest.raises(gguf.GGUFError, match="duplicate"):
        w.add_tensor_info("a", (4,), GGMLType.F32)
    w.write_header()
    with pytest.raises(gguf.GGUFError, match="in order: expected 'a'"):
        w.write_tensor_data("b", np.zeros(4, np.float32))
    with pytest.raises(gguf.GGUFError, match="wrote 12 bytes, expected 16"):
        w.write_tensor_data("a", np.zeros(3, np.float32))
    w.abort()
    w = GGUFWriter(tmp_path / "z.gguf")
    w.add_tensor_info("a", (4,), GGMLType.F32)
    w.write_header()
    with pytest.raises(gguf.GGUFError, match="closed before writing tensors"):
        w.close()


def test_reader_rejects_bad_files(tmp_path):
    p = tmp_path / "not.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(gguf.GGUFError, match="not a GGUF file"):
        GGUFReader(p)
    good = tmp_path / "good.gguf"
    _write(good, [("k", "v" * 100, None)], [("t", (32,), GGMLType.F32, np.ones(32, np.float32))])
    data = good.read_bytes()
    for cut in (30, 60, len(data) - 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(gguf.GGUFError, match="truncated|past the end"):
            GGUFReader(bad)
    with pytest.raises(FileNotFoundError):
        GGUFReader(tmp_path / "missing.gguf")


def test_reads_the_upstream_qwen2_vocab():
    from moecache.paths import vocab_file

    try:
        path = vocab_file("qwen2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with GGUFReader(path) as r:
        assert r["tokenizer.ggml.model"] == "gpt2"
        assert r["tokenizer.ggml.pre"] == "qwen2"
        tokens = r["tokenizer.ggml.tokens"]
        assert len(tokens) == 151936 and tokens[:3] == ["!", '"', "#"]
        assert len(r["tokenizer.ggml.token_type"]) == 151936
        assert r["tokenizer.ggml.merges"][0] == "Ġ Ġ"
    kvs = gguf.read_tokenizer_kvs(path)
    assert {kv.key for kv in kvs} >= {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre",
                                      "tokenizer.ggml.eos_token_id"}
    assert all(kv.key.startswith("tokenizer.") for kv in kvs)


# --------------------------------------------------------------------------- the same bytes as ggml


def _data_with_ties(rng) -> np.ndarray:
    """Random rows, and blocks whose values fall exactly on the rounding ties of each type."""
    rows = [rng.standard_normal(256).astype(np.float32) * scale for scale in (1e-3, 0.1, 1.0, 37.0)]
    halves = np.arange(-15.5, 16.5, 1.0, dtype=np.float32)  # 32 values k + 0.5
    q8_d1 = halves.copy()
    q8_d1[0] = 127.0  # amax 127: d = 1, so x / d is exactly k + 0.5
    q8_d2 = (2 * halves + 1).astype(np.float32)
    q8_d2[5] = -254.0  # d = 2: odd values land on halves
    q4_d1 = np.clip(halves, -7.5, 7.5)
    q4_d1[3] = -8.0  # max = -8: d = 1, x + 8.5 is an integer
    sign_tie = rng.standard_normal(32).astype(np.float32)
    sign_tie[4], sign_tie[9] = 3.0, -3.0  # equal |x|: the first one sets Q4_0's scale
    f16_ties = (1.0 + (2 * np.arange(32, dtype=np.float32) + 1) * np.float32(2.0**-11)).astype(np.float32)
    zeros = np.zeros(32, np.float32)
    rows.append(np.concatenate([q8_d1, q8_d2, q4_d1, -q4_d1, sign_tie, f16_ties, -f16_ties, zeros]))
    return np.stack(rows)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "F16", "F32"])
def test_quantization_matches_llama_cpps_gguf_py_byte_for_byte(llama_gguf, name):
    data = _data_with_ties(np.random.default_rng(11))
    ours = gguf.quantize(data, GGMLType[name])
    reference = llama_gguf.quants.quantize(data, llama_gguf.GGMLQuantizationType[name])
    reference = np.ascontiguousarray(reference).view(np.uint8).reshape(-1)
    assert ours.shape == reference.shape
    differ = np.count_nonzero(ours != reference)
    assert differ == 0, f"{name}: {differ} of {ours.size} bytes differ from gguf-py's (ggml's reference)"


def test_q8_0_rounds_halves_away_from_zero():
    x = np.arange(-15.5, 16.5, 1.0, dtype=np.float32)
    x[0] = -127.0  # d = 1
    q = np.frombuffer(gguf.quantize_q8_0(x)[0, 2:].tobytes(), dtype=np.int8)
    assert list(q[1:4]) == [-15, -14, -13]  # -14.5 -> -15, -13.5 -> -14, -12.5 -> -13
    assert list(q[15:18]) == [-1, 1, 2]  # -0.5 -> -1, 0.5 -> 1, 1.5 -> 2
