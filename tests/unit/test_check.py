"""`moecache check`: a GGUF file whose weights were overwritten in the middle loaded and served nonsense
without a word. The check reads every tensor: a recorded checksum (moecache synth writes one) finds any
changed byte; without one, NaN/Inf values and block scales find most damage, and changed quant values
inside a block are the documented limit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moecache import check, gguf
from moecache.gguf import GGMLType

N_BLOCKS = 4096  # a Q4_0 tensor of 128 x 1024


def write_model(path, checksum: bool):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, checksum=checksum)
    w.add("general.architecture", "test")
    w.add_tensor_info("blk.0.ffn_down_exps.weight", (128, 1024), GGMLType.Q4_0)
    w.add_tensor_info("blk.0.attn_norm.weight", (256,), GGMLType.F16)
    w.write_header()
    w.write_tensor_data("blk.0.ffn_down_exps.weight", gguf.random_blocks(rng, N_BLOCKS, GGMLType.Q4_0, 0.02))
    w.write_tensor_data("blk.0.attn_norm.weight", np.ones(256, dtype=np.float16))
    w.close()
    return path


def overwrite(path, offset: int, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def q4_tensor_offset(path) -> int:
    with gguf.GGUFReader(path) as r:
        return r.tensor("blk.0.ffn_down_exps.weight").file_offset


def test_an_intact_file_passes_and_its_checksum_matches(tmp_path):
    report = check.check_model(write_model(tmp_path / "m.gguf", checksum=True))
    assert report.ok and report.checksum == "ok" and not report.damaged and not report.suspect
    assert report.n_tensors == 2 and report.n_bytes == N_BLOCKS * 18 + 512


def test_4_kib_overwritten_in_the_middle_is_found_with_and_without_a_checksum(tmp_path):
    for checksum in (True, False):
        path = write_model(tmp_path / f"m-{checksum}.gguf", checksum=checksum)
        overwrite(path, q4_tensor_offset(path) + N_BLOCKS * 18 // 2, random.Random(3).randbytes(4096))
        report = check.check_model(path)
        assert not report.ok
        assert report.checksum == ("mismatch" if checksum else "absent")
        assert report.damaged and report.damaged[0].tensor == "blk.0.ffn_down_exps.weight"
        assert report.damaged[0].first_block >= N_BLOCKS // 2 - 1


def test_a_changed_quant_value_needs_the_checksum(tmp_path):
    """The documented limit: a block's 4-bit values carry no redundancy."""
    for checksum in (True, False):
        path = write_model(tmp_path / f"m-{checksum}.gguf", checksum=checksum)
        overwrite(path, q4_tensor_offset(path) + 100 * 18 + 5, b"\x77")
        report = check.check_model(path)
        assert report.ok is (not checksum), report.render()


def test_a_nan_in_a_float_tensor_is_damage(tmp_path):
    path = write_model(tmp_path / "m.gguf", checksum=False)
    with gguf.GGUFReader(path) as r:
        at = r.tensor("blk.0.attn_norm.weight").file_offset
    overwrite(path, at + 2 * 7, np.float16(np.nan).tobytes())
    report = check.check_model(path)
    assert [(p.tensor, p.first_block, p.count) for p in report.damaged] == [("blk.0.attn_norm.weight", 7, 1)]


def test_the_command_exits_1_when_damaged_and_2_for_a_file_that_is_not_a_model(tmp_path, capsys):
    path = write_model(tmp_path / "m.gguf", checksum=True)
    assert check.main([str(path), "-q"]) == 0
    overwrite(path, q4_tensor_offset(path) + 1000, b"\xff" * 64)
    assert check.main([str(path), "-q"]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    (tmp_path / "x.gguf").write_bytes(b"not a model")
    assert check.main([str(tmp_path / "x.gguf")]) == 2
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(path.read_bytes()[:2000])
    assert check.main([str(truncated)]) == 1


def test_synth_records_the_checksum(tmp_path):
    from moecache import synth

    out = tmp_path / "tiny.gguf"
    synth.write_model(out, preset="tiny", seed=0, progress=False)
    with gguf.GGUFReader(out) as r:
        assert len(str(r.get(gguf.CHECKSUM_KEY))) == 64
    assert check.check_model(out).checksum == "ok"
