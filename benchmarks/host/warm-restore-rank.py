"""The warm restore's ranking, by the prompt's routing alone (LLAMA_MOE_CACHE_WARM_BLEND=0) against the prompt's
share plus the profile's decode history (the default), on the host test device with synchronous uploads: the hit
rates are the routing's and the ranking's alone, so the development CPU measures them. A 30B-shaped model with
its calibrated routing cut to 4 small layers; four code prompts twice in one server, then once after a restart.

    python3 benchmarks/host/warm-restore-rank.py [N_PREDICT [SLOTS]]   (from the repository's root)
"""
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from moecache import synth
from moecache.server import ServerProcess

work = Path(tempfile.gettempdir()) / "moecache-warm-rank"
work.mkdir(exist_ok=True)
model = work / "m128.gguf"
if not model.exists():
    p = replace(synth.get_preset("qwen3-30b-a3b"), name="wx", n_layer=4, n_embd=256, n_ff_exp=64, n_ff=256,
                n_head=4, n_head_kv=2, head_dim=64)
    synth.write_model(model, preset=p, quant="q8_0", seed=0, routing_strength=2.0, context_mix=0.1, progress=False, threads=2)
texts = [Path(f"benchmarks/prompts/code/{f}").read_text()[:2500] for f in ("functools.py", "heapq.py", "textwrap.py", "fractions.py")]
ENV = {"LLAMA_MOE_CACHE_HOST_DEVICE": "1", "LLAMA_MOE_CACHE_SYNC_UPLOADS": "1"}
ARGS = ["-t", "2", "-c", "4096", "-np", "1", "-ngl", "99", "--cpu-moe", "--no-repack", "-ub", "64", "-b", "1024",
        "--moe-cache-slots", sys.argv[2] if len(sys.argv) > 2 else "24", "--prefill-ubatch", "256", "--prefill-min-tokens", "128"]
for blend in ("0", "1"):
    prof = work / f"p{blend}.profile"; prof.unlink(missing_ok=True)
    rows = []
    for restart in (0, 1):
        with ServerProcess(model, args=ARGS + ["--moe-cache-profile", str(prof)], env={**ENV, "LLAMA_MOE_CACHE_WARM_BLEND": blend}, timeout=300) as srv:
            for rnd in range(2 if restart == 0 else 1):
                for i, t in enumerate(texts):
                    _, before = srv.get("/moe-cache")
                    st, out = srv.post("/completion", {"prompt": t, "n_predict": int(sys.argv[1]) if len(sys.argv) > 1 else 64, "temperature": 0.0, "cache_prompt": False, "ignore_eos": True}, timeout=600)
                    _, after = srv.get("/moe-cache")
                    ar = after["prefill_swap"]["after_restore"]; br = before["prefill_swap"]["after_restore"]
                    h = ar["hits"] - br["hits"]; m = ar["misses"] - br["misses"]
                    th = after["total"]["hits"] - before["total"]["hits"]; tm = after["total"]["misses"] - before["total"]["misses"]
                    rows.append((restart, rnd, i, h / max(1, h + m), th / max(1, th + tm)))
    for key, sel in (("first round", lambda r: r[0] == 0 and r[1] == 0), ("second round", lambda r: r[0] == 0 and r[1] == 1), ("after restart", lambda r: r[0] == 1)):
        rs = [r for r in rows if sel(r)]
        print(f"blend={blend} {key}: after-restore hits {statistics.mean(r[3] for r in rs):.3f}, request hits {statistics.mean(r[4] for r in rs):.3f}", flush=True)
