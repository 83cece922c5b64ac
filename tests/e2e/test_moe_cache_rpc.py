"""The hot-expert cache on rpc-server devices: several devices on one machine without a GPU. An rpc-server on
loopback runs the patched CPU backend, which implements MUL_MAT_ID's skip ids, but the RPC device cannot say
so; LLAMA_MOE_CACHE_ASSUME_SKIP_IDS=1 (a test switch) lets the cache take it. The graphs then split as on a GPU
machine: the cached layers on the device, each layer's misses in a CPU split between two device splits.

- Every split of a decode step takes only what the stock graph's splits take (on the same device, the experts
  on the CPU) and, for a cached layer, the ids of its misses (into the CPU's split) and their result (into the
  device's next split), for each architecture the synthetic presets cover. The scheduler's split dump
  (GGML_SCHED_DEBUG=1) names each split's inputs. gpt-oss's expert biases used to add two inputs there: the
  device's split copied the layer's host bias tensor (the last bias addition of the misses ran on the device)
  and the CPU's split the device's maps and routed ids (the misses' bias ids were looked up on the CPU); on an
  H100 that was 4.2-4.7 ms of copies a token for gpt-oss-120b's 18 cached layers.
- The output equals the stock path's on the same device (greedy tokens)."""

from __future__ import annotations

import re

import pytest

from conftest import _tiny_model
from moe_cache_checks import cache_stats, complete, last_graph_splits
from moecache.server import ServerProcess

PROMPTS = ["The committee met on Tuesday to discuss the budget", "def fibonacci(n):\n"]
# what a cached layer's splits may take from the other backend beyond the stock graph's inputs: the ids of
# its misses (for the CPU's split) and their result (for the device's next split)
ALLOWED = re.compile(r"^ffn_moe_cold(_ids|_bias_ids)?-\d+$")


@pytest.fixture(scope="module", params=["tiny", "tiny-gpt-oss", "tiny-qwen35moe", "tiny-qwen4exp"])
def model(request, moecache_cache_dir):
    return _tiny_model(moecache_cache_dir, request.param)


def run(model, port, extra, env):
    args = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none",
            "--rpc", f"127.0.0.1:{port}", "--device", "RPC0", *extra]
    with ServerProcess(model, args=args, env=env, timeout=180) as srv:
        outs = [complete(srv, p, n_predict=8) for p in PROMPTS]
        return outs, cache_stats(srv), srv.log_text()


def test_decode_splits_take_only_the_misses_and_the_output_is_the_stock_one(model, rpc_servers):
    (port,) = rpc_servers(1)
    dump = {"GGML_SCHED_DEBUG": "1"}
    ref, _, ref_log = run(model, port, ["-v"], dump)
    outs, st, log = run(model, port, ["--moe-cache-slots", "8", "-v"], {"LLAMA_MOE_CACHE_ASSUME_SKIP_IDS": "1", **dump})
    assert st["enabled"] and st["total"]["hits"] > 0 and st["total"]["misses"] > 0, st["total"]
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in ref]
    splits, stock = last_graph_splits(log), last_graph_splits(ref_log)
    # a decode step through the cache (not a reservation's or a bypassed batch's graph): the cached layers on the
    # device, each layer's misses in a CPU split between two of the device's, which takes their result
    assert sum(1 for backend, _ in splits if backend == "CPU") >= 4, splits
    assert sum(1 for b, names in splits if b != "CPU" and any(re.fullmatch(r"ffn_moe_cold-\d+", n) for n in names)) >= 4
    # unnamed leaves (qwen4exp's attention inputs) are numbered by graph: compared by how many there are
    def unnamed(graph):
        return sum(1 for _, names in graph for n in names if re.fullmatch(r"leaf_\d+", n))

    assert unnamed(splits) <= unnamed(stock)
    stock_inputs = {name for _, names in stock for name in names}
    extra = [(b, name) for b, names in splits for name in names
             if name not in stock_inputs and not ALLOWED.match(name) and not re.fullmatch(r"leaf_\d+", name)]
    assert not extra, f"split inputs beyond the stock graph's, the misses' ids and their result: {extra}"


def test_a_partial_release_parks_layers_on_each_device(moecache_cache_dir, rpc_servers):
    """The prefill-phase swap's partial release per device: the layers split over two rpc-servers (2 + 2), each
    device frees from its own last cached layer back what its prompt needs (LLAMA_PREFILL_SWAP_PARK_MIB: one
    layer's banks, no headroom), so the second swap parks one layer on each and keeps the other; the restore
    brings both back at their slot count, and the output is the stock path's at the prefill ubatch."""
    model = _tiny_model(moecache_cache_dir, "tiny")
    ports = rpc_servers(2)
    base = ["-t", "2", "-c", "2048", "-b", "256", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none",
            "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-sm", "layer", "-ts", "1,1"]
    long = "The committee met on Tuesday to discuss the budget for the coming year, and " * 20
    with ServerProcess(model, args=base + ["-ub", "128"], timeout=180) as srv:
        ref = [complete(srv, long, n_predict=8) for _ in range(2)]
    cache = ["--moe-cache-slots", "8", "--moe-cache-headroom", "0", "-ub", "32", "--prefill-ubatch", "128",
             "--prefill-min-tokens", "64", "-v"]
    env = {"LLAMA_MOE_CACHE_ASSUME_SKIP_IDS": "1"}
    with ServerProcess(model, args=base + cache, env=env, timeout=180) as srv:
        st = cache_stats(srv)
        banks = st["total"]["bytes_vram"]
    env["LLAMA_PREFILL_SWAP_PARK_MIB"] = f"{banks / 4 / 2**20:.6f}"  # one of the four layers' banks
    with ServerProcess(model, args=base + cache, env=env, timeout=180) as srv:
        outs = [complete(srv, long, n_predict=8) for _ in range(2)]
        st = cache_stats(srv)
        log = srv.log_text()
    devices = {l["device"] for l in st["layers"] if l.get("device")}
    assert len(devices) == 2, st["layers"]
    sw = st["prefill_swap"]
    assert sw["swaps"] == 2 and not any(sw["failed"].values()), sw
    assert sw["partial"]["swaps"] == 1 and sw["partial"]["fallbacks"] == 0, sw
    assert sw["partial"]["last_bytes_kept"] == banks // 2, (sw["partial"], banks)
    assert "2 layers' banks freed" in log
    # each device freed one layer's banks, its own last one (not the last two layers, both on the second device)
    freed = re.findall(r"park: prefill swap: (RPC\d)\S*: ([\d.]+) MiB of banks freed", log)
    assert sorted(d for d, _ in freed) == ["RPC0", "RPC1"], freed
    assert all(abs(float(mib) - banks / 4 / 2**20) < 1e-3 for _, mib in freed), (freed, banks)
    assert sw["last"]["n_slots"] == 8 and st["total"]["bytes_vram"] == banks
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in ref]


def test_slots_by_layer_keep_each_devices_memory(tiny_model, rpc_servers, tmp_path):
    """With the layers on two devices, --moe-cache-slots-by-layer moves slots between the layers of one device,
    never from one device to another (each has its own memory): layers that the profile shows on 2 experts on
    one device, layers that spread over all 16 on the other, and every layer keeps the even share; within a
    device the split is the plan's (moecache.cache_sim.slots_by_layer). The tokens are the cache's without it."""
    from moe_cache_checks import N_EXPERT
    from moecache.cache_sim import slots_by_layer

    ports = rpc_servers(2)
    slots = 8
    args = ["-t", "2", "-c", "2048", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none",
            "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-sm", "layer", "-ts", "1,1",
            "--moe-cache-slots", str(slots), "--moe-cache-profile", str(tmp_path / "experts.profile")]
    env = {"LLAMA_MOE_CACHE_ASSUME_SKIP_IDS": "1"}
    with ServerProcess(tiny_model, args=args, env=env, timeout=180) as srv:
        even = [complete(srv, p, n_predict=8) for p in PROMPTS]
        st = cache_stats(srv)
    devices = [layer.get("device") for layer in st["layers"]]
    assert len(set(devices)) == 2 and all(layer["n_slots"] == slots for layer in st["layers"]), st["layers"]
    narrow, wide = [50, 50] + [0] * (N_EXPERT - 2), [10] * N_EXPERT
    rows = [narrow if d == devices[0] else wide for d in devices]
    profile = tmp_path / "experts.profile"
    head = profile.read_text().splitlines()[:2]
    profile.write_text("\n".join(head + [f"layer {il} " + " ".join(map(str, c)) for il, c in enumerate(rows)]
                                 + ["end", ""]))
    with ServerProcess(tiny_model, args=[*args, "--moe-cache-slots-by-layer"], env=env, timeout=180) as srv:
        outs = [complete(srv, p, n_predict=8) for p in PROMPTS]
        st = cache_stats(srv)
    sizes = [layer["n_slots"] for layer in st["layers"]]
    want = []
    for d in dict.fromkeys(devices):
        want += slots_by_layer([r for r, dd in zip(rows, devices) if dd == d], slots, N_EXPERT)
    assert sizes == want == [slots] * len(rows), sizes
    # one pool over both devices would have moved slots from the narrow layers to the wide ones
    assert slots_by_layer(rows, slots, N_EXPERT) != want
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in even]
