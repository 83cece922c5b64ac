"""Where an MTP decode step's time goes on the GPU (issue 49: MTP drafts cost 7-12x there): the
qwen3.5-35b-a3b-mtp synthetic model served with the experts in host memory, plain and with
--spec-type draft-mtp, GGML_SCHED_TIMES=16 (per backend: compute, input copies and the host time between
graphs, every 16 graphs of each context, the target's and the draft's). Writes each arm's server log and
timings into OUT.

    python3 benchmarks/gpu/mtp-profile.py MODEL.gguf OUT [extra llama-server flags...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moecache.server import ServerProcess

ARMS = {"plain": [], "mtp": ["--spec-type", "draft-mtp"], "mtp-1": ["--spec-type", "draft-mtp", "--spec-draft-n-max", "1"]}


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    base = ["-ngl", "99", "--cpu-moe", "--no-repack", "-lm", "none", "-c", "16384", "-np", "1", "--fit", "off", "-lv", "4",
            *sys.argv[3:]]
    prompt = (Path(__file__).resolve().parents[1] / "prompts" / "code" / "functools.py").read_text()[:6000]
    for name, extra in ARMS.items():
        # the log kept in OUT: the contexts' last times are logged when the server stops
        with ServerProcess(model, args=[*base, *extra], env={"GGML_SCHED_TIMES": "16"}, timeout=600,
                           log_path=out / f"mtp-profile-{name}.log") as srv:
            status, body = srv.post("/completion", {"prompt": prompt, "n_predict": 96, "temperature": 0.0,
                                                    "cache_prompt": False, "ignore_eos": True}, timeout=600)
        t = body.get("timings", {}) if status == 200 else {}
        line = {"arm": name, "status": status, "decode_tps": t.get("predicted_per_second"),
                "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}
        print(json.dumps(line), flush=True)
        with open(out / "mtp-profile.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
