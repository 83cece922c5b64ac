"""The Python API's checks: files and parameters are refused with clear errors before (or
instead of) reaching llama.cpp. Tests that need the compiled module but no model are at the end."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import moecache
from moecache import api

SRC = Path(__file__).resolve().parents[2] / "src"


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_header_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF v3 file with one KV (general.architecture) and no tensors."""
    kv = _gguf_string("general.architecture") + struct.pack("<i", 8) + _gguf_string(arch)
    path.write_bytes(b"GGUF" + struct.pack("<Iqq", 3, 0, 1) + kv)
    return path


def test_import_does_not_load_the_native_module():
    # the build orchestrator imports moecache while _core does not exist yet
    code = ("import sys, moecache, moecache.orchestrator; "
            "assert 'moecache._core' not in sys.modules, 'native module loaded on import'; "
            "assert issubclass(moecache.ModelLoadError, moecache.MoecacheError); "
            "assert issubclass(moecache.MoecacheError, RuntimeError); "
            "assert issubclass(moecache.OutOfMemoryError, MemoryError); print('ok')")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(FileNotFoundError) as e:
        moecache.Model(missing)
    assert str(missing) in str(e.value)


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(moecache.ModelLoadError) as e:
        moecache.Model(p)
    msg = str(e.value)
    assert "not a GGUF file" in msg and str(p) in msg


def test_empty_file_is_not_a_gguf(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(moecache.ModelLoadError, match="not a GGUF file"):
        moecache.Model(p)


def test_directory_is_refused(tmp_path):
    with pytest.raises(moecache.ModelLoadError, match="directory"):
        moecache.Model(tmp_path)


@pytest.mark.parametrize("kwargs, words", [
    ({"n_gpu_layers": -2}, "n_gpu_layers"),
    ({"n_gpu_layers": 1.5}, "n_gpu_layers"),
    ({"n_cpu_moe": -1}, "n_cpu_moe"),
    ({"tensor_overrides": "exps"}, "<regex>=<buffer type>"),
    ({"tensor_overrides": [("exps",)]}, "(regex, buffer type) pair"),
])
def test_bad_model_parameters(tmp_path, kwargs, words):
    p = write_header_only_gguf(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(ValueError) as e:
        moecache.Model(p, **kwargs)
    assert words in str(e.value)


def test_tensor_override_forms():
    assert api._parse_tensor_overrides(None) == []
    assert api._parse_tensor_overrides("exps=CPU,blk\\.0\\.=CUDA0") == [("exps", "CPU"), ("blk\\.0\\.", "CUDA0")]
    assert api._parse_tensor_overrides({"exps": "CPU"}) == [("exps", "CPU")]
    assert api._parse_tensor_overrides([("exps", "CPU")]) == [("exps", "CPU")]


def test_physical_cores_is_sane():
    n = moecache.physical_cores()
    assert 1 <= n <= (os.cpu_count() or 1)


def test_generation_dataclass_fields():
    g = moecache.Generation(tokens=[1, 2], text="ab", prompt_tokens=3, finish_reason="length")
    assert g.timings == {} and g.tokens == [1, 2] and g.finish_reason == "length"


# --- with the compiled module, no model ------------------------------------------------------


def test_system_info_and_devices():
    info = moecache.system_info()
    assert isinstance(info, str) and "CPU" in info
    devs = moecache.devices()
    assert any(d["type"] == "cpu" for d in devs)
    for d in devs:
        assert {"name", "description", "type", "memory_free", "memory_total"} <= set(d)
        assert d["memory_total"] >= d["memory_free"] >= 0
    assert "CPU" in moecache.buffer_types()


def test_unsupported_architecture(tmp_path):
    p = write_header_only_gguf(tmp_path / "alien.gguf", "nosucharch")
    with pytest.raises(moecache.ModelLoadError) as e:
        moecache.Model(p)
    assert "unsupported architecture 'nosucharch'" in str(e.value)


def test_truncated_gguf_says_so(tmp_path):
    p = tmp_path / "cut.gguf"
    full = write_header_only_gguf(tmp_path / "full.gguf", "qwen3moe").read_bytes()
    p.write_bytes(full[:-5])
    with pytest.raises(moecache.ModelLoadError, match="not a valid GGUF"):
        moecache.Model(p)


def test_unknown_buffer_type_lists_the_allowed_ones(tmp_path):
    p = write_header_only_gguf(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(ValueError) as e:
        moecache.Model(p, tensor_overrides=[("exps", "NoSuchDevice0")])
    assert "NoSuchDevice0" in str(e.value) and "CPU" in str(e.value)


def test_bad_regex_in_overrides(tmp_path):
    p = write_header_only_gguf(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(ValueError, match="invalid regex"):
        moecache.Model(p, tensor_overrides=[("exps(", "CPU")])


def test_info_command(capsys):
    from moecache import info

    assert info.main([]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp 0c1e57098" in out and "devices:" in out and "CPU" in out
