"""The CPU's experimental MUL_MAT_ID switches change how a decode step's expert rows are computed, not what:
- GGML_CPU_MMID_FLAT=1 (patch 0077) splits the rows of one token's experts into one contiguous run per
  thread instead of a slice of every expert per thread; every row is still one thread's dot product;
- GGML_CPU_DOT_X4=1 (patch 0079) computes four Q4_0 rows' dot products at once, each row with the one-row
  kernel's operations in the same order (checked to fail with two rows' results swapped).
So decode must be bit-identical to the stock path: the same tokens and the same log-probabilities, with the
experts in the model's buffers and with the hot-expert cache's expert tables (its banks on the host test
device). Whether they are faster is for the benchmarks (bench-cpu-mmid, run.sh cpu-mmid on the H200).
"""

from __future__ import annotations

import pytest

from moe_cache_checks import N_EXPERT, PROMPTS, complete, logprobs
from moecache.server import ServerProcess

ARGS = ["-t", "2", "-c", "1024", "-np", "1", "--no-repack", "--no-webui"]  # repacked experts take their own kernels
CACHE = ["--cpu-moe", "--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16"]


@pytest.mark.parametrize("switch,model", [("GGML_CPU_MMID_FLAT", "tiny_model"), ("GGML_CPU_DOT_X4", "tiny_q4_0")],
                         ids=["flat", "x4"])
@pytest.mark.parametrize("extra,env", [([], {}), (CACHE, {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"})],
                         ids=["experts", "cache-tables"])
def test_decode_with_the_switch_is_bit_identical(request, switch, model, extra, env):
    path = request.getfixturevalue(model)
    outs = {}
    for on in ("0", "1"):
        with ServerProcess(path, args=[*ARGS, *extra], env={**env, switch: on}, timeout=120) as srv:
            outs[on] = [complete(srv, p, n_predict=24) for p in PROMPTS]
    for a, b in zip(outs["0"], outs["1"]):
        assert a["tokens"] == b["tokens"]
        assert logprobs(a) == logprobs(b)
