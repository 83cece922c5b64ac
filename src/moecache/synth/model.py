"""What a synthetic model is: its presets (shapes of real models), routing profiles, quantizations,
scales, the plan of a tensor (TensorSpec) and the metadata every architecture shares. The writers
(moecache.synth for qwen3moe, moecache.synth.archs for the hybrid architectures) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import gguf
from ..gguf import GGMLType, ValueType

ARCH = "qwen3moe"
# the generator's version: bumped whenever the same arguments give other bytes; it is in the file's
# metadata and in the names of cached models (cached_model_name)
SYNTH_VERSION = 3  # 3: the tensor data's sha256 in the header (moecache check)
DEFAULT_QUANT = "q8_0"


@dataclass(frozen=True)
class Preset:
    """Hyperparameters of a synthetic qwen3moe model."""

    name: str
    description: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int  # dense FFN length (qwen3moe has no dense layers; stored as upstream does)
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    n_vocab: int = 151936  # the qwen2 tokenizer
    tokenizer: str = "qwen2"
    # the architecture; qwen35moe and qwen4exp use the fields below (archs.py), qwen3moe none of them
    arch: str = "qwen3moe"
    n_ff_shexp: int = 0  # shared expert FFN length
    full_attention_interval: int = 0  # every N-th layer is full attention, the others linear attention (GDN)
    n_rot: int = 0  # rotary dims (0 = head_dim)
    rope_sections: tuple[int, ...] = ()  # multi-rope sections (rotary pairs per section)
    ssm_conv_kernel: int = 0  # GDN: conv kernel, head size, key heads, value heads
    ssm_state_size: int = 0
    ssm_group_count: int = 0
    ssm_time_step_rank: int = 0
    hc_count: int = 0  # qwen4exp: hyper-connection streams and their low rank
    hc_low_rank: int = 0
    indexer_n_head: int = 0  # qwen4exp QSA: indexer heads, head size, top-k tokens, tokens per block
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    compress_ratio: int = 0
    ple_ngram_size: int = 0  # qwen4exp n-gram embedding: n, hash heads per n-gram, conv kernel,
    ple_heads_per_ngram: int = 0  # rows per head (the largest primes up to it) and its layer
    ple_conv_kernel: int = 0
    ple_head_vocab: int = 0
    ple_layer: int = 0
    sliding_window: int = 0  # gpt-oss: the window of its sliding-window layers
    n_nextn: int = 0  # qwen35moe: MTP (nextn) blocks after the n_layer main layers (the pin runs one)

    @property
    def n_clusters(self) -> int:
        """Token clusters: 4 per expert, at most n_embd (so the centroids can be orthonormal)."""
        return max(1, min(4 * self.n_expert, self.n_embd))


# the shapes both tiny hybrid presets share
_TINY_HYBRID = dict(
    n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff=64, n_ff_shexp=64,
    n_head=4, n_head_kv=2, head_dim=64, n_ctx_train=4096, rope_freq_base=10_000_000.0,
    full_attention_interval=4, n_rot=16, rope_sections=(3, 3, 2, 0),
    ssm_conv_kernel=4, ssm_state_size=32, ssm_group_count=2, ssm_time_step_rank=4)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny", description="for tests: 4 layers, d_model 64, 16 experts (top-4), ~27 MB at q8_0",
        n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff=256,
        n_head=4, n_head_kv=2, head_dim=64, n_ctx_train=4096),
    "demo": Preset(
        name="demo", description="for moecache-server --demo: 8 layers, d_model 256, 32 experts (top-4), ~140 MB at q8_0",
        n_layer=8, n_embd=256, n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff=1024,
        n_head=4, n_head_kv=2, head_dim=64, n_ctx_train=8192),
    "qwen3-30b-a3b": Preset(
        name="qwen3-30b-a3b",
        description="the real Qwen3-30B-A3B shapes: 48 layers, d_model 2048, 128 experts (top-8), expert FFN 768; "
                    "~16 GiB at q4_0, ~30 GiB at q8_0",
        n_layer=48, n_embd=2048, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff=6144,
        n_head=32, n_head_kv=4, head_dim=128, n_ctx_train=40960),
    "qwen3-next-80b-a3b": Preset(
        name="qwen3-next-80b-a3b",
        description="Qwen3-Next-80B-A3B's expert shapes as a qwen3moe (its linear-attention layers and shared "
                    "expert are not modelled): 48 layers, d_model 2048, 512 experts (top-10), expert FFN 512, "
                    "16 heads of 256 (2 KV); ~41 GiB at q4_0",
        n_layer=48, n_embd=2048, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff=5120,
        n_head=16, n_head_kv=2, head_dim=256, n_ctx_train=262144),
    # the hybrid archs (archs.py); where a number is not published the description says so
    "tiny-qwen35moe": Preset(
        name="tiny-qwen35moe", arch="qwen35moe",
        description="for tests: qwen35moe, 4 layers (3 linear-attention, 1 gated attention), d_model 64, "
                    "16 experts (top-4) + a shared expert; ~22 MB at q8_0",
        **_TINY_HYBRID),
    "tiny-qwen4exp": Preset(
        name="tiny-qwen4exp", arch="qwen4exp",
        description="for tests: qwen4exp, 4 layers (3 linear-attention, 1 QSA with its block indexer, PLE on "
                    "layer 0), d_model 64, 4 hyper-connection streams, 16 experts (top-4) + a shared expert; "
                    "~22 MB at q8_0",
        **_TINY_HYBRID,
        hc_count=4, hc_low_rank=8, indexer_n_head=2, indexer_head_dim=32, indexer_top_k=8, compress_ratio=4,
        ple_ngram_size=3, ple_heads_per_ngram=1, ple_conv_kernel=4, ple_head_vocab=1024, ple_layer=0),
    "qwen3.5-122b-a10b": Preset(
        name="qwen3.5-122b-a10b", arch="qwen35moe",
        description="Qwen3.5-122B-A10B (qwen35moe): 48 layers (36 gated-delta-net, 12 gated attention), d_model 3072, "
                    "256 experts (top-8) + a shared expert, expert FFN 1024, 32 heads of 256 (2 KV), GDN 16 key / "
                    "64 value heads of 128, 262k context; the qwen2 tokenizer (151,936 tokens: the real 248,320-token "
                    "vocab is not in the pinned tree) and no MTP layer; ~64 GiB at q4_0 (fits a 125 GB machine)",
        n_layer=48, n_embd=3072, n_expert=256, n_expert_used=8, n_ff_exp=1024, n_ff=1024, n_ff_shexp=1024,
        n_head=32, n_head_kv=2, head_dim=256, n_ctx_train=262144, rope_freq_base=10_000_000.0,
        full_attention_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0),
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=64),
    "qwen3.8-flash-next": Preset(
        name="qwen3.8-flash-next", arch="qwen4exp",
        description="Qwen3.8-Flash-Next (qwen4exp): 48 layers (36 gated-delta-net, 12 QSA with indexer top-k 2048 "
                    "and compress ratio 4), 512 experts (top-10), a PLE n-gram table of ~29 GB; not published, "
                    "taken from Qwen3-Next-80B-A3B: d_model 2048, expert and shared FFN 512, 16 heads of 256 (2 KV), "
                    "GDN 16 key / 32 value heads of 128; not published, plausible: 4 hyper-connection streams of "
                    "rank 128, 16 indexer heads of 128, 3-gram PLE with 8 heads per n-gram on layer 0; qwen2 "
                    "tokenizer, no MTP layer; ~69 GiB at q4_0 (fits a 125 GB machine)",
        n_layer=48, n_embd=2048, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff=5120, n_ff_shexp=512,
        n_head=16, n_head_kv=2, head_dim=256, n_ctx_train=262144, rope_freq_base=10_000_000.0,
        full_attention_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0),
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
        hc_count=4, hc_low_rank=128, indexer_n_head=16, indexer_head_dim=128, indexer_top_k=2048, compress_ratio=4,
        ple_ngram_size=3, ple_heads_per_ngram=8, ple_conv_kernel=4, ple_head_vocab=25_000_000, ple_layer=0),
}
PRESETS["tiny-gpt-oss"] = Preset(
    name="tiny-gpt-oss", arch="gpt-oss",
    description="for tests: gpt-oss, 4 layers (sliding-window and full attention in turn), d_model 64, 16 experts "
                "(top-4) with biases, attention sinks; ~22 MB at q8_0",
    n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff=64, n_head=4, n_head_kv=2,
    head_dim=64, n_ctx_train=4096, rope_freq_base=150_000.0, rms_eps=1e-5, sliding_window=128)
PRESETS["gpt-oss-120b"] = Preset(
    name="gpt-oss-120b", arch="gpt-oss",
    description="gpt-oss-120b's shapes: 36 layers (sliding window 128 and full attention in turn), d_model 2880, "
                "128 experts (top-4) with biases, expert FFN 2880, 64 heads of 64 (8 KV), attention sinks; the qwen2 "
                "tokenizer (its o200k vocab is not in the pinned tree), no YaRN; MXFP4 experts with --quant mxfp4_moe; "
                "~61 GiB at q8_0, ~60 GiB of experts",
    n_layer=36, n_embd=2880, n_expert=128, n_expert_used=4, n_ff_exp=2880, n_ff=2880, n_head=64, n_head_kv=8,
    head_dim=64, n_ctx_train=131072, rope_freq_base=150_000.0, rms_eps=1e-5, sliding_window=128)
PRESETS["gpt-oss-120b-18l"] = replace(
    PRESETS["gpt-oss-120b"], name="gpt-oss-120b-18l",
    description="gpt-oss-120b's shapes cut to 18 layers (its 128 experts top-4 with biases per layer): for the "
                "gpt-oss benchmark on one GPU machine's disk, at half the budget; ~31 GiB with MXFP4 experts",
    n_layer=18)
PRESETS["gpt-oss-20b"] = replace(
    PRESETS["gpt-oss-120b"], name="gpt-oss-20b",
    description="gpt-oss-20b's shapes: 24 layers (sliding window 128 and full attention in turn), d_model 2880, "
                "32 experts (top-4) with biases, expert FFN 2880, 64 heads of 64 (8 KV), attention sinks; the qwen2 "
                "tokenizer, no YaRN; MXFP4 experts with --quant mxfp4_moe: ~11 GiB, ~9.5 GiB of experts",
    n_layer=24, n_expert=32)
# an MTP block (one full-attention decoder block with the MoE, and the nextn projection) after the main
# layers: its eh_proj passes the next token's normed embedding through, so its draft is the token the main
# model predicts from that embedding (the residual updates are small), and a fair share of drafts is accepted
PRESETS["tiny-qwen35moe-mtp"] = replace(
    PRESETS["tiny-qwen35moe"], name="tiny-qwen35moe-mtp",
    description="for tests: tiny-qwen35moe with an MTP block (for --spec-type draft-mtp); ~24 MB at q8_0",
    n_nextn=1)
PRESETS["qwen3.5-122b-a10b-mtp"] = replace(
    PRESETS["qwen3.5-122b-a10b"], name="qwen3.5-122b-a10b-mtp",
    description="qwen3.5-122b-a10b (see there) with its MTP block (one full-attention decoder block with 256 "
                "experts and the nextn projection) for --spec-type draft-mtp; ~66 GiB at q4_0",
    n_nextn=1)
# the MTP scenario's model on one GPU machine's 64 GiB disk: the 122B shapes in half the layers
PRESETS["qwen3.5-122b-a10b-mtp-24l"] = replace(
    PRESETS["qwen3.5-122b-a10b-mtp"], name="qwen3.5-122b-a10b-mtp-24l",
    description="qwen3.5-122b-a10b-mtp's shapes cut to 24 layers (18 gated-delta-net, 6 gated attention) and its "
                "MTP block: for the MTP benchmark on one GPU machine's disk; ~34 GiB at q4_0",
    n_layer=24)
PRESETS["qwen3.5-35b-a3b-mtp"] = replace(
    PRESETS["qwen3.5-122b-a10b-mtp"], name="qwen3.5-35b-a3b-mtp",
    description="Qwen3.5-35B-A3B's shapes (qwen35moe): 40 layers (30 gated-delta-net, 10 gated attention), d_model "
                "2048, 256 experts (top-8) + a shared expert, expert FFN 512, 16 heads of 256 (2 KV), GDN 16 key / 32 "
                "value heads of 128, and its MTP block; the qwen2 tokenizer; ~19 GiB at q4_0",
    n_layer=40, n_embd=2048, n_ff_exp=512, n_ff=512, n_ff_shexp=512, n_head=16, ssm_time_step_rank=32)
# tiny-qwen4exp's QSA layer is its last, so only the last prompt token's QSA output reaches the logits;
# with a second QSA layer, every prompt token's first-QSA output reaches a later layer's cache
PRESETS["tiny-qwen4exp-8l"] = replace(
    PRESETS["tiny-qwen4exp"], name="tiny-qwen4exp-8l",
    description="for tests: tiny-qwen4exp with 8 layers (6 linear-attention, 2 QSA), so that the first QSA "
                "layer's output for every prompt token reaches the second's cache; ~40 MB at q8_0",
    n_layer=8)
# the long-context benchmark's model: the attention of Qwen3.8-Flash-Next at its real shapes on a 64 GB disk
PRESETS["qwen3.8-flash-next-16l"] = replace(
    PRESETS["qwen3.8-flash-next"], name="qwen3.8-flash-next-16l",
    description="Qwen3.8-Flash-Next's shapes (see qwen3.8-flash-next) cut to 16 layers (12 gated-delta-net, 4 QSA) "
                "and a PLE table of 1M rows per head: for depth benchmarks of the attention on one GPU's disk; "
                "~15 GiB at q4_0",
    n_layer=16, ple_head_vocab=1_000_000)

# routing fitted to published LRU hit rates of the real models on real text (routing_strength,
# context_mix): moecache calibrate-routing, benchmarks/results/2026-12-01-routing-calibration-context-*.md
# (Qwen3-30B-A3B: kekzl/imp PR #1374; the 512-expert shape: llama.cpp PR #27861)
ROUTING_PROFILES: dict[str, tuple[float, float]] = {
    "qwen3-30b-a3b": (2.0, 0.1),
    "qwen3-next-80b-a3b": (1.0, 0.4),
}
ROUTINGS = ("default", "calibrated")
MAX_CONTEXT_MIX = 2.0


def routing_profile(preset: str, routing: str = "default") -> tuple[float, float]:
    """(routing_strength, context_mix) of a routing name: "default" = token identity at strength 1,
    "calibrated" = the preset's fitted profile."""
    if routing == "default":
        return 1.0, 0.0
    if routing != "calibrated":
        raise SynthError(f"unknown routing {routing!r}: use one of {', '.join(ROUTINGS)}")
    try:
        return ROUTING_PROFILES[preset]
    except KeyError:
        raise SynthError(f"preset {preset!r} has no calibrated routing; presets with one: "
                         f"{', '.join(ROUTING_PROFILES)}") from None


# quant types written directly, and general.file_type (enum llama_ftype) of each
DIRECT_QUANTS: dict[str, tuple[GGMLType, int]] = {
    "q8_0": (GGMLType.Q8_0, 7),
    "q4_0": (GGMLType.Q4_0, 2),
    "f16": (GGMLType.F16, 1),
    "f32": (GGMLType.F32, 0),
    "mxfp4_moe": (GGMLType.Q8_0, 38),  # the routed experts in MXFP4 (as gpt-oss ships them; EXPERT_QUANTS), the rest Q8_0
}
# direct quants whose routed experts have a type of their own
EXPERT_QUANTS: dict[str, GGMLType] = {"mxfp4_moe": GGMLType.MXFP4}
# quant types made by the built llama-quantize from an F16 / Q8_0 file (no importance matrix needed)
QUANTIZE_QUANTS = ("q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
                   "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")


ALL_QUANTS = tuple(DIRECT_QUANTS) + QUANTIZE_QUANTS

# F16 intermediates up to this size; bigger models go through Q8_0 (--allow-requantize)
F16_INTERMEDIATE_LIMIT = 4 << 30

# --- scales (see the module docstring) ----------------------------------------------------------
EMBED_CENTROID_WEIGHT = 0.8  # |centroid part| / |embedding|; the rest is per-token noise
ROUTER_GAIN = 5.0  # logit bonus of a cluster's first preferred expert at routing_strength 1
ROUTER_NOISE = 1.0  # std of the random part of the router logits
EXPERT_POPULARITY_SIGMA = 0.7  # log-normal spread of how many clusters prefer each expert
RESIDUAL_DRIFT = 0.3  # relative norm of all residual updates of the model together
OUTPUT_LOGIT_STD = 2.0
SWIGLU_STD = 0.6  # std of silu(g) * u for g, u ~ N(0, 1)

CHUNK_BYTES = 8 << 20


class SynthError(RuntimeError):
    """A synthetic model cannot be written or analysed; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# the plan: every tensor, its shape, type and how it is filled


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order (ne[0] first)
    type: GGMLType
    init: str  # "ones" | "embed" | "router" | "random"
    std: float = 0.0
    layer: int = -1

    @property
    def nbytes(self) -> int:
        return gguf.tensor_nbytes(self.shape, self.type)


def get_preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise SynthError(f"unknown preset {preset!r}. Presets: {', '.join(PRESETS)}") from None


def general_kvs(p: Preset, file_type: int) -> list[tuple[str, object, ValueType]]:
    """The general.* KVs every synthetic model starts with."""
    return [
        ("general.architecture", p.arch, ValueType.STRING),
        ("general.name", f"moecache synthetic {p.name} (random weights)", ValueType.STRING),
        ("general.description", "Synthetic MoE model written by `moecache synth`: real shapes and tokenizer, "
                                "random weights, routing that follows token identity. Its text output is noise.",
         ValueType.STRING),
        ("general.file_type", file_type, ValueType.UINT32),
    ]


def shape_kvs(p: Preset) -> list[tuple[str, object, ValueType]]:
    """The hyperparameters every architecture of synth shares (sizes, experts, attention, rope), in
    file order; a shared expert's FFN length comes after the experts' where the preset has one."""
    U32, F32, a = ValueType.UINT32, ValueType.FLOAT32, p.arch
    shared = [(f"{a}.expert_shared_feed_forward_length", p.n_ff_shexp, U32)] if p.n_ff_shexp else []
    return [
        (f"{a}.block_count", p.n_layer + p.n_nextn, U32),  # the MTP blocks are blocks too
        (f"{a}.context_length", p.n_ctx_train, U32),
        (f"{a}.embedding_length", p.n_embd, U32),
        (f"{a}.feed_forward_length", p.n_ff, U32),
        (f"{a}.expert_feed_forward_length", p.n_ff_exp, U32),
    ] + shared + [
        (f"{a}.expert_count", p.n_expert, U32),
        (f"{a}.expert_used_count", p.n_expert_used, U32),
        (f"{a}.attention.head_count", p.n_head, U32),
        (f"{a}.attention.head_count_kv", p.n_head_kv, U32),
        (f"{a}.attention.key_length", p.head_dim, U32),
        (f"{a}.attention.value_length", p.head_dim, U32),
        (f"{a}.attention.layer_norm_rms_epsilon", p.rms_eps, F32),
        (f"{a}.rope.freq_base", p.rope_freq_base, F32),
    ]


def synth_kvs(p: Preset, seed: int, routing_strength: float) -> list[tuple[str, object, ValueType]]:
    """The moecache.synth.* KVs that say how a synthetic model was made (they end its KVs)."""
    return [
        ("moecache.synth.version", SYNTH_VERSION, ValueType.UINT32),
        ("moecache.synth.preset", p.name, ValueType.STRING),
        ("moecache.synth.seed", seed, ValueType.UINT32),
        ("moecache.synth.routing_strength", routing_strength, ValueType.FLOAT32),
        ("moecache.synth.n_clusters", p.n_clusters, ValueType.UINT32),
    ]
