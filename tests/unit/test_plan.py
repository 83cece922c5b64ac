"""`moecache plan`'s budget arithmetic and `moecache-server --plan auto`'s merging, on probe figures made
up here (the probe itself, llama-server --memory-probe, runs in tests/e2e/test_plan.py)."""

from __future__ import annotations

import pytest

from moecache import cache_sim
from moecache import plan as planmod
from moecache import server
from moecache.plan import GiB, MiB, PlanError, Request, make_plan

HEADROOM_MIB = 512


def gpu(name="CUDA0", model=4 * GiB, context=2 * GiB, compute=1 * GiB, slot=100 * MiB, layers=48, free=24 * GiB):
    return {"name": name, "description": "test GPU", "type": "gpu", "total": free, "free": free, "model": model,
            "context": context, "compute": compute, "moe_banks": 0, "moe_slot": slot, "n_moe_layers": layers}


def probe_result(devices, n_expert=128, n_ubatch=512, host_model=16 * GiB):
    return {"devices": devices, "host": {"model": host_model, "context": 0, "compute": 0, "moe_banks": 0,
                                         "moe_slot": 0, "n_moe_layers": 0},
            "n_layer": 48, "n_expert": n_expert, "n_expert_used": 8, "n_ctx": 8192, "n_batch": 2048,
            "n_ubatch": n_ubatch, "n_seq_max": 1, "moe_cache_headroom_mib": HEADROOM_MIB}


@pytest.fixture
def fake_probe(monkeypatch, tmp_path):
    """probe() answers from `answer(args)`; each call's arguments are kept in `calls`."""
    calls = []
    state = {"answer": None}

    def probe(model, args, env=None, binary=None, routing_readback=False):
        calls.append(list(args))
        return state["answer"](list(args))

    monkeypatch.setattr(planmod, "probe", probe)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    def use(answer):
        state["answer"] = answer
        return model

    use.calls = calls
    return use


def last_value(args, flag):
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


def ub_of(args):
    return int(last_value(args, "-ub"))


def answer(whole_fits=False, prefill_compute=None, **kw):
    """Whole model (no --cpu-moe): 60 GiB of weights unless whole_fits; with --cpu-moe: gpu(**kw), and a
    compute buffer of prefill_compute[ub] at a larger ubatch."""
    def f(args):
        if not {"--cpu-moe", "-ot", "-ncmoe"} & set(args):  # any of them: the experts (or some) in host memory
            return probe_result([gpu(model=(3 if whole_fits else 60) * GiB, slot=0, layers=0)], host_model=0)
        ub = ub_of(args)
        d = gpu(**kw)
        if prefill_compute and ub in prefill_compute:
            d["compute"] = prefill_compute[ub]
        c = int(last_value(args, "-c"))
        return {**probe_result([d], n_ubatch=ub), "n_ctx": c or 40960}  # -c 0: the model's own context
    return f


def test_slots_take_what_the_weights_kv_compute_and_headroom_leave(fake_probe):
    model = fake_probe(answer())
    # 24 GiB - (4 + 2 + 1) GiB - 512 MiB = 16.5 GiB = 168.96 slots of 100 MiB -> 168, capped at 128 experts
    p = make_plan(Request(model, gpu_mem_gib=[24.0], swap=False))
    assert p.slots == 128 and any("every expert fits" in n for n in p.notes)
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False))
    assert p.slots == (16 * GiB - 7 * GiB - HEADROOM_MIB * MiB) // (100 * MiB) == 87
    assert "--moe-cache-slots 87" in p.command() and "--cpu-moe" in p.args() and "--no-repack" in p.args()
    d = p.to_json()["devices"][0]
    assert d["banks"] == 87 * 100 * MiB and 0 <= d["left"] < 100 * MiB


def test_the_budget_defaults_to_the_free_memory(fake_probe):
    model = fake_probe(answer(free=12 * GiB))
    p = make_plan(Request(model, swap=False))
    assert p.devices[0].budget == 12 * GiB
    assert p.slots == (12 * GiB - 7 * GiB - HEADROOM_MIB * MiB) // (100 * MiB)


def test_the_smallest_gpu_decides_the_slots(fake_probe):
    model = fake_probe(lambda args: probe_result([gpu("CUDA0", slot=50 * MiB), gpu("CUDA1", slot=150 * MiB)])
                       if "--cpu-moe" in args else probe_result([gpu("CUDA0", model=40 * GiB), gpu("CUDA1")]))
    p = make_plan(Request(model, gpu_mem_gib=[10.0, 10.0], swap=False))
    left = 10 * GiB - 7 * GiB - HEADROOM_MIB * MiB
    assert p.slots == min(left // (50 * MiB), left // (150 * MiB))
    with pytest.raises(PlanError, match="gives 3 budgets for 2 GPU"):
        make_plan(Request(model, gpu_mem_gib=[10.0, 10.0, 10.0], swap=False))


def test_a_model_that_fits_needs_no_cache(fake_probe):
    model = fake_probe(answer(whole_fits=True))
    p = make_plan(Request(model, gpu_mem_gib=[24.0]))
    assert p.all_in_vram and p.slots == 0
    assert "--cpu-moe" not in p.args() and "--moe-cache-slots" not in p.args()
    assert "The whole model fits" in p.render()


def test_an_impossible_budget_says_what_to_change(fake_probe):
    model = fake_probe(answer(context=20 * GiB))
    with pytest.raises(PlanError) as e:
        make_plan(Request(model, ctx=100_000, users=2, gpu_mem_gib=[24.0]))
    msg = str(e.value)
    assert "over the 24.00 GiB budget" in msg and "2 x 100000 tokens" in msg and "Fix: lower --ctx or --users" in msg


def test_no_room_for_a_slot_is_a_plan_without_the_cache(fake_probe):
    model = fake_probe(answer())
    p = make_plan(Request(model, gpu_mem_gib=[7.55]))
    assert p.slots == 0 and "--moe-cache-slots" not in p.args() and p.prefill_ubatch is None
    assert any("no room for one cache slot" in n for n in p.notes)


def test_the_swap_takes_the_largest_ubatch_whose_buffers_fit(fake_probe):
    # at -ub 2048 the compute buffer (12 GiB) does not fit in 16 GiB beside 6 GiB; at 1024 (5 GiB) it does
    model = fake_probe(answer(prefill_compute={2048: 12 * GiB, 1024: 5 * GiB}))
    p = make_plan(Request(model, gpu_mem_gib=[16.0]))
    assert p.prefill_ubatch == 1024 and "--prefill-ubatch 1024" in p.command()
    assert p.devices[0].prefill_compute == 5 * GiB
    # a prompt shorter than both ubatches: no swap, and the note says why
    p = make_plan(Request(model, gpu_mem_gib=[16.0], prompt_tokens=600))
    assert p.prefill_ubatch is None and any("shorter than 1024" in n for n in p.notes)


def test_a_swap_with_the_cache_waits_for_its_warm_copies_unless_you_say_otherwise(fake_probe):
    # the swap's warm restore refills the slots: the first token waits (at most RESTORE_WAIT_MS) for those copies
    model = fake_probe(answer(prefill_compute={2048: 2 * GiB, 1024: 1 * GiB}))
    p = make_plan(Request(model, gpu_mem_gib=[24.0]))
    assert p.slots > 0 and p.prefill_ubatch
    args = p.args()
    assert last_value(args, "--prefill-restore-wait") == str(planmod.RESTORE_WAIT_MS) and planmod.RESTORE_WAIT_MS > 0
    # no swap (a short prompt), no wait; no cache (no room for a slot), no wait
    assert "--prefill-restore-wait" not in make_plan(Request(model, gpu_mem_gib=[24.0], prompt_tokens=600)).args()
    assert "--prefill-restore-wait" not in make_plan(Request(fake_probe(answer()), gpu_mem_gib=[7.55])).args()
    # your flag or variable (new name or old) wins
    for rest, env in ((["--prefill-restore-wait", "0"], {}), ([], {"LLAMA_ARG_PREFILL_RESTORE_WAIT": "0"}),
                      ([], {"LLAMA_PREFILL_SWAP_RESTORE_WAIT_MS": "5"})):
        assert "--prefill-restore-wait" not in server.planned_args(args, rest, env)
    assert "--prefill-restore-wait" in server.planned_args(args, [], {})


def test_the_swap_is_not_planned_where_the_batch_caps_its_ubatch(fake_probe):
    model = fake_probe(lambda args: probe_result([gpu()], n_ubatch=min(ub_of(args), 512)) if "--cpu-moe" in args
                       else probe_result([gpu(model=60 * GiB)]))
    p = make_plan(Request(model, gpu_mem_gib=[16.0]))
    assert p.prefill_ubatch is None


def test_without_a_gpu_the_plan_says_where_to_run(fake_probe, monkeypatch):
    monkeypatch.delenv(planmod.HOST_DEVICE_ENV, raising=False)
    model = fake_probe(lambda args: probe_result([]))
    with pytest.raises(PlanError, match="no GPU device"):
        make_plan(Request(model), environ={})


def test_the_host_test_device_counts_what_the_library_counts(fake_probe):
    """On the host test device the weights are host memory the banks never share: the budget holds the
    KV cache, the compute buffers, the headroom and the banks, as the library sizes them."""
    host = {"model": 20 * MiB, "context": 1 * MiB, "compute": 2 * MiB, "moe_banks": 0, "moe_slot": 1 * MiB,
            "n_moe_layers": 4}
    model = fake_probe(lambda args: {**probe_result([]), "host": host})
    env = {planmod.HOST_DEVICE_ENV: "1", planmod.HOST_DEVICE_MIB_ENV: str(HEADROOM_MIB + 3 + 5.5)}
    p = make_plan(Request(model, swap=False), environ=env)
    assert p.host_test_device and p.slots == 5
    with pytest.raises(PlanError, match="has no size"):
        make_plan(Request(model), environ={planmod.HOST_DEVICE_ENV: "1"})


def test_bad_requests_are_refused(fake_probe):
    model = fake_probe(answer())
    for req, what in ((Request(model, ctx=0), "--ctx"), (Request(model, users=0), "--users"),
                      (Request(model, gpu_mem_gib=[0.0]), "--gpu-mem"), (Request(model.with_name("no.gguf")), "not found")):
        with pytest.raises(PlanError, match=what):
            make_plan(req)


def test_the_cli_prints_the_plan_and_fails_clearly(fake_probe, capsys):
    model = fake_probe(answer())
    assert planmod.main([str(model), "--gpu-mem", "16", "--no-swap", "--bandwidth", "none"]) == 0
    out = capsys.readouterr().out
    assert "--moe-cache-slots 87" in out and "KV cache" in out
    assert planmod.main([str(model), "--gpu-mem", "4", "--bandwidth", "none"]) == 1
    assert "Fix:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        planmod.main([str(model), "--gpu-mem", "lots"])
    assert planmod.main([str(model), "--gpu-mem", "16", "--bandwidth", "host=50"]) == 1
    assert "missing: device, h2d" in capsys.readouterr().err
    assert planmod.main([str(model), "--gpu-mem", "16", "--bandwidth", "host=50,device=3000,h2d=25",
                         "--trace", str(model.with_name("none.jsonl"))]) == 1
    assert "routing trace not found" in capsys.readouterr().err


def test_the_rate_bounds_follow_the_bandwidths(fake_probe):
    model = fake_probe(answer())
    bw = planmod.parse_bandwidth("host=10,device=4000,h2d=25")
    p = make_plan(Request(model, gpu_mem_gib=[16.0], bandwidth=bw))
    r = p.rates()
    # 8 used experts x 100 MiB (one of each of the 48 cached layers) per token; 87 of 128 slots held, hits from
    # the prior (no trace, no profile)
    h = planmod.prior_hit_rate(87, 128)
    expert = 8 * 100 * MiB
    # the link's share reads faster than the CPU's: the misses on the GPU, read over the link
    assert p.miss().mode == "gpu"
    want = 1 / (4 * GiB / 4000e9 + h * expert / 4000e9 + (1 - h) * expert / 25e9)
    assert r.hit_rate == pytest.approx(h) and r.decode == pytest.approx(want)
    assert "decode  <=" in p.render() and p.to_json()["rates"]["decode_bound"] == pytest.approx(want)
    assert "--moe-cache-miss gpu" in p.command() and "misses: misses on the GPU" in p.render()
    # with the misses on the CPU, read from host memory
    p.request.bandwidth = planmod.parse_bandwidth("host=10,device=4000,h2d=2")
    assert p.miss().mode == "cpu"
    assert p.rates().decode == pytest.approx(1 / (4 * GiB / 4000e9 + h * expert / 4000e9 + (1 - h) * expert / 10e9))
    assert r.prefill == pytest.approx(512 / (16 * GiB / 25e9))
    assert r.prefill_swap == pytest.approx(p.prefill_ubatch / (16 * GiB / 25e9))
    # no bandwidths: no rates
    assert make_plan(Request(model, gpu_mem_gib=[16.0])).rates() is None


# --- moecache-server --plan auto --------------------------------------------------------------------------


def test_the_request_comes_from_the_server_command_line(tmp_path):
    m = tmp_path / "m.gguf"
    req = server.plan_request_from_args(str(m), ["-m", str(m), "-c", "16384", "-np", "2", "-ub", "256"], {}, None)
    assert (req.ctx, req.users, req.ubatch, req.gpu_mem_gib) == (8192, 2, 256, None)
    assert req.probe_args[-2:] == ["-ub", "256"]  # the whole command line is probed
    req = server.plan_request_from_args(str(m), [], {"LLAMA_ARG_N_PARALLEL": "4"}, "20,22")
    assert (req.ctx, req.users, req.ubatch, req.gpu_mem_gib) == (8192, 4, 512, [20.0, 22.0])
    with pytest.raises(PlanError, match="-np"):
        server.plan_request_from_args(str(m), ["-np", "many"], {}, None)


def test_the_users_flags_and_environment_win_over_the_plan():
    plan = ["-ngl", "99", "-c", "8192", "-np", "1", "-ub", "512", "-b", "2048", "--cpu-moe", "--no-repack",
            "-lm", "none", "--moe-cache-slots", "40", "--prefill-ubatch", "2048"]
    got = server.planned_args(plan, ["--n-gpu-layers", "20", "-ot", "exps=CPU", "--ubatch-size=256"],
                              {"LLAMA_ARG_MOE_HOT_K": "8", "LLAMA_ARG_PREFILL_UBATCH": "", "LLAMA_ARG_LOAD_MODE": "mmap"})
    assert got == ["-c", "8192", "-np", "1", "-b", "2048", "--no-repack", "--prefill-ubatch", "2048"]
    assert server.planned_args(plan, [], {}) == plan


def test_your_miss_placement_wins_over_the_plans_by_flag_or_variable():
    # LLAMA_ARG_MOE_CACHE_MISS=cpu is yours as much as --moe-cache-miss cpu: the plan's split (a flag, which would
    # beat the variable in llama-server) must not be added over it; the same for its shares
    plan = ["--moe-cache-slots", "40", "--moe-cache-miss", "split", "--moe-cache-miss-split-pct", "31"]
    assert server.planned_args(plan, [], {}) == plan
    for rest, env in ((["--moe-cache-miss", "cpu"], {}), ([], {"LLAMA_ARG_MOE_CACHE_MISS": "cpu"})):
        assert "--moe-cache-miss" not in server.planned_args(plan, rest, env)
    got = server.planned_args(plan, [], {"LLAMA_ARG_MOE_CACHE_MISS_SPLIT_PCT": "60"})
    assert "--moe-cache-miss-split-pct" not in got and got[got.index("--moe-cache-miss") + 1] == "split"
    auto = ["--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", "40"]
    assert server.planned_args(auto, [], {"LLAMA_ARG_MOE_CACHE_MISS_AUTO_PCT": "10"}) == ["--moe-cache-miss", "auto"]


def test_experts_on_the_cpu_get_its_fast_switches_unless_you_set_them(fake_probe):
    # the misses run on the CPU: the plan turns on huge pages, the flat split, the four-row dots and the overlap
    # (bit-identical, 1.1-1.3x decode of the cache's misses on the H200); each stays yours to set
    model = fake_probe(answer())
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False))
    for flag in ("--host-hugepages", "--cpu-experts-flat", "--cpu-experts-x4", "--cpu-experts-overlap"):
        assert flag in p.args()
    assert "--host-hugepages" not in make_plan(Request(fake_probe(answer(whole_fits=True)), gpu_mem_gib=[24.0])).args()
    plan = p.args()
    got = server.planned_args(plan, ["--no-cpu-experts-x4"], {"GGML_CPU_MMID_FLAT": "0"})
    assert "--cpu-experts-x4" not in got and "--cpu-experts-flat" not in got and "--host-hugepages" in got
    assert "--host-hugepages" not in server.planned_args(plan, [], {"LLAMA_ARG_HOST_HUGEPAGES": "0"})
    # ggml's own variable counts as yours too (GGML_SCHED_HOST_OVERLAP=0: off)
    for rest, env in ((["--no-cpu-experts-overlap"], {}), ([], {"GGML_SCHED_HOST_OVERLAP": "0"}),
                      ([], {"LLAMA_ARG_CPU_EXPERTS_OVERLAP": "off"})):
        got = server.planned_args(plan, rest, env)
        assert "--cpu-experts-overlap" not in got and "--cpu-experts-x4" in got
    assert server.planned_args(plan, [], {}) == plan


def test_plan_flags_are_moecache_flags():
    ours, rest = server.split_args(["--plan", "auto", "--plan-gpu-mem", "24", "-m", "x.gguf"])
    assert (ours.plan, ours.plan_gpu_mem, rest) == ("auto", "24", ["-m", "x.gguf"])


def test_your_expert_placement_is_probed_as_the_server_runs_it(fake_probe):
    """--plan auto with your own -ot (or --cpu-moe): the probes carry your flags and none of the plan's that
    they decide (-ot, --cpu-moe and -ncmoe add up instead of the last one winning), and the whole-model step
    does not plan your placement away."""
    model = fake_probe(answer())
    for mine in (["-ot", "token_embd=CPU"], ["--cpu-moe"], ["-ncmoe", "10"]):
        fake_probe.calls.clear()
        p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False, probe_args=["-m", str(model), *mine]))
        assert not p.all_in_vram and any("place the experts" in n for n in p.notes)
        for call in fake_probe.calls:
            placement = [a for a in call if a in ("--cpu-moe", "-ot", "-ncmoe")]
            assert placement == [mine[0]], call
        assert "--cpu-moe" not in server.planned_args(p.args(), ["-m", str(model), *mine], {})


def test_the_context_the_server_gets_is_the_one_planned(fake_probe):
    model = fake_probe(answer())
    p = make_plan(Request(model, ctx=8192, users=2, gpu_mem_gib=[16.0], swap=False, probe_args=["-c", "0"]))
    assert p.request.ctx == 40960 // 2 and any("40960 tokens in all" in n for n in p.notes)


def test_an_idle_gpu_does_not_bind_the_plan(fake_probe):
    idle = {**gpu("CUDA1", model=0, context=0, compute=0, slot=0, layers=0, free=100 * MiB)}
    model = fake_probe(lambda args: probe_result([gpu(), idle]) if "--cpu-moe" in args
                       else probe_result([gpu(model=60 * GiB), idle]))
    p = make_plan(Request(model, gpu_mem_gib=[16.0, 0.1], swap=False))
    assert p.slots == 87


def test_the_host_read_bandwidth_is_measured():
    bw = planmod.measure_bandwidth("", mib=64, reps=1, threads=2)
    assert bw.host_read > 1e8 and bw.device == 0 and not bw.usable()


def test_a_trace_is_replayed_once_for_the_table_and_the_json(fake_probe, monkeypatch):
    from moecache import cache_sim

    model = fake_probe(answer())
    calls = []
    monkeypatch.setattr(cache_sim, "load_trace", lambda path: path)
    monkeypatch.setattr(cache_sim, "simulate", lambda trace, slots: calls.append(slots) or {"hit_rate": 0.8})
    bw = planmod.parse_bandwidth("host=50,device=4000,h2d=25")
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False, bandwidth=bw, trace=model))
    p.rates(), p.render(), p.to_json()
    assert calls == [87] and p.rates().hit_rate == 0.8 and "replayed" in p.rates().hit_source


@pytest.mark.parametrize("extra,expect", [
    (["--measure-text", "{text}"], "give --measure too"),
    (["--measure", "--measure-text", "{missing}"], "cannot read"),
    (["--measure", "--measure-text", "{empty}"], "has no text"),
])
def test_measure_text_errors_name_the_problem(tmp_path, capsys, extra, expect):
    (tmp_path / "text.txt").write_text("def f():\n    return 1\n")
    (tmp_path / "empty.txt").write_text("  \n")
    names = {"text": tmp_path / "text.txt", "missing": tmp_path / "missing.txt", "empty": tmp_path / "empty.txt"}
    argv = [str(tmp_path / "model.gguf"), *[a.format(**names) for a in extra]]
    with pytest.raises(SystemExit) as e:
        planmod.main(argv)
    assert e.value.code == 2 and expect in capsys.readouterr().err


# --- moecache-server without --plan: planned when a MoE does not fit ---------------------------------------


def test_the_default_plans_a_moe_only_where_it_does_not_fit(fake_probe, monkeypatch, capsys):
    monkeypatch.setattr(server, "moe_expert_count", lambda path: 128)
    model = fake_probe(answer(whole_fits=True))
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "24", explicit=False) == []
    err = capsys.readouterr().err
    assert "plan: none: the whole model fits" in err and err.count("\n") == 1
    model = fake_probe(answer())
    added = server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False)
    assert "--cpu-moe" in added and "--moe-cache-slots" in added
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "hot-expert cache of" in lines[0] and lines[1].startswith("moecache-server: plan: why:")
    # --plan auto plans what fits too (every layer on the GPU) and prints the table
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=True)
    fake_probe(answer(whole_fits=True))
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "24", explicit=True) == \
        ["-ngl", "99", "-c", "8192", "-np", "1", "-ub", "512", "-b", "2048"]


def test_the_default_leaves_dense_models_and_failed_plans_to_llama_server(fake_probe, monkeypatch, capsys):
    model = fake_probe(answer())
    monkeypatch.setattr(server, "moe_expert_count", lambda path: 0)
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False) == []
    assert capsys.readouterr().err == "" and not fake_probe.calls  # not even probed
    monkeypatch.setattr(server, "moe_expert_count", lambda path: 128)
    model = fake_probe(answer(context=20 * GiB))
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False) == []
    assert "plan: none, llama-server's own placement (" in capsys.readouterr().err
    assert server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=True) is None


# --- where the cache's misses run: the cost model ------------------------------------------------------------

EXPERT_BYTES = 2.654e6  # one expert of the 30B shape at Q4_0 (3 x 768 x 2048 weights)


@pytest.mark.parametrize("bw,mode,pct", [
    (None, "cpu", None),                                       # nothing measured: the CPU, as before
    ("host=20,device=3000,h2d=55", "gpu", None),               # the link reads faster than the CPU
    ("host=96,device=3000,h2d=55", "auto", 29),                # the H100 machine: GPU up to 29% misses
    ("host=200,device=3000,h2d=50", "auto", 17),               # 12 channels of DDR5: GPU up to 17% misses
    ("host=70,device=1000,h2d=25", "auto", 9),                 # a desktop on PCIe 4
    ("host=70,device=1000,h2d=2", "cpu", None),                # a slow link: the CPU at any hit rate
])
def test_the_miss_placement_follows_the_bandwidths(bw, mode, pct):
    m = planmod.miss_placement(planmod.parse_bandwidth(bw) if bw else None, 8 * EXPERT_BYTES)
    assert (m.mode, m.auto_pct) == (mode, pct), m
    expected = {"cpu": [], "gpu": ["--moe-cache-miss", "gpu"],
                "auto": ["--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", str(pct)]}[mode]
    assert m.args() == expected
    if mode == "auto":
        # at the crossover both placements cost the same: a CPU layer equals the slower read's extra time
        b = planmod.parse_bandwidth(bw)
        gpu = m.crossover * 8 * EXPERT_BYTES / (b.host_to_device * planmod.LINK_EXPERT_READ_SHARE)
        cpu = planmod.CPU_LAYER_S + m.crossover * 8 * EXPERT_BYTES / b.host_read
        assert gpu == pytest.approx(cpu)


def test_the_default_plan_places_the_misses_and_your_flags_win(fake_probe, monkeypatch, capsys):
    monkeypatch.setattr(server, "moe_expert_count", lambda path: 128)
    measured = []
    bw = planmod.Bandwidth(20e9, 3000e9, 55e9, "test")
    monkeypatch.setattr(planmod, "measure_bandwidth_apart", lambda device: measured.append(device) or bw)
    model = fake_probe(answer())
    added = server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False)
    assert measured and added[added.index("--moe-cache-miss") + 1] == "gpu", added
    what = capsys.readouterr().err.splitlines()
    assert "misses on the GPU" in what[0] and "at any hit rate" in what[1]
    # none: not measured, the misses stay on the CPU (the library's default: no flag)
    measured.clear()
    added = server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False,
                                bandwidth="none")
    assert not measured and "--moe-cache-miss" not in added and "--moe-cache-slots" in added
    # given: the same choice without measuring
    added = server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False,
                                bandwidth="host=200,device=3000,h2d=50")
    assert not measured and "--moe-cache-miss" in added and "--moe-cache-miss-auto-pct" in added
    # your flag wins over the plan's (and its threshold goes with it: auto's percentage is auto's)
    added = server.startup_plan("moecache-server", str(model), ["-m", str(model), "--moe-cache-miss", "cpu"], {},
                                "16", explicit=False, bandwidth="host=200,device=3000,h2d=50")
    assert "--moe-cache-miss" not in added, added
    capsys.readouterr()


def test_a_bad_plan_bandwidth_is_refused(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMA_ARG_PLAN_BANDWIDTH", "host=fast")
    assert server.main(["-m", str(model)]) == 2
    assert "--plan-bandwidth" in capsys.readouterr().err


def test_the_hit_rate_comes_from_the_expert_profile_of_earlier_runs(fake_probe, tmp_path, monkeypatch, capsys):
    """Where the cache's profile of earlier runs exists, the plan's expected hit rate is the share of its
    routings that each layer's slots most-routed experts took (the summary says so); a damaged or other-shaped
    profile leaves the uniform floor."""
    model = fake_probe(answer())
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False))
    n_exp, slots = p.n_expert, p.slots
    counts = [100] * slots + [1] * (n_exp - slots)  # the hot set takes almost everything
    prof = tmp_path / "m.profile"
    prof.write_text("moecache-expert-profile 1\nmodel x\n" +
                    "".join(f"layer {i} " + " ".join(map(str, counts)) + "\n" for i in range(3)) + "end\n")
    want = 100 * slots / (100 * slots + n_exp - slots)
    assert planmod.profile_hit_rate(prof, slots, n_exp) == pytest.approx(want)
    p.request.profile = prof
    h, source = p.hit_rate()
    assert h == pytest.approx(want) and source.startswith("the expert profile")
    assert f"expected hits {100 * want:.0f}%" in p.summary()[0]
    for bad in ("garbage\n", "moecache-expert-profile 1\nmodel x\nlayer 0 1 2\nend\n",
                "moecache-expert-profile 1\nmodel x\n" + "layer 0 " + " ".join(["0"] * n_exp) + "\nend\n"):
        prof.write_text(bad)
        assert p.hit_rate() == (planmod.prior_hit_rate(slots, n_exp), planmod.PRIOR_SOURCE)
    # moecache-server's default plan reads the profile it keeps for the model
    monkeypatch.setattr(server, "moe_expert_count", lambda path: n_exp)
    prof.write_text("moecache-expert-profile 1\nmodel x\n" + "layer 0 " + " ".join(map(str, counts)) + "\nend\n")
    lines = []
    server.startup_plan("moecache-server", str(model), ["-m", str(model)], {}, "16", explicit=False, profile=prof,
                        lines=lines, bandwidth="none")
    assert "expected hits" in lines[0], lines


def test_slots_by_layer_go_where_the_routing_spreads():
    """The library's size_layers in Python: half the even share each, then slot by slot to the layer whose
    next-hottest expert holds the largest share of its routing. A layer that routes to 4 experts gives its slots
    to one that spreads over all of them; the total stays; a layer without counts keeps the even share; equal
    layers stay even; no layer exceeds the experts."""
    n_exp, slots = 16, 8
    narrow = [100] * 4 + [0] * 12
    wide = [10] * 16
    sizes = cache_sim.slots_by_layer([narrow, wide, [0] * 16], slots, n_exp)
    assert sizes == [4, 12, 8] and sum(sizes) == 3 * slots
    assert cache_sim.slots_by_layer([wide, wide, wide], slots, n_exp) == [8, 8, 8]
    assert cache_sim.slots_by_layer([narrow, wide], 16, n_exp) == [16, 16]  # every expert fits: nothing to move
    # at most every expert a layer; what no routing asks for is shared evenly among the others
    assert cache_sim.slots_by_layer([narrow, narrow, wide], 12, n_exp) == [10, 10, 16]
    # and the hit rate of that split beats the even one on the same counts
    even = sum(sum(sorted(c, reverse=True)[:slots]) for c in (narrow, wide)) / sum(map(sum, (narrow, wide)))
    split = sum(sum(sorted(c, reverse=True)[:k]) for c, k in zip((narrow, wide), (4, 12))) / sum(map(sum, (narrow, wide)))
    assert split > even


def test_the_profile_hit_rate_by_layer(tmp_path):
    n_exp, slots = 16, 8
    prof = tmp_path / "m.profile"
    rows = {0: [100] * 4 + [0] * 12, 1: [10] * 16}
    prof.write_text("moecache-expert-profile 1\nmodel x\n" +
                    "".join(f"layer {i} " + " ".join(map(str, c)) + "\n" for i, c in rows.items()) + "end\n")
    total = 400 + 160
    assert planmod.profile_hit_rate(prof, slots, n_exp) == pytest.approx((400 + 80) / total)
    assert planmod.profile_hit_rate(prof, slots, n_exp, by_layer=True) == pytest.approx((400 + 120) / total)


def test_the_server_plan_sizes_layers_by_the_profile_unless_you_say_no(fake_probe, monkeypatch):
    monkeypatch.setattr(server, "moe_expert_count", lambda path: 128)
    model = fake_probe(answer())
    args = ["-m", str(model)]
    added = server.startup_plan("moecache-server", str(model), args, {}, "16", explicit=False, bandwidth="none")
    assert "--moe-cache-profile" in added and "--moe-cache-slots-by-layer" in added, added
    for rest, env in (([*args, "--no-moe-cache-slots-by-layer"], {}), (args, {"LLAMA_ARG_MOE_CACHE_SLOTS_BY_LAYER": "0"})):
        added = server.startup_plan("moecache-server", str(model), rest, env, "16", explicit=False, bandwidth="none")
        assert "--moe-cache-slots-by-layer" not in added, added
        assert not server.plan_request_from_args(str(model), rest, env, "16").slots_by_layer
    assert server.plan_request_from_args(str(model), args, {}, "16").slots_by_layer


# --- per layer: whole experts in VRAM against cache slots ----------------------------------------------------

EXPERT_30B = 2_654_208  # one expert of one layer of the 30B shape at Q4_0
H100 = "host=102.6,device=3000,h2d=55"


def answer_layers(budget=24 * GiB, prefill_compute=None):
    """A 30B-shaped model of 48 MoE layers: --cpu-moe puts every layer's routed experts in host memory,
    --n-cpu-moe N those of layers 0..N-1 (the later layers' experts count in the GPU's weights); the whole
    model does not fit."""
    layer = 128 * EXPERT_30B

    def f(args):
        flag = next((f for f in ("--n-cpu-moe", "-ncmoe") if f in args), None)
        cached = 48 if "--cpu-moe" in args else (int(last_value(args, flag)) if flag else 0)
        ub = ub_of(args)
        compute = (prefill_compute or {}).get(ub, 1 * GiB)
        d = gpu(model=int(0.7 * GiB) + (48 - cached) * layer, context=12 * GiB, compute=compute,
                slot=cached * EXPERT_30B, layers=cached, free=budget)
        return {**probe_result([d], n_ubatch=ub, host_model=cached * layer), "n_ctx": int(last_value(args, "-c"))}
    return f


def placed(model, bandwidth=H100, **kw):
    req = Request(model, gpu_mem_gib=[24.0], bandwidth=planmod.parse_bandwidth(bandwidth) if bandwidth else None,
                  **kw)
    return planmod.place_layers(make_plan(req))


def test_layers_stay_whole_in_vram_where_the_cost_model_says_so(fake_probe):
    model = fake_probe(answer_layers())
    p = placed(model, swap=False)
    r = p.residency
    assert 0 < r.resident < 48 and p.request.n_cpu_moe == 48 - r.resident
    args = p.args()
    assert "--cpu-moe" not in args and args[args.index("--n-cpu-moe") + 1] == str(48 - r.resident)
    # the slots come from the probe of that placement: what the whole layers leave, over the cached layers
    d = p.devices[0]
    assert d.n_moe_layers == 48 - r.resident and p.slots == d.slots_fit() > 0
    # the least modelled cost of every placement, below llama-server's --fit and every layer cached
    bw = planmod.parse_bandwidth(H100)
    free = 24 * GiB - (int(0.7 * GiB) + 12 * GiB + 1 * GiB + HEADROOM_MIB * MiB)
    routed = planmod.routed_per_step(128, 8, 1)
    costs = {}
    for k in range(48):
        left = free - k * 128 * EXPERT_30B
        if left < EXPERT_30B * (48 - k):
            break
        s = min(128, left // (EXPERT_30B * (48 - k)))
        costs[k] = (48 - k) * planmod.layer_step_s(bw, EXPERT_30B, routed, planmod.prior_hit_rate(s, 128))
    assert r.step_s == pytest.approx(min(costs.values())) and r.resident == min(costs, key=costs.get)
    assert r.step_s < r.fit_s and r.step_s < r.all_cached_s == pytest.approx(costs[0])
    what, why = p.summary()
    assert f"the experts of the last {r.resident} of 48 MoE layers whole in VRAM" in what
    assert "llama-server's --fit placement" in why and "per layer" in p.render()
    assert p.to_json()["residency"]["resident"] == r.resident
    # every placement the model weighed, to check it against (-ncmoe N places one by hand)
    assert [c[0] for c in r.candidates] == sorted(costs) and "modelled ms/token" in p.render()
    assert f"{48 - r.resident:>6}" in next(l for l in p.render().splitlines() if l.endswith("<-"))


def test_the_cpu_expert_kernels_rates_enter_the_cost_model(fake_probe):
    """The cost model reads the CPU's experts at the rate its kernels stream them (the GGUF layout with the
    switches; gpt-oss's MXFP4 one-row kernel may stay far below the host's read) and llama-server's --fit layers
    at the rate of its own layout: where moecache's kernels are slower, every placement with CPU work costs
    more and the misses move to the link sooner; where only llama-server's layout is slower, --fit's modelled
    cost rises and moecache's placements do not change."""
    model = fake_probe(answer_layers())
    base = placed(model, swap=False).residency
    slow = placed(model, bandwidth=H100 + ",cpu=30", swap=False).residency
    slow_stock = placed(model, bandwidth=H100 + ",cpu-stock=30", swap=False).residency
    # moecache's CPU slower: every placement with CPU work costs more, and the misses lean to the link
    assert slow.step_s > base.step_s and slow.all_cached_s >= base.all_cached_s and slow.fit_s > base.fit_s
    routed = 8 * EXPERT_30B
    assert (planmod.miss_placement(planmod.parse_bandwidth(H100 + ",cpu=60"), routed).crossover
            > planmod.miss_placement(planmod.parse_bandwidth(H100), routed).crossover)
    # slower than the GPU's read over the link: the misses go there at any share
    assert planmod.miss_placement(planmod.parse_bandwidth(H100 + ",cpu=30"), routed).mode == "gpu"
    # only llama-server's layout slower: its --fit costs more, moecache's own placements do not change
    assert slow_stock.resident == base.resident and slow_stock.step_s == pytest.approx(base.step_s)
    assert slow_stock.fit_s > base.fit_s and slow_stock.all_cached_s == pytest.approx(base.all_cached_s)
    bw = planmod.parse_bandwidth(H100 + ",cpu=30")
    assert bw.cpu_read() == 30e9 and bw.cpu_read_stock() == 30e9 and bw.host_read == 102.6e9
    assert "the CPU's experts 30.0 GB/s" in bw.text()
    # a rate above the host's read is bounded by it; none measured: the host's read
    assert planmod.parse_bandwidth(H100 + ",cpu=500").cpu_read() == 102.6e9
    assert planmod.parse_bandwidth(H100).cpu_read() == planmod.parse_bandwidth(H100).cpu_read_stock() == 102.6e9
    with pytest.raises(ValueError, match="cpu-stock=GB/s"):
        planmod.parse_bandwidth(H100 + ",gpu=3")


def test_the_cpu_expert_kernels_are_timed_on_the_models_types(tmp_path):
    """measure_cpu_experts runs bench-cpu-mmid on the model's expert shape and type, in moecache's layout and in
    llama-server's, and names what it timed; a model whose expert type the bench does not build is refused
    with the types it does."""
    from moecache import synth

    path = tmp_path / "m.gguf"
    synth.write_model(path, preset="tiny", quant="q8_0", seed=0, progress=False, threads=2)
    shapes = planmod.expert_shapes(path)
    assert set(shapes) == {"q8_0"} and shapes["q8_0"][0] > 0
    ce = planmod.measure_cpu_experts(path, threads=1)
    assert ce.ours > 1e8 and ce.stock > 1e8 and ce.text.startswith("q8_0 ") and "1 threads" in ce.text
    # timed with the flat split and without: the faster one is the rate, and the text says which
    assert f"the flat split {'on' if ce.flat else 'off'}" in ce.text and "without" in ce.text
    bw = planmod.Bandwidth(1e11, 1e12, 5e10)
    planmod.add_cpu_experts(bw, path)
    assert bw.cpu_experts > 0 and "the CPU's experts: q8_0" in bw.source and isinstance(bw.cpu_experts_flat, bool)
    notes: list[str] = []
    bw2 = planmod.Bandwidth(1e11, 1e12, 5e10)
    planmod.add_cpu_experts(bw2, tmp_path / "missing.gguf", notes)
    assert bw2.cpu_experts == 0 and notes and "the host read stands for them" in notes[0]


def test_skewed_routing_caches_more_layers_than_flat_routing(fake_probe, tmp_path):
    """With an expert profile: flat counts give hits = slots / experts (whole layers pay), a few hot experts
    per layer give many hits from few slots (more layers cached)."""
    model = fake_probe(answer_layers())

    def profile(counts):
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.profile"
        path.write_text("moecache-expert-profile 1\nmodel x\n" + "".join(
            f"layer {il} {' '.join(map(str, counts))}\n" for il in range(48)) + "end\n")
        return path

    flat = placed(model, swap=False, profile=profile([100] * 128)).residency
    skewed = placed(model, swap=False, profile=profile([1000] * 16 + [1] * 112)).residency
    assert all(r.hit_source.startswith("the expert profile of earlier runs") for r in (flat, skewed))
    assert skewed.resident < flat.resident
    assert skewed.hit_rate > 0.9 and flat.hit_rate < 0.5


def test_the_swap_keeps_room_with_whole_layers(fake_probe):
    model = fake_probe(answer_layers(prefill_compute={2048: 3 * GiB}))
    p = placed(model)
    assert p.prefill_ubatch == 2048 and p.residency.resident > 0
    d = p.devices[0]
    # the banks give back what the prompt's compute buffers need beyond the decode's
    assert p.slots * d.slot >= 2 * GiB


@pytest.mark.parametrize("case", ["no bandwidth", "your placement", "two GPUs"])
def test_no_whole_layers_without_bandwidths_or_with_your_placement(fake_probe, case):
    model = fake_probe(answer_layers())
    if case == "no bandwidth":
        p = placed(model, bandwidth=None, swap=False)
    elif case == "your placement":
        p = placed(model, swap=False, probe_args=["-ncmoe", "40"])
    else:
        two = answer_layers()
        model = fake_probe(lambda args: {**two(args), "devices": two(args)["devices"] * 2})
        p = placed(model, swap=False)
    assert p.request.n_cpu_moe is None and (p.residency is None or p.residency.resident == 0)
    assert "--n-cpu-moe" not in p.args()


@pytest.mark.parametrize("flat", [True, False])
def test_the_flat_split_only_where_the_cpu_timed_it_faster(fake_probe, flat):
    """The CPU's timing at start decides the flat split for the model's types (it loses for Q5_K, Q6_K and
    IQ4_XS on some CPUs): off, the plan leaves it out and keeps huge pages and the four-row dots."""
    model = fake_probe(answer_layers())
    req = Request(model, gpu_mem_gib=[24.0], bandwidth=planmod.parse_bandwidth(H100), swap=False)
    req.bandwidth.cpu_experts_flat = flat
    args = planmod.place_layers(make_plan(req)).args()
    assert "--host-hugepages" in args and "--cpu-experts-x4" in args
    assert ("--cpu-experts-flat" in args) == flat


def test_the_python_api_takes_the_whole_layers():
    model_kw, _ = planmod._api_settings(["-ngl", "99", "--n-cpu-moe", "30", "--no-repack"])
    assert model_kw == {"n_gpu_layers": -1, "n_cpu_moe": 30, "repack": False}



def test_the_placement_probes_the_whole_model_once(fake_probe):
    model = fake_probe(answer_layers())
    placed(model, swap=False)
    whole = [a for a in fake_probe.calls if not {"--cpu-moe", "--n-cpu-moe"} & set(a)]
    assert len(whole) == 1, fake_probe.calls


def test_the_split_of_the_misses_balances_the_link_against_the_cpu():
    # gpt-oss's layers on the H100 machine: 4 routed MXFP4 experts of 13 MB at 49% hits, link 55 GB/s (half of it
    # beside the CPU), the CPU's experts 76 GB/s: the two parts are equal near 30% on the GPU (what the H100 run
    # measured best), and faster than either alone
    bw = planmod.Bandwidth(200e9, 3000e9, 55e9, "test", cpu_experts=76e9)
    missed = 4 * 13e6 * 0.51
    s, t = planmod.split_share(bw, missed)
    beside = missed / (55e9 * planmod.LINK_SPLIT_READ_SHARE)
    alone = missed / (55e9 * planmod.LINK_EXPERT_READ_SHARE)
    cpu = planmod.CPU_LAYER_S + missed / 76e9
    assert 0.25 < s < 0.35
    assert t == pytest.approx(s * beside) == pytest.approx(planmod.CPU_LAYER_S + (1 - s) * missed / 76e9)
    assert t < min(alone, cpu)
    # misses that cross the link faster than a CPU layer's fixed cost: every miss on the GPU, the link's time
    few = 1e6
    s, t = planmod.split_share(bw, few)
    assert s == 1.0 and t == pytest.approx(few / (55e9 * planmod.LINK_SPLIT_READ_SHARE))
    assert planmod.split_share(bw, 0.0) == (0.0, 0.0)


def test_the_split_is_chosen_only_where_the_misses_would_run_on_the_cpu_and_it_pays():
    bw = planmod.Bandwidth(200e9, 3000e9, 55e9, "test", cpu_experts=76e9)
    gpt_oss = 4 * 13e6                               # a layer's routed experts, bytes
    base = planmod.miss_placement(bw, gpt_oss)
    # at 49% hits the misses would run on the CPU: the split, at the model's share
    assert base.on_cpu_at(0.51)
    split = planmod.split_placement(bw, base, gpt_oss, 0.49)
    assert split is not None and split.mode == "split"
    assert split.split_pct == round(100 * planmod.split_share(bw, gpt_oss * 0.51)[0])
    assert split.args() == ["--moe-cache-miss", "split", "--moe-cache-miss-split-pct", str(split.split_pct)]
    assert f"{split.split_pct}% of its misses" in split.why
    # at 95% hits the same layer's misses run on the GPU: no split (the H100's 30B at 76% hits gained nothing)
    assert not base.on_cpu_at(0.05)
    assert planmod.split_placement(bw, base, gpt_oss, 0.95) is None
    # misses on the CPU, but so few that the link takes them all faster than a CPU layer: not a split (the
    # share would be 100%)
    cpu_only = planmod.MissPlacement("cpu", None, None, "test")
    tiny = 4 * 0.2e6
    assert planmod.split_share(bw, tiny * 0.5)[0] == 1.0
    assert planmod.split_placement(bw, cpu_only, tiny, 0.5) is None
    # a CPU so fast that the link beside it takes less than 10% off (the split's time over the CPU's alone is
    # cpu / (cpu + link beside it)): none
    fast_cpu = planmod.Bandwidth(400e9, 3000e9, 55e9, "test", cpu_experts=300e9)
    s, t = planmod.split_share(fast_cpu, gpt_oss * 0.51)
    assert 0 < s < 1 and t > (1 - planmod.SPLIT_MIN_GAIN) * (planmod.CPU_LAYER_S + gpt_oss * 0.51 / 300e9)
    assert planmod.split_placement(fast_cpu, cpu_only, gpt_oss, 0.49) is None
    # no bandwidths: none
    assert planmod.split_placement(None, cpu_only, gpt_oss, 0.49) is None
    # the per-layer placement weighs a cached layer at the split's time where the plan would split it, else at the
    # cheaper of the CPU and the link alone
    expert = gpt_oss / 4
    assert planmod.layer_step_s(bw, expert, 4, 0.49) == pytest.approx(planmod.split_share(bw, gpt_oss * 0.51)[1])
    assert planmod.layer_step_s(bw, expert, 4, 0.95) == pytest.approx(
        gpt_oss * 0.05 / (55e9 * planmod.LINK_EXPERT_READ_SHARE))
    assert planmod.layer_step_s(fast_cpu, expert, 4, 0.49) == pytest.approx(
        planmod.CPU_LAYER_S + gpt_oss * 0.51 / 300e9)


def test_the_rendered_plan_says_what_the_model_expects_of_the_split(fake_probe):
    model = fake_probe(answer())
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False,
                          bandwidth=planmod.Bandwidth(200e9, 3000e9, 55e9, "test", cpu_experts=80e9)))
    line = next(x for x in p.render().splitlines() if x.startswith("misses split"))
    assert "--moe-cache-miss-split-pct" in line and "not chosen" in line
    assert "split" not in " ".join(p.args())  # the plan does not choose it here
    assert not any(x.startswith("misses split") for x in make_plan(Request(model, gpu_mem_gib=[16.0])).render().splitlines())


def test_a_plan_whose_misses_would_run_on_the_cpu_splits_them(fake_probe):
    # a slow link (25 GB/s) makes the CPU take the misses at the expected hit rate; beside it the link still takes
    # more than 10% off their time: the plan splits them, at the model's share, and says so
    model = fake_probe(answer())
    bw = planmod.Bandwidth(200e9, 3000e9, 25e9, "test", cpu_experts=76e9)
    p = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False, bandwidth=bw))
    miss = p.miss()
    assert miss.mode == "split" and 0 < miss.split_pct < 100
    args = p.args()
    assert args[args.index("--moe-cache-miss") + 1] == "split"
    assert args[args.index("--moe-cache-miss-split-pct") + 1] == str(miss.split_pct)
    what, why = p.summary()
    assert f"misses split, {miss.split_pct}% on the GPU" in what and "misses split" in why
    lines = p.render().splitlines()
    assert any(x.startswith("misses: a layer's misses split") for x in lines)
    assert not any(x.startswith("misses split (") for x in lines)  # the not-chosen line is for other plans
    assert p.to_json()["miss"]["split_pct"] == miss.split_pct
    # a fast link: the misses go to the GPU and the split is not chosen
    fast = make_plan(Request(model, gpu_mem_gib=[16.0], swap=False,
                             bandwidth=planmod.Bandwidth(200e9, 3000e9, 55e9, "test", cpu_experts=76e9)))
    assert fast.miss().mode != "split" and "split" not in " ".join(fast.args())
