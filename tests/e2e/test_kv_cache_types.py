"""K and V cache types that differ: llama-server warns at start-up and names the flags that fix it
(mixed pairs often have no flash-attention kernel on a GPU and fall back silently). The warning is
for GPU offload with flash attention: -ngl 99 asks for offload (on this CPU build the layers stay on
the CPU), -ngl 0 or -fa off do not warn."""

from __future__ import annotations

import pytest

from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "512", "-np", "1", "-ngl", "99", "-fa", "on"]
WARNING = "the K cache type (q8_0) and the V cache type (f16) differ"


def start(tiny_model, args, env=None):
    with ServerProcess(tiny_model, args=BASE + args, env=env or {}, timeout=120) as srv:
        status, body = srv.post("/completion", {"prompt": "The quick brown fox", "n_predict": 4})
        return status, srv.log_text()


@pytest.mark.parametrize("how", ["flags", "env"])
def test_mixed_kv_types_warn_with_the_fix(tiny_model, llama_server_bin, how):
    if how == "flags":
        status, log = start(tiny_model, ["-ctk", "q8_0", "-ctv", "f16"])
    else:
        status, log = start(tiny_model, [], env={"LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "f16"})
    assert status == 200
    assert WARNING in log
    assert "-ctk q8_0 -ctv q8_0 (LLAMA_ARG_CACHE_TYPE_K, LLAMA_ARG_CACHE_TYPE_V)" in log


def test_a_k_type_without_a_kernel_pair_suggests_q8_0(tiny_model, llama_server_bin):
    status, log = start(tiny_model, ["-ctk", "q5_1", "-ctv", "f16"])
    assert status == 200
    assert "the K cache type (q5_1) and the V cache type (f16) differ" in log
    assert "-ctk q8_0 -ctv q8_0" in log


@pytest.mark.parametrize("extra", [["-ctk", "q8_0", "-ctv", "q8_0"], ["-ctk", "q8_0", "-ctv", "f16", "-ngl", "0"],
                                   ["-ctk", "q8_0", "-ctv", "f16", "-fa", "off"]],
                         ids=["matching", "no-offload", "no-flash-attention"])
def test_no_warning_without_the_mixed_gpu_flash_attention_case(tiny_model, llama_server_bin, extra):
    status, log = start(tiny_model, extra)
    assert status == 200
    assert "differ: flash attention" not in log
