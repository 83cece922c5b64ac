"""`moecache check MODEL`: read every tensor of a GGUF file and tell whether it is damaged.

llama.cpp loads a file whose weights were overwritten in the middle and serves nonsense without a word
(`--check-tensors` notices only some damage). This reads every byte of the tensor data:

- the file's recorded checksum (`moecache synth` writes one: gguf.CHECKSUM_KEY), when it has one:
  any changed byte of the weights is found;
- every float value of F32, F16 and BF16 tensors, and every block scale of the quantized types
  (the f16 `d` and `dmin` of the Q and K quants, the IQ types' `d`, MXFP4's exponent): NaN or Inf
  is damage, a scale larger than SCALE_LIMIT is reported as suspect.

What it cannot find without a checksum: damage that leaves every scale finite, such as changed
quant values (the 4-bit numbers inside a block). A random overwrite of a few KiB almost always hits
scales too (each 18-byte Q4_0 block has one), but a flipped bit in a value does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import gguf
from .gguf import GGMLType

# a block scale above this is reported (real weights' scales are far smaller; a random f16 often is not)
SCALE_LIMIT = 1024.0

# where each quantized type keeps its scales inside a block: (byte offset, kind); f16 for the d/dmin
# fields, e8m0 for MXFP4's shared exponent (0xFF is NaN)
BLOCK_SCALES: dict[GGMLType, tuple[tuple[int, str], ...]] = {
    GGMLType.Q4_0: ((0, "f16"),),
    GGMLType.Q4_1: ((0, "f16"), (2, "f16")),
    GGMLType.Q5_0: ((0, "f16"),),
    GGMLType.Q5_1: ((0, "f16"), (2, "f16")),
    GGMLType.Q8_0: ((0, "f16"),),
    GGMLType.Q2_K: ((80, "f16"), (82, "f16")),
    GGMLType.Q3_K: ((108, "f16"),),
    GGMLType.Q4_K: ((0, "f16"), (2, "f16")),
    GGMLType.Q5_K: ((0, "f16"), (2, "f16")),
    GGMLType.Q6_K: ((208, "f16"),),
    GGMLType.IQ2_XXS: ((0, "f16"),),
    GGMLType.IQ2_XS: ((0, "f16"),),
    GGMLType.IQ3_XXS: ((0, "f16"),),
    GGMLType.IQ1_S: ((0, "f16"),),
    GGMLType.IQ4_NL: ((0, "f16"),),
    GGMLType.IQ3_S: ((0, "f16"),),
    GGMLType.IQ2_S: ((0, "f16"),),
    GGMLType.IQ4_XS: ((0, "f16"),),
    GGMLType.MXFP4: ((0, "e8m0"),),
}
FLOAT_TYPES = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.BF16: "bf16"}
CHUNK_BYTES = 64 << 20


@dataclass
class TensorProblem:
    tensor: str
    what: str
    count: int
    first_block: int  # the first bad block (or element) in the tensor

    def text(self) -> str:
        return f"{self.tensor}: {self.count} {self.what} (first at block {self.first_block})"


@dataclass
class CheckReport:
    path: str
    n_tensors: int = 0
    n_bytes: int = 0
    checksum: str = "absent"  # "ok", "mismatch" or "absent"
    damaged: list[TensorProblem] = field(default_factory=list)
    suspect: list[TensorProblem] = field(default_factory=list)
    unchecked_types: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checksum != "mismatch" and not self.damaged

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "n_tensors": self.n_tensors, "n_bytes": self.n_bytes,
                "checksum": self.checksum, "damaged": [p.__dict__ for p in self.damaged],
                "suspect": [p.__dict__ for p in self.suspect], "unchecked_types": self.unchecked_types}

    def render(self) -> str:
        lines = [f"{self.path}: {self.n_tensors} tensors, {self.n_bytes / (1 << 20):.1f} MiB read"]
        lines.append({"ok": "checksum: matches the one recorded in the file",
                      "mismatch": "checksum: DOES NOT MATCH the one recorded in the file: the weights were changed",
                      "absent": "checksum: none recorded (only NaN/Inf values and scales can be checked)"}[self.checksum])
        for p in self.damaged[:20]:
            lines.append("damaged: " + p.text())
        if len(self.damaged) > 20:
            lines.append(f"damaged: ... {len(self.damaged) - 20} more tensors")
        for p in self.suspect[:10]:
            lines.append("suspect: " + p.text())
        if self.unchecked_types:
            lines.append(f"values not checked for the types {', '.join(self.unchecked_types)} (the checksum covers them)")
        lines.append("result: " + ("OK" if self.ok else "DAMAGED. Fix: download or convert the model again"))
        return "\n".join(lines)


def _f16_bad(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(NaN or Inf, |x| > SCALE_LIMIT) of little-endian f16 values given as uint16."""
    exp_all_ones = (raw & 0x7C00) == 0x7C00
    values = raw.view("<f2").astype(np.float32)
    return exp_all_ones, np.abs(values) > SCALE_LIMIT


def _check_blocks(data: np.ndarray, gtype: GGMLType, block_base: int, counts: dict) -> None:
    """Count the blocks whose scales are NaN/Inf ("bad") or above SCALE_LIMIT ("big"), keeping the first."""
    _, size = gguf.BLOCK_SIZES[gtype]
    blocks = data.reshape(-1, size)
    for offset, kind in BLOCK_SCALES[gtype]:
        if kind == "f16":
            raw = blocks[:, offset].astype(np.uint16) | (blocks[:, offset + 1].astype(np.uint16) << 8)
            bad, big = _f16_bad(raw)
        else:
            bad, big = blocks[:, offset] == 0xFF, np.zeros(len(blocks), dtype=bool)
        for key, mask in (("bad", bad), ("big", big)):
            n = int(mask.sum())
            if n:
                first = counts.setdefault(key, [0, block_base + int(np.argmax(mask))])
                first[0] += n


def _check_floats(data: np.ndarray, gtype: GGMLType, base: int, counts: dict) -> None:
    if gtype == GGMLType.BF16:
        raw = data.view("<u2")
        bad = (raw & 0x7F80) == 0x7F80
    else:
        bad = ~np.isfinite(data.view(FLOAT_TYPES[gtype]))
    n = int(bad.sum())
    if n:
        first = counts.setdefault("bad", [0, base + int(np.argmax(bad))])
        first[0] += n


def check_model(path, progress: bool = False) -> CheckReport:
    """Read every tensor of the GGUF file at `path`; see the module's docstring. GGUFError for a file
    whose header cannot be read (not a GGUF, truncated)."""
    from ._progress import Progress

    report = CheckReport(path=str(path))
    with gguf.GGUFReader(path) as r:
        recorded = r.get(gguf.CHECKSUM_KEY)
        digest = hashlib.sha256() if recorded else None
        report.n_tensors = len(r.tensors)
        total = sum(t.nbytes for t in r.tensors)
        bar = Progress(max(1, total >> 20), f"check {Path(path).name}", unit="MiB", enabled=progress)
        unchecked = set()
        shown = 0
        for t in r.tensors:
            data = r.tensor_bytes(t.name)
            _, size = gguf.BLOCK_SIZES[t.type]
            step = max(size, CHUNK_BYTES // size * size)
            counts: dict = {}
            for start in range(0, t.nbytes, step):
                chunk = data[start:start + step]
                if digest is not None:
                    digest.update(chunk)
                if t.type in BLOCK_SCALES:
                    _check_blocks(chunk, t.type, start // size, counts)
                elif t.type in FLOAT_TYPES:
                    _check_floats(chunk, t.type, start // size, counts)
                else:
                    unchecked.add(t.type.name)
                report.n_bytes += len(chunk)
                bar.update((report.n_bytes >> 20) - shown)
                shown = report.n_bytes >> 20
            if "bad" in counts:
                what = "NaN or Inf values" if t.type in FLOAT_TYPES else "blocks with a NaN or Inf scale"
                report.damaged.append(TensorProblem(t.name, what, *counts["bad"]))
            if "big" in counts:
                report.suspect.append(TensorProblem(t.name, f"blocks with a scale above {SCALE_LIMIT:g}", *counts["big"]))
        bar.close()
        report.unchecked_types = sorted(unchecked)
        if digest is not None:
            report.checksum = "ok" if digest.hexdigest() == str(recorded) else "mismatch"
    return report


def main(argv: list[str] | None = None, prog: str = "moecache check") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the GGUF file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    problem = gguf.check_model_file(args.model)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    try:
        report = check_model(args.model, progress=not args.quiet and not args.json)
    except gguf.GGUFError as e:
        print(f"{prog}: {e}\nFix: the file's header is damaged or truncated: download or convert the model again.",
              file=sys.stderr)
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
