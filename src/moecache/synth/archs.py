"""Synthetic models of the hybrid Qwen MoE architectures: ``qwen35moe`` (Qwen3.5 MoE) and ``qwen4exp``
(Qwen3.8-Flash-Next), for `moecache synth`.

Both interleave gated-delta-net (GDN) linear-attention layers with full-attention layers (every
``full_attention_interval``-th layer), and every layer has a routed MoE plus a sigmoid-gated shared
expert. qwen4exp adds, per the pinned tree's loader (src/models/qwen4exp.cpp):

* hyper-connections: ``hc_count`` residual streams; before the token mixer, before the MoE and before
  the LM head a mixer RMS-norms each stream (gamma [n_embd, hc]), gates it through a low-rank
  down/up pair and averages the streams; an ``inject`` matrix scales each stream's residual add.
  There is no output_norm: the head mixer is the final norm;
* QSA on the full-attention layers: a learned block indexer (q/k projections and norms) picks the
  top-k blocks of ``compress_ratio`` cached tokens that the attention may see;
* one PLE layer (a GDN layer): a per-layer n-gram hash embedding table (``per_layer_token_embd``,
  gathered by a hash of the last ``ple_ngram_size`` tokens) with key/value projections, grouped norms
  and a dilated depthwise conv.

Routing follows the tokens exactly as in the qwen3moe generator: the same token clusters, router
rows and embeddings (synth.make_structure, router_weights, embedding_rows), and small residual
updates from zero-mean random weights, so the hidden state the router sees stays close to
norm(embedding). The arch-specific parts keep that true:

* qwen35moe is pre-norm like qwen3moe; its router reads post_attention_norm(h) (ones);
* qwen4exp's mixer gives the router mean_streams(norm(h_s) * gamma * sigmoid(gate)); the gate is
  near 0 (small up-projection), so sigmoid(gate) ~ 1/2, and the gammas are 2: the router and the LM
  head get norm(h) as in qwen3moe. The streams start as copies of the embedding and get the same
  small updates (inject ~ 0, so each stream's weight 2 * sigmoid(inject / hc) ~ 1).

Small tensors read by element-wise ops (norms, ssm_a, ssm_dt, the conv kernels, the routers) are
F32; matmul weights are the model's type where their rows hold whole quant blocks, F32 otherwise.
"""

from __future__ import annotations

import math

import numpy as np

from .. import gguf
from ..gguf import GGMLType, ValueType
from .model import (OUTPUT_LOGIT_STD, RESIDUAL_DRIFT, SWIGLU_STD, Preset, SynthError, TensorSpec, general_kvs,
                    shape_kvs, synth_kvs)

ARCHS = ("qwen35moe", "qwen4exp", "gpt-oss")
HYBRID = ("qwen35moe", "qwen4exp")  # the gated-delta-net hybrids

# gpt-oss's expert biases: N(0, std) (its released files have them; zero would leave their path untried).
# gate and up read norm(h) projections of ~N(0, 1); down's bias is a residual update, scaled as its weights
GPT_OSS_BIAS_STD = 0.1

# the end-of-text id of each tokenizer: the PLE hash restarts its n-gram window after it
TOKENIZER_EOS = {"qwen2": 151643}

HC_NORM_GAMMA = 2.0  # sigmoid(0) = 1/2 halves the mixed stream; 2 gives the router norm(h) back
HC_GATE_STD = 0.1  # std of the mixer gate logits: sigmoid(gate) stays ~1/2
HC_INJECT_STD = 0.1  # std of inject / hc_count: each stream's residual weight stays ~1
SSM_A = -1.0  # -exp(A_log): negative, so the GDN state decays (exp(softplus(.) * A) < 1)
SSM_DT_BIAS = 0.0


def check(p: Preset) -> None:
    """A clear SynthError when a preset's shapes cannot make a model that the pinned loader accepts."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SynthError(f"preset {p.name} ({p.arch}): {what}")

    need(p.arch in ARCHS, f"unknown architecture (synth writes qwen3moe, {', '.join(ARCHS)})")
    need(p.n_nextn in (0, 1) and (p.n_nextn == 0 or p.arch == "qwen35moe"),
         "an MTP block (n_nextn = 1) is written for qwen35moe only (the pin runs one block)")
    if p.arch == "gpt-oss":
        need(p.sliding_window > 0, "sliding_window must be > 0 (gpt-oss alternates sliding-window and full layers)")
        need(p.n_head % p.n_head_kv == 0, "n_head must be a multiple of n_head_kv")
        return
    need(p.n_ff_shexp > 0, "n_ff_shexp (the shared expert's FFN length) must be > 0")
    need(p.full_attention_interval > 0 and p.n_layer >= p.full_attention_interval,
         "full_attention_interval must be in 1..n_layer, so that there is a full-attention layer")
    need(min(p.ssm_conv_kernel, p.ssm_state_size, p.ssm_group_count, p.ssm_time_step_rank) > 0,
         "the linear-attention shapes (ssm_conv_kernel, ssm_state_size, ssm_group_count, ssm_time_step_rank) "
         "must be > 0")
    need(p.ssm_time_step_rank % p.ssm_group_count == 0, "ssm_time_step_rank (value heads) must be a multiple of "
                                                        "ssm_group_count (key heads)")
    need(0 < rope_dims(p) <= p.head_dim and len(p.rope_sections) == 4 and sum(p.rope_sections) * 2 <= rope_dims(p),
         "n_rot must be in 1..head_dim and rope_sections 4 numbers that cover at most n_rot / 2 pairs")
    if p.arch == "qwen4exp":
        need(p.hc_count > 1 and p.hc_low_rank > 0, "hc_count must be > 1 and hc_low_rank > 0")
        need(p.indexer_n_head > 0 and p.indexer_head_dim >= rope_dims(p) and p.indexer_top_k > 0
             and p.compress_ratio > 0, "the indexer needs heads, a head size >= n_rot, a top-k and a compress ratio")
        n_heads = ple_n_heads(p)
        need(2 <= p.ple_ngram_size <= 8 and 0 < n_heads <= 64, "ple_ngram_size must be in 2..8 and "
             "(ple_ngram_size - 1) * ple_heads_per_ngram in 1..64 (the loader's limits)")
        need(p.n_embd % n_heads == 0, "n_embd must be a multiple of the PLE head count")
        need(p.ple_conv_kernel > 0 and p.ple_head_vocab > n_heads, "the PLE needs a conv kernel and head vocab sizes")
        need(0 <= p.ple_layer < p.n_layer and is_recurrent(p, p.ple_layer),
             "ple_layer must be a linear-attention layer (its conv history lives in the recurrent cache)")
        need(p.tokenizer in TOKENIZER_EOS, f"the PLE needs the end-of-text id of tokenizer {p.tokenizer}")
        need(sum(ple_head_vocab_sizes(p)) < 2**31, "the PLE table must have fewer than 2**31 rows")


def rope_dims(p: Preset) -> int:
    return p.n_rot or p.head_dim


def is_recurrent(p: Preset, layer: int) -> bool:
    """Whether a layer is a linear-attention (GDN) layer; the others are full attention (the loaders' rule)."""
    return (layer + 1) % p.full_attention_interval != 0


def ple_n_heads(p: Preset) -> int:
    return (p.ple_ngram_size - 1) * p.ple_heads_per_ngram


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            return False
    return True


def ple_head_vocab_sizes(p: Preset) -> list[int]:
    """Rows of each PLE hash head: the largest distinct primes <= ple_head_vocab, so that the heads of one
    n-gram (which hash the same mixed value) land on unrelated rows."""
    out, n = [], p.ple_head_vocab
    while len(out) < ple_n_heads(p):
        if _is_prime(n):
            out.append(n)
        n -= 1
    return out


def ple_rows(p: Preset) -> int:
    return sum(ple_head_vocab_sizes(p))


def ple_multipliers(p: Preset) -> list[int]:
    """Per-position multipliers of the n-gram hash: fixed odd 63-bit constants (any odd numbers mix)."""
    rng = np.random.default_rng([0x5EED, 5])
    return [int(v) | 1 for v in rng.integers(1 << 40, 1 << 63, size=p.ple_ngram_size, dtype=np.int64)]


def residual_eps(p: Preset) -> float:
    """Relative size of one residual update: 3 per layer (mixer, routed experts, shared expert) together
    drift ~RESIDUAL_DRIFT, as in qwen3moe."""
    return RESIDUAL_DRIFT / math.sqrt(3 * p.n_layer)


def _mm_type(wt: GGMLType, ne0: int) -> GGMLType:
    """A matmul weight's type: the model's where its rows hold whole quant blocks, else F32."""
    return wt if ne0 % gguf.BLOCK_SIZES[wt][0] == 0 else GGMLType.F32


def plan_gpt_oss(p: Preset, wt: GGMLType) -> list[TensorSpec]:
    """The tensors of a gpt-oss model, in file order: pre-norm attention with biases and per-head sinks,
    sliding-window on every other layer (the KVs say so), then a routed MoE whose experts have biases (the
    router reads post_attention_norm(h), ones, so routing follows the tokens as in qwen3moe)."""
    check(p)
    f32 = GGMLType.F32
    n_e, eps = p.n_embd, residual_eps(p)
    in_std = 1.0 / math.sqrt(n_e)
    n_q, n_kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim

    def t(name, shape, init="random", std=0.0, layer=-1, type_=None):
        return TensorSpec(name, tuple(shape), _mm_type(wt, shape[0]) if type_ is None else type_, init, std, layer)

    specs = [t("token_embd.weight", (n_e, p.n_vocab), "embed", type_=wt),
             t("output_norm.weight", (n_e,), "ones", type_=f32),
             t("output.weight", (n_e, p.n_vocab), std=OUTPUT_LOGIT_STD / math.sqrt(n_e), type_=wt)]
    for i in range(p.n_layer):
        b = f"blk.{i}."
        specs += [
            t(b + "attn_norm.weight", (n_e,), "ones", layer=i, type_=f32),
            t(b + "post_attention_norm.weight", (n_e,), "ones", layer=i, type_=f32),
            t(b + "attn_q.weight", (n_e, n_q), std=in_std, layer=i),
            t(b + "attn_q.bias", (n_q,), "fill", 0.0, i, f32),
            t(b + "attn_k.weight", (n_e, n_kv), std=in_std, layer=i),
            t(b + "attn_k.bias", (n_kv,), "fill", 0.0, i, f32),
            t(b + "attn_v.weight", (n_e, n_kv), std=in_std, layer=i),
            t(b + "attn_v.bias", (n_kv,), "fill", 0.0, i, f32),
            t(b + "attn_output.weight", (n_q, n_e), std=eps / math.sqrt(n_q), layer=i),
            t(b + "attn_output.bias", (n_e,), "fill", 0.0, i, f32),
            t(b + "attn_sinks.weight", (p.n_head,), "fill", 0.0, i, f32),
            t(b + "ffn_gate_inp.weight", (n_e, p.n_expert), "router", layer=i, type_=f32),
            t(b + "ffn_gate_inp.bias", (p.n_expert,), "fill", 0.0, i, f32),
            t(b + "ffn_gate_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, layer=i, type_=wt),
            t(b + "ffn_gate_exps.bias", (p.n_ff_exp, p.n_expert), std=GPT_OSS_BIAS_STD, layer=i, type_=f32),
            t(b + "ffn_up_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, layer=i, type_=wt),
            t(b + "ffn_up_exps.bias", (p.n_ff_exp, p.n_expert), std=GPT_OSS_BIAS_STD, layer=i, type_=f32),
            t(b + "ffn_down_exps.weight", (p.n_ff_exp, n_e, p.n_expert),
              std=eps / (SWIGLU_STD * math.sqrt(p.n_ff_exp)), layer=i, type_=wt),
            t(b + "ffn_down_exps.bias", (n_e, p.n_expert), std=eps * GPT_OSS_BIAS_STD, layer=i, type_=f32),
        ]
    return specs


def plan_tensors(p: Preset, wt: GGMLType) -> list[TensorSpec]:
    """The tensors of a qwen35moe / qwen4exp / gpt-oss model, in file order (see the module docstring for the
    scales)."""
    if p.arch == "gpt-oss":
        return plan_gpt_oss(p, wt)
    check(p)
    f32 = GGMLType.F32
    n_e, eps = p.n_embd, residual_eps(p)
    in_std = 1.0 / math.sqrt(n_e)
    n_q, n_kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    key_dim = p.ssm_state_size * p.ssm_group_count
    value_dim = p.ssm_state_size * p.ssm_time_step_rank
    hc, hc_dim, lr = p.hc_count, p.hc_count * n_e, p.hc_low_rank
    q4 = p.arch == "qwen4exp"

    def t(name, shape, init="random", std=0.0, layer=-1, type_=None):
        return TensorSpec(name, tuple(shape), _mm_type(wt, shape[0]) if type_ is None else type_, init, std, layer)

    def hc_mixer(prefix, layer, inject):
        # the gammas are stored flat: the loader reshapes them to [n_embd, hc] (and 1-D tensors stay
        # unquantized in llama-quantize, as an element-wise weight must)
        specs = [t(prefix + "norm.weight", (hc_dim,), "fill", HC_NORM_GAMMA, layer, f32),
                 # down reads the normed streams (entries ~HC_NORM_GAMMA) and gives N(0, 1); up reads
                 # silu(that / hc), of rms ~1 / (2 hc), and gives gate logits of std ~HC_GATE_STD
                 t(prefix + "down.weight", (hc_dim, lr), std=1.0 / (HC_NORM_GAMMA * math.sqrt(hc_dim)), layer=layer),
                 t(prefix + "up.weight", (lr, hc_dim), std=2.0 * hc * HC_GATE_STD / math.sqrt(lr), layer=layer)]
        if inject:
            inject_std = hc * HC_INJECT_STD / (HC_NORM_GAMMA * math.sqrt(hc_dim))
            specs.append(t(prefix + "inject.weight", (hc_dim, hc), std=inject_std, layer=layer, type_=f32))
        return specs

    specs = [t("token_embd.weight", (n_e, p.n_vocab), "embed", type_=wt)]
    if q4:
        specs += hc_mixer("output_hc_", -1, inject=False)
    else:
        specs.append(t("output_norm.weight", (n_e,), "ones", type_=f32))
    specs.append(t("output.weight", (n_e, p.n_vocab), std=OUTPUT_LOGIT_STD / math.sqrt(n_e), type_=wt))
    if q4:
        # the n-gram table: gathered rows are [head_dim] pieces of one n_embd vector (entries ~1)
        specs.append(t("per_layer_token_embd.weight", (n_e // ple_n_heads(p), ple_rows(p)), std=1.0, type_=wt))

    for i in range(p.n_layer):
        b = f"blk.{i}."
        if q4:
            layer = hc_mixer(b + "hc_attn_", i, inject=True) + hc_mixer(b + "hc_ffn_", i, inject=True)
        else:
            layer = [t(b + "attn_norm.weight", (n_e,), "ones", layer=i, type_=f32),
                     t(b + "post_attention_norm.weight", (n_e,), "ones", layer=i, type_=f32)]
        if is_recurrent(p, i):
            # GDN: conv over [q | k | v], gated RMS norm of the output (sigmoid gate in qwen4exp, silu in qwen35moe)
            layer += [
                t(b + "attn_qkv.weight", (n_e, 2 * key_dim + value_dim), std=in_std, layer=i),
                t(b + "attn_gate.weight", (n_e, value_dim), std=in_std, layer=i),
                t(b + "ssm_conv1d.weight", (p.ssm_conv_kernel, 2 * key_dim + value_dim),
                  std=1.0 / math.sqrt(p.ssm_conv_kernel), layer=i, type_=f32),
                t(b + "ssm_dt.bias", (p.ssm_time_step_rank,), "fill", SSM_DT_BIAS, i, f32),
                t(b + "ssm_a", (p.ssm_time_step_rank,), "fill", SSM_A, i, f32),
                t(b + "ssm_beta.weight", (n_e, p.ssm_time_step_rank), std=in_std, layer=i, type_=f32),
                t(b + "ssm_alpha.weight", (n_e, p.ssm_time_step_rank), std=in_std, layer=i, type_=f32),
                t(b + "ssm_norm.weight", (p.ssm_state_size,), "ones", layer=i, type_=f32),
                t(b + "ssm_out.weight", (value_dim, n_e), std=eps / (SWIGLU_STD * math.sqrt(value_dim)), layer=i),
            ]
        else:
            # gated attention: attn_q holds [q | gate] per head
            layer += [
                t(b + "attn_q.weight", (n_e, 2 * n_q), std=in_std, layer=i),
                t(b + "attn_k.weight", (n_e, n_kv), std=in_std, layer=i),
                t(b + "attn_v.weight", (n_e, n_kv), std=in_std, layer=i),
                t(b + "attn_output.weight", (n_q, n_e), std=eps / math.sqrt(n_q), layer=i),
                t(b + "attn_q_norm.weight", (p.head_dim,), "ones", layer=i, type_=f32),
                t(b + "attn_k_norm.weight", (p.head_dim,), "ones", layer=i, type_=f32),
            ]
            if q4:
                idx = p.indexer_head_dim
                layer += [
                    t(b + "indexer.q_proj.weight", (n_e, p.indexer_n_head * idx), std=in_std, layer=i),
                    t(b + "indexer.k_proj.weight", (n_e, idx), std=in_std, layer=i),
                    t(b + "indexer.q_norm.weight", (idx,), "ones", layer=i, type_=f32),
                    t(b + "indexer.k_norm.weight", (idx,), "ones", layer=i, type_=f32),
                ]
        if q4 and i == p.ple_layer:
            # PLE: value and conv output are residual updates (small); key meets norm(h) in the gate
            kern = p.ple_conv_kernel
            layer += [
                t(b + "ple_key.weight", (n_e, hc_dim), std=in_std, layer=i),
                t(b + "ple_value.weight", (n_e, n_e), std=eps / math.sqrt(n_e), layer=i),
                t(b + "ple_norm_key.weight", (hc_dim,), "ones", layer=i, type_=f32),
                t(b + "ple_norm_query.weight", (hc_dim,), "ones", layer=i, type_=f32),
                t(b + "ple_norm_conv.weight", (hc_dim,), "ones", layer=i, type_=f32),
                t(b + "ple_conv1d.weight", (kern, hc_dim), std=eps / math.sqrt(kern), layer=i, type_=f32),
            ]
        layer += [
            t(b + "ffn_gate_inp.weight", (n_e, p.n_expert), "router", layer=i, type_=f32),
            t(b + "ffn_gate_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, layer=i, type_=wt),
            t(b + "ffn_up_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, layer=i, type_=wt),
            t(b + "ffn_down_exps.weight", (p.n_ff_exp, n_e, p.n_expert),
              std=eps / (SWIGLU_STD * math.sqrt(p.n_ff_exp)), layer=i, type_=wt),
            # the shared expert is random (not token-aligned); its gate is one sigmoid per token
            t(b + "ffn_gate_inp_shexp.weight", (n_e,), std=in_std, layer=i, type_=f32),
            t(b + "ffn_gate_shexp.weight", (n_e, p.n_ff_shexp), std=in_std, layer=i),
            t(b + "ffn_up_shexp.weight", (n_e, p.n_ff_shexp), std=in_std, layer=i),
            t(b + "ffn_down_shexp.weight", (p.n_ff_shexp, n_e), std=eps / (SWIGLU_STD * math.sqrt(p.n_ff_shexp)),
              layer=i),
        ]
        specs += layer
    if p.n_nextn:
        specs += plan_mtp_block(p, wt)
    return specs


def plan_mtp_block(p: Preset, wt: GGMLType) -> list[TensorSpec]:
    """qwen35moe's MTP block (layer n_layer): a full-attention decoder block with the MoE and a shared expert,
    and the nextn tensors. eh_proj maps concat(enorm(embedding of the next token), hnorm(h)) to n_embd: its
    identity on the embedding half and zeros on h's, so the block sees norm(embedding) as the main layers do;
    its updates are small and its head is the model's (output_norm, output): its draft is the main model's
    prediction from that token, which the main model then mostly confirms."""
    f32 = GGMLType.F32
    n_e, eps = p.n_embd, residual_eps(p)
    in_std = 1.0 / math.sqrt(n_e)
    n_q, n_kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    i, last = p.n_layer, p.n_layer - 1  # the router of the last main layer: the structure has no row for i
    b = f"blk.{i}."

    def t(name, shape, init="random", std=0.0, layer=i, type_=None):
        return TensorSpec(name, tuple(shape), _mm_type(wt, shape[0]) if type_ is None else type_, init, std, layer)

    return [
        t(b + "attn_norm.weight", (n_e,), "ones", type_=f32),
        t(b + "post_attention_norm.weight", (n_e,), "ones", type_=f32),
        t(b + "attn_q.weight", (n_e, 2 * n_q), std=in_std),
        t(b + "attn_k.weight", (n_e, n_kv), std=in_std),
        t(b + "attn_v.weight", (n_e, n_kv), std=in_std),
        t(b + "attn_output.weight", (n_q, n_e), std=eps / math.sqrt(n_q)),
        t(b + "attn_q_norm.weight", (p.head_dim,), "ones", type_=f32),
        t(b + "attn_k_norm.weight", (p.head_dim,), "ones", type_=f32),
        t(b + "ffn_gate_inp.weight", (n_e, p.n_expert), "router", layer=last, type_=f32),
        t(b + "ffn_gate_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, type_=wt),
        t(b + "ffn_up_exps.weight", (n_e, p.n_ff_exp, p.n_expert), std=in_std, type_=wt),
        t(b + "ffn_down_exps.weight", (p.n_ff_exp, n_e, p.n_expert), std=eps / (SWIGLU_STD * math.sqrt(p.n_ff_exp)),
          type_=wt),
        t(b + "ffn_gate_inp_shexp.weight", (n_e,), std=in_std, type_=f32),
        t(b + "ffn_gate_shexp.weight", (n_e, p.n_ff_shexp), std=in_std),
        t(b + "ffn_up_shexp.weight", (n_e, p.n_ff_shexp), std=in_std),
        t(b + "ffn_down_shexp.weight", (p.n_ff_shexp, n_e), std=eps / (SWIGLU_STD * math.sqrt(p.n_ff_shexp))),
        t(b + "nextn.eh_proj.weight", (2 * n_e, n_e), "eh_identity"),
        t(b + "nextn.enorm.weight", (n_e,), "ones", type_=f32),
        t(b + "nextn.hnorm.weight", (n_e,), "ones", type_=f32),
    ]


def eh_identity_chunks(spec: TensorSpec) -> list:
    """The bytes of eh_proj (ggml {2 n_embd, n_embd}): row j is 1 at column j, 0 elsewhere."""
    n_in, n_out = spec.shape

    def rows():
        x = np.zeros((n_out, n_in), dtype=np.float32)
        x[np.arange(n_out), np.arange(n_out)] = 1.0
        return gguf.quantize(x, spec.type)

    return [rows]


def plan_kvs(p: Preset, file_type: int, seed: int, routing_strength: float) -> list[tuple[str, object, ValueType]]:
    """The model KVs (everything but the tokenizer) of a qwen35moe / qwen4exp / gpt-oss model, in file order."""
    check(p)
    U32, ARR = ValueType.UINT32, ValueType.ARRAY
    a = p.arch
    if a == "gpt-oss":
        # every other layer attends within the window (the loader's pattern of 2: the last of each pair is full)
        return general_kvs(p, file_type) + shape_kvs(p) + [
            (f"{a}.attention.sliding_window", p.sliding_window, U32),
        ] + synth_kvs(p, seed, routing_strength)

    def u32s(v):
        return np.asarray(v, dtype=np.uint32)

    kvs = general_kvs(p, file_type) + shape_kvs(p) + [
        *([(f"{a}.nextn_predict_layers", p.n_nextn, U32)] if p.n_nextn else []),
        (f"{a}.rope.dimension_count", rope_dims(p), U32),
        (f"{a}.rope.dimension_sections", np.asarray(p.rope_sections, dtype=np.int32), ARR),
        (f"{a}.full_attention_interval", p.full_attention_interval, U32),
        (f"{a}.ssm.conv_kernel", p.ssm_conv_kernel, U32),
        (f"{a}.ssm.inner_size", p.ssm_state_size * p.ssm_time_step_rank, U32),  # the value width
        (f"{a}.ssm.state_size", p.ssm_state_size, U32),
        (f"{a}.ssm.time_step_rank", p.ssm_time_step_rank, U32),  # value heads
        (f"{a}.ssm.group_count", p.ssm_group_count, U32),  # key heads
    ]
    if a == "qwen4exp":
        vocab = ple_head_vocab_sizes(p)
        offsets = np.concatenate([[0], np.cumsum(vocab[:-1])]).astype(np.uint64)
        kvs += [
            (f"{a}.hyper_connection.count", p.hc_count, U32),
            (f"{a}.hyper_connection.low_rank", p.hc_low_rank, U32),
            (f"{a}.attention.indexer.head_count", p.indexer_n_head, U32),
            (f"{a}.attention.indexer.key_length", p.indexer_head_dim, U32),
            (f"{a}.attention.indexer.top_k", p.indexer_top_k, U32),
            # QSA on the full-attention layers; 0 elsewhere (the GDN layers have no KV cache)
            (f"{a}.attention.compress_ratios",
             u32s([0 if is_recurrent(p, i) else p.compress_ratio for i in range(p.n_layer)]), ARR),
            (f"{a}.ple.layers", u32s([p.ple_layer]), ARR),
            (f"{a}.ple.ngram_size", p.ple_ngram_size, U32),
            (f"{a}.ple.heads_per_ngram", p.ple_heads_per_ngram, U32),
            (f"{a}.ple.conv_kernel", p.ple_conv_kernel, U32),
            (f"{a}.ple.eos_token_id", TOKENIZER_EOS[p.tokenizer], U32),
            (f"{a}.embedding_length_per_layer_input", p.n_embd // ple_n_heads(p), U32),
            (f"{a}.ple.layer_multipliers", np.asarray(ple_multipliers(p), dtype=np.uint64), ARR),
            (f"{a}.ple.head_offsets", offsets, ARR),
            (f"{a}.ple.head_vocab_sizes", np.asarray(vocab, dtype=np.uint64), ARR),
        ]
    return kvs + synth_kvs(p, seed, routing_strength)


def fill_chunks(spec: TensorSpec) -> list:
    """The bytes of a constant F32 tensor of any shape (its value is spec.std), as _chunk_jobs' jobs."""
    n = int(np.prod(spec.shape))
    return [lambda: np.full(n, spec.std, dtype="<f4").view(np.uint8)]
