"""The cache's maps (expert -> slot, expert -> miss) kept on the cached layers' device.

As a graph input the maps were copied to the device for every split that reads them: two views per cached
layer, after each CPU split, each a user-input copy with its wait. Kept on the device, they are written
between graphs where they changed. On the host test device the tensor lives in host memory, but the
bookkeeping is the same: the kept maps equal the host's after every flush (LLAMA_MOE_CACHE_MAPS_CHECK), and the output equals the one with the maps as an input (LLAMA_MOE_CACHE_DEVICE_MAPS=0)
token for token and in its log-probabilities while uploads and evictions change the maps, and the log says
where they are kept.
"""

from __future__ import annotations

from moe_cache_checks import PROMPTS, assert_same_outputs, cache_stats, complete
from moecache.server import ServerProcess

ARGS = ["-t", "2", "-c", "1024", "-np", "1", "-ngl", "0", "--no-repack", "-lv", "4",
        "--moe-cache-slots", "6", "--moe-cache-policy", "lru", "--moe-cache-max-uploads", "4"]
HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1", "LLAMA_MOE_CACHE_MAPS_CHECK": "1"}


def run(model, **env):
    with ServerProcess(model, args=ARGS, env={**HOST, **env}, timeout=120) as srv:
        outs = [complete(srv, p * 2, n_predict=32) for p in PROMPTS + PROMPTS]
        st = cache_stats(srv)["total"]
        log = srv.log_text()
    return outs, st, log


def test_maps_kept_on_the_device_give_the_inputs_output(tiny_model):
    kept, st, log = run(tiny_model)
    as_input, st_input, log_input = run(tiny_model, LLAMA_MOE_CACHE_DEVICE_MAPS="0")
    assert "the maps of 4 cached layers kept in" in log, log[-3000:]
    assert "cached layers kept in" not in log_input
    # after every flush the kept maps equal the host's (on the host device a stale map would still compute
    # the same output: a hit and a miss run the same kernel on the same bytes; on a GPU they do not)
    assert "equal the host's" in log and "differ from the host's" not in log, log[-3000:]
    # the maps changed under the graphs: uploads, and evictions of a 6-slot layer of 16 experts
    assert st["uploads"] > 0 and st["evictions"] > 0, st
    assert (st["hits"], st["misses"], st["uploads"]) == (st_input["hits"], st_input["misses"], st_input["uploads"])
    assert_same_outputs(as_input, kept)
