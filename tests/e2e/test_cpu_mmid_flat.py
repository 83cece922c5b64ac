"""GGML_CPU_MMID_FLAT=1 (patch 0077, experimental): the CPU's MUL_MAT_ID of one token splits the rows of its
experts into one contiguous run per thread instead of a slice of every expert per thread. Every row is still
one thread's dot product, so decode must be bit-identical to the stock split: the same tokens and the same
log-probabilities, with the experts in the model's buffers and with the hot-expert cache's expert tables
(its banks on the host test device). Whether it is faster is for the H200 (run.sh cpu-pages).
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, complete, logprobs
from moecache.server import ServerProcess

ARGS = ["-t", "2", "-c", "1024", "-np", "1", "--no-repack", "--no-webui"]  # repacked experts take their own kernels
CACHE = ["--cpu-moe", "--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16"]


@pytest.mark.parametrize("extra,env", [([], {}), (CACHE, {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"})],
                         ids=["experts", "cache-tables"])
def test_one_token_split_into_runs_is_bit_identical(tiny_model, extra, env):
    outs = {}
    for flat in ("0", "1"):
        with ServerProcess(tiny_model, args=[*ARGS, *extra], env={**env, "GGML_CPU_MMID_FLAT": flat},
                           timeout=120) as srv:
            outs[flat] = [complete(srv, p, n_predict=24) for p in PROMPTS]
    for a, b in zip(outs["0"], outs["1"]):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)
