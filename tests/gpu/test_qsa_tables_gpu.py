"""QSA's block tables kept in VRAM across graphs on CUDA: with --qsa-sparse --kq-mask-device
--qsa-block-topk a graph writes the block ids that changed into the tables (set_rows) instead of
uploading every block id's inputs each ubatch. The output equals LLAMA_QSA_TABLES=0's bit for bit on
the tiny qwen4exp with two QSA layers, through a deep prompt, a shared prefix with the tail cut, a
different prompt and decode past window growth on two slots, also where every second write is taken
as not run (LLAMA_QSA_TABLES_DROP_CONFIRM=2); the tables are in CUDA0 and the changed-block write is taken.

Marked `gpu`: run by benchmarks/gpu/run.sh on the H200.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import PROMPTS, assert_same_outputs, complete, real_text
from moecache import synth
from moecache.server import ServerProcess

pytestmark = pytest.mark.gpu

ARGS = ["-t", "8", "-c", "8192", "-np", "2", "-no-kvu", "-ngl", "99", "-fa", "on", "-b", "256", "-ub", "64",
        "--qsa-sparse", "--kq-mask-device", "--qsa-block-topk", "-lv", "5"]
LONG = real_text(1500, 9000)
DELTA = "QSA's block tables written where changed"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth.write_model(tmp_path_factory.mktemp("qsatables") / "tiny-qwen4exp-8l.gguf", preset="tiny-qwen4exp-8l",
                             seed=0, progress=False)


def run(model, env):
    with ServerProcess(model, args=ARGS, env=env, timeout=300) as srv:
        status, body = srv.post("/tokenize", {"content": LONG})
        assert status == 200 and len(body["tokens"]) > 1700, len(body["tokens"])
        toks = body["tokens"]
        requests = [(toks[:1500], 300), (toks[:1500] + toks[1501:1530], 40), (toks[300:1200], 40), (PROMPTS[0], 40)]
        outs = [complete(srv, p, n_predict=n, cache_prompt=True, id_slot=i % 2) for i, (p, n) in enumerate(requests)]
        return outs, srv.log_text()


def test_the_block_tables_on_cuda_give_the_output_of_the_whole_inputs(model):
    ref, ref_log = run(model, {"LLAMA_QSA_TABLES": "0"})
    out, log = run(model, {})
    dropped, drop_log = run(model, {"LLAMA_QSA_TABLES_DROP_CONFIRM": "2"})
    assert DELTA in log and DELTA in drop_log and DELTA not in ref_log
    assert "qsa_blk_cells kept in CUDA0" in log
    assert_same_outputs(ref, out)
    assert_same_outputs(ref, dropped)
