"""The KQ mask built on the device (--kq-mask-device) through the real llama-server on the CPU.

Where positions alone decide the mask (causal, no sliding window, no ALiBi, one sequence per KV
stream), the host uploads each cell's position and each token's instead of n_kv x n_tokens values,
and the graph computes log(step(p_token - p_cell + 0.5)): 0 or -inf, the host mask's own values. So
the output is the stock output bit for bit: qwen3moe (plain KV cache), tiny-qwen4exp-8l (hybrid memory, QSA
reads the mask too, with and without --qsa-sparse, and its per-block bias is built on the device as
well), flash attention on (f16 mask) and off (f32), several streams. The graph's node and
input-tensor counts in the start-up log show the path ran. qwen4exp has M-RoPE, so every ubatch has 2D
positions; its text ubatches compare positions alone.
"""

from __future__ import annotations

import re

import pytest

from moe_cache_checks import PROMPTS, complete, logprobs, op_shape, op_time_reports, real_text
from moecache.server import ServerProcess

BASE = ["-t", "2", "-c", "2048", "-ngl", "0", "-b", "256", "-ub", "64", "-lv", "4"]
GRAPH = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = ([\d /]+), splits = [\d /]+, "
                   r"input objects = [\d /]+, input tensors = ([\d /]+)")


def run(model, args, prompts):
    with ServerProcess(model, args=BASE + args, timeout=300) as srv:
        outs = [complete(srv, p, n_predict=24) for p in prompts]
        graph = GRAPH.search(srv.log_text())
    assert graph, "no graph line in the server log"
    return outs, graph.groups()


def same(a, b):
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert logprobs(x) == logprobs(y)  # exact


LONG = real_text(1500, 4000)


@pytest.mark.parametrize("fa", ["on", "off"])
@pytest.mark.parametrize("streams", [["-np", "1"], ["-np", "2", "-no-kvu"]], ids=["one-stream", "two-streams"])
def test_the_device_mask_gives_the_stock_output_bit_for_bit(tiny_model, fa, streams):
    args = ["-fa", fa] + streams
    prompts = PROMPTS + [LONG]
    ref, ref_graph = run(tiny_model, args, prompts)
    out, graph = run(tiny_model, args + ["--kq-mask-device"], prompts)
    same(ref, out)
    assert graph != ref_graph, (ref_graph, graph)  # the mask's nodes and its two inputs are in the graph


def input_tensors(graph) -> int:
    return int(graph[1].split("/")[0])


@pytest.mark.parametrize("sparse", [[], ["--qsa-sparse"]], ids=["masked-qsa", "sparse-qsa"])
def test_hybrid_memory_and_qsa_read_the_device_mask(qwen4exp_8l, sparse):
    """The KQ mask and the QSA per-block bias from positions: each of the two host
    inputs becomes two small ones (cells and tokens; blocks and tails), the output is the stock's."""
    args = ["-fa", "on", "-np", "1", "-ub", "16"] + sparse
    ref, ref_graph = run(qwen4exp_8l, args, [LONG])
    out, graph = run(qwen4exp_8l, args + ["--kq-mask-device"], [LONG])
    same(ref, out)
    assert graph != ref_graph
    assert input_tensors(graph) - input_tensors(ref_graph) == 2, (ref_graph, graph)


def test_qsa_blocks_of_two_sequences_in_one_stream(qwen4exp_8l):
    """-kvu -np 2: slot 1's ubatches run while slot 0's cells share the stream, so the grouped layout
    (blocks per sequence set) writes the device's block values; LLAMA_QSA_LAYOUT_CHECK=1 compares the
    kept layout's with it wherever one sequence is left. The output is the host path's bit for bit."""
    args = BASE + ["-fa", "on", "-np", "2", "-kvu", "-ub", "16", "-c", "4096"]
    texts = [LONG[:2500], LONG[1500:4000], LONG[:2000]]
    outs = []
    for extra in ([], ["--kq-mask-device"]):
        with ServerProcess(qwen4exp_8l, args=args + extra, env={"LLAMA_QSA_LAYOUT_CHECK": "1"}, timeout=300) as srv:
            outs.append([complete(srv, t, n_predict=12, id_slot=i % 2) for i, t in enumerate(texts)])
    same(outs[0], outs[1])


def test_several_sequences_in_one_stream_keep_the_host_mask(tiny_model):
    """A unified KV cache (-kvu) with two slots: each request's ubatches hold one sequence and build the
    mask on the device; the output stays the stock output."""
    args = ["-fa", "on", "-np", "2", "-kvu"]
    ref, _ = run(tiny_model, args, PROMPTS)
    out, _ = run(tiny_model, args + ["--kq-mask-device"], PROMPTS)
    same(ref, out)


def test_the_variable_turns_it_on(tiny_model):
    args = ["-fa", "on", "-np", "1"]
    _, ref_graph = run(tiny_model, args, PROMPTS[:1])
    with ServerProcess(tiny_model, args=BASE + args, env={"LLAMA_ARG_KQ_MASK_DEVICE": "1"}, timeout=300) as srv:
        complete(srv, PROMPTS[0], n_predict=4)
        graph = GRAPH.search(srv.log_text()).groups()
    assert graph != ref_graph


def test_a_text_ubatch_of_an_mrope_model_compares_positions_alone(qwen4exp_8l):
    """The (y, x) comparison at equal positions is for embedding ubatches (an image's tokens share a
    position); a text token is (p, p, p) and starts after every cached cell of its sequence, so its mask
    is the 1D one: every node timed (GGML_SCHED_OP_TIMES) shows the mask's log but none of the 2D
    comparison's abs, and the output is the host mask's bit for bit."""
    args = ["-fa", "on", "-np", "1", "-ub", "16"]
    ref, _ = run(qwen4exp_8l, args, [LONG[:1500]])
    with ServerProcess(qwen4exp_8l, args=BASE + args + ["--kq-mask-device"], env={"GGML_SCHED_OP_TIMES": "1", "GGML_SCHED_OP_TIMES_TOP": "1000"},
                       timeout=300) as srv:
        out = [complete(srv, LONG[:1500], n_predict=24)]
        entries = {e for r in op_time_reports(srv.log_text()) if r["backend"] == "CPU" for e in r["rows"]}
    same(ref, out)
    ops = {(e.split()[0], tuple(op_shape(e))) for e in entries if e[0] != "("}
    masks = {shape for op, shape in ops if op == "LOG"}  # log(visible): the device mask ran
    assert masks, sorted(ops)
    assert not {shape for op, shape in ops if op == "ABS"} & masks, sorted(ops)
