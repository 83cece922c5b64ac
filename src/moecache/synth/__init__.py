"""`moecache synth`: synthetic MoE GGUF models with real shapes, a real tokenizer and token-driven routing.

The weights are random, but built so that expert routing behaves like a trained MoE's on real
text: it follows token identity, so usage is skewed (frequent tokens pull their experts up) and
bursty (repeated tokens reuse their experts).

How the routing is made to follow tokens:

* every vocabulary token belongs to a cluster (a seeded hash of its id); its embedding is the
  cluster's centroid (orthonormal directions, scaled to entries of about 1) plus noise;


* the residual updates are small (attn_output and ffn_down_exps have small scales) and the random
  weights have mean 0 (gguf.zero_mean_quants: a bias would add one common direction to every
  token in every layer), so the hidden state of every layer stays close to the token's embedding;


* each layer draws a cluster -> preferred experts map (biased by a per-layer expert popularity)
  and its router rows (ffn_gate_inp, F32) are sums of the centroids of the clusters that prefer
  the expert, scaled by ``routing_strength``, plus a random part. At strength 0 the router is
  purely random.


With ``context_mix`` > 0 routing also follows the context, as a trained model's does (token identity
alone leaves LRU hit rates far below the published ones): attention is made uniform over the earlier
positions (attn_q_norm = 0), attn_v is a random n_kv-dimensional projection P of the hidden state and
attn_output is context_mix * P^T (spread over each KV group's query heads), so every layer adds
context_mix * P^T P mean_{s<=t} norm(h_s) to the residual. ``predicted_trace`` models the same term;
``ROUTING_PROFILES`` holds the (strength, mix) fitted per preset to published hit rates.

Large tensors (attention, experts, output) are written as random quantized blocks with a chosen
scale, chunked and in parallel, so the 30B preset needs no giant float arrays. K-quants are made
by writing F16 (or Q8_0 for big models) first and running the built ``llama-quantize``.

``moecache synth --stats MODEL`` runs real text through a model and reports, per MoE layer, the
experts touched, the share of routings held by the top 10% / 25% of experts and the reuse of a
token's experts within the previous 8 / 64 tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .. import gguf
from ..gguf import GGMLType, ValueType
from ..texts import default_texts  # noqa: F401  (moecache.synth.default_texts, as before)
from . import archs
from .model import (ARCH, SYNTH_VERSION, DEFAULT_QUANT, Preset, PRESETS, ROUTING_PROFILES,
                    ROUTINGS, MAX_CONTEXT_MIX, routing_profile, DIRECT_QUANTS, EXPERT_QUANTS, QUANTIZE_QUANTS, ALL_QUANTS,
                    F16_INTERMEDIATE_LIMIT, EMBED_CENTROID_WEIGHT, ROUTER_GAIN, ROUTER_NOISE,
                    EXPERT_POPULARITY_SIGMA, RESIDUAL_DRIFT, OUTPUT_LOGIT_STD, SWIGLU_STD, CHUNK_BYTES,
                    SynthError, TensorSpec, get_preset, general_kvs, shape_kvs, synth_kvs)





def _arch_module(p: Preset, context_mix: float = 0.0):
    """The writer of the other architectures (archs.py)."""

    if context_mix > 0.0:
        raise SynthError(f"the context term (context_mix) is written for qwen3moe only, not for {p.arch} "
                         f"(preset {p.name})")
    return archs


def residual_scale(p: Preset) -> float:
    """Relative size of one residual update (2 per layer) so that all of them together drift ~RESIDUAL_DRIFT."""
    return RESIDUAL_DRIFT / math.sqrt(2 * p.n_layer)


def plan_tensors(preset: str | Preset, weight_type: GGMLType = GGMLType.Q8_0,
                 context_mix: float = 0.0) -> list[TensorSpec]:
    """The tensors of a model, in file order, without writing anything."""
    p = get_preset(preset)
    wt = GGMLType(weight_type)
    if p.arch != ARCH:
        return _arch_module(p, context_mix).plan_tensors(p, wt)
    n_q = p.n_head * p.head_dim
    n_kv = p.n_head_kv * p.head_dim
    eps = residual_scale(p)
    f32 = GGMLType.F32
    specs = [
        TensorSpec("token_embd.weight", (p.n_embd, p.n_vocab), wt, "embed"),
        TensorSpec("output_norm.weight", (p.n_embd,), f32, "ones"),
        TensorSpec("output.weight", (p.n_embd, p.n_vocab), wt, "random", OUTPUT_LOGIT_STD / math.sqrt(p.n_embd)),
    ]
    in_std = 1.0 / math.sqrt(p.n_embd)
    ctx = context_mix > 0.0
    for i in range(p.n_layer):
        b = f"blk.{i}."
        # with a context term: uniform attention (q_norm 0), V = P x, output = context_mix * P^T
        v_spec = TensorSpec(b + "attn_v.weight", (p.n_embd, n_kv), wt, "ctx_v", layer=i) if ctx else \
            TensorSpec(b + "attn_v.weight", (p.n_embd, n_kv), wt, "random", in_std, i)
        o_spec = TensorSpec(b + "attn_output.weight", (n_q, p.n_embd), wt, "ctx_out", context_mix, i) if ctx else \
            TensorSpec(b + "attn_output.weight", (n_q, p.n_embd), wt, "random", eps / math.sqrt(n_q), i)
        specs += [
            TensorSpec(b + "attn_norm.weight", (p.n_embd,), f32, "ones", layer=i),
            TensorSpec(b + "attn_q.weight", (p.n_embd, n_q), wt, "random", in_std, i),
            TensorSpec(b + "attn_k.weight", (p.n_embd, n_kv), wt, "random", in_std, i),
            v_spec,
            o_spec,
            TensorSpec(b + "attn_q_norm.weight", (p.head_dim,), f32, "zeros" if ctx else "ones", layer=i),
            TensorSpec(b + "attn_k_norm.weight", (p.head_dim,), f32, "ones", layer=i),
            TensorSpec(b + "ffn_norm.weight", (p.n_embd,), f32, "ones", layer=i),
            TensorSpec(b + "ffn_gate_inp.weight", (p.n_embd, p.n_expert), f32, "router", layer=i),
            TensorSpec(b + "ffn_gate_exps.weight", (p.n_embd, p.n_ff_exp, p.n_expert), wt, "random", in_std, i),
            TensorSpec(b + "ffn_up_exps.weight", (p.n_embd, p.n_ff_exp, p.n_expert), wt, "random", in_std, i),
            TensorSpec(b + "ffn_down_exps.weight", (p.n_ff_exp, p.n_embd, p.n_expert), wt, "random",
                       eps / (SWIGLU_STD * math.sqrt(p.n_ff_exp)), i),
        ]
    return specs




def plan_kvs(p: Preset, file_type: int, seed: int, routing_strength: float,
             context_mix: float = 0.0) -> list[tuple[str, object, ValueType]]:
    """The model KVs (everything but the tokenizer), in file order."""
    if p.arch != ARCH:
        return _arch_module(p, context_mix).plan_kvs(p, file_type, seed, routing_strength)
    # written only when set, so the models without it keep their bytes
    ctx = [("moecache.synth.context_mix", context_mix, ValueType.FLOAT32)] if context_mix > 0.0 else []
    return general_kvs(p, file_type) + shape_kvs(p) + synth_kvs(p, seed, routing_strength) + ctx


# ---------------------------------------------------------------------------------------------
# the routing structure


@dataclass
class Structure:
    """What makes routing follow tokens: clusters, centroids, and each layer's preferred experts."""

    centroids: np.ndarray  # (n_clusters, n_embd) float32, orthonormal rows (unit length)
    token_cluster: np.ndarray  # (n_vocab,) int32
    preferred: np.ndarray  # (n_layer, n_clusters, n_expert_used) int32: a cluster's preferred experts, best first


def make_structure(p: Preset, seed: int) -> Structure:
    rng = np.random.default_rng([seed, 0x5EED, 1])
    k = p.n_clusters
    g = rng.standard_normal((k, p.n_embd))
    if p.n_embd <= 256:
        # small models: exactly orthonormal centroids (signs fixed so that the result is unique)
        q, r = np.linalg.qr(g.T)
        g = (q * np.sign(np.diag(r))[None, :]).T
    # big models: random directions are already orthogonal up to ~1/sqrt(n_embd); no LAPACK needed
    centroids = np.ascontiguousarray(g / np.linalg.norm(g, axis=1, keepdims=True), dtype=np.float32)
    token_cluster = rng.integers(0, k, size=p.n_vocab, dtype=np.int64).astype(np.int32)
    preferred = np.empty((p.n_layer, k, p.n_expert_used), dtype=np.int32)
    for il in range(p.n_layer):
        # each cluster draws its preferred experts without replacement, with probability proportional to
        # the layer's expert popularity (Gumbel top-k: the k largest log(p) + Gumbel noise)
        log_pop = rng.normal(0.0, EXPERT_POPULARITY_SIGMA, size=p.n_expert)
        keys = log_pop[None, :] + rng.gumbel(size=(k, p.n_expert))
        preferred[il] = np.argsort(-keys, axis=1, kind="stable")[:, :p.n_expert_used]
    return Structure(centroids, token_cluster, preferred)


def router_weights(p: Preset, st: Structure, layer: int, seed: int, routing_strength: float) -> np.ndarray:
    """Router of one layer as a numpy (n_expert, n_embd) float32 array (ggml shape {n_embd, n_expert})."""
    rng = np.random.default_rng([seed, 0x5EED, 2, layer])
    n = p.n_embd
    w = rng.standard_normal((p.n_expert, n)).astype(np.float64) * (ROUTER_NOISE / math.sqrt(n))
    if routing_strength != 0.0:
        ku = p.n_expert_used
        bonus = 1.0 - 0.5 * np.arange(ku) / ku  # best preferred expert gets the full gain
        # expert e's row += bonus * centroid of every cluster that prefers e (no BLAS: same bytes everywhere)
        # logit_e = u . w_e with |u| ~ sqrt(n): the aligned part adds gain * bonus * cos(u, centroid)
        aligned = np.zeros_like(w)
        cent = st.centroids.astype(np.float64)
        for c in range(p.n_clusters):  # a cluster's preferred experts are distinct: plain fancy-index add
            aligned[st.preferred[layer, c]] += bonus[:, None] * cent[c][None, :]
        w += (ROUTER_GAIN * routing_strength / math.sqrt(n)) * aligned
    return w.astype(np.float32)


def embedding_rows(p: Preset, st: Structure, seed: int, r0: int, r1: int) -> np.ndarray:
    """Float32 embeddings of tokens r0..r1-1: centroid (entries ~1) plus noise."""
    rng = np.random.default_rng([seed, 0x5EED, 3, r0])
    n = p.n_embd
    a = EMBED_CENTROID_WEIGHT
    b = math.sqrt(1.0 - a * a)
    cent = st.centroids[st.token_cluster[r0:r1]] * np.float32(a * math.sqrt(n))
    noise = rng.standard_normal((r1 - r0, n), dtype=np.float32) * np.float32(b)
    return cent + noise


# ---------------------------------------------------------------------------------------------
# writing


def _random_raw_blocks(rng: np.random.Generator, n_blocks: int, wt: GGMLType, std: float) -> np.ndarray:
    """Like gguf.random_blocks, but with the generator's raw 64-bit output (several times faster)."""
    if wt not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.MXFP4):
        return gguf.random_blocks(rng, n_blocks, wt, std)
    bsize = gguf.BLOCK_SIZES[wt][1]
    nbytes = n_blocks * bsize
    raw = rng.bit_generator.random_raw((nbytes + 7) // 8).view(np.uint8)[:nbytes].reshape(n_blocks, bsize)
    if wt == GGMLType.MXFP4:  # uniform nibbles are already symmetric: only the E8M0 scale byte
        raw[:, 0] = gguf.mxfp4_scale_byte(std)
        return raw
    gguf.zero_mean_quants(raw, wt)
    unit = gguf.Q8_0_RANDOM_STD if wt == GGMLType.Q8_0 else gguf.Q4_0_RANDOM_STD
    raw[:, 0:2] = np.frombuffer(np.float16(std / unit).tobytes(), dtype=np.uint8)
    return raw


def _chunk_jobs(p: Preset, st: Structure, spec: TensorSpec, index: int, seed: int,
                routing_strength: float) -> list[Callable[[], np.ndarray]]:
    """Callables that produce a tensor's bytes in order, each one deterministic on its own."""
    if spec.init == "fill":  # a constant of any shape (archs.py)
        return _arch_module(p).fill_chunks(spec)
    if spec.init == "eh_identity":  # the MTP block's projection (archs.py)
        return _arch_module(p).eh_identity_chunks(spec)
    if spec.init == "ones":
        return [lambda: np.ones(spec.shape[0], dtype="<f4").view(np.uint8)]
    if spec.init == "zeros":
        return [lambda: np.zeros(spec.shape[0], dtype="<f4").view(np.uint8)]
    if spec.init == "ctx_v":
        return [lambda: gguf.quantize(context_projection(p, seed, spec.layer), spec.type)]
    if spec.init == "ctx_out":
        return [lambda: gguf.quantize(context_output(p, seed, spec.layer, spec.std), spec.type)]
    if spec.init == "router":
        return [lambda: router_weights(p, st, spec.layer, seed, routing_strength).reshape(-1).view(np.uint8)]
    if spec.init == "embed":
        n_rows = spec.shape[1]
        rows = embed_chunk_rows(p)
        return [(lambda r0=r0: gguf.quantize(embedding_rows(p, st, seed, r0, min(r0 + rows, n_rows)), spec.type))
                for r0 in range(0, n_rows, rows)]
    if spec.init == "random":
        block, bsize = gguf.BLOCK_SIZES[spec.type]
        n_blocks = int(np.prod(spec.shape)) // block
        per = max(1, CHUNK_BYTES // bsize)
        return [(lambda c=c, b0=b0: _random_raw_blocks(np.random.default_rng([seed, 0x5EED, 4, index, c]),
                                                       min(per, n_blocks - b0), spec.type, spec.std))
                for c, b0 in enumerate(range(0, n_blocks, per))]
    raise AssertionError(spec.init)


def _ordered(jobs: Iterable[Callable[[], np.ndarray]], pool: cf.Executor, window: int) -> Iterator[np.ndarray]:
    """Run jobs in the pool, at most `window` ahead, and yield their results in order."""
    pending: deque[cf.Future] = deque()
    it = iter(jobs)
    try:
        for job in it:
            pending.append(pool.submit(job))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def tokenizer_kvs(tokenizer: str = "qwen2") -> list[gguf.KV]:
    from ..paths import vocab_file

    try:
        path = vocab_file(tokenizer)
    except FileNotFoundError as e:
        raise SynthError(f"the {tokenizer} tokenizer is needed for a synthetic model: {e}") from None
    return gguf.read_tokenizer_kvs(path)


def _write_gguf(out: Path, p: Preset, wt: GGMLType, file_type: int, seed: int, routing_strength: float,
                threads: int, progress: bool, context_mix: float = 0.0, expert_type: GGMLType | None = None) -> None:
    from .._progress import Progress

    tok = tokenizer_kvs(p.tokenizer)
    n_tokens = next((len(kv.value) for kv in tok if kv.key == "tokenizer.ggml.tokens"), None)
    if n_tokens != p.n_vocab:
        raise SynthError(f"the {p.tokenizer} vocab file has {n_tokens} tokens but preset {p.name} needs {p.n_vocab}; "
                         "reinstall moecache (its vocab files come from the pinned llama.cpp tree)")
    specs = plan_tensors(p, wt, context_mix)
    if expert_type is not None:
        specs = [replace(x, type=expert_type) if x.name.endswith("_exps.weight") else x for x in specs]
    st = make_structure(p, seed)
    w = gguf.GGUFWriter(out, checksum=True)  # `moecache check` tells any damage to the weights
    for key, value, vtype in plan_kvs(p, file_type, seed, routing_strength, context_mix):
        w.add(key, value, vtype)
    for kv in tok:
        w.add_kv(kv)
    for s in specs:
        w.add_tensor_info(s.name, s.shape, s.type)
    total = sum(s.nbytes for s in specs)
    mib = 1 << 20
    bar = Progress(max(1, total // mib), f"synth {p.name} {wt.name.lower()}", unit="MiB", enabled=progress)
    done = 0
    try:
        w.write_header()
        with cf.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for i, s in enumerate(specs):
                def counted(chunks):
                    nonlocal done
                    for c in chunks:
                        yield c
                        before = done // mib
                        done += c.nbytes
                        if done // mib > before:
                            bar.update(done // mib - before)
                w.write_tensor_data(s.name, counted(_ordered(_chunk_jobs(p, st, s, i, seed, routing_strength),
                                                             pool, 2 * max(1, threads))))
        w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        bar.close()


def _quantize_binary(quant: str) -> Path:
    from .. import paths

    try:
        return paths.binary("llama-quantize")
    except FileNotFoundError as e:
        raise SynthError(f"--quant {quant} is made with llama-quantize, which is not available: {e} "
                         f"Or write {'/'.join(DIRECT_QUANTS)} directly.") from None


def _run_quantize(src: Path, dst: Path, quant: str, requantize: bool, threads: int) -> None:
    exe = _quantize_binary(quant)
    cmd = [str(exe)] + (["--allow-requantize"] if requantize else []) + [str(src), str(dst), quant.upper(),
                                                                        str(max(1, threads))]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if proc.returncode != 0 or not dst.is_file():
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise SynthError(f"llama-quantize failed (exit {proc.returncode}) making {quant}:\n{tail}")


def write_model(path: str | os.PathLike, preset: str | Preset = "tiny", quant: str = DEFAULT_QUANT, seed: int = 0,
                routing_strength: float = 1.0, progress: bool = True, threads: int | None = None,
                overwrite: bool = True, context_mix: float = 0.0) -> Path:
    """Write a synthetic qwen3moe model to `path` and return it.

    The file appears only when complete: it is written to a temporary file next to `path` and
    renamed at the end (also on error or Ctrl-C nothing partial is left). Same arguments, same bytes.
    """
    p = get_preset(preset)
    quant = quant.lower()
    if quant not in ALL_QUANTS:
        raise SynthError(f"unknown quant {quant!r}. Written directly: {', '.join(DIRECT_QUANTS)}; "
                         f"via llama-quantize: {', '.join(QUANTIZE_QUANTS)}")
    if not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise SynthError(f"seed must be an integer in 0..2**32-1, got {seed!r}")
    if not (math.isfinite(routing_strength) and 0.0 <= routing_strength <= 10.0):
        raise SynthError(f"routing strength must be in 0..10 (0 = random router, 1 = default), got {routing_strength}")
    if not (math.isfinite(context_mix) and 0.0 <= context_mix <= MAX_CONTEXT_MIX):
        raise SynthError(f"context mix must be in 0..{MAX_CONTEXT_MIX:g} (0 = routing by token identity only), "
                         f"got {context_mix}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise SynthError(f"{path} exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise SynthError(f"folder {path.parent} does not exist; create it first")
    threads = threads or os.cpu_count() or 1
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a model file is ordinary data
    inter: Path | None = None
    try:
        if quant in DIRECT_QUANTS:
            wt, ftype = DIRECT_QUANTS[quant]
            _write_gguf(tmp, p, wt, ftype, seed, routing_strength, threads, progress, context_mix,
                        expert_type=EXPERT_QUANTS.get(quant))
        else:
            _quantize_binary(quant)  # fail before writing the intermediate file
            f16_size = sum(s.nbytes for s in plan_tensors(p, GGMLType.F16))
            wt, ftype = DIRECT_QUANTS["f16" if f16_size <= F16_INTERMEDIATE_LIMIT else "q8_0"]
            fd, inter_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{wt.name.lower()}.partial",
                                              dir=path.parent)
            os.close(fd)
            inter = Path(inter_name)
            _write_gguf(inter, p, wt, ftype, seed, routing_strength, threads, progress, context_mix)
            if progress:
                print(f"synth: llama-quantize {wt.name} -> {quant.upper()} ...", file=sys.stderr, flush=True)
            _run_quantize(inter, tmp, quant, wt != GGMLType.F16, threads)
        os.replace(tmp, path)
    finally:
        for t in (tmp, inter):
            if t is not None and t.exists():
                t.unlink()
    return path


def cached_model_name(preset: str, quant: str | None = None, seed: int = 0, routing_strength: float = 1.0,
                      context_mix: float = 0.0) -> str:
    """File name of a cached synthetic model, <preset>-<quant>-seed<N>[-r<strength>][-c<mix>]-synth-v<SYNTH_VERSION>.gguf
    (routing only where it is not the default): with the generator's version in it, a file that an
    older generator made is never taken for a new one."""
    routing = (f"-r{routing_strength:g}" if routing_strength != 1.0 else "") + (f"-c{context_mix:g}" if context_mix else "")
    return f"{preset}-{(quant or DEFAULT_QUANT).lower()}-seed{seed}{routing}-synth-v{SYNTH_VERSION}.gguf"


def cached_model_path(preset: str, quant: str | None = None, seed: int = 0, routing_strength: float = 1.0,
                      context_mix: float = 0.0) -> Path:
    """Where moecache caches a synthetic model (the demo's, a benchmark scenario's { synth = ... })."""
    from ..orchestrator.upstream import cache_dir

    return cache_dir() / "models" / cached_model_name(preset, quant, seed, routing_strength, context_mix)


# ---------------------------------------------------------------------------------------------
# routing statistics


def _reuse(sel_layer: np.ndarray, n_expert: int, window: int) -> float:
    """Mean over tokens t >= 1 of the fraction of t's experts also selected in tokens t-window..t-1."""
    t_n, k = sel_layer.shape
    if t_n < 2:
        return float("nan")
    valid = (sel_layer >= 0) & (sel_layer < n_expert)
    onehot = np.zeros((t_n, n_expert), dtype=bool)
    rows = np.repeat(np.arange(t_n), k)
    onehot[rows[valid.reshape(-1)], sel_layer.reshape(-1)[valid.reshape(-1)]] = True
    idx = np.where(onehot, np.arange(t_n)[:, None], -(1 << 40))
    last = np.maximum.accumulate(idx, axis=0)  # last selection at or before t
    prev = np.vstack([np.full((1, n_expert), -(1 << 40)), last[:-1]])  # last selection before t
    safe = np.where(valid, sel_layer, 0)
    gap = np.arange(t_n)[:, None] - np.take_along_axis(prev, safe, axis=1)
    hit = (gap <= window) & valid
    n_sel = valid.sum(axis=1)
    frac = np.divide(hit.sum(axis=1), n_sel, out=np.zeros(t_n), where=n_sel > 0)
    return float(frac[1:][n_sel[1:] > 0].mean()) if (n_sel[1:] > 0).any() else float("nan")


def routing_stats(trace: np.ndarray, n_expert: int) -> dict:
    """Statistics of a routing trace of shape (n_tokens, n_moe_layers, n_expert_used) (expert ids; < 0 = none).

    Per layer: experts touched; the share of routings held by the top 10% and top 25% of experts
    (by count; uniform usage gives ~0.10 / ~0.25); reuse within 8 / 64 tokens (mean over tokens of
    the fraction of a token's experts that the same layer also selected within the previous 8 / 64
    tokens). ``total`` has the means over layers (and min/max of experts touched).
    """
    trace = np.asarray(trace)
    if trace.ndim != 3:
        raise ValueError(f"trace must have shape (n_tokens, n_layers, n_expert_used), got {trace.shape}")
    if n_expert <= 0:
        raise ValueError("n_expert must be positive")
    n_tok, n_layer, k = trace.shape
    top10 = max(1, math.ceil(0.10 * n_expert))
    top25 = max(1, math.ceil(0.25 * n_expert))
    layers = []
    for il in range(n_layer):
        sel = trace[:, il, :].astype(np.int64)
        ids = sel[(sel >= 0) & (sel < n_expert)]
        counts = np.bincount(ids, minlength=n_expert)
        ranked = np.sort(counts)[::-1]
        n = max(int(counts.sum()), 1)
        layers.append({
            "layer": il,
            "routings": int(counts.sum()),
            "experts_touched": int((counts > 0).sum()),
            "top10_share": float(ranked[:top10].sum() / n),
            "top25_share": float(ranked[:top25].sum() / n),
            "max_share": float(ranked[0] / n),
            "reuse8": _reuse(sel, n_expert, 8),
            "reuse64": _reuse(sel, n_expert, 64),
        })

    def mean(key):
        vals = [l[key] for l in layers if not math.isnan(l[key])]
        return float(np.mean(vals)) if vals else float("nan")

    total = {
        "experts_touched_mean": mean("experts_touched"),
        "experts_touched_min": min((l["experts_touched"] for l in layers), default=0),
        "experts_touched_max": max((l["experts_touched"] for l in layers), default=0),
        "top10_share": mean("top10_share"),
        "top25_share": mean("top25_share"),
        "max_share": mean("max_share"),
        "reuse8": mean("reuse8"),
        "reuse64": mean("reuse64"),
    }
    return {"n_tokens": int(n_tok), "n_layers": int(n_layer), "n_expert": int(n_expert),
            "n_expert_used": int(k), "top10_experts": top10, "top25_experts": top25,
            "layers": layers, "total": total}


# ---------------------------------------------------------------------------------------------
# a numpy reference of the routing, and a small byte-level BPE tokenizer for it


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character map of byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# the qwen2 pre-tokenizer regex with \p{L} ~ [^\W\d_] and \p{N} ~ \d (Python's re has no \p{..})
_QWEN2_SPLIT = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+")


class BPETokenizer:
    """A byte-level BPE tokenizer from GGUF tokenizer KVs (the qwen2 pre-tokenizer), for the numpy reference.

    It follows llama.cpp's tokenizer for ordinary text (letters, digits, punctuation, whitespace);
    for exotic Unicode it may split differently. The real path (`moecache.Model.tokenize`) is
    used wherever the compiled module is available.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: np.ndarray | None = None):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {}
        for i, m in enumerate(merges):
            a, _, b = m.partition(" ")
            self.ranks[(a, b)] = i
        self.byte_map = _bytes_to_unicode()
        specials = []
        if token_types is not None:
            specials = [t for t, ty in zip(tokens, token_types) if ty in (3, 4) and t]  # CONTROL, USER_DEFINED
        self._special = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
                                   + ")") if specials else None
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "BPETokenizer":
        with gguf.GGUFReader(path) as r:
            if r.get("tokenizer.ggml.model") != "gpt2":
                raise SynthError(f"{path}: the reference tokenizer handles byte-level BPE (gpt2) vocabularies only")
            return cls(r["tokenizer.ggml.tokens"], r["tokenizer.ggml.merges"], r.get("tokenizer.ggml.token_type"))

    def _bpe(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        parts = [self.byte_map[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids = []
        for s in parts:
            if s in self.vocab:
                ids.append(self.vocab[s])
            else:  # cannot happen with a complete byte-level vocabulary; keep going byte by byte
                ids.extend(self.vocab[c] for c in s if c in self.vocab)
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        pieces = self._special.split(text) if self._special else [text]
        out: list[int] = []
        for j, piece in enumerate(pieces):
            if not piece:
                continue
            if self._special and j % 2 == 1:
                out.append(self.vocab[piece])
                continue
            for m in _QWEN2_SPLIT.finditer(piece):
                out.extend(self._bpe(m.group(0)))
        return out


@lru_cache(maxsize=4)
def reference_tokenizer(tokenizer: str = "qwen2") -> BPETokenizer:
    from ..paths import vocab_file

    return BPETokenizer.from_gguf(vocab_file(tokenizer))


def embed_chunk_rows(p: Preset) -> int:
    """Rows of token_embd per generated chunk (an embedding's noise depends on its chunk)."""
    return max(1, (CHUNK_BYTES // 4) // p.n_embd)


def context_projection(p: Preset, seed: int, layer: int) -> np.ndarray:
    """(n_head_kv * head_dim, n_embd) float32, rows of length ~1: the subspace a layer's context term
    carries (context_mix in predicted_trace)."""
    rng = np.random.default_rng([seed, 0x5EED, 4, layer])
    n_kv = p.n_head_kv * p.head_dim
    return (rng.standard_normal((n_kv, p.n_embd), dtype=np.float32) / np.float32(math.sqrt(p.n_embd)))


def context_output(p: Preset, seed: int, layer: int, context_mix: float) -> np.ndarray:
    """attn_output of a layer with a context term, (n_embd, n_head * head_dim) float32: query head h
    reads KV head h // (n_head / n_head_kv) (ggml's GQA broadcast), and each KV head's mean value comes
    back through P^T once in all, so its columns are context_mix / group * P^T[:, that KV head]."""
    proj = context_projection(p, seed, layer)  # (n_kv, n_embd)
    group = p.n_head // p.n_head_kv
    hd = p.head_dim
    out = np.empty((p.n_embd, p.n_head * hd), dtype=np.float32)
    for h in range(p.n_head):
        g = h // group
        out[:, h * hd:(h + 1) * hd] = proj[g * hd:(g + 1) * hd].T * np.float32(context_mix / group)
    return out


def predicted_trace(preset: str | Preset, tokens: Sequence[int], seed: int = 0,
                    routing_strength: float = 1.0, context_mix: float = 0.0) -> np.ndarray:
    """The routing that a model of `preset` would get, from the float weights before quantization, without
    writing the model (e.g. for the qwen3-30b-a3b preset). Same approximation as reference_trace.

    context_mix > 0 models the context term that the generator writes with the same context_mix: each
    layer's attention attends uniformly to every earlier position, and its value/output projections carry
    a random n_kv-dimensional subspace (context_projection), scaled by context_mix, into the residual:
    h += context_mix * P^T P mean_{s <= t} norm(h_s); the router then sees norm(h). 0 = token identity only."""
    p = get_preset(preset)
    st = make_structure(p, seed)
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= p.n_vocab):
        raise ValueError(f"token ids must be in 0..{p.n_vocab - 1}")
    rows = embed_chunk_rows(p)
    x = np.empty((len(ids), p.n_embd), dtype=np.float64)
    for chunk in np.unique(ids // rows):
        r0 = int(chunk) * rows
        emb = embedding_rows(p, st, seed, r0, min(r0 + rows, p.n_vocab))
        sel = np.nonzero(ids // rows == chunk)[0]
        x[sel] = emb[ids[sel] - r0]
    def norm(v):
        return v / np.sqrt((v * v).mean(axis=1, keepdims=True) + p.rms_eps)

    out = np.empty((len(ids), p.n_layer, p.n_expert_used), dtype=np.int32)
    if context_mix == 0.0:
        x = norm(x)
        for il in range(p.n_layer):
            logits = x @ router_weights(p, st, il, seed, routing_strength).astype(np.float64).T
            out[:, il, :] = np.argsort(-logits, axis=1, kind="stable")[:, :p.n_expert_used]
        return out
    h = x.astype(np.float32)
    counts = np.arange(1, len(ids) + 1, dtype=np.float32)[:, None]
    for il in range(p.n_layer):
        mean = np.cumsum(norm(h), axis=0, dtype=np.float64).astype(np.float32) / counts  # causal, uniform attention
        proj = context_projection(p, seed, il)
        h = h + np.float32(context_mix) * ((mean @ proj.T) @ proj)
        logits = norm(h).astype(np.float64) @ router_weights(p, st, il, seed, routing_strength).astype(np.float64).T
        out[:, il, :] = np.argsort(-logits, axis=1, kind="stable")[:, :p.n_expert_used]
    return out


def reference_trace(path: str | os.PathLike, tokens: Sequence[int]) -> np.ndarray:
    """Routing predicted from the weights in a GGUF: embedding -> RMS norm -> router -> top-k, per layer.

    It ignores attention and the (small) residual updates, so it matches the real routing of the
    first layer closely and drifts a little with depth. Returns int32 (n_tokens, n_layers, n_expert_used).
    Needs token_embd in F32/F16/BF16/Q8_0/Q4_0 (not K-quants).
    """
    with gguf.GGUFReader(path) as r:
        arch = r["general.architecture"]
        if arch != ARCH:
            raise SynthError(f"{path}: the numpy routing reference follows qwen3moe models only, not {arch}; "
                             "read the routing from the model itself (--backend core)")
        n_layer = int(r[f"{arch}.block_count"])
        k = int(r[f"{arch}.expert_used_count"])
        eps = float(r.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
        ids = np.asarray(tokens, dtype=np.int64)
        try:
            x = r.tensor_rows("token_embd.weight", ids).astype(np.float64)
        except gguf.GGUFError as e:
            raise SynthError(f"{path}: the reference cannot read token_embd ({e})") from None
        ctx = float(r.get("moecache.synth.context_mix", 0.0))
        if ctx > 0.0:
            return _reference_trace_context(r, arch, x, n_layer, k, eps)
        x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
        out = np.empty((len(ids), n_layer, k), dtype=np.int32)
        for il in range(n_layer):
            norm = r.tensor_rows(f"blk.{il}.ffn_norm.weight").astype(np.float64)
            w = r.tensor_rows(f"blk.{il}.ffn_gate_inp.weight").astype(np.float64)  # (n_expert, n_embd)
            logits = (x * norm) @ w.T
            top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
            out[:, il, :] = top
        return out


def _reference_trace_context(r: gguf.GGUFReader, arch: str, x: np.ndarray, n_layer: int, k: int,
                             eps: float) -> np.ndarray:
    """reference_trace of a model with a context term: each layer adds its attention output computed from
    the file's attn_v and attn_output with uniform causal attention (its attn_q_norm is 0, so every
    attention logit is 0), then routes norm(h)."""
    n_head = int(r[f"{arch}.attention.head_count"])
    n_head_kv = int(r[f"{arch}.attention.head_count_kv"])
    hd = int(r[f"{arch}.attention.key_length"])
    group = n_head // n_head_kv

    def norm(v):
        return v / np.sqrt((v * v).mean(axis=1, keepdims=True) + eps)

    h = x
    counts = np.arange(1, len(h) + 1, dtype=np.float64)[:, None]
    out = np.empty((len(h), n_layer, k), dtype=np.int32)
    for il in range(n_layer):
        b = f"blk.{il}."
        if np.any(r.tensor_rows(b + "attn_q_norm.weight") != 0):
            raise SynthError(f"layer {il}: attn_q_norm is not 0, so its attention is not uniform; "
                             "this reference cannot follow it")
        xa = norm(h) * r.tensor_rows(b + "attn_norm.weight").astype(np.float64)
        v = xa @ r.tensor_rows(b + "attn_v.weight").astype(np.float64).T  # (T, n_kv)
        mean_v = np.cumsum(v, axis=0) / counts
        heads = np.repeat(mean_v.reshape(len(h), n_head_kv, hd), group, axis=1).reshape(len(h), n_head * hd)
        h = h + heads @ r.tensor_rows(b + "attn_output.weight").astype(np.float64).T
        xf = norm(h) * r.tensor_rows(b + "ffn_norm.weight").astype(np.float64)
        logits = xf @ r.tensor_rows(b + "ffn_gate_inp.weight").astype(np.float64).T
        out[:, il, :] = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return out


# ---------------------------------------------------------------------------------------------
# real text


def _read_model_info(path: Path) -> dict:
    with gguf.GGUFReader(path) as r:
        arch = r.get("general.architecture")
        if f"{arch}.expert_count" not in r.kv:
            raise SynthError(f"{path}: architecture {arch} has no experts ({arch}.expert_count is missing)")
        return {"arch": arch, "n_expert": int(r[f"{arch}.expert_count"]),
                "n_expert_used": int(r[f"{arch}.expert_used_count"]), "n_layer": int(r[f"{arch}.block_count"]),
                "n_ctx_train": int(r.get(f"{arch}.context_length", 4096)),
                "synth": {k.split(".")[-1]: kv.value for k, kv in r.kv.items() if k.startswith("moecache.synth.")}}


def _core_available() -> bool:
    """Whether the compiled module (moecache._core) can be loaded."""
    try:
        import moecache

        moecache.native_module()
        return True
    except Exception:
        return False


def stats_for_model(path: str | os.PathLike, text: str | None = None, max_tokens: int = 4096,
                    backend: str = "auto", n_threads: int | None = None) -> dict:
    """Run real text through a model and return routing_stats of its routing, plus where it came from.

    backend: "core" (the compiled module: moecache.Model(...).context(...).trace_routing), "reference"
    (the numpy prediction from the weights; synthetic-style models only), or "auto" (core when available).
    """
    path = Path(path)
    if not path.is_file():
        raise SynthError(f"{path}: no such model file")
    info = _read_model_info(path)
    sources = ["(given text)"]
    if text is None:
        texts = default_texts()
        sources = [name for name, _ in texts]
        # an even share of every source (code and prose), at ~4 characters a token
        budget = max(1, 4 * max_tokens // len(texts)) if max_tokens else None
        text = "\n\n".join(t[:budget] for _, t in texts)
    if backend == "auto":
        backend = "core" if _core_available() else "reference"
    if backend == "core":
        import moecache

        model = moecache.Model(str(path))
        tokens = list(model.tokenize(text, add_special=False, parse_special=False))[:max_tokens]
        if not tokens:
            raise SynthError("the text is empty")
        n_batch = min(max(len(tokens), 16), 2048)
        kwargs = {"n_ctx": max(len(tokens), 16), "n_batch": n_batch, "n_ubatch": min(512, n_batch)}
        if n_threads:
            kwargs["n_threads"] = n_threads
        ctx = model.context(**kwargs)
        trace = np.asarray(ctx.trace_routing(tokens), dtype=np.int32)
    elif backend == "reference":
        tokens = reference_tokenizer().encode(text)[:max_tokens]
        if not tokens:
            raise SynthError("the text is empty")
        trace = reference_trace(path, tokens)
    else:
        raise SynthError(f"unknown backend {backend!r} (auto, core, reference)")
    stats = routing_stats(trace, info["n_expert"])
    stats.update({"model": str(path), "backend": backend, "text_sources": sources, "synth": info["synth"]})
    return stats


def format_stats(stats: dict) -> str:
    lines = [f"model: {stats.get('model', '?')}   routing from: {stats.get('backend', '?')}",
             f"text: {', '.join(stats.get('text_sources', []))} ({stats['n_tokens']} tokens)",
             f"experts: {stats['n_expert']} per layer, {stats['n_expert_used']} used per token; "
             f"top 10% = {stats['top10_experts']} experts, top 25% = {stats['top25_experts']} "
             f"(uniform usage: shares ~0.10 / ~0.25)",
             "",
             f"{'layer':>5} {'touched':>8} {'top10%':>8} {'top25%':>8} {'max':>7} {'reuse8':>8} {'reuse64':>8}"]
    for l in stats["layers"]:
        lines.append(f"{l['layer']:>5} {l['experts_touched']:>8} {l['top10_share']:>8.3f} {l['top25_share']:>8.3f} "
                     f"{l['max_share']:>7.3f} {l['reuse8']:>8.3f} {l['reuse64']:>8.3f}")
    t = stats["total"]
    lines.append(f"{'all':>5} {t['experts_touched_mean']:>8.1f} {t['top10_share']:>8.3f} {t['top25_share']:>8.3f} "
                 f"{t['max_share']:>7.3f} {t['reuse8']:>8.3f} {t['reuse64']:>8.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI


def _strength(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not (math.isfinite(v) and 0.0 <= v <= 10.0):
        raise argparse.ArgumentTypeError(f"must be in 0..10 (0 = random router, 1 = default), got {s}")
    return v


def _context_mix(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not (math.isfinite(v) and 0.0 <= v <= MAX_CONTEXT_MIX):
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_CONTEXT_MIX:g}, got {s}")
    return v


def _seed(s: str) -> int:
    try:
        v = int(s, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be in 0..4294967295, got {s}")
    return v


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {s}")
    return v


def _preset_name(s: str) -> str:
    if s not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {s!r}; presets: {', '.join(PRESETS)}")
    return s


def _quant_name(s: str) -> str:
    if s.lower() not in ALL_QUANTS:
        raise argparse.ArgumentTypeError(f"unknown quant {s!r}; written directly: {', '.join(DIRECT_QUANTS)}; "
                                         f"via llama-quantize: {', '.join(QUANTIZE_QUANTS)}")
    return s.lower()


def build_parser(prog: str = "moecache synth") -> argparse.ArgumentParser:
    presets = "; ".join(f"{n}: {p.description}" for n, p in PRESETS.items())
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Write a synthetic MoE GGUF (qwen3moe, qwen35moe, qwen4exp or gpt-oss) with real shapes, the real qwen2 "
                    "tokenizer and random weights whose expert routing follows token identity; or, with --stats, "
                    "report the routing "
                    "statistics of real text through a model.",
        epilog="examples:\n  moecache synth tiny.gguf --preset tiny\n"
               "  moecache synth big.gguf --preset qwen3-30b-a3b --quant q4_0\n"
               "  moecache synth --stats tiny.gguf --json\n  moecache synth stats tiny.gguf --text README.md",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", metavar="OUT.gguf", help="the model file to write")
    ap.add_argument("--preset", type=_preset_name, default="tiny", help=f"model shape (default tiny). {presets}")
    ap.add_argument("--quant", type=_quant_name, default=DEFAULT_QUANT,
                    help=f"weight type (default {DEFAULT_QUANT}). Written directly: {', '.join(DIRECT_QUANTS)}. "
                         f"Made with the built llama-quantize: {', '.join(QUANTIZE_QUANTS)}")
    ap.add_argument("--seed", type=_seed, default=0, help="random seed; the same seed gives the same bytes (default 0)")
    ap.add_argument("--routing-strength", type=_strength, default=None,
                    help="how strongly routing follows token identity: 0 = random router, 1 = default, up to 10")
    ap.add_argument("--context-mix", type=_context_mix, default=None,
                    help=f"how strongly routing follows the context (uniform attention over the earlier tokens "
                         f"through a random subspace): 0 = token identity only (default), up to {MAX_CONTEXT_MIX:g}")
    ap.add_argument("--routing", choices=ROUTINGS, default="default",
                    help="default: strength 1, no context term; calibrated: the preset's profile fitted to published "
                         f"hit rates ({'; '.join(f'{n}: strength {a:g}, mix {b:g}' for n, (a, b) in ROUTING_PROFILES.items())}); "
                         "--routing-strength / --context-mix override it")
    ap.add_argument("--threads", type=_positive, default=None,
                    help="worker threads for writing (default: all cores)")
    ap.add_argument("--force", action="store_true", help="overwrite OUT.gguf if it exists")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    st = ap.add_argument_group("routing statistics")
    st.add_argument("--stats", metavar="MODEL", help="report routing statistics of real text through MODEL "
                                                     "(same as `moecache synth stats MODEL`)")
    st.add_argument("--text", metavar="FILE", action="append", default=None,
                    help="text file(s) to run (repeatable; default: benchmarks/prompts in a checkout, else the "
                         "source of Python's textwrap and argparse modules)")
    st.add_argument("--max-tokens", type=_positive, default=4096, help="tokens of text to run (default 4096)")
    st.add_argument("--backend", choices=("auto", "core", "reference"), default="auto",
                    help="where routing comes from: core = the model run by the compiled module; reference = "
                         "the numpy prediction from the weights (synthetic models only); auto = core when built")
    st.add_argument("--json", action="store_true", help="print the statistics as JSON")
    return ap


def _stats_main(args, ap) -> int:
    text = None
    if args.text:
        parts = []
        for f in args.text:
            try:
                parts.append(Path(f).read_text(encoding="utf-8", errors="replace"))
            except OSError as e:
                ap.error(f"--text {f}: cannot read it ({e.strerror or e})")
        text = "\n\n".join(parts)
    try:
        stats = stats_for_model(args.stats, text, max_tokens=args.max_tokens, backend=args.backend,
                                n_threads=args.threads)
    except (SynthError, gguf.GGUFError, FileNotFoundError) as e:
        print(f"moecache synth: {e}", file=sys.stderr)
        return 1
    if args.text:
        stats["text_sources"] = list(args.text)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def main(argv: list[str] | None = None, prog: str = "moecache synth") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(prog)
    if argv and argv[0] == "stats":
        argv = argv[1:]
        if argv and not argv[0].startswith("-"):
            argv = ["--stats", argv[0]] + argv[1:]
        elif not any(a in ("-h", "--help") or a.startswith("--stats") for a in argv):
            ap.error("stats needs a MODEL: moecache synth stats MODEL [--text FILE ...] [--json]")
    args = ap.parse_args(argv)
    if args.list_presets:
        for n, p in PRESETS.items():
            d = asdict(p)
            size = sum(s.nbytes for s in plan_tensors(p, GGMLType.Q8_0)) / (1 << 20)
            print(f"{n}: {p.description}\n    {d}\n    q8_0 size: {size:.0f} MiB")
        return 0
    if args.stats:
        if args.out:
            ap.error("give either OUT.gguf (write a model) or --stats MODEL (report statistics), not both")
        return _stats_main(args, ap)
    if not args.out:
        ap.error("OUT.gguf is required (or --stats MODEL); see --help")
    out = Path(args.out)
    if out.suffix != ".gguf":
        ap.error(f"OUT must end in .gguf, got {out}")
    if out.exists() and not args.force:
        print(f"moecache synth: {out} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    if out.is_dir():
        ap.error(f"{out} is a folder")
    try:
        strength, mix = routing_profile(args.preset, args.routing)
    except SynthError as e:
        ap.error(f"--routing: {e}")
    strength = strength if args.routing_strength is None else args.routing_strength
    mix = mix if args.context_mix is None else args.context_mix
    try:
        write_model(out, preset=args.preset, quant=args.quant, seed=args.seed, routing_strength=strength,
                    context_mix=mix, progress=not args.quiet, threads=args.threads)
    except KeyboardInterrupt:
        print("moecache synth: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (SynthError, gguf.GGUFError, OSError) as e:
        print(f"moecache synth: {e}", file=sys.stderr)
        return 1
    size = out.stat().st_size / (1 << 20)
    print(f"wrote {out} ({size:.1f} MiB): synthetic {get_preset(args.preset).arch} '{args.preset}' {args.quant}, "
          f"seed {args.seed}, "
          f"routing strength {strength:g}, context mix {mix:g} (random weights: the text it generates is noise)")
    return 0
