"""The comparison the CUDA tests make against a reference (moe_cache_checks.assert_close_tokens): equal tokens,
or a divergence only where the reference's best two were a near tie; and llama-server's log-probabilities
aligned with its tokens (none for a token that leaves a UTF-8 character incomplete)."""

from __future__ import annotations

import pytest

from moe_cache_checks import assert_close_tokens, token_steps

REF = [5, 7, 9]
STEPS = [[(5, -0.5), (6, -2.0)], [(7, -1.00), (8, -1.05)], [(9, -0.1), (1, -3.0)]]


def test_the_same_tokens_within_the_bound():
    other = [[(5, -0.51), (6, -2.0)], [(7, -1.01), (8, -1.04)], [(9, -0.12), (1, -3.0)]]
    assert assert_close_tokens(REF, STEPS, REF, other) == 3
    with pytest.raises(AssertionError, match="step 0: log-probability"):
        assert_close_tokens(REF, STEPS, REF, [[(5, -0.7)], *other[1:]])
    with pytest.raises(AssertionError, match="2 tokens against the reference's 3"):
        assert_close_tokens(REF, STEPS, REF[:2])


def test_a_divergence_passes_only_at_a_near_tie():
    assert assert_close_tokens(REF, STEPS, [5, 8, 1]) == 1   # step 1: 7 and 8 0.05 apart, the comparison ends
    with pytest.raises(AssertionError, match="step 0: token 6 instead of 5"):
        assert_close_tokens(REF, STEPS, [6, 7, 9])           # 1.5 apart: more than rounding
    with pytest.raises(AssertionError, match="step 1: token 3 instead of 7"):
        assert_close_tokens(REF, STEPS, [5, 3, 9])           # not among the tied


def test_llama_server_steps_follow_the_tokens():
    out = {"tokens": [5, 7, 9], "completion_probabilities": [
        {"id": 5, "top_logprobs": [{"id": 5, "logprob": -0.5}]},
        {"id": 9, "top_logprobs": [{"id": 9, "logprob": -0.1}]}]}  # 7 left a character incomplete
    steps = token_steps(out)
    assert steps == [[(5, -0.5)], None, [(9, -0.1)]]
    assert assert_close_tokens(out["tokens"], steps, [5, 7, 9]) == 3
    with pytest.raises(AssertionError, match="without log-probabilities"):
        assert_close_tokens(out["tokens"], steps, [5, 8, 9])
    with pytest.raises(AssertionError, match="left over"):
        token_steps({"tokens": [5], "completion_probabilities": [{"id": 6, "top_logprobs": []}]})
