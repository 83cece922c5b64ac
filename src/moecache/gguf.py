"""A small GGUF (version 3) reader and streaming writer, numpy only.

Layout of a GGUF file (all little endian):

    magic "GGUF" | u32 version | i64 n_tensors | i64 n_kv
    n_kv x (string key, i32 value type, value)        arrays: i32 element type, u64 count, elements
    n_tensors x (string name, u32 n_dims, n_dims x i64 ne, i32 ggml type, u64 offset in data)
    padding to `general.alignment` (default 32)
    data: every tensor at its offset, each one padded to the alignment

Strings are a u64 byte length followed by UTF-8 bytes without a terminator. Shapes are in ggml
order: ne[0] is the contiguous (innermost) dimension, so a numpy array of a tensor has shape
``tuple(reversed(ne))``.

The writer streams: the header and tensor table are written first (sizes are known from shapes
and types), then each tensor's bytes are written in chunks, so a model of many GiB never needs to
be held in memory.
"""

from __future__ import annotations

import hashlib
import mmap
import math
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Iterable

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"


class ValueType(IntEnum):
    """Types of KV values (enum gguf_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy dtypes of the fixed-size value types
_VALUE_DTYPES: dict[ValueType, np.dtype] = {
    ValueType.UINT8: np.dtype("<u1"),
    ValueType.INT8: np.dtype("<i1"),
    ValueType.UINT16: np.dtype("<u2"),
    ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"),
    ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"),
    ValueType.BOOL: np.dtype("<i1"),
    ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"),
    ValueType.FLOAT64: np.dtype("<f8"),
}


class GGMLType(IntEnum):
    """Tensor data types (enum ggml_type)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


_QK_K = 256
# (elements per block, bytes per block)
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (_QK_K, 84),
    GGMLType.Q3_K: (_QK_K, 110),
    GGMLType.Q4_K: (_QK_K, 144),
    GGMLType.Q5_K: (_QK_K, 176),
    GGMLType.Q6_K: (_QK_K, 210),
    GGMLType.Q8_K: (_QK_K, 292),
    GGMLType.IQ2_XXS: (_QK_K, 66),
    GGMLType.IQ2_XS: (_QK_K, 74),
    GGMLType.IQ3_XXS: (_QK_K, 98),
    GGMLType.IQ1_S: (_QK_K, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (_QK_K, 110),
    GGMLType.IQ2_S: (_QK_K, 82),
    GGMLType.IQ4_XS: (_QK_K, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (_QK_K, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (_QK_K, 54),
    GGMLType.TQ2_0: (_QK_K, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
    GGMLType.Q2_0: (64, 18),
}


# the sha256 of a file's tensor data (each tensor's bytes in table order, padding left out), where recorded
CHECKSUM_KEY = "moecache.tensor_data.sha256"


class GGUFError(ValueError):
    """A file is not a valid GGUF, or a value cannot be written as GGUF."""


def tensor_nbytes(shape: Iterable[int], ggml_type: GGMLType | int) -> int:
    """Bytes of a tensor of `shape` (ggml order, ne[0] first) and type; ne[0] must fill whole blocks."""
    ggml_type = GGMLType(ggml_type)
    shape = [int(s) for s in shape]
    block, size = BLOCK_SIZES[ggml_type]
    if not shape:
        raise GGUFError("a tensor needs at least one dimension")
    if shape[0] % block:
        raise GGUFError(f"ne[0]={shape[0]} is not a multiple of the {ggml_type.name} block size {block}")
    n = 1
    for s in shape:
        n *= s
    return n // block * size


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------
# quantization: byte for byte what ggml's quantize_row_q8_0_ref / q4_0_ref and its F16 conversion
# write (float32 arithmetic throughout, as in C; tests compare with llama.cpp's own gguf-py)

_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
_Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
assert _Q8_0_BLOCK.itemsize == 34 and _Q4_0_BLOCK.itemsize == 18


def _as_blocks(x: np.ndarray, qk: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.size % qk or (x.ndim and x.shape[-1] % qk):
        raise GGUFError(f"the last dimension ({x.shape[-1] if x.ndim else 1}) must be a multiple of {qk}")
    return x.reshape(-1, qk)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (numpy's rint rounds them to even)."""
    t = np.trunc(x)
    return t + np.where(np.abs(x - t) >= 0.5, np.sign(x), 0)  # x - trunc(x) is exact in floating point


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (uint8 array of n_blocks x 34) of a float array whose last dimension is a multiple of 32."""
    xb = _as_blocks(x, 32)
    amax = np.abs(xb).max(axis=1)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    out = np.empty(len(xb), dtype=_Q8_0_BLOCK)
    out["d"] = d.astype(np.float16)
    out["qs"] = round_half_away(xb * inv[:, None]).astype(np.int8)
    return out.view(np.uint8).reshape(len(xb), 34)


def dequantize_q8_0(blocks: np.ndarray | bytes) -> np.ndarray:
    """Float32 values (flat) of Q8_0 data."""
    b = np.frombuffer(blocks, dtype=_Q8_0_BLOCK) if isinstance(blocks, (bytes, memoryview)) else \
        np.ascontiguousarray(blocks).view(_Q8_0_BLOCK).reshape(-1)
    return (b["qs"].astype(np.float32) * b["d"].astype(np.float32)[:, None]).reshape(-1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (uint8 array of n_blocks x 18): d = -max/8 where max is the signed value of largest |x|."""
    xb = _as_blocks(x, 32)
    idx = np.abs(xb).argmax(axis=1)  # the first of equal |x|, as ggml's strict `amax < fabsf(v)`
    vmax = xb[np.arange(len(xb)), idx]
    d = vmax / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc(xb * inv[:, None] + np.float32(8.5)), 0, 15).astype(np.uint8)  # (int8_t)(x + 8.5f)
    out = np.empty(len(xb), dtype=_Q4_0_BLOCK)
    out["d"] = d.astype(np.float16)
    out["qs"] = q[:, :16] | (q[:, 16:] << 4)
    return out.view(np.uint8).reshape(len(xb), 18)


def dequantize_q4_0(blocks: np.ndarray | bytes) -> np.ndarray:
    """Float32 values (flat) of Q4_0 data: element j from the low nibble of byte j, element j+16 from the high one."""
    b = np.frombuffer(blocks, dtype=_Q4_0_BLOCK) if isinstance(blocks, (bytes, memoryview)) else \
        np.ascontiguousarray(blocks).view(_Q4_0_BLOCK).reshape(-1)
    lo = (b["qs"] & 0x0F).astype(np.int8) - 8
    hi = (b["qs"] >> 4).astype(np.int8) - 8
    q = np.concatenate([lo, hi], axis=1).astype(np.float32)
    return (q * b["d"].astype(np.float32)[:, None]).reshape(-1)


# Random quants must have mean 0: the raw ranges -128..127 and -8..7 have a mean of half a step,
# which makes every random matrix W = mean * ones + noise. Its rank-one part adds the same value to
# every output, layer after layer, until the hidden state of every token points the same way and
# routes to the same experts (Q4_0 at n_embd 2048: the half step is ~0.11 std, enough to take over
# within a few layers). So the one value without a mirror image (-128, -8) becomes 0.
# standard deviation of the weights of such a block, per unit of d
Q8_0_RANDOM_STD = float(np.sqrt(2 * sum(k * k for k in range(1, 128)) / 256))  # -127..127, and 0 twice
Q4_0_RANDOM_STD = float(np.sqrt(2 * sum(k * k for k in range(1, 8)) / 16))     # -7..7, and 0 twice
# MXFP4: a block's 32 weights are kvalues_mxfp4[nibble] (E2M1 doubled: 0, +-1, 2, 3, 4, 6, 8, 12, symmetric)
# times 2^(e - 128) for its E8M0 byte e; uniform random nibbles have mean 0 and this standard deviation
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_RANDOM_STD = float(np.sqrt(sum(v * v for v in MXFP4_VALUES) / 16))


def mxfp4_scale_byte(std: float) -> int:
    """The E8M0 byte that gives uniform random MXFP4 blocks a standard deviation nearest `std` (a power of 2
    apart at most)."""
    e = 128 + int(round(math.log2(std / MXFP4_RANDOM_STD))) if std > 0 else 0
    return min(254, max(1, e))


def zero_mean_quants(raw: np.ndarray, ggml_type: GGMLType | int) -> np.ndarray:
    """Make uniform random Q8_0 / Q4_0 blocks (uint8, n_blocks x block bytes) symmetric around 0, in
    place: the quant -128 (Q8_0), the nibble 0 (Q4_0: -8) become 0. The scale bytes are left alone."""
    ggml_type = GGMLType(ggml_type)
    qs = raw[:, 2:]
    if ggml_type == GGMLType.Q8_0:
        qs[qs == 0x80] = 0
    elif ggml_type == GGMLType.Q4_0:
        low_is_zero = ((qs & 0x0F) == 0).view(np.uint8)
        high_is_zero = ((qs & 0xF0) == 0).view(np.uint8)
        qs |= (low_is_zero << 3) | (high_is_zero << 7)  # nibble 0 -> 8, which is the value 0
    else:
        raise GGUFError(f"zero_mean_quants handles Q8_0 and Q4_0, not {ggml_type.name}")
    return raw


def random_blocks(rng: np.random.Generator, n_blocks: int, ggml_type: GGMLType | int, std: float) -> np.ndarray:
    """Random quantized blocks (uint8, n_blocks x block bytes) whose weights have mean 0 and standard
    deviation ~`std`.

    The quants are uniform random bytes (made symmetric, see zero_mean_quants) and every block has
    the same scale, so this is as fast as the random generator: the way multi-GiB synthetic experts
    are written without float arrays.
    """
    ggml_type = GGMLType(ggml_type)
    if ggml_type == GGMLType.Q8_0:
        raw = zero_mean_quants(rng.integers(0, 256, size=(n_blocks, 34), dtype=np.uint8), ggml_type)
        raw[:, 0:2] = np.frombuffer(np.float16(std / Q8_0_RANDOM_STD).tobytes(), dtype=np.uint8)
        return raw
    if ggml_type == GGMLType.Q4_0:
        raw = zero_mean_quants(rng.integers(0, 256, size=(n_blocks, 18), dtype=np.uint8), ggml_type)
        raw[:, 0:2] = np.frombuffer(np.float16(std / Q4_0_RANDOM_STD).tobytes(), dtype=np.uint8)
        return raw
    if ggml_type == GGMLType.MXFP4:
        raw = rng.integers(0, 256, size=(n_blocks, 17), dtype=np.uint8)
        raw[:, 0] = mxfp4_scale_byte(std)
        return raw
    if ggml_type in (GGMLType.F16, GGMLType.F32):
        dt = np.float16 if ggml_type == GGMLType.F16 else np.float32
        return (rng.standard_normal(n_blocks, dtype=np.float32) * np.float32(std)).astype(dt).view(np.uint8) \
            .reshape(n_blocks, -1)
    raise GGUFError(f"random blocks of type {ggml_type.name} are not supported (use Q8_0, Q4_0, MXFP4, F16 or F32)")


def quantize(x: np.ndarray, ggml_type: GGMLType | int) -> np.ndarray:
    """Bytes (uint8 array) of float data `x` in `ggml_type` (F32, F16, Q8_0, Q4_0)."""
    ggml_type = GGMLType(ggml_type)
    if ggml_type == GGMLType.F32:
        return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.F16:
        # through float32 first, as ggml converts a float: float64 -> float16 directly can round differently
        return np.asarray(x, dtype=np.float32).astype("<f2").reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.Q8_0:
        return quantize_q8_0(x).reshape(-1)
    if ggml_type == GGMLType.Q4_0:
        return quantize_q4_0(x).reshape(-1)
    raise GGUFError(f"quantizing to {ggml_type.name} is not supported here (F32, F16, Q8_0, Q4_0)")


def dequantize(data: np.ndarray | bytes, ggml_type: GGMLType | int) -> np.ndarray:
    """Flat float32 values of tensor data of type F32, F16, BF16, Q8_0 or Q4_0."""
    ggml_type = GGMLType(ggml_type)
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, memoryview)) else \
        np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if ggml_type == GGMLType.F32:
        return buf.view("<f4").astype(np.float32)
    if ggml_type == GGMLType.F16:
        return buf.view("<f2").astype(np.float32)
    if ggml_type == GGMLType.BF16:
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if ggml_type == GGMLType.Q8_0:
        return dequantize_q8_0(buf)
    if ggml_type == GGMLType.Q4_0:
        return dequantize_q4_0(buf)
    raise GGUFError(f"dequantizing {ggml_type.name} is not supported here (F32, F16, BF16, Q8_0, Q4_0)")


# ---------------------------------------------------------------------------------------------
# reader


@dataclass
class KV:
    """One key-value pair: its GGUF type, the element type for arrays, and the value.

    Numeric arrays are numpy arrays, string arrays are lists of str, scalars are Python values.
    """

    key: str
    type: ValueType
    value: Any
    array_type: ValueType | None = None


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] first
    type: GGMLType
    offset: int  # from the start of the data section
    nbytes: int
    file_offset: int = 0  # absolute position in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class GGUFReader:
    """Reads the header, every KV pair and the tensor table of a GGUF file; tensor data on demand (mmap)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: not a GGUF file (only {size} bytes)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._mm)
        self._pos = 0
        self.kv: dict[str, KV] = {}
        self.tensors: list[TensorInfo] = []
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF ({e})") from None

    # -- low level
    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path}: truncated GGUF (wanted {n} bytes at offset {self._pos})")
        b = self._buf[self._pos:self._pos + n]
        self._pos += n
        return b

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self._take(size))[0]

    def _string(self) -> str:
        n = self._scalar("<Q")
        return bytes(self._take(n)).decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: ValueType):
        if vtype == ValueType.STRING:
            return self._string()
        if vtype == ValueType.BOOL:
            return bool(self._scalar("<b"))
        dt = _VALUE_DTYPES.get(vtype)
        if dt is None:
            raise GGUFError(f"{self.path}: unknown value type {int(vtype)}")
        return np.frombuffer(self._take(dt.itemsize), dtype=dt)[0].item()

    def _parse(self) -> None:
        magic = bytes(self._take(4))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        self.version = self._scalar("<I")
        if self.version != GGUF_VERSION:
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (only {GGUF_VERSION})")
        n_tensors = self._scalar("<q")
        n_kv = self._scalar("<q")
        if n_tensors < 0 or n_kv < 0:
            raise GGUFError(f"{self.path}: negative tensor or KV count")
        for _ in range(n_kv):
            key = self._string()
            vtype = ValueType(self._scalar("<i"))
            if vtype == ValueType.ARRAY:
                atype = ValueType(self._scalar("<i"))
                n = self._scalar("<Q")
                if atype == ValueType.STRING:
                    value: Any = [self._string() for _ in range(n)]
                elif atype == ValueType.ARRAY:
                    raise GGUFError(f"{self.path}: nested arrays are not supported (key {key})")
                else:
                    dt = _VALUE_DTYPES[atype]
                    value = np.frombuffer(self._take(n * dt.itemsize), dtype=dt).copy()
                    if atype == ValueType.BOOL:
                        value = value.astype(bool)
                self.kv[key] = KV(key, vtype, value, atype)
            else:
                self.kv[key] = KV(key, vtype, self._value(vtype))
        self.alignment = int(self.kv[ALIGNMENT_KEY].value) if ALIGNMENT_KEY in self.kv else DEFAULT_ALIGNMENT
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            shape = tuple(self._scalar("<q") for _ in range(n_dims))
            gtype = GGMLType(self._scalar("<i"))
            offset = self._scalar("<Q")
            self.tensors.append(TensorInfo(name, shape, gtype, offset, tensor_nbytes(shape, gtype)))
        self.data_offset = _pad(self._pos, self.alignment) if n_tensors else self._pos
        for t in self.tensors:
            t.file_offset = self.data_offset + t.offset
            if t.file_offset + t.nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: tensor {t.name} runs past the end of the file (truncated?)")
        self._by_name = {t.name: t for t in self.tensors}

    # -- public
    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    def __getitem__(self, key: str) -> Any:
        return self.kv[key].value

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw data of a tensor as a read-only uint8 view of the file."""
        t = self.tensor(name)
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.file_offset)

    def tensor_rows(self, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Float32 values of a tensor as a numpy array of shape reversed(ne); `rows` picks along the outermost axis
        of a 2-D tensor (e.g. token ids of token_embd) without dequantizing the rest."""
        t = self.tensor(name)
        raw = self.tensor_bytes(name)
        np_shape = tuple(reversed(t.shape))
        if rows is None:
            return dequantize(raw, t.type).reshape(np_shape)
        if len(t.shape) != 2:
            raise GGUFError("row selection needs a 2-D tensor")
        row_bytes = t.nbytes // t.shape[1]
        sel = raw.reshape(t.shape[1], row_bytes)[rows]
        return dequantize(np.ascontiguousarray(sel), t.type).reshape(-1, t.shape[0])

    def close(self) -> None:
        try:
            self._buf.release()
            self._mm.close()
        except BufferError:  # arrays returned by tensor_bytes() still view the map; it closes with them
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# writer


def _infer_type(value: Any) -> tuple[ValueType, ValueType | None]:
    if isinstance(value, bool):
        return ValueType.BOOL, None
    if isinstance(value, int):
        return (ValueType.UINT32 if 0 <= value < 2**32 else ValueType.INT64), None
    if isinstance(value, float):
        return ValueType.FLOAT32, None
    if isinstance(value, str):
        return ValueType.STRING, None
    if isinstance(value, np.ndarray):
        for vt, dt in _VALUE_DTYPES.items():
            if vt != ValueType.BOOL and dt == value.dtype.newbyteorder("<"):
                return ValueType.ARRAY, vt
        if value.dtype == bool:
            return ValueType.ARRAY, ValueType.BOOL
        raise GGUFError(f"cannot store a numpy array of dtype {value.dtype} in GGUF")
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return ValueType.ARRAY, ValueType.STRING
        if all(isinstance(v, bool) for v in value):
            return ValueType.ARRAY, ValueType.BOOL
        if all(isinstance(v, int) for v in value):
            return ValueType.ARRAY, ValueType.INT32
        if all(isinstance(v, (int, float)) for v in value):
            return ValueType.ARRAY, ValueType.FLOAT32
    raise GGUFError(f"cannot infer a GGUF type for {type(value).__name__} value {value!r:.60}")


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _encode_scalar(vtype: ValueType, value: Any) -> bytes:
    if vtype == ValueType.STRING:
        return _encode_string(value)
    if vtype == ValueType.BOOL:
        return struct.pack("<b", 1 if value else 0)
    dt = _VALUE_DTYPES[vtype]
    try:
        arr = np.array(value, dtype=dt)
    except (OverflowError, ValueError, TypeError):
        raise GGUFError(f"value {value!r} does not fit {vtype.name}") from None
    if vtype not in (ValueType.FLOAT32, ValueType.FLOAT64) and arr.item() != value:
        raise GGUFError(f"value {value!r} does not fit {vtype.name}")
    return arr.tobytes()


def encode_kv(kv: KV) -> bytes:
    out = [_encode_string(kv.key), struct.pack("<i", int(kv.type))]
    if kv.type == ValueType.ARRAY:
        atype = ValueType(kv.array_type)
        out.append(struct.pack("<iQ", int(atype), len(kv.value)))
        if atype == ValueType.STRING:
            out.extend(_encode_string(s) for s in kv.value)
        else:
            dt = _VALUE_DTYPES[atype]
            out.append(np.asarray(kv.value).astype(dt).tobytes())
    else:
        out.append(_encode_scalar(ValueType(kv.type), kv.value))
    return b"".join(out)


class GGUFWriter:
    """Streaming GGUF writer.

        w = GGUFWriter(path)
        w.add("general.architecture", "qwen3moe")           # type inferred, or pass vtype=
        w.add_tensor_info("token_embd.weight", (n_embd, n_vocab), GGMLType.Q8_0)
        w.write_header()                                     # header, KVs, tensor table, padding
        w.write_tensor_data("token_embd.weight", chunks)     # in the order of add_tensor_info
        w.close()

    Tensors must be written in the order they were added; each one's bytes are checked against
    its shape and type.
    """

    def __init__(self, path: str | os.PathLike, alignment: int = DEFAULT_ALIGNMENT, checksum: bool = False):
        """`checksum`: record the sha256 of the tensor data (each tensor's bytes in table order, padding
        left out) under CHECKSUM_KEY, so `moecache check` can tell any damage to the weights."""
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"alignment {alignment} is not a power of two")
        self.path = Path(path)
        self.alignment = alignment
        self.kv: dict[str, KV] = {}
        self.tensors: list[TensorInfo] = []
        self._f = None
        self._next_tensor = 0
        self._data_start = 0
        self._hash = hashlib.sha256() if checksum else None
        self._hash_at = 0  # where the digest's placeholder lies in the file
        self.add(ALIGNMENT_KEY, alignment, ValueType.UINT32)
        if checksum:
            self.add(CHECKSUM_KEY, "0" * 64, ValueType.STRING)  # written over by close()

    # -- metadata
    def add(self, key: str, value: Any, vtype: ValueType | None = None, array_type: ValueType | None = None) -> None:
        if self._f is not None:
            raise GGUFError("KVs must be added before write_header()")
        if vtype is None:
            vtype, array_type = _infer_type(value)
        elif vtype == ValueType.ARRAY and array_type is None:
            _, array_type = _infer_type(value)
        if key == ALIGNMENT_KEY and (vtype != ValueType.UINT32 or int(value) != self.alignment):
            raise GGUFError(f"{ALIGNMENT_KEY} is set by the writer (alignment={self.alignment})")
        kv = KV(key, ValueType(vtype), value, None if array_type is None else ValueType(array_type))
        if kv.type != ValueType.ARRAY:
            encode_kv(kv)  # a value that does not fit its type fails here, naming the key
        self.kv[key] = kv

    def add_kv(self, kv: KV) -> None:
        self.add(kv.key, kv.value, kv.type, kv.array_type)

    def add_tensor_info(self, name: str, shape: Iterable[int], ggml_type: GGMLType | int) -> TensorInfo:
        if self._f is not None:
            raise GGUFError("tensors must be added before write_header()")
        if any(t.name == name for t in self.tensors[-1:]) or name in {t.name for t in self.tensors}:
            raise GGUFError(f"duplicate tensor name {name!r}")
        if len(name.encode()) >= 64:
            raise GGUFError(f"tensor name {name!r} is too long (ggml allows 63 bytes)")
        shape = tuple(int(s) for s in shape)
        gtype = GGMLType(ggml_type)
        nbytes = tensor_nbytes(shape, gtype)
        offset = 0 if not self.tensors else self.tensors[-1].offset + _pad(self.tensors[-1].nbytes, self.alignment)
        info = TensorInfo(name, shape, gtype, offset, nbytes)
        self.tensors.append(info)
        return info

    # -- streaming
    def write_header(self) -> None:
        self._f = open(self.path, "wb")
        f = self._f
        f.write(GGUF_MAGIC + struct.pack("<Iqq", GGUF_VERSION, len(self.tensors), len(self.kv)))
        for kv in self.kv.values():
            encoded = encode_kv(kv)
            if kv.key == CHECKSUM_KEY and self._hash is not None:
                self._hash_at = f.tell() + len(encoded) - 64  # the value's 64 hex digits end the pair
            f.write(encoded)
        for t in self.tensors:
            f.write(_encode_string(t.name) + struct.pack("<I", len(t.shape)))
            f.write(struct.pack(f"<{len(t.shape)}q", *t.shape))
            f.write(struct.pack("<iQ", int(t.type), t.offset))
        pos = f.tell()
        f.write(b"\0" * (_pad(pos, self.alignment) - pos))
        self._data_start = f.tell()

    def write_tensor_data(self, name: str, chunks: Iterable[bytes | np.ndarray] | bytes | np.ndarray) -> None:
        if self._f is None:
            raise GGUFError("write_header() first")
        if self._next_tensor >= len(self.tensors):
            raise GGUFError(f"tensor {name!r}: all declared tensors were already written")
        t = self.tensors[self._next_tensor]
        if t.name != name:
            raise GGUFError(f"tensors must be written in order: expected {t.name!r}, got {name!r}")
        f = self._f
        start = f.tell()
        if start - self._data_start != t.offset:
            raise GGUFError(f"tensor {name!r}: at data offset {start - self._data_start}, expected {t.offset}")
        if isinstance(chunks, (bytes, bytearray, memoryview, np.ndarray)):
            chunks = [chunks]
        for c in chunks:
            if isinstance(c, np.ndarray):
                c = memoryview(np.ascontiguousarray(c)).cast("B")
            f.write(c)
            if self._hash is not None:
                self._hash.update(c)
        written = f.tell() - start
        if written != t.nbytes:
            raise GGUFError(f"tensor {name!r}: wrote {written} bytes, expected {t.nbytes} "
                            f"({t.type.name}, shape {t.shape})")
        f.write(b"\0" * (_pad(written, self.alignment) - written))
        self._next_tensor += 1

    def close(self) -> None:
        if self._f is None:
            return
        missing = [t.name for t in self.tensors[self._next_tensor:]]
        if self._hash is not None and not missing:
            self._f.seek(self._hash_at)
            self._f.write(self._hash.hexdigest().encode())
        self._f.close()
        self._f = None
        if missing:
            raise GGUFError(f"{self.path}: closed before writing tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")

    def abort(self) -> None:
        """Close the file without the completeness check (the caller removes it)."""
        if self._f is not None:
            self._f.close()
            self._f = None


def read_tokenizer_kvs(path: str | os.PathLike) -> list[KV]:
    """The tokenizer KVs (tokenizer.*) of a GGUF, e.g. an upstream ggml-vocab-*.gguf, in file order."""
    with GGUFReader(path) as r:
        return [kv for k, kv in r.kv.items() if k.startswith("tokenizer.")]


def check_model_file(path: str | os.PathLike) -> str | None:
    """None when `path` is a readable GGUF file, else a message naming the problem and the fix."""
    p = Path(path)
    if str(path) == "":
        return "-m/--model was given without a path. Fix: pass the path of a .gguf file, e.g. -m model.gguf."
    if not p.exists():
        return (f"model file not found: {p}\n"
                f"Fix: check the path (relative paths are taken from {Path.cwd()}), or make a test model "
                f"with `moecache synth`.")
    if p.is_dir():
        return f"model path is a directory, not a file: {p}\nFix: pass the path of the .gguf file inside it."
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot read the model file {p}: {e.strerror}\nFix: check its permissions."
    if magic != GGUF_MAGIC:
        return (f"not a GGUF file: {p} (it starts with {magic!r}, a GGUF file starts with b'GGUF')\n"
                f"Fix: convert the model to GGUF with llama.cpp's convert_hf_to_gguf.py, or pass the right file.")
    return None
