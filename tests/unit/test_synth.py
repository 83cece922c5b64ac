"""`moecache synth`: presets and tensor plans, the written tiny model, determinism, routing statistics,
the numpy routing reference and the CLI. Nothing here needs the compiled module."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from moecache import synth
from moecache.gguf import GGMLType, GGUFReader


@pytest.fixture(scope="module")
def vocab_path() -> Path:
    from moecache.paths import vocab_file

    try:
        return vocab_file("qwen2")
    except FileNotFoundError as e:
        pytest.skip(f"no qwen2 vocab (build or fetch the pinned tree first): {e}")


@pytest.fixture(scope="module")
def real_tokens(vocab_path) -> list[int]:
    text = "\n\n".join(t for _, t in synth.default_texts())
    ids = synth.reference_tokenizer().encode(text)
    assert len(ids) > 2000
    return ids[:3000]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, vocab_path) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return synth.write_model(path, preset="tiny", seed=0, progress=False)


# --------------------------------------------------------------------------- presets and plans


def test_presets_exist_with_the_issue_shapes():
    assert {"tiny", "demo", "qwen3-30b-a3b"} <= set(synth.PRESETS)
    p = synth.PRESETS["qwen3-30b-a3b"]
    assert (p.n_layer, p.n_embd, p.n_expert, p.n_expert_used, p.n_ff_exp) == (48, 2048, 128, 8, 768)
    assert (p.n_head, p.n_head_kv, p.head_dim, p.n_vocab, p.n_ff) == (32, 4, 128, 151936, 6144)
    assert p.rope_freq_base == 1e6 and p.rms_eps == 1e-6 and p.n_ctx_train == 40960
    t = synth.PRESETS["tiny"]
    assert t.n_layer <= 4 and t.n_embd <= 128 and t.n_expert == 16 and t.n_expert_used == 4


def test_qwen3_30b_plan_without_writing():
    specs = synth.plan_tensors("qwen3-30b-a3b", GGMLType.Q4_0)
    by = {s.name: s for s in specs}
    assert len(specs) == 3 + 48 * 12 and len(by) == len(specs)
    assert by["token_embd.weight"].shape == (2048, 151936)
    assert by["output.weight"].shape == (2048, 151936)
    assert by["output_norm.weight"].shape == (2048,)
    for i in (0, 47):
        b = f"blk.{i}."
        assert by[b + "attn_q.weight"].shape == (2048, 4096)
        assert by[b + "attn_k.weight"].shape == (2048, 512)
        assert by[b + "attn_v.weight"].shape == (2048, 512)
        assert by[b + "attn_output.weight"].shape == (4096, 2048)
        assert by[b + "attn_q_norm.weight"].shape == (128,)
        assert by[b + "attn_k_norm.weight"].shape == (128,)
        assert by[b + "ffn_gate_inp.weight"].shape == (2048, 128)
        assert by[b + "ffn_gate_inp.weight"].type == GGMLType.F32
        assert by[b + "ffn_gate_exps.weight"].shape == (2048, 768, 128)
        assert by[b + "ffn_up_exps.weight"].shape == (2048, 768, 128)
        assert by[b + "ffn_down_exps.weight"].shape == (768, 2048, 128)
        assert by[b + "ffn_down_exps.weight"].type == GGMLType.Q4_0
    assert "blk.48.attn_q.weight" not in by
    size = sum(s.nbytes for s in specs)
    assert 15.5 * 2**30 < size < 16.5 * 2**30  # the ~16 GiB of the real Q4_0 model
    # every big tensor is written as random blocks (no float arrays); only the embedding is built
    big = [s for s in specs if s.nbytes > 64 << 20]
    assert {s.init for s in big} == {"random", "embed"}


def test_unknown_preset_lists_the_presets():
    with pytest.raises(synth.SynthError, match="tiny, demo, qwen3-30b-a3b"):
        synth.plan_tensors("nope")


def test_residual_updates_are_small_and_router_is_f32():
    for p in (p for p in synth.PRESETS.values() if p.arch == "qwen3moe"):  # the others: test_synth_archs.py
        assert synth.residual_scale(p) * math.sqrt(2 * p.n_layer) == pytest.approx(synth.RESIDUAL_DRIFT)
        specs = {s.name: s for s in synth.plan_tensors(p)}
        # attn_output: entries of the update ~ std * sqrt(n_q) ~ the residual scale, far below the hidden's ~1
        s = specs["blk.0.attn_output.weight"]
        assert s.std * math.sqrt(s.shape[0]) < 0.2


# --------------------------------------------------------------------------- the written tiny model


def test_tiny_metadata_and_tensors_match_the_preset(tiny, vocab_path):
    p = synth.PRESETS["tiny"]
    with GGUFReader(tiny) as r:
        assert r["general.architecture"] == "qwen3moe"
        assert r["general.file_type"] == 7  # MOSTLY_Q8_0
        assert r["qwen3moe.block_count"] == p.n_layer
        assert r["qwen3moe.embedding_length"] == p.n_embd
        assert r["qwen3moe.expert_count"] == p.n_expert
        assert r["qwen3moe.expert_used_count"] == p.n_expert_used
        assert r["qwen3moe.expert_feed_forward_length"] == p.n_ff_exp
        assert r["qwen3moe.attention.head_count"] == p.n_head
        assert r["qwen3moe.attention.head_count_kv"] == p.n_head_kv
        assert r["qwen3moe.attention.key_length"] == p.head_dim
        assert r["qwen3moe.rope.freq_base"] == 1e6
        assert r["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
        assert r["moecache.synth.preset"] == "tiny" and r["moecache.synth.seed"] == 0
        plan = synth.plan_tensors(p, GGMLType.Q8_0)
        assert [(t.name, t.shape, t.type) for t in r.tensors] == [(s.name, s.shape, s.type) for s in plan]
        assert r.tensor("token_embd.weight").shape[1] == len(r["tokenizer.ggml.tokens"]) == 151936
        # the whole tokenizer is the upstream one
        with GGUFReader(vocab_path) as v:
            for k, kv in v.kv.items():
                if k.startswith("tokenizer."):
                    got = r[k]
                    assert (np.array_equal(got, kv.value) if isinstance(got, np.ndarray) else got == kv.value), k
        # values are sane: norms are 1, router is finite, experts and embedding have the planned scales
        assert np.all(r.tensor_rows("output_norm.weight") == 1.0)
        assert np.all(r.tensor_rows("blk.2.attn_q_norm.weight") == 1.0)
        router = r.tensor_rows("blk.0.ffn_gate_inp.weight")
        assert router.shape == (p.n_expert, p.n_embd) and np.isfinite(router).all()
        emb = r.tensor_rows("token_embd.weight", np.arange(1000))
        assert np.isfinite(emb).all() and 0.8 < emb.std() < 1.2
        down = r.tensor_rows("blk.1.ffn_down_exps.weight")
        spec = {s.name: s for s in plan}["blk.1.ffn_down_exps.weight"]
        assert down.shape == (p.n_expert, p.n_embd, p.n_ff_exp)
        assert down.std() == pytest.approx(spec.std, rel=0.05)
    umask = os.umask(0)
    os.umask(umask)
    assert tiny.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's private one


def test_same_seed_same_bytes_other_seed_other_bytes(tiny, tmp_path):
    again = synth.write_model(tmp_path / "again.gguf", preset="tiny", seed=0, progress=False, threads=3)
    assert again.read_bytes() == tiny.read_bytes()  # also with another thread count
    other = synth.write_model(tmp_path / "other.gguf", preset="tiny", seed=1, progress=False)
    assert other.stat().st_size == tiny.stat().st_size
    assert other.read_bytes() != tiny.read_bytes()


def test_q4_0_direct(tmp_path, vocab_path):
    path = synth.write_model(tmp_path / "q4.gguf", preset="tiny", quant="q4_0", seed=0, progress=False)
    with GGUFReader(path) as r:
        assert r["general.file_type"] == 2
        assert r.tensor("blk.0.ffn_up_exps.weight").type == GGMLType.Q4_0
        assert r.tensor("blk.0.ffn_gate_inp.weight").type == GGMLType.F32
        spec = {s.name: s for s in synth.plan_tensors("tiny", GGMLType.Q4_0)}["blk.0.ffn_up_exps.weight"]
        assert r.tensor_rows("blk.0.ffn_up_exps.weight").std() == pytest.approx(spec.std, rel=0.05)


def test_failed_write_leaves_nothing(tmp_path, vocab_path, monkeypatch):
    calls = {"n": 0}
    real = synth._random_raw_blocks

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(synth, "_random_raw_blocks", boom)
    with pytest.raises(KeyboardInterrupt):
        synth.write_model(tmp_path / "m.gguf", preset="tiny", progress=False, threads=1)
    assert list(tmp_path.iterdir()) == []


def test_kquant_without_llama_quantize_is_a_clear_error(tmp_path, vocab_path, monkeypatch):
    import moecache.paths

    def missing(name):
        raise FileNotFoundError(f"{name} was not found (looked in: nowhere)")

    monkeypatch.setattr(moecache.paths, "binary", missing)
    with pytest.raises(synth.SynthError, match="llama-quantize.*not available"):
        synth.write_model(tmp_path / "k.gguf", preset="tiny", quant="q4_k_m", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_kquant_with_the_built_llama_quantize(tmp_path, vocab_path):
    from moecache.paths import binary

    try:
        binary("llama-quantize")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    path = synth.write_model(tmp_path / "k.gguf", preset="tiny", quant="q4_k_m", progress=False)
    with GGUFReader(path) as r:
        assert r["general.file_type"] == 15  # MOSTLY_Q4_K_M
        types = {t.name: t.type for t in r.tensors}
        assert types["blk.0.ffn_gate_inp.weight"] == GGMLType.F32
        assert any(t not in (GGMLType.F16, GGMLType.F32, GGMLType.Q8_0) for t in types.values())
        assert len(r.tensors) == len(synth.plan_tensors("tiny"))
    assert [p.name for p in tmp_path.iterdir()] == ["k.gguf"]


def test_bad_arguments():
    with pytest.raises(synth.SynthError, match="unknown quant"):
        synth.write_model("/nonexistent/x.gguf", quant="q9_9")
    with pytest.raises(synth.SynthError, match="routing strength"):
        synth.write_model("/nonexistent/x.gguf", routing_strength=-1)
    with pytest.raises(synth.SynthError, match="does not exist"):
        synth.write_model("/nonexistent/dir/x.gguf")


# --------------------------------------------------------------------------- routing statistics


def test_routing_stats_uniform_round_robin():
    n_expert, k, t = 16, 4, 64
    trace = np.array([[[(4 * i + j) % n_expert for j in range(k)]] for i in range(t)], dtype=np.int32)
    s = synth.routing_stats(trace, n_expert)
    layer = s["layers"][0]
    assert layer["experts_touched"] == 16
    assert layer["top25_share"] == pytest.approx(0.25)
    assert layer["top10_share"] == pytest.approx(2 / 16)  # ceil(1.6) = 2 experts
    # token i uses experts of token i-4: reuse within 8 is complete, within 1..3 tokens none
    assert layer["reuse8"] == pytest.approx((3 * 0 + 60 * 1.0) / 63)
    assert s["n_tokens"] == 64 and s["n_layers"] == 1 and s["n_expert_used"] == 4


def test_routing_stats_hand_computed():
    # 2 layers, 2 experts per token, 8 experts
    layer0 = [[0, 1], [0, 2], [3, 4], [0, 1]]
    layer1 = [[5, 5], [5, -1], [6, 7], [7, 6]]  # a duplicate and a skipped (-1) slot
    trace = np.stack([np.array(layer0), np.array(layer1)], axis=1).astype(np.int32)
    s = synth.routing_stats(trace, 8)
    l0, l1 = s["layers"]
    assert l0["experts_touched"] == 5 and l0["routings"] == 8
    assert l0["top10_share"] == pytest.approx(3 / 8)  # expert 0: 3 of 8 routings
    assert l0["top25_share"] == pytest.approx(5 / 8)  # experts 0 and 1
    # reuse: t1 {0,2}: 0 seen -> 1/2; t2 {3,4}: 0; t3 {0,1}: both seen -> 1
    assert l0["reuse8"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert l1["routings"] == 7 and l1["experts_touched"] == 3
    # t1 {5}: seen -> 1; t2 {6,7}: 0; t3 {7,6}: 1
    assert l1["reuse8"] == pytest.approx((1 + 0 + 1) / 3)
    assert s["total"]["reuse8"] == pytest.approx((l0["reuse8"] + l1["reuse8"]) / 2)


def test_routing_stats_window_limits():
    # expert 0 at token 0, then again at token 10 and 100: reuse within 8 misses, within 64 hits once
    t = 101
    trace = np.full((t, 1, 1), -1, dtype=np.int32)
    for i in range(t):
        trace[i, 0, 0] = 1 + i  # a new expert each token
    trace[10, 0, 0] = trace[100, 0, 0] = 0
    trace[0, 0, 0] = 0
    s = synth.routing_stats(trace, 200)["layers"][0]
    assert s["reuse8"] == 0.0
    assert s["reuse64"] == pytest.approx(1 / 100)


def test_routing_stats_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shape"):
        synth.routing_stats(np.zeros((3, 4)), 8)


# --------------------------------------------------------------------------- the reference and real text


def test_reference_tokenizer_matches_upstream_test_vectors(vocab_path):
    from moecache.orchestrator.upstream import pristine_tree

    tok = synth.reference_tokenizer()
    # the upstream test vectors sit next to the vocab in the llama.cpp tree (installs ship only the vocab)
    for folder in (vocab_path.parent, pristine_tree(quiet=True) / "models"):
        vectors = folder / (vocab_path.name + ".inp")
        if vectors.is_file():
            break
    else:
        pytest.skip("the upstream tokenizer test vectors (ggml-vocab-qwen2.gguf.inp/.out) are not here")
    inp = vectors.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = vectors.with_suffix(".out").read_text(encoding="utf-8").split("\n")
    assert len(inp) > 40
    ok = [tok.encode(a) == [int(x) for x in b.split()] for a, b in zip(inp, out)]
    assert sum(ok) >= len(inp) - 1  # '½' is a number to \p{N} but not to Python's \d
    ascii_cases = [i for i, a in enumerate(inp) if a.isascii()]
    assert all(ok[i] for i in ascii_cases)
    assert tok.encode("<|im_start|>user") == [151644, 872]  # special tokens are kept whole


def test_real_text_routing_is_skewed_and_stable_by_seed(tiny, real_tokens, tmp_path):
    s1 = synth.routing_stats(synth.reference_trace(tiny, real_tokens), 16)
    assert s1["total"]["top25_share"] > 0.35
    assert s1["total"]["top10_share"] > 0.18
    for layer in s1["layers"]:
        assert layer["top25_share"] > 0.33
    # another file with the same seed gives the same statistics; another seed routes differently
    again = synth.write_model(tmp_path / "again.gguf", preset="tiny", seed=0, progress=False)
    assert synth.routing_stats(synth.reference_trace(again, real_tokens), 16) == s1
    other = synth.write_model(tmp_path / "other.gguf", preset="tiny", seed=7, progress=False)
    t_other = synth.reference_trace(other, real_tokens)
    assert not np.array_equal(t_other, synth.reference_trace(tiny, real_tokens))
    assert synth.routing_stats(t_other, 16)["total"]["top25_share"] > 0.35


def test_routing_strength_zero_is_less_skewed(real_tokens, vocab_path):
    def top25(strength):
        tr = synth.predicted_trace("tiny", real_tokens, seed=0, routing_strength=strength)
        return synth.routing_stats(tr, 16)["total"]["top25_share"]

    assert top25(0.0) < top25(1.0) - 0.05 < top25(2.0)


def test_routing_follows_token_identity(tiny, real_tokens):
    tr = synth.reference_trace(tiny, real_tokens)
    toks = np.asarray(real_tokens)
    # the same token routes to (nearly) the same experts wherever it occurs
    first = {}
    same = []
    for i, t in enumerate(toks):
        if t in first:
            same.append(set(tr[i, 0]) == set(tr[first[t], 0]))
        else:
            first[t] = i
    assert np.mean(same) == 1.0  # the reference ignores context: exact
    # and tokens of one cluster share most of their experts
    st = synth.make_structure(synth.PRESETS["tiny"], 0)
    cl = st.token_cluster[toks]
    overlaps = []
    for c in np.unique(cl)[:20]:
        idx = np.nonzero(cl == c)[0]
        ts = np.unique(toks[idx])
        if len(ts) >= 2:
            a, b = first[ts[0]], first[ts[1]]
            overlaps.append(len(set(tr[a, 0]) & set(tr[b, 0])) / 4)
    assert np.mean(overlaps) > 0.6


def test_predicted_trace_agrees_with_the_written_weights(tiny, real_tokens):
    pred = synth.predicted_trace("tiny", real_tokens[:1000], seed=0)
    ref = synth.reference_trace(tiny, real_tokens[:1000])
    agree = np.mean([len(set(a) & set(b)) / 4 for a, b in zip(pred.reshape(-1, 4), ref.reshape(-1, 4))])
    assert agree > 0.95  # only Q8_0 rounding of the embedding differs


# --------------------------------------------------------------------------- the context term


def test_context_term_plan_and_metadata(tmp_path, vocab_path):
    plain = {t.name: t for t in synth.plan_tensors("tiny")}
    ctx = {t.name: t for t in synth.plan_tensors("tiny", GGMLType.Q8_0, context_mix=0.5)}
    assert plain.keys() == ctx.keys()
    assert all(plain[n].shape == ctx[n].shape and plain[n].type == ctx[n].type for n in plain)
    for il in range(4):
        b = f"blk.{il}."
        assert (plain[b + "attn_v.weight"].init, ctx[b + "attn_v.weight"].init) == ("random", "ctx_v")
        assert (plain[b + "attn_output.weight"].init, ctx[b + "attn_output.weight"].init) == ("random", "ctx_out")
        assert (plain[b + "attn_q_norm.weight"].init, ctx[b + "attn_q_norm.weight"].init) == ("ones", "zeros")
    changed = {n for n in plain if plain[n] != ctx[n]}
    assert changed == {f"blk.{il}.{t}.weight" for il in range(4) for t in ("attn_v", "attn_output", "attn_q_norm")}
    path = synth.write_model(tmp_path / "c.gguf", preset="tiny", seed=0, context_mix=0.5, progress=False)
    with GGUFReader(path) as r:
        assert r["moecache.synth.context_mix"] == pytest.approx(0.5)
        assert np.all(r.tensor_rows("blk.1.attn_q_norm.weight") == 0)
        p = synth.PRESETS["tiny"]
        v = r.tensor_rows("blk.1.attn_v.weight")
        proj = synth.context_projection(p, 0, 1)
        assert v.shape == proj.shape and np.abs(v - proj).max() < 0.01 * np.abs(proj).max() + 1e-6  # Q8_0
        o = r.tensor_rows("blk.1.attn_output.weight")
        group, hd = p.n_head // p.n_head_kv, p.head_dim
        # query head h reads KV head h // group: its columns are mix / group * that head's rows of P, transposed
        for h in range(p.n_head):
            want = 0.5 / group * proj[(h // group) * hd:(h // group + 1) * hd].T
            assert np.abs(o[:, h * hd:(h + 1) * hd] - want).max() < 0.01 * np.abs(want).max() + 1e-7


def test_without_a_context_term_the_metadata_has_no_key(tiny):
    with GGUFReader(tiny) as r:
        assert r.get("moecache.synth.context_mix") is None


def test_context_reference_follows_the_written_weights(tmp_path, vocab_path, real_tokens):
    """reference_trace of a context model (from its attn_v / attn_output) equals the numpy prediction
    up to Q8_0 rounding, and both differ clearly from token-identity routing in the deeper layers."""
    path = synth.write_model(tmp_path / "c.gguf", preset="tiny", seed=0, context_mix=0.5, progress=False)
    tokens = real_tokens[:800]
    ref = synth.reference_trace(path, tokens)
    pred = synth.predicted_trace("tiny", tokens, seed=0, context_mix=0.5)
    plain = synth.predicted_trace("tiny", tokens, seed=0)

    def agree(a, b, il):
        return np.mean([len(set(x) & set(y)) / 4 for x, y in zip(a[:, il], b[:, il])])

    for il in range(4):
        assert agree(ref, pred, il) > 0.97, il
    assert agree(ref, plain, 3) < 0.75


def test_routing_profiles_and_bad_mixes(tmp_path, vocab_path):
    assert synth.routing_profile("tiny", "default") == (1.0, 0.0)
    assert synth.routing_profile("qwen3-30b-a3b", "calibrated") == synth.ROUTING_PROFILES["qwen3-30b-a3b"]
    with pytest.raises(synth.SynthError, match="no calibrated routing; presets with one: qwen3-30b-a3b"):
        synth.routing_profile("tiny", "calibrated")
    with pytest.raises(synth.SynthError, match="unknown routing 'hot'"):
        synth.routing_profile("tiny", "hot")
    for bad in (-0.1, 2.5, float("nan")):
        with pytest.raises(synth.SynthError, match="context mix must be in 0..2"):
            synth.write_model(tmp_path / "x.gguf", preset="tiny", context_mix=bad, progress=False)
    assert not list(tmp_path.iterdir())


def test_cli_context_mix_and_calibrated_routing(tmp_path, vocab_path, capsys):
    out = tmp_path / "m.gguf"
    assert synth.main([str(out), "--preset", "tiny", "--quiet", "--context-mix", "0.3"]) == 0
    assert "context mix 0.3" in capsys.readouterr().out
    with GGUFReader(out) as r:
        assert r["moecache.synth.context_mix"] == pytest.approx(0.3)
    with pytest.raises(SystemExit) as e:
        synth.main([str(tmp_path / "n.gguf"), "--preset", "tiny", "--routing", "calibrated"])
    assert e.value.code == 2 and "no calibrated routing" in capsys.readouterr().err


@pytest.mark.slow
def test_qwen3_30b_routing_is_skewed_without_writing_it(real_tokens):
    tr = synth.predicted_trace("qwen3-30b-a3b", real_tokens[:1500], seed=0)
    assert tr.shape == (1500, 48, 8)
    s = synth.routing_stats(tr, 128)
    assert s["total"]["top25_share"] > 0.4
    assert s["total"]["experts_touched_min"] > 64


def test_stats_for_model_reference_backend(tiny, vocab_path):
    s = synth.stats_for_model(tiny, max_tokens=1500, backend="reference")
    assert s["backend"] == "reference" and s["n_tokens"] == 1500
    assert s["synth"]["preset"] == "tiny"
    assert s["total"]["top25_share"] > 0.35
    text = synth.format_stats(s)
    assert "top25%" in text and "reuse64" in text and len(text.splitlines()) == 5 + 4 + 1


# --------------------------------------------------------------------------- CLI


def test_cli_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        synth.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--quant", "--seed", "--routing-strength", "--context-mix", "--routing", "--force", "--stats", "--text", "--json",
                 "--max-tokens", "--backend", "--threads", "--quiet", "--list-presets", "qwen3-30b-a3b", "q4_k_m"):
        assert flag in out, flag


@pytest.mark.parametrize("argv, message", [
    (["x.gguf", "--preset", "huge"], "unknown preset 'huge'; presets: tiny, demo, qwen3-30b-a3b"),
    (["x.gguf", "--quant", "q9"], "unknown quant 'q9'"),
    (["x.gguf", "--routing-strength", "-1"], "must be in 0..10"),
    (["x.gguf", "--routing-strength", "abc"], "not a number"),
    (["x.gguf", "--seed", "-3"], "must be in 0..4294967295"),
    (["x.gguf", "--context-mix", "3"], "must be in 0..2"),
    (["x.gguf", "--routing", "hot"], "invalid choice: 'hot'"),
    (["x.txt"], "must end in .gguf"),
    ([], "OUT.gguf is required"),
    (["stats"], "stats needs a MODEL"),
    (["x.gguf", "--stats", "m.gguf"], "not both"),
])
def test_cli_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        synth.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_writes_refuses_overwrite_and_reports_stats(tmp_path, vocab_path, capsys):
    out = tmp_path / "m.gguf"
    assert synth.main([str(out), "--preset", "tiny", "--quiet"]) == 0
    assert "synthetic qwen3moe" in capsys.readouterr().out
    first = out.read_bytes()
    assert synth.main([str(out), "--quiet"]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert synth.main([str(out), "--quiet", "--force", "--seed", "5"]) == 0
    assert out.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    capsys.readouterr()
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 50 + "The quick brown fox jumps over the lazy dog. " * 40)
    assert synth.main(["stats", str(out), "--text", str(text), "--json", "--backend", "reference"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["text_sources"] == [str(text)] and len(s["layers"]) == 4 and s["n_expert"] == 16
    assert synth.main(["--stats", str(tmp_path / "missing.gguf"), "--backend", "reference"]) == 1
    assert "no such model file" in capsys.readouterr().err
    assert synth.main(["--list-presets"]) == 0
    assert "qwen3-30b-a3b" in capsys.readouterr().out


# --------------------------------------------------------------------------- cached model files


def test_cached_model_names_carry_the_generator_version(tmp_path, monkeypatch):
    from moecache import server
    from moecache.bench import ModelSpec, runner

    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))

    def every_cached_path():
        return {
            "bench": runner.synth_cache_path(ModelSpec(synth="qwen3-30b-a3b", quant="q4_0", seed=0)),
            "bench default quant": runner.synth_cache_path(ModelSpec(synth="tiny")),
            "demo": server.demo_model_path(),
        }

    now = every_cached_path()
    for where, path in now.items():
        assert path.parent == tmp_path / "models", where
        assert f"synth-v{synth.SYNTH_VERSION}" in path.name, where
    assert now["bench"].name == synth.cached_model_name("qwen3-30b-a3b", "q4_0", 0)
    # a calibrated routing is another file, named by its profile
    cal = runner.synth_cache_path(ModelSpec(synth="qwen3-30b-a3b", quant="q4_0", routing="calibrated"))
    strength, mix = synth.ROUTING_PROFILES["qwen3-30b-a3b"]
    assert cal.name == synth.cached_model_name("qwen3-30b-a3b", "q4_0", 0, strength, mix) != now["bench"].name
    assert f"-r{strength:g}-c{mix:g}-synth" in cal.name
    # the default quant is spelled out, so { synth = "tiny" } and quant = "q8_0" share one file
    assert now["bench default quant"].name == synth.cached_model_name("tiny", synth.DEFAULT_QUANT, 0)
    monkeypatch.setattr(synth, "SYNTH_VERSION", synth.SYNTH_VERSION + 1)
    newer = every_cached_path()
    for where in now:
        assert newer[where] != now[where], where  # a newer generator never reuses an older file


def test_the_test_models_are_cached_under_the_versioned_name(tiny_model):
    assert tiny_model.name == synth.cached_model_name("tiny", seed=0)
    with GGUFReader(tiny_model) as r:
        assert r["moecache.synth.version"] == synth.SYNTH_VERSION


def test_gpt_oss_with_mxfp4_experts_is_written_directly(tmp_path):
    """gpt-oss (its attention biases and sinks, expert biases) with --quant mxfp4_moe: the routed experts in
    MXFP4 written directly (random nibbles, an E8M0 scale whose weights' std is within a factor of 2 of the
    planned one), the other matmuls in Q8_0, the file type MOSTLY_MXFP4_MOE; the expert biases random, not 0."""
    import numpy as np

    from moecache.gguf import MXFP4_VALUES, GGMLType, GGUFReader

    path = synth.write_model(tmp_path / "g.gguf", preset="tiny-gpt-oss", quant="mxfp4_moe", progress=False, threads=2)
    specs = {s.name: s for s in synth.plan_tensors("tiny-gpt-oss", GGMLType.Q8_0)}
    with GGUFReader(path) as g:
        assert g.get("general.architecture") == "gpt-oss" and g.get("general.file_type") == 38
        assert g.get("gpt-oss.attention.sliding_window") == 128
        types = {t.name: t.type for t in g.tensors}
        assert {types[n] for n in types if n.endswith("_exps.weight")} == {GGMLType.MXFP4}
        assert types["blk.0.attn_q.weight"] == GGMLType.Q8_0 and types["blk.0.attn_sinks.weight"] == GGMLType.F32
        raw = np.asarray(g.tensor_bytes("blk.1.ffn_up_exps.weight")).reshape(-1, 17)
        vals = np.asarray(MXFP4_VALUES, dtype=np.float64)
        q = raw[:, 1:]
        w = np.concatenate([vals[q & 0x0F], vals[q >> 4]], axis=1) * np.exp2(raw[:, :1].astype(np.float64) - 128)
        want = specs["blk.1.ffn_up_exps.weight"].std
        assert want / 2 <= w.std() <= want * 2, (w.std(), want)
        assert abs(w.mean()) < 0.05 * w.std()
        bias = np.frombuffer(bytes(g.tensor_bytes("blk.1.ffn_gate_exps.bias")), dtype="<f4")
        assert bias.std() > 0.05 and abs(bias.mean()) < 0.02
