"""The device mask's cell positions kept on the GPU across graphs on CUDA: a graph writes
only the cells edited since (set_rows into the table in VRAM), or the window whole where more were.
The output equals LLAMA_KQ_TABLE=0's (the positions uploaded whole each ubatch) bit for bit on the demo
model and on the tiny qwen4exp with QSA's sparse path and block-level top-k, through requests that cut
and rewrite the cache's tail, a different prompt, decode past windows, and every second write taken as
not run (LLAMA_KQ_TABLE_DROP_CONFIRM=2); the debug line says the edited-cells write was taken.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete, real_text
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

BASE = ["-t", "8", "-c", "4096", "-np", "2", "-no-kvu", "-ngl", "99", "-fa", "on", "-b", "512", "-ub", "256",
        "--kq-mask-device", "-lv", "5"]
ARGS = {"demo": [], "tiny-qwen4exp": ["--qsa-sparse", "--qsa-block-topk"]}
LONG = real_text(1200, 6000)
N_LONG = 1000
DELTA = "the device's cell positions written where edited"


@pytest.fixture(scope="module")
def models(demo_and_qwen4exp):
    return demo_and_qwen4exp


def run(model, args, env):
    with ServerProcess(model, args=BASE + args, env=env, timeout=300) as srv:
        status, body = srv.post("/tokenize", {"content": LONG})
        assert status == 200 and len(body["tokens"]) > N_LONG + 16, body
        long = body["tokens"][:N_LONG]
        requests = [(long, 300), (long + body["tokens"][N_LONG + 1:N_LONG + 16], 40), (PROMPTS[0], 40),
                    (PROMPTS[1] * 6, 40)]
        outs = [complete(srv, p, n_predict=n, cache_prompt=True, id_slot=i % 2) for i, (p, n) in enumerate(requests)]
        return outs, srv.log_text()


@pytest.mark.parametrize("name", ["demo", "tiny-qwen4exp"])
def test_the_kept_positions_on_cuda_give_the_output_of_the_whole_input(models, name):
    ref, ref_log = run(models[name], ARGS[name], {"LLAMA_KQ_TABLE": "0"})
    out, log = run(models[name], ARGS[name], {})
    dropped, drop_log = run(models[name], ARGS[name], {"LLAMA_KQ_TABLE_DROP_CONFIRM": "2"})
    assert DELTA in log and DELTA in drop_log and DELTA not in ref_log
    assert "kq_cell_pos kept in CUDA0" in log
    assert_same_outputs(ref, out)
    assert_same_outputs(ref, dropped)
