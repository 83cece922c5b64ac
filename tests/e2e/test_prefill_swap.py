"""The prefill-phase swap through the real llama-server on loopback (CPU: the hot-expert cache's banks
on the host test device). A long prompt runs at --prefill-ubatch and gives what the stock path gives
at that -ub; a short one is bit-identical to the stock path at -ub; every failing step leaves a
working server whose output equals the stock path (at the ubatch the prompt really ran at); another
slot generating makes the swap wait; bypass mode changes nothing; the stats and /metrics count it.

Fault injection: LLAMA_PREFILL_SWAP_FAIL=<step>[:N] fails that step of the N-th swap (reserve: the
prefill ubatch's compute buffers; restore: the decode compute buffers; banks: the cache's banks;
graphs: the reservation beside the restored banks; upload: an upload of the warm restore; partial: the
prompt's buffers beside the banks a partial release kept; unpark: its parked banks again).
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from moe_cache_checks import (N_EXPERT, cache_stats, complete, host_context_mib, logprobs, server_help,
                              wait_generating)

from moecache.server import ServerError, ServerProcess

UB, PREFILL_UB, MIN_TOKENS = 32, 128, 64
BASE_ARGS = ["-t", "2", "-c", "2048", "-b", "256", "-np", "1", "-ngl", "0", "--no-repack", "--metrics"]
HOST = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1"}
CACHE = ["--moe-cache-slots", str(N_EXPERT // 2), "--moe-cache-max-uploads", "16", "--moe-cache-rebalance-interval", "4"]
SWAP = ["-ub", str(UB), "--prefill-ubatch", str(PREFILL_UB), "--prefill-min-tokens", str(MIN_TOKENS)]
LONG = "The committee met on Tuesday to discuss the budget for the coming year, and " * 20  # ~300 tokens
SHORT = "def fibonacci(n):\n"


def requests(srv):
    """A long prompt (swaps), a short one (does not), the long one again (swaps again)."""
    return [complete(srv, LONG, n_predict=16), complete(srv, SHORT, n_predict=16), complete(srv, LONG, n_predict=16)]


def swap_stats(srv):
    return cache_stats(srv)["prefill_swap"]


@pytest.fixture(scope="module")
def stock_small(tiny_model, llama_server_bin):
    """The stock path at -ub 32 with the same cache: what prompts that do not swap must give."""
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(UB)] + CACHE, env=HOST, timeout=120) as srv:
        yield requests(srv)


@pytest.fixture(scope="module")
def stock_big(tiny_model, llama_server_bin):
    """The stock path at -ub 128: what prompts that swap must give."""
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(PREFILL_UB)] + CACHE, env=HOST, timeout=120) as srv:
        yield requests(srv)


def first_step(out):
    """The prompt's own result: the first token and its top log-probabilities (before any decode)."""
    return logprobs(out)[0]


def test_a_long_prompt_runs_at_the_prefill_ubatch_and_equals_the_stock_path_there(tiny_model, stock_big, stock_small):
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=HOST, timeout=120) as srv:
        outs = requests(srv)
        cache = cache_stats(srv)
        st = cache["prefill_swap"]
        status, metrics = srv.get("/metrics")
    # the cache's own counters go on through the swaps: the recent window is kept, the prompts'
    # ubatches (3 of them per long prompt: 128 + 128 + the rest) count as batches it did not take
    assert cache["total"]["hit_rate_recent"] > 0
    assert cache["total"]["batches_bypassed"]["batch"] >= 6
    assert outs[0]["timings"]["prefill_ubatch"] == PREFILL_UB
    assert outs[0]["timings"]["prefill_swap_ms"] > 0
    assert "prefill_ubatch" not in outs[1]["timings"]
    # prefill at ubatch 128 is the stock prefill at -ub 128, bit for bit (the first step's log-probs),
    # and differs from -ub 32 (so the comparison can fail)
    for i in (0, 2):
        assert first_step(outs[i]) == first_step(stock_big[i])
    assert first_step(stock_big[0]) != first_step(stock_small[0])
    # greedy decode after the swap is the stock decode (the cache's hits are exact up to rounding)
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in stock_big]
    assert st["swaps"] == 2 and st["skipped"]["short"] == 1 and st["n_ubatch_last"] == PREFILL_UB
    assert not any(st["failed"].values()) and st["active"] is False
    assert st["last"]["n_slots"] == N_EXPERT // 2  # the cache came back at its size
    # the second swap freed only what the first one's prompt took of the banks' memory: on the host test device
    # without a budget, nothing; every bank stayed
    assert st["partial"] == {"swaps": 1, "fallbacks": 0, "last_bytes_kept": cache["total"]["bytes_vram"]}, st
    assert st["last"]["bytes_released"] == 0 and st["last"]["bytes_restored"] > 0
    assert st["warm_uploads"] > 0 and st["after_restore"]["tokens"] > 0
    assert status == 200
    assert "llamacpp:prefill_swaps_total 2" in metrics
    assert 'llamacpp:prefill_swap_failures_total{step="reserve"} 0' in metrics


def test_a_short_prompt_is_bit_identical_to_the_stock_path(tiny_model, llama_server_bin):
    """Swap configured, prompt under the threshold: nothing differs, the log-probabilities neither."""
    def run(args):
        with ServerProcess(tiny_model, args=BASE_ARGS + args + CACHE, env=HOST, timeout=120) as srv:
            return [complete(srv, SHORT, n_predict=24), complete(srv, LONG[:200], n_predict=24)], swap_stats(srv)
    ref, _ = run(["-ub", str(UB)])
    got, st = run(SWAP[:-1] + ["1000"])  # every prompt is under 1000 tokens
    assert [logprobs(o) for o in got] == [logprobs(o) for o in ref]
    assert st["swaps"] == 0 and st["skipped"]["short"] == 2


def test_bypass_mode_decides_but_keeps_the_ubatch(tiny_model, stock_small):
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + ["--prefill-swap-mode", "bypass"] + CACHE, env=HOST,
                       timeout=120) as srv:
        outs = requests(srv)
        st = swap_stats(srv)
    assert [logprobs(o) for o in outs] == [logprobs(o) for o in stock_small]
    assert st["swaps"] == 0 and st["skipped"]["bypass"] == 2 and st["mode"] == "bypass"
    # counted once per prompt, not per batch: each long prompt takes two batches of -b 256, and its
    # second batch (under the threshold by itself) is no new decision
    assert st["skipped"]["short"] == 1


@pytest.mark.parametrize("step", ["reserve", "restore", "banks", "upload"])
def test_a_failing_step_leaves_a_working_server_with_the_stock_output(tiny_model, stock_small, stock_big, step):
    env = {**HOST, "LLAMA_PREFILL_SWAP_FAIL": step}  # the first swap's step fails
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=env, timeout=120) as srv:
        outs = requests(srv)
        st = swap_stats(srv)
        status, metrics = srv.get("/metrics")
        log = srv.log_text()
    assert f"injected: LLAMA_PREFILL_SWAP_FAIL={step}" in log
    assert st["failed"][step] == 1 and sum(st["failed"].values()) == 1
    assert f'llamacpp:prefill_swap_failures_total{{step="{step}"}} 1' in metrics
    if step == "reserve":
        # the first long prompt ran at -ub 32 (rolled back), the second one swapped
        assert "prefill_ubatch" not in outs[0]["timings"] and outs[2]["timings"]["prefill_ubatch"] == PREFILL_UB
        assert first_step(outs[0]) == first_step(stock_small[0])
        assert outs[0]["tokens"] == stock_small[0]["tokens"]
        assert st["swaps"] == 1
    else:
        assert first_step(outs[0]) == first_step(stock_big[0])
        assert outs[0]["tokens"] == stock_big[0]["tokens"]
        assert st["swaps"] == 2
    # the requests after the failure work and give the stock output
    assert first_step(outs[2]) == first_step(stock_big[2])
    assert [o["tokens"] for o in outs[1:]] == [o["tokens"] for o in stock_big[1:]]
    if step == "banks":
        assert st["last"]["n_slots"] == N_EXPERT // 2  # the next restore brought the banks back
    if step == "upload":
        assert "takes the stock path from now on" in log  # that layer, the others keep their cache
        # the next swap (a partial release that keeps every other bank here) frees that layer's buffer
        assert st["partial"]["swaps"] == 1 and st["last"]["bytes_released"] > 0, st


def test_a_prompt_of_larger_ubatches_than_the_measured_ones_frees_every_bank(tiny_model):
    """The pools grow with the ubatch: a first swapped prompt of one ubatch under the prefill ubatch measures for
    prompts like it only. The next, of full prefill ubatches, frees every bank and measures again; the one after
    it is a partial release."""
    unit = "The committee met on Tuesday to discuss the budget for the coming year, and "
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=HOST, timeout=120) as srv:
        first = complete(srv, unit * 6, n_predict=4)  # 60-odd tokens over the threshold, under one prefill ubatch
        st1 = swap_stats(srv)
        complete(srv, LONG, n_predict=4)
        st2 = swap_stats(srv)
        complete(srv, LONG, n_predict=4)
        st3 = swap_stats(srv)
    assert first["timings"]["prefill_ubatch"] == PREFILL_UB and MIN_TOKENS <= first["tokens_evaluated"] < PREFILL_UB, first
    assert (st1["swaps"], st2["swaps"], st3["swaps"]) == (1, 2, 3)
    assert (st2["partial"]["swaps"], st3["partial"]["swaps"]) == (0, 1), (st2, st3)


def test_an_injected_banks_failure_after_a_partial_release_leaves_decode_without_the_cache(tiny_model, stock_big):
    """banks:2: the second swap is a partial release; its restore's banks fail all the same (every bank goes), decode
    runs without the cache until the next restore, the output is the stock one."""
    env = {**HOST, "LLAMA_PREFILL_SWAP_FAIL": "banks:2"}
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=env, timeout=120) as srv:
        outs = requests(srv)
        st = swap_stats(srv)
        enabled = cache_stats(srv)["enabled"]
        after = complete(srv, LONG, n_predict=16)
        st3 = swap_stats(srv)
    assert st["failed"]["banks"] == 1 and st["last"]["n_slots"] == 0 and not enabled, st
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in stock_big]
    # the third swap is a full one (the cache was suspended) and brings the banks back
    assert after["tokens"] == stock_big[2]["tokens"] and st3["last"]["n_slots"] == N_EXPERT // 2, st3


def test_the_swap_waits_while_another_slot_generates(tiny_model, llama_server_bin):
    """-np 2: a long prompt arriving while the other slot generates runs at -ub (no decode step waits
    for a transition), with the same output as alone; alone, it swaps."""
    args = BASE_ARGS[:] + SWAP + CACHE
    args[args.index("-np") + 1] = "2"
    args[args.index("-c") + 1] = "4096"
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        alone = complete(srv, LONG, n_predict=8)
        assert alone["timings"]["prefill_ubatch"] == PREFILL_UB
        for _ in range(3):  # a starved client can miss the whole of the other request: send it again
            long_gen = {}

            def generate():
                long_gen["out"] = complete(srv, SHORT, n_predict=600)

            t = threading.Thread(target=generate)
            t.start()
            if wait_generating(srv, lambda: not t.is_alive()):
                break
            t.join()
        during = complete(srv, LONG, n_predict=8)
        busy = long_gen.get("out") is None  # the other slot was still generating when this one finished
        t.join()
        st = swap_stats(srv)
    assert busy, "the generating request finished before the long prompt: make it longer"
    assert "prefill_ubatch" not in during["timings"]
    assert st["skipped"]["others_generating"] >= 1 and st["swaps"] == 1
    assert during["tokens"] == alone["tokens"]  # prefill at -ub 32 and at 128 agree on the tokens here


def test_flags_have_help_and_variables_with_the_public_names(llama_server_bin):
    out = server_help(llama_server_bin)
    for flag, env in [("--prefill-ubatch", "LLAMA_ARG_PREFILL_UBATCH"), ("--prefill-min-tokens", "LLAMA_ARG_PREFILL_MIN_TOKENS"),
                      ("--prefill-swap-mode", "LLAMA_ARG_PREFILL_SWAP_MODE"),
                      ("--prefill-warm-restore", "LLAMA_ARG_PREFILL_WARM_RESTORE")]:
        assert flag in out and env in out, flag
    for old in ("LLAMA_PHASE_PREFILL_UBATCH", "LLAMA_PHASE_PREFILL_MIN_TOKENS", "LLAMA_PHASE_PREFILL_MODE"):
        assert old in out, old


def test_the_server_reads_the_public_variable_names(tiny_model):
    env = {**HOST, "LLAMA_PHASE_PREFILL_UBATCH": str(PREFILL_UB), "LLAMA_PHASE_PREFILL_MIN_TOKENS": str(MIN_TOKENS),
           "LLAMA_PHASE_PREFILL_MODE": "bypass", "LLAMA_ARG_PREFILL_WARM_RESTORE": "off"}
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(UB)] + CACHE, env=env, timeout=120) as srv:
        st = swap_stats(srv)
    assert (st["n_ubatch"], st["min_tokens"], st["mode"], st["warm_restore"]) == (PREFILL_UB, MIN_TOKENS, "bypass", False)


@pytest.mark.parametrize("flags,expect", [
    (["--prefill-swap-mode", "fast"], "invalid value for --prefill-swap-mode: 'fast' (expected transaction or bypass)"),
    (["--prefill-ubatch", "-5"], "invalid value for --prefill-ubatch: '-5'"),
    (["--prefill-min-tokens", "0"], "invalid value for --prefill-min-tokens: '0' (expected an integer >= 1)"),
])
def test_bad_flags_are_named(tiny_model, llama_server_bin, flags, expect):
    with pytest.raises(ServerError) as e:
        with ServerProcess(tiny_model, args=BASE_ARGS + flags, env=HOST, timeout=60):
            pass
    assert expect in str(e.value)


def test_a_prefill_ubatch_not_above_the_ubatch_turns_the_swap_off_and_says_so(tiny_model):
    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", "128", "--prefill-ubatch", "64"] + CACHE, env=HOST,
                       timeout=120) as srv:
        out = complete(srv, LONG, n_predict=4)
        st = swap_stats(srv)
        log = srv.log_text()
    assert "is not larger than n_ubatch = 128: the swap is off" in log
    assert st["enabled"] is False and "prefill_ubatch" not in out["timings"]


def test_layers_on_two_devices_swap_each_device(tiny_model, rpc_servers):
    """Two rpc-servers on loopback (their CPU backends) hold the layers: the compute buffers of both
    devices are released and reserved again, and the output is the stock path's at the prefill ubatch."""
    ports = rpc_servers(2)
    args = ["-t", "2", "-c", "2048", "-b", "256", "-np", "1", "-ngl", "99", "--no-repack",
            "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-sm", "layer", "-ts", "1,1", "-lv", "4"]
    with ServerProcess(tiny_model, args=args + ["-ub", str(PREFILL_UB)], timeout=120) as srv:
        ref = complete(srv, LONG, n_predict=12)
    with ServerProcess(tiny_model, args=args + SWAP, timeout=120) as srv:
        out = complete(srv, LONG, n_predict=12)
        again = complete(srv, LONG, n_predict=12)
        st = swap_stats(srv)
        log = srv.log_text()
    devices = set(re.findall(r"\s(RPC\d+\[[^\]]+\]) compute buffer size", log))  # RPC0[host:port]
    assert len(devices) >= 2, f"the layers are not on two devices: {devices}"
    assert st["swaps"] == 2 and not any(st["failed"].values())
    assert st["last"]["bytes_released"] > 0 and st["last"]["bytes_restored"] > 0
    assert first_step(out) == first_step(ref) and out["tokens"] == ref["tokens"] == again["tokens"]


def test_the_server_and_the_python_api_share_the_defaults(tiny_model):
    from moecache import api

    with ServerProcess(tiny_model, args=BASE_ARGS + ["-ub", str(UB), "--prefill-ubatch", str(PREFILL_UB)], env=HOST,
                       timeout=120) as srv:
        st = swap_stats(srv)
    defaults = {name: o.default for name, o in api.PREFILL_SWAP_OPTIONS.items()}
    assert st["min_tokens"] == defaults["prefill_min_tokens"]
    assert st["mode"] == defaults["prefill_swap_mode"] and st["warm_restore"] == defaults["prefill_warm_restore"]
    assert st["restore_wait_ms"] == defaults["prefill_restore_wait_ms"]


def test_with_ngram_drafts_the_swap_gives_the_stock_output(gemma_model, llama_server_bin):
    """n-gram speculation on a code edit with a small real model (Gemma 3 270M: no experts, so the swap
    moves only the compute buffers): the prompt swaps, the verify batches follow, and the output is the
    stock path's at the prefill ubatch with the same drafting."""
    from test_spec_gating import CODE

    args = ["-t", "2", "-c", "2048", "-b", "256", "-np", "1", "-ngl", "0", "--spec-type", "ngram-map-k4v"]

    def run(extra):
        with ServerProcess(gemma_model, args=args + extra, timeout=120) as srv:
            outs = [complete(srv, CODE, n_predict=64), complete(srv, CODE, n_predict=64)]
            return outs, swap_stats(srv) if "--prefill-ubatch" in extra else None
    ref, _ = run(["-ub", str(PREFILL_UB)])
    got, st = run(SWAP)
    assert st["swaps"] == 2 and not any(st["failed"].values())
    assert all(o["timings"]["prefill_ubatch"] == PREFILL_UB for o in got)
    assert all(o["timings"].get("draft_n_accepted", 0) > 0 for o in got), "no draft was accepted: nothing is checked"
    assert [o["tokens"] for o in got] == [o["tokens"] for o in ref]
    assert first_step(got[0]) == first_step(ref[0])


def test_graphs_that_do_not_fit_beside_the_banks_bring_them_back_with_half_the_slots(tiny_model, stock_big):
    env = {**HOST, "LLAMA_PREFILL_SWAP_FAIL": "graphs"}
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=env, timeout=120) as srv:
        first = complete(srv, LONG, n_predict=16)
        st1 = swap_stats(srv)
        rest = [complete(srv, SHORT, n_predict=16), complete(srv, LONG, n_predict=16)]
        st2 = swap_stats(srv)
        log = srv.log_text()
    assert "injected: LLAMA_PREFILL_SWAP_FAIL=graphs" in log and "trying with half of them" in log
    assert st1["failed"]["banks"] == 1 and st1["last"]["n_slots"] == N_EXPERT // 4
    assert st2["last"]["n_slots"] == N_EXPERT // 2  # the next restore asks for the full size again
    assert [o["tokens"] for o in [first] + rest] == [o["tokens"] for o in stock_big]


def test_an_injected_upload_failure_without_warm_restore_fails_nothing(tiny_model):
    """No warm upload to fail: the injection must not hit a later ordinary upload."""
    env = {**HOST, "LLAMA_PREFILL_SWAP_FAIL": "upload"}
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE + ["--no-prefill-warm-restore"], env=env,
                       timeout=120) as srv:
        requests(srv)
        cache = cache_stats(srv)
    assert cache["prefill_swap"]["failed"]["upload"] == 0 and cache["prefill_swap"]["warm_uploads"] == 0
    assert all(layer["cached"] for layer in cache["layers"]), [layer.get("reason") for layer in cache["layers"]]


def test_a_sliding_window_model_holds_the_prefill_ubatch(gemma_model, llama_server_bin):
    """Gemma 3's sliding-window KV cache holds n_swa + n_ubatch cells (512 + 32, padded to 768): with the
    swap configured it is made for the prefill ubatch, so a prompt longer than the window runs at 512
    (a 512-token ubatch needs 512 + 512 cells: it did not fit, and the server retried smaller batches)."""
    from test_spec_gating import CODE

    prompt = CODE * 8  # about 1150 tokens: more than the window of 512 + the prefill ubatch of 512
    args = ["-t", "2", "-c", "2048", "-b", "512", "-np", "1", "-ngl", "0"]
    with ServerProcess(gemma_model, args=args + ["-ub", "512"], timeout=120) as srv:
        ref = complete(srv, prompt, n_predict=16)
    with ServerProcess(gemma_model, args=args + ["-ub", "32", "--prefill-ubatch", "512", "--prefill-min-tokens", "64"],
                       timeout=120) as srv:
        out = complete(srv, prompt, n_predict=16)
        st = swap_stats(srv)
        log = srv.log_text()
    assert ref["timings"]["prompt_n"] > 1024
    assert "failed to find free space" not in log and "retrying with smaller batch size" not in log
    assert st["swaps"] == 1 and out["timings"]["prefill_ubatch"] == 512
    assert out["tokens"] == ref["tokens"]
    assert first_step(out) == first_step(ref)


def test_a_request_cancelled_during_its_swapped_prompt_ends_the_swap(tiny_model, stock_big):
    """The client goes away while its long prompt runs under the swap (it streams prompt progress, so
    the server notices at the next batch): the slot is released with the prompt half done, the swap
    ends at the next iteration, and the server answers the next request with the stock output."""
    import http.client
    import json as _json

    args = BASE_ARGS[:] + SWAP + CACHE
    args[args.index("-b") + 1] = "32"  # many small batches: the prompt takes long enough to be cut off
    args[args.index("-ub") + 1] = "8"
    args[args.index("--prefill-ubatch") + 1] = "32"
    long_prompt = LONG * 6  # ~1800 tokens
    with ServerProcess(tiny_model, args=args + ["-c", "4096"], env=HOST, timeout=120) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {"prompt": long_prompt, "n_predict": 8, "stream": True, "return_progress": True, "cache_prompt": False}
        conn.request("POST", "/completion", body=_json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.read(5)  # the first progress event: the prompt is running, under the swap
        conn.sock.shutdown(2)
        conn.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = swap_stats(srv)
            if not st["active"] and st["swaps"] >= 1:
                break
            time.sleep(0.05)
        after = complete(srv, LONG, n_predict=16)
        st = swap_stats(srv)
        log = srv.log_text()
    assert first.startswith(b"data:"), first
    assert st["active"] is False and st["swaps"] == 2 and not any(st["failed"].values()), st
    # the request was cancelled with its prompt part done (under the swap), not after it
    released = [int(n) for n in re.findall(r"task 0 \| stop processing: n_tokens = (\d+)", log)]
    assert "cancel task" in log and released and released[0] < 1000, released
    assert after["tokens"] == stock_big[0]["tokens"]


def test_a_prompt_right_after_a_restore_drops_the_warm_uploads_not_yet_made(tiny_model, stock_big):
    """Each upload takes 100 ms longer (a slow link): the first long prompt's warm restore queues one upload
    per slot (8 x 4 layers, over 3 s), and the second long prompt, sent as soon as the first returns its one
    token, starts its swap while most of them are still queued. The release drops them, since their banks
    go, instead of waiting for them all; the output is the stock one."""
    env = {**HOST, "LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "100"}
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=env, timeout=120) as srv:
        first = complete(srv, LONG, n_predict=1)
        second = complete(srv, LONG, n_predict=16)
        st = swap_stats(srv)
        status, metrics = srv.get("/metrics")
    assert st["swaps"] == 2 and not any(st["failed"].values())
    # the two restores queued about 32 each; most of the first one's were still waiting
    assert st["warm_uploads"] > 16 and st["warm_dropped"] >= 8, st
    assert first["tokens"] == stock_big[0]["tokens"][:1]
    assert second["tokens"] == stock_big[0]["tokens"]
    assert status == 200 and "llamacpp:prefill_swap_warm_dropped_total" in metrics


def _restore_after_taken(tiny_model, device_slots: float, taken_mib: float, slot_mib: float, ctx_mib: float):
    """A server on a host test device that holds its context, a 1 MiB headroom and `device_slots` slots,
    which loses `taken_mib` after its first allocation (as a GPU that keeps what its first long prompt
    loaded): the slots at the start, the swap's stats after one long prompt, and the device's size."""
    device_mib = ctx_mib + 1.0 + device_slots * slot_mib
    env = {**HOST, "LLAMA_MOE_CACHE_HOST_DEVICE_MIB": f"{device_mib:.6f}",
           "LLAMA_MOE_CACHE_HOST_DEVICE_TAKEN_MIB": f"{taken_mib:.6f}"}
    args = BASE_ARGS + SWAP + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-headroom", "1", "--fit", "off"]
    with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
        start = cache_stats(srv)["n_slots"]
        complete(srv, LONG, n_predict=4)
        st = swap_stats(srv)
    return start, st, device_mib


def test_a_restore_counts_what_was_taken_since_the_start_against_the_headroom(tiny_model):
    """The headroom is kept free for what the backends allocate on first use and keep (CUDA loads the kernels
    of the first prompt at the prefill ubatch, cuBLAS makes its workspace). A restore used to ask for the whole
    headroom again on top of what those took, and came back with fewer slots than the start (on the H200:
    79 of 80). It now counts what the device lost since the start against the headroom, down to half of it."""
    args = BASE_ARGS + SWAP + ["--moe-cache-slots", str(N_EXPERT), "--moe-cache-headroom", "0", "--fit", "off",
                               "-lv", "4"]  # -lv 4: the buffer sizes are in the log
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        st = cache_stats(srv)
        ctx_mib = host_context_mib(srv.log_text())
    slot_mib = st["total"]["bytes_vram"] / st["n_slots"] / 2**20

    # three and a half slots: less than one slot taken (but more than the half slot to spare) within the headroom
    start, st, _ = _restore_after_taken(tiny_model, 3.5, 0.75 * slot_mib, slot_mib, ctx_mib)
    assert start == 3 and st["swaps"] == 1 and not any(st["failed"].values()), st
    assert st["last"]["n_slots"] == start, st

    # more taken than half the headroom: the restore still keeps half of it free, with fewer slots
    start, st, device_mib = _restore_after_taken(tiny_model, 13.5, 1.0, slot_mib, ctx_mib)
    assert start == 13 and st["swaps"] == 1 and not any(st["failed"].values()), st
    assert 0 < st["last"]["n_slots"] < start, st
    assert device_mib - ctx_mib - 1.0 - st["last"]["n_slots"] * slot_mib >= 0.5 - 1e-6, st


def test_a_copy_finished_at_a_swap_is_published_and_counted(tiny_model):
    """Each upload takes 400 ms: the second long prompt's swap waits for the first restore's copy in progress.
    That copy is made, so the release publishes it (counted in the cache's uploads) before it unpublishes
    every slot; it used to be thrown away uncounted. The second request decodes 2 tokens, too few for any of
    its own restore's copies to finish: the one upload counted is that copy."""
    env = {**HOST, "LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "400"}
    with ServerProcess(tiny_model, args=BASE_ARGS + SWAP + CACHE, env=env, timeout=120) as srv:
        complete(srv, LONG, n_predict=1)
        complete(srv, LONG, n_predict=2)
        cache = cache_stats(srv)
    assert cache["prefill_swap"]["swaps"] == 2 and cache["prefill_swap"]["warm_dropped"] >= 8, cache["prefill_swap"]
    assert cache["total"]["uploads"] >= 1, cache["total"]


def _budget_server(tiny_model, extra_env=None):
    """Arguments and environment of a server on a host test device sized so that the first swap's prompt
    takes 3/8 of the banks' memory (the log's sizes are rounded to 0.01 MiB: a layer's banks are 1/4): the
    device holds the context at -ub 32, all slots and what is left of the prompt's larger compute buffer after
    3/8 of the banks (no headroom). The sizes come from a first server's log (-lv 4), so the test follows
    the model's."""
    args = BASE_ARGS + SWAP + CACHE + ["--moe-cache-headroom", "0", "--fit", "off", "-lv", "4"]
    with ServerProcess(tiny_model, args=args, env=HOST, timeout=120) as srv:
        banks_mib = cache_stats(srv)["total"]["bytes_vram"] / 2**20
        complete(srv, LONG, n_predict=1)
        log = srv.log_text()
    compute = [float(m) for m in re.findall(r"CPU compute buffer size =\s+([0-9.]+) MiB", log)]
    grow_mib = max(compute) - compute[0]  # the prefill ubatch's compute buffer over the decode one's
    assert grow_mib > banks_mib * 3 / 8, (compute, banks_mib)
    device_mib = host_context_mib(log) + banks_mib + grow_mib - banks_mib * 3 / 8
    env = {**HOST, "LLAMA_MOE_CACHE_HOST_DEVICE_MIB": f"{device_mib:.6f}", **(extra_env or {})}
    return args, env, banks_mib


def test_a_later_swap_frees_only_what_its_prompt_took_and_keeps_the_other_layers(tiny_model, stock_big):
    """The first swap frees every bank and measures what its prompt's buffers took of them (3/8, on this
    device); the next swaps free that much, from the last layer back, and keep the other layers' banks and
    experts. The output is the stock one at the prefill ubatch either way; the restore queues fewer copies."""
    args, env, banks_mib = _budget_server(tiny_model)
    got = {}
    for name, extra in (("partial", {}), ("full", {"LLAMA_PREFILL_SWAP_PARTIAL": "0"})):
        with ServerProcess(tiny_model, args=args, env={**env, **extra}, timeout=120) as srv:
            outs = requests(srv)
            got[name] = (outs, swap_stats(srv), srv.log_text())
    for outs, st, _ in got.values():
        assert [o["tokens"] for o in outs] == [o["tokens"] for o in stock_big]
        assert first_step(outs[2]) == first_step(stock_big[2])
        assert st["swaps"] == 2 and not any(st["failed"].values()) and st["last"]["n_slots"] == N_EXPERT // 2, st
    partial, full = got["partial"][1], got["full"][1]
    assert full["partial"]["swaps"] == 0 and full["last"]["bytes_released"] >= banks_mib * 2**20, full
    # 3/8 of the banks needed: the last two of the 4 layers parked, two kept
    assert partial["partial"]["swaps"] == 1 and partial["partial"]["fallbacks"] == 0, partial
    assert partial["partial"]["last_bytes_kept"] == banks_mib * 2**20 / 2, partial
    assert partial["warm_uploads"] < full["warm_uploads"], (partial, full)


@pytest.mark.parametrize("step", ["partial", "unpark"])
def test_a_partial_release_that_does_not_fit_frees_every_bank_with_the_stock_output(tiny_model, stock_big, step):
    """The prompt's buffers beside the kept banks (partial) or the parked banks at the end (unpark) fail in the
    second swap: every bank goes and comes back sized again, as in a full release; nothing else changes."""
    args, env, _ = _budget_server(tiny_model, {"LLAMA_PREFILL_SWAP_FAIL": f"{step}:2"})
    with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
        outs = requests(srv)
        st = swap_stats(srv)
        status, metrics = srv.get("/metrics")
        log = srv.log_text()
    assert f"injected: LLAMA_PREFILL_SWAP_FAIL={step}" in log
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in stock_big]
    assert first_step(outs[2]) == first_step(stock_big[2])
    assert st["swaps"] == 2 and not any(st["failed"].values()) and st["last"]["n_slots"] == N_EXPERT // 2, st
    assert st["partial"]["fallbacks"] == 1 and st["partial"]["swaps"] == (1 if step == "unpark" else 0), st
    assert status == 200 and "llamacpp:prefill_swap_partial_fallbacks_total 1" in metrics


def _restore_wait_run(tiny_model, wait_ms: int, how: str = "flag"):
    """One long prompt, 16 tokens, each warm copy 20 ms slower (the restore queues up to 8 x 4 of them). The
    wait set by --prefill-restore-wait, or by its variable (LLAMA_ARG_PREFILL_RESTORE_WAIT) or old name."""
    env = {**HOST, "LLAMA_MOE_CACHE_UPLOAD_DELAY_MS": "20"}
    args = BASE_ARGS + SWAP + CACHE
    if how == "flag":
        args = args + ["--prefill-restore-wait", str(wait_ms)]
    else:
        env[{"env": "LLAMA_ARG_PREFILL_RESTORE_WAIT", "old": "LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS"}[how]] = str(wait_ms)
    with ServerProcess(tiny_model, args=args, env=env, timeout=120) as srv:
        out = complete(srv, LONG, n_predict=16)
        st = swap_stats(srv)
    assert st["restore_wait_ms"] == wait_ms, st
    return out, st


def test_a_restore_can_wait_for_its_warm_copies_before_the_first_token(tiny_model, stock_big):
    """--prefill-restore-wait MS: the restore waits (at most that long) until its warm copies are made,
    so the first tokens find the prompt's experts in the slots instead of sharing the link with the copies (on
    a GPU with the misses read over it). Without it the first 16 tokens decode while most copies still wait;
    with it every copy is published before the first: more of those tokens' experts hit. A short wait is a
    bound, not a promise: the restore returns after it with the copies still running. The output is the
    stock one in every case."""
    _, cold = _restore_wait_run(tiny_model, 0, "env")
    out, warm = _restore_wait_run(tiny_model, 10000, "flag")
    _, short = _restore_wait_run(tiny_model, 100, "old")
    for st in (cold, warm, short):
        assert st["swaps"] == 1 and not any(st["failed"].values()) and st["after_restore"]["tokens"] > 0, st
    assert out["tokens"] == stock_big[0]["tokens"]
    # every copy waited for: its restore took the copies' time (20 ms each, one after the other), and the first
    # tokens hit more
    assert warm["warm_uploads"] >= 16, warm
    assert warm["last"]["restore_ms"] >= warm["warm_uploads"] * 20 * 0.9, warm
    assert warm["after_restore"]["hit_rate"] > cold["after_restore"]["hit_rate"], (warm, cold)
    # a bound of 100 ms: waited that long, not for every copy; without the switch, no wait at all
    assert 100 <= short["last"]["restore_ms"] < warm["last"]["restore_ms"] - 150, (short["last"], warm["last"])
    assert cold["last"]["restore_ms"] < short["last"]["restore_ms"], (cold["last"], short["last"])


@pytest.mark.parametrize("partial", ["1", "0"])
def test_layers_sized_by_the_profile_come_back_in_the_same_memory_after_swaps(tiny_model, stock_big, tmp_path, partial):
    """--moe-cache-slots-by-layer: the layers' own slot counts survive the swaps (a partial release brings the
    parked layers back at their counts; a full one sizes them again from the profile, this run's routing added):
    the same bank bytes, the stock output at the prefill ubatch."""
    profile = tmp_path / "experts.profile"
    args, env, banks_mib = _budget_server(tiny_model, {"LLAMA_PREFILL_SWAP_PARTIAL": partial})
    with ServerProcess(tiny_model, args=[*args, "--moe-cache-profile", str(profile)], env=env, timeout=120) as srv:
        complete(srv, SHORT, n_predict=4)
    head = profile.read_text().splitlines()[:2]
    narrow, wide = " ".join(["50", "50"] + ["0"] * (N_EXPERT - 2)), " ".join(["10"] * N_EXPERT)
    profile.write_text("\n".join(head + [f"layer {il} {narrow if il % 2 == 0 else wide}" for il in range(4)] + ["end", ""]))
    with ServerProcess(tiny_model, args=[*args, "--moe-cache-profile", str(profile), "--moe-cache-slots-by-layer"],
                       env=env, timeout=120) as srv:
        before = cache_stats(srv)
        outs = requests(srv)
        after = cache_stats(srv)
    sizes = [layer["n_slots"] for layer in before["layers"]]
    assert sizes == [N_EXPERT // 4, N_EXPERT * 3 // 4] * 2, sizes
    st = after["prefill_swap"]
    assert st["swaps"] == 2 and not any(st["failed"].values()), st
    assert sum(layer["n_slots"] for layer in after["layers"]) == sum(sizes)
    assert after["total"]["bytes_vram"] == before["total"]["bytes_vram"] == round(banks_mib * 2**20)
    if partial == "1":
        assert st["partial"]["swaps"] == 1 and [layer["n_slots"] for layer in after["layers"]] == sizes, st
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in stock_big]
