"""`moecache synth` for the hybrid archs (qwen35moe, qwen4exp): presets at the published shapes, the
tensor plans and KVs the pinned loaders need, and a written tiny file. The numbers below are written
out, not recomputed from the generator's formulas. Nothing here needs the compiled module."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moecache import synth
from moecache.synth import archs as synth_archs
from moecache.gguf import GGMLType, GGUFReader, ValueType

GiB = 1 << 30
RAM_125GB = 125e9
# read by element-wise ops (MUL, ADD, SSM_CONV) or the F32 router: the pin's CPU path needs them F32
F32_SUFFIXES = ("norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ple_conv1d.weight",
                "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def plan(preset, wt=GGMLType.Q4_0):
    specs = synth.plan_tensors(preset, wt)
    by = {s.name: s for s in specs}
    assert len(by) == len(specs), "duplicate tensor names"
    return specs, by


def kvs(preset):
    p = synth.PRESETS[preset]
    return {k: (v, t) for k, v, t in synth.plan_kvs(p, 2, 0, 1.0)}


def layers_with(by, suffix, n_layer):
    return [i for i in range(n_layer) if f"blk.{i}.{suffix}" in by]


# --------------------------------------------------------------------------- presets


def test_presets_have_the_published_shapes():
    q = synth.PRESETS["qwen3.5-122b-a10b"]
    assert q.arch == "qwen35moe"
    assert (q.n_layer, q.n_embd, q.n_expert, q.n_expert_used) == (48, 3072, 256, 8)
    assert (q.n_ff_exp, q.n_ff_shexp) == (1024, 1024)
    assert (q.n_head, q.n_head_kv, q.head_dim, q.n_ctx_train, q.full_attention_interval) == (32, 2, 256, 262144, 4)
    f = synth.PRESETS["qwen3.8-flash-next"]
    assert f.arch == "qwen4exp"
    assert (f.n_layer, f.n_expert, f.n_expert_used, f.full_attention_interval) == (48, 512, 10, 4)
    assert (f.indexer_top_k, f.compress_ratio) == (2048, 4)
    assert (f.n_embd, f.n_ff_exp, f.n_head, f.head_dim) == (2048, 512, 16, 256)
    for name in ("qwen3.5-122b-a10b", "qwen3.8-flash-next"):
        d = synth.PRESETS[name].description
        assert "not in the pinned tree" in d or "not published" in d  # the guessed numbers are named
    # the qwen3moe presets are untouched
    assert all(synth.PRESETS[n].arch == "qwen3moe" for n in ("tiny", "demo", "qwen3-30b-a3b", "qwen3-next-80b-a3b"))


def test_real_presets_fit_a_125gb_machine_at_q4_0_but_are_full_size():
    sizes = {n: sum(s.nbytes for s in synth.plan_tensors(n, GGMLType.Q4_0)) for n in
             ("qwen3.5-122b-a10b", "qwen3.8-flash-next")}
    assert 60 * GiB < sizes["qwen3.5-122b-a10b"] < 66 * GiB  # 122B weights at 4.5 bits
    assert 66 * GiB < sizes["qwen3.8-flash-next"] < 72 * GiB  # 77B of experts + a 29 GB table
    assert all(v < RAM_125GB for v in sizes.values())


# --------------------------------------------------------------------------- qwen35moe


def test_qwen35_122b_plan_has_the_loader_shapes():
    specs, by = plan("qwen3.5-122b-a10b")
    # 3 globals; 36 GDN layers x (2 norms + 9 + 8 ffn); 12 attention layers x (2 + 6 + 8)
    assert len(specs) == 3 + 36 * 19 + 12 * 16
    assert by["token_embd.weight"].shape == (3072, 151936)
    assert by["output.weight"].shape == (3072, 151936)
    assert by["output_norm.weight"].shape == (3072,)
    assert layers_with(by, "attn_q.weight", 48) == list(range(3, 48, 4))
    assert len(layers_with(by, "attn_qkv.weight", 48)) == 36
    gdn = {s.name[len("blk.0."):]: s.shape for s in specs if s.name.startswith("blk.0.")}
    assert gdn == {
        "attn_norm.weight": (3072,), "post_attention_norm.weight": (3072,),
        "attn_qkv.weight": (3072, 12288),  # q, k: 16 heads of 128; v: 64 heads of 128
        "attn_gate.weight": (3072, 8192),
        "ssm_conv1d.weight": (4, 12288), "ssm_dt.bias": (64,), "ssm_a": (64,),
        "ssm_beta.weight": (3072, 64), "ssm_alpha.weight": (3072, 64), "ssm_norm.weight": (128,),
        "ssm_out.weight": (8192, 3072),
        "ffn_gate_inp.weight": (3072, 256),
        "ffn_gate_exps.weight": (3072, 1024, 256), "ffn_up_exps.weight": (3072, 1024, 256),
        "ffn_down_exps.weight": (1024, 3072, 256),
        "ffn_gate_inp_shexp.weight": (3072,), "ffn_gate_shexp.weight": (3072, 1024),
        "ffn_up_shexp.weight": (3072, 1024), "ffn_down_shexp.weight": (1024, 3072),
    }
    assert by["blk.3.attn_q.weight"].shape == (3072, 16384)  # 32 heads of 256, query and gate
    assert by["blk.3.attn_k.weight"].shape == (3072, 512) and by["blk.3.attn_v.weight"].shape == (3072, 512)
    assert by["blk.3.attn_output.weight"].shape == (8192, 3072)
    assert by["blk.3.attn_q_norm.weight"].shape == (256,) and by["blk.3.attn_k_norm.weight"].shape == (256,)
    assert "blk.3.attn_qkv.weight" not in by and "blk.0.attn_q.weight" not in by


def test_qwen35_kvs():
    kv = kvs("qwen3.5-122b-a10b")
    a = "qwen35moe."
    assert kv["general.architecture"][0] == "qwen35moe"
    want = {"block_count": 48, "embedding_length": 3072, "expert_count": 256, "expert_used_count": 8,
            "expert_feed_forward_length": 1024, "expert_shared_feed_forward_length": 1024,
            "attention.head_count": 32, "attention.head_count_kv": 2, "attention.key_length": 256,
            "attention.value_length": 256, "rope.dimension_count": 64, "full_attention_interval": 4,
            "ssm.conv_kernel": 4, "ssm.inner_size": 8192, "ssm.state_size": 128, "ssm.time_step_rank": 64,
            "ssm.group_count": 16, "context_length": 262144}
    for k, v in want.items():
        assert kv[a + k][0] == v, k
    sections, t = kv[a + "rope.dimension_sections"]
    assert t == ValueType.ARRAY and list(sections) == [11, 11, 10, 0]
    assert not any(k.startswith(a + "ple.") or "hyper_connection" in k for k in kv)


# --------------------------------------------------------------------------- qwen4exp


def test_qwen38_flash_next_plan_has_the_loader_shapes():
    specs, by = plan("qwen3.8-flash-next")
    # globals: token_embd, 3 head-mixer tensors, output, the PLE table; per layer 8 hyper-connection
    # tensors + 8 ffn; GDN 9, QSA 6 + 4 indexer; the PLE layer 6 more
    assert len(specs) == 6 + 48 * 16 + 36 * 9 + 12 * 10 + 6
    assert "output_norm.weight" not in by and "blk.0.attn_norm.weight" not in by  # the mixers norm
    assert by["output_hc_norm.weight"].shape == (8192,)  # [n_embd, hc] stored flat
    assert by["output_hc_down.weight"].shape == (8192, 128) and by["output_hc_up.weight"].shape == (128, 8192)
    assert by["blk.47.hc_ffn_inject.weight"].shape == (8192, 4)
    assert layers_with(by, "attn_q.weight", 48) == list(range(3, 48, 4))
    assert layers_with(by, "indexer.q_proj.weight", 48) == list(range(3, 48, 4))
    assert layers_with(by, "ple_key.weight", 48) == [0]
    assert by["blk.0.attn_qkv.weight"].shape == (2048, 8192)  # 16 + 16 key heads, 32 value heads, of 128
    assert by["blk.0.attn_gate.weight"].shape == (2048, 4096)
    assert by["blk.0.ssm_conv1d.weight"].shape == (4, 8192)
    assert by["blk.0.ssm_out.weight"].shape == (4096, 2048)
    assert by["blk.0.ssm_alpha.weight"].shape == (2048, 32) and by["blk.0.ssm_a"].shape == (32,)
    assert by["blk.3.attn_q.weight"].shape == (2048, 8192)  # 16 heads of 256, query and gate
    assert by["blk.3.attn_k.weight"].shape == (2048, 512)
    assert by["blk.3.attn_output.weight"].shape == (4096, 2048)
    assert by["blk.3.indexer.q_proj.weight"].shape == (2048, 2048)  # 16 heads of 128
    assert by["blk.3.indexer.k_proj.weight"].shape == (2048, 128)
    assert by["blk.3.indexer.k_norm.weight"].shape == (128,)
    assert by["blk.0.ple_key.weight"].shape == (2048, 8192)
    assert by["blk.0.ple_value.weight"].shape == (2048, 2048)
    assert by["blk.0.ple_norm_conv.weight"].shape == (8192,)
    assert by["blk.0.ple_conv1d.weight"].shape == (4, 8192)
    assert by["blk.10.ffn_up_exps.weight"].shape == (2048, 512, 512)
    assert by["blk.10.ffn_down_exps.weight"].shape == (512, 2048, 512)
    assert by["blk.10.ffn_down_shexp.weight"].shape == (512, 2048)
    # the n-gram table: 16 heads of 128 (2 n-gram sizes x 8), ~25M rows each: ~29 GB at 4.5 bits
    ple = by["per_layer_token_embd.weight"]
    assert ple.shape[0] == 128 and 16 * 24_999_000 < ple.shape[1] <= 16 * 25_000_000
    assert 27e9 < ple.nbytes < 30e9


def test_qwen38_kvs():
    kv = kvs("qwen3.8-flash-next")
    a = "qwen4exp."
    want = {"block_count": 48, "expert_count": 512, "expert_used_count": 10, "hyper_connection.count": 4,
            "hyper_connection.low_rank": 128, "attention.indexer.head_count": 16,
            "attention.indexer.key_length": 128, "attention.indexer.top_k": 2048, "ple.ngram_size": 3,
            "ple.heads_per_ngram": 8, "ple.conv_kernel": 4, "ple.eos_token_id": 151643,
            "embedding_length_per_layer_input": 128, "ssm.inner_size": 4096}
    for k, v in want.items():
        assert kv[a + k][0] == v, k
    ratios = list(kv[a + "attention.compress_ratios"][0])
    assert ratios == [4 if i % 4 == 3 else 0 for i in range(48)]
    assert list(kv[a + "ple.layers"][0]) == [0]
    sizes = kv[a + "ple.head_vocab_sizes"][0]
    offsets = kv[a + "ple.head_offsets"][0]
    mult = kv[a + "ple.layer_multipliers"][0]
    assert sizes.dtype == np.uint64 and offsets.dtype == np.uint64 and mult.dtype == np.uint64  # the loader reads u64
    assert len(sizes) == len(offsets) == 16 and len(mult) == 3 and all(int(m) % 2 == 1 for m in mult)
    assert len(set(sizes.tolist())) == 16 and max(sizes) <= 25_000_000
    assert offsets[0] == 0 and all(offsets[h + 1] == offsets[h] + sizes[h] for h in range(15))
    _, by = plan("qwen3.8-flash-next")
    assert by["per_layer_token_embd.weight"].shape[1] == int(offsets[-1] + sizes[-1])  # the gather's rows


def test_ple_eos_is_the_tokenizers():
    from moecache.paths import vocab_file

    try:
        path = vocab_file("qwen2")
    except FileNotFoundError as e:
        pytest.skip(f"no qwen2 vocab: {e}")
    with GGUFReader(path) as r:
        assert synth_archs.TOKENIZER_EOS["qwen2"] == int(r["tokenizer.ggml.eos_token_id"])


# --------------------------------------------------------------------------- both


@pytest.mark.parametrize("preset", ["tiny-qwen35moe", "tiny-qwen4exp", "qwen3.5-122b-a10b", "qwen3.8-flash-next"])
def test_tensor_types_are_ones_the_loader_accepts(preset):
    specs, _ = plan(preset, GGMLType.Q8_0)
    for s in specs:
        if s.name.endswith(F32_SUFFIXES) or s.name.endswith("hc_attn_inject.weight"):
            assert s.type == GGMLType.F32, s.name
        elif s.type != GGMLType.F32:
            assert s.type == GGMLType.Q8_0 and s.shape[0] % 32 == 0, s.name
    if preset.startswith("qwen3."):  # at the real widths every big matmul weight is quantized
        assert all(s.type == GGMLType.Q8_0 for s in specs if s.nbytes > (64 << 20))


@pytest.mark.parametrize("preset,kinds", [
    ("tiny-qwen35moe", ("attn_qkv.weight", "attn_q.weight", "ffn_gate_exps.weight", "ffn_up_shexp.weight")),
    ("tiny-qwen4exp", ("attn_qkv.weight", "attn_q.weight", "indexer.q_proj.weight", "ple_key.weight",
                       "hc_attn_down.weight", "ffn_gate_exps.weight", "ffn_up_shexp.weight")),
])
def test_tiny_presets_have_every_kind_of_layer_and_are_small(preset, kinds):
    specs, by = plan(preset, GGMLType.Q8_0)
    p = synth.PRESETS[preset]
    for k in kinds:
        assert layers_with(by, k, p.n_layer), k
    assert p.n_layer == 4 and p.n_embd == 64 and p.n_expert == 16
    assert sum(s.nbytes for s in specs) < 30e6


@pytest.mark.parametrize("preset", ["tiny-qwen35moe", "tiny-qwen4exp", "qwen3.5-122b-a10b", "qwen3.8-flash-next"])
def test_residual_writers_are_small_and_readers_unit_scale(preset):
    specs, by = plan(preset)
    p = synth.PRESETS[preset]
    # what a layer adds to the residual: entries ~ std * sqrt(fan-in) (x ~0.6 after a gate), far below ~1
    writers = [s for s in specs if s.name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight",
                                                    "ffn_down_shexp.weight", "ple_value.weight"))]
    assert len(writers) == 3 * p.n_layer + (1 if p.arch == "qwen4exp" else 0)
    for s in writers:
        assert s.init == "random" and 0 < s.std * math.sqrt(s.shape[0]) < 0.2, s.name
    # what reads the normed hidden state: unit-scale outputs
    for s in specs:
        if s.name.endswith(("attn_qkv.weight", "attn_q.weight", "ffn_up_exps.weight", "indexer.k_proj.weight")):
            assert s.std * math.sqrt(s.shape[0]) == pytest.approx(1.0), s.name


def test_router_and_embeddings_are_the_qwen3moe_generators():
    specs, by = plan("tiny-qwen4exp")
    assert by["token_embd.weight"].init == "embed"
    assert all(by[f"blk.{i}.ffn_gate_inp.weight"].init == "router" for i in range(4))


def test_context_mix_is_qwen3moe_only():
    with pytest.raises(synth.SynthError, match="qwen3moe only"):
        synth.plan_tensors("tiny-qwen4exp", GGMLType.Q8_0, 0.5)


@pytest.mark.parametrize("change,message", [
    ({"ple_layer": 3}, "linear-attention layer"),
    ({"full_attention_interval": 0}, "full_attention_interval"),
    ({"hc_count": 1}, "hc_count"),
    ({"indexer_head_dim": 8}, "indexer"),
    ({"arch": "qwen9"}, "unknown architecture"),
])
def test_bad_shapes_are_clear_errors(change, message):
    p = dataclasses.replace(synth.PRESETS["tiny-qwen4exp"], **change)
    with pytest.raises(synth.SynthError, match=message):
        synth.plan_tensors(p)


# --------------------------------------------------------------------------- a written file


def test_written_tiny_qwen4exp_matches_its_plan(tmp_path):
    from moecache.paths import vocab_file

    try:
        vocab_file("qwen2")
    except FileNotFoundError as e:
        pytest.skip(f"no qwen2 vocab: {e}")
    p = synth.PRESETS["tiny-qwen4exp"]
    path = synth.write_model(tmp_path / "t.gguf", preset=p, seed=3, progress=False, threads=2)
    specs, _ = plan(p, GGMLType.Q8_0)
    with GGUFReader(path) as r:
        assert r["general.architecture"] == "qwen4exp"
        assert [(t.name, t.shape, t.type) for t in r.tensors] == [(s.name, s.shape, s.type) for s in specs]
        assert list(r["qwen4exp.ple.head_vocab_sizes"]) == [1021, 1019]  # the largest primes <= 1024
        assert np.all(r.tensor_rows("blk.0.hc_attn_norm.weight") == 2.0)
        assert np.all(r.tensor_rows("blk.1.ssm_a") == -1.0)  # negative: the state decays
        # the router is qwen3moe's, from the same structure
        st = synth.make_structure(p, 3)
        want = synth.router_weights(p, st, 2, 3, 1.0)
        assert np.array_equal(r.tensor_rows("blk.2.ffn_gate_inp.weight"), want)
        for name in ("blk.0.ple_value.weight", "blk.3.attn_output.weight", "output_hc_up.weight"):
            w = r.tensor_rows(name).astype(np.float64)
            assert np.isfinite(w).all() and abs(w.mean()) < 0.1 * w.std() + 1e-9
    # the numpy routing reference models qwen3moe only: a clear error, not a missing tensor
    with pytest.raises(synth.SynthError, match="qwen3moe models only, not qwen4exp.*--backend core"):
        synth.reference_trace(path, [1, 2, 3])


def test_the_depth_benchmark_preset_keeps_the_real_attention_shapes():
    full, cut = synth.PRESETS["qwen3.8-flash-next"], synth.PRESETS["qwen3.8-flash-next-16l"]
    same = ("n_embd", "n_head", "n_head_kv", "head_dim", "n_rot", "indexer_n_head", "indexer_head_dim",
            "indexer_top_k", "compress_ratio", "full_attention_interval", "n_expert", "n_expert_used", "n_ctx_train")
    assert {k: getattr(cut, k) for k in same} == {k: getattr(full, k) for k in same}
    assert cut.n_layer == 16 and cut.arch == "qwen4exp"
    assert sum(s.nbytes for s in synth.plan_tensors("qwen3.8-flash-next-16l", GGMLType.Q4_0)) < 20 * GiB
