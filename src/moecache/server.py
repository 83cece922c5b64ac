"""`moecache-server`: run the built (patched) llama-server.

Every llama-server flag and environment variable is passed through unchanged; moecache's own
flags (long options only, so that llama-server's short flags such as `-hf` never collide) are
taken out first with argparse. Before anything starts, a `-m/--model` path is checked (it must
exist and be a GGUF file), so a typo gives a clear message instead of a C++ stack of logs.

`--demo` makes (once, cached) a small synthetic MoE model and serves it on 127.0.0.1 with the
hot-expert cache on (experts in host memory, 16 slots per layer on the GPU; without a CUDA device
the slots live in host memory, the library's test device), stats at /moe-cache and /metrics.

`ServerProcess` (process.py: llama-server on a free loopback port, for the tests, `moecache bench` and
`moecache plan --measure`) and the option tables (options.py) are importable from here too.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Mapping, Sequence

from .gguf import check_model_file
from .options import (_FALSE_WORDS, _TRUE_WORDS, CACHE_SIZE_ENV, CACHE_SIZE_FLAGS, CTX_ENV, CTX_FLAGS,
                      EXPERT_PLACEMENT_ENV, EXPERT_PLACEMENT_FLAGS, HOST_ENV, HOST_FLAGS, METRICS_ENV, METRICS_FLAGS,
                      MODEL_ENV, MODEL_FLAGS, MOE_CACHE_OPTIONS, PARALLEL_ENV, PARALLEL_FLAGS, PLAN_SETTINGS, PORT_ENV,
                      PORT_FLAGS, REPACK_ENV, REPACK_FLAGS, UBATCH_ENV, UBATCH_FLAGS, _env_set, check_basic_settings,
                      find_flag_value, has_flag, planned_args, setting_value, switch_setting, user_decides)


from .process import (DEFAULT_HOST, ServerError, ServerProcess, die_with_parent_hook, free_port,  # noqa: F401
                      http_request, server_binary)


_server_binary = server_binary  # looked up at each call, so that tests can replace it

DEFAULT_PORT = 8080
DEMO_PRESET = "demo"
DEMO_SEED = 0
DEMO_CTX = 4096

EXIT_USAGE = 2


# --------------------------------------------------------------------------- argument handling


PROG = "moecache-server"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """moecache's own flags. Long options only: llama-server owns the short ones."""
    p = argparse.ArgumentParser(
        prog=prog,
        add_help=False,
        allow_abbrev=False,
        usage=f"{prog} [moecache flags] [llama-server flags]",
        description=(
            "Run the moecache build of llama-server. The flags below are moecache's own; every "
            "llama-server flag (and LLAMA_ARG_* environment variable) is accepted as well and "
            "passed through unchanged."
        ),
    )
    p.add_argument("--help", action="store_true",
                   help="show this help, then llama-server's own help (also: -h)")
    p.add_argument("--demo", action="store_true",
                   help=f"serve a small synthetic MoE model (made once and cached; random weights, "
                        f"so the text it writes is gibberish). Listens on {DEFAULT_HOST}:{DEFAULT_PORT} "
                        f"unless --host/--port (or LLAMA_ARG_HOST/LLAMA_ARG_PORT) say otherwise")
    p.add_argument("--dashboard", dest="dashboard", action="store_true", default=None,
                   help="serve moecache's dashboard at the server's URL: expert heat per layer, hit rate over "
                        "time, uploads, swaps, speculation per slot and a prompt box, live from the server's "
                        "endpoints (the default; it takes the place of llama-server's web UI, as --path DIR "
                        "would) (env: LLAMA_ARG_DASHBOARD)")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="serve llama-server's own web UI instead")
    p.add_argument("--tune-config", metavar="FILE", default=None,
                   help="apply the hot-expert cache settings `moecache tune TRACE --write-config FILE` chose "
                        "(its slots, policy and policy settings); your own flags and LLAMA_ARG_* variables win "
                        "(env: LLAMA_ARG_TUNE_CONFIG)")
    p.add_argument("--verify-model", action="store_true", default=None,
                   help="read every tensor of the model before starting (`moecache check`): a damaged file (its "
                        "recorded checksum does not match, NaN/Inf values or block scales) stops the start with exit "
                        "status 2 instead of serving nonsense; reads the whole file once (env: LLAMA_ARG_VERIFY_MODEL)")
    p.add_argument("--plan", choices=("auto", "off"), default=None,
                   help="plan the GPU layers, the experts' placement, the hot-expert cache's slots and the "
                        "prefill-phase swap's ubatch with `moecache plan` for your -c (total context, default "
                        "8192 per user), -np and -ub before starting; your own flags and LLAMA_ARG_* variables win. "
                        "Default (no --plan): planned when the model is a MoE that does not fit the GPUs, else "
                        "llama-server's own placement; auto: always planned, printed in full, and a plan that "
                        "cannot be made stops the start; off: llama-server's own placement (its --fit) "
                        "(env: LLAMA_ARG_PLAN)")
    p.add_argument("--plan-gpu-mem", metavar="GIB[,GIB...]", default=None,
                   help="with --plan auto: the budget of each GPU in GiB (default: what each has free at start) "
                        "(env: LLAMA_ARG_PLAN_GPU_MEM)")
    p.add_argument("--plan-bandwidth", metavar="SPEC", default=None,
                   help="the bandwidths the plan's decode cost model weighs, per layer, whole experts in VRAM "
                        "against cache slots and where the misses run (the CPU reading host memory against the "
                        "GPU reading it over the link): auto (default) measures them at start when the plan has a "
                        "cache (a few seconds: the host's read, the link, the CPU's kernels on the model's expert "
                        "types), none caches every layer and leaves the misses on the CPU, "
                        "host=GB/s,device=GB/s,h2d=GB/s[,cpu=GB/s,cpu-stock=GB/s] gives them "
                        "(env: LLAMA_ARG_PLAN_BANDWIDTH)")
    return p


def split_args(argv: Sequence[str], prog: str = PROG) -> tuple[argparse.Namespace, list[str]]:
    """Split argv into moecache's options and the llama-server arguments (kept verbatim, in order)."""
    argv = list(argv)
    # `-h` is not an argparse option: argparse would read llama-server's `-hf REPO` as `-h -f REPO`.
    wants_help = "-h" in argv
    ours, rest = build_parser(prog).parse_known_args(argv)
    if wants_help:
        ours.help = True
        rest = [a for a in rest if a != "-h"]
    return ours, rest


PATH_FLAGS = ("--path",)
PATH_ENV = ("LLAMA_ARG_STATIC_PATH",)
DASHBOARD_ENV = "LLAMA_ARG_DASHBOARD"


def dashboard_dir() -> Path:
    """The dashboard's files, shipped in the package."""
    return Path(__file__).resolve().parent / "dashboard"


def dashboard_args(wanted: bool | None, args: Sequence[str], environ) -> list[str]:
    """`--path <dashboard>` unless it is turned off (--no-dashboard, LLAMA_ARG_DASHBOARD=0) or the user
    serves their own static files (--path, LLAMA_ARG_STATIC_PATH)."""
    if wanted is None:
        word = environ.get(DASHBOARD_ENV, "").strip().lower()
        wanted = word not in _FALSE_WORDS  # llama.cpp's falsey words, as every boolean variable
    if not wanted or has_flag(args, PATH_FLAGS) or _env_set(environ, PATH_ENV):
        return []
    return ["--path", str(dashboard_dir())]


# --demo shows the hot-expert cache
DEMO_CACHE_SLOTS = 16
HOST_DEVICE_ENV = "LLAMA_MOE_CACHE_HOST_DEVICE"  # test device: the slot banks in host memory


# --------------------------------------------------------------------------- demo model


def demo_model_path() -> Path:
    from .synth import cached_model_path

    return cached_model_path(DEMO_PRESET, seed=DEMO_SEED)


def ensure_synth_model(path: Path, preset: str, seed: int = 0, quant: str | None = None,
                       out=None, routing: str = "default") -> Path:
    """Write a synthetic model to `path` once (synth writes a temp file and renames it when done,
    so a cached file is always complete); `routing` names a synth routing profile."""
    path = Path(path)
    if path.is_file() and check_model_file(path) is None:
        return path
    from . import synth

    out = out or sys.stderr
    path.parent.mkdir(parents=True, exist_ok=True)
    strength, mix = synth.routing_profile(preset, routing)
    print(f"moecache: making the synthetic model '{preset}'{' ' + quant if quant else ''}"
          f"{'' if routing == 'default' else f' ({routing} routing: strength {strength:g}, context mix {mix:g})'} "
          f"(once; cached at {path}) ...", file=out, flush=True)
    kwargs = {"preset": preset, "seed": seed, "routing_strength": strength, "context_mix": mix}
    if quant:
        kwargs["quant"] = quant
    synth.write_model(path, **kwargs)
    return path


def cuda_devices(exe) -> list[str] | None:
    """Names of the CUDA devices the llama-server binary sees (its `--list-devices`: the devices of
    this very build, without a CUDA context left in this process), or None when it cannot tell."""
    try:
        r = subprocess.run([str(exe), "--list-devices"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0 or "Available devices:" not in r.stdout:
        return None
    names = []
    for line in r.stdout.split("Available devices:", 1)[1].splitlines():
        m = re.match(r"\s+([^\s:]+): ", line)  # "  CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)"
        if m and m.group(1).startswith("CUDA"):
            names.append(m.group(1))
    return names


def demo_server_setup(rest: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], str, str]:
    """What --demo adds to listen where the demo says (flags to put before the user's), and the host
    and port llama-server will then listen on, whoever decided them."""
    args: list[str] = []
    for flags, env, value in ((HOST_FLAGS, HOST_ENV, DEFAULT_HOST), (PORT_FLAGS, PORT_ENV, str(DEFAULT_PORT)),
                              (CTX_FLAGS, CTX_ENV, str(DEMO_CTX))):
        if not user_decides(rest, environ, flags, env):
            args += [flags[0], value]
    host = setting_value(rest, environ, HOST_FLAGS, HOST_ENV, DEFAULT_HOST)
    host = host.split(",")[0].strip() or DEFAULT_HOST  # llama-server takes a list: it listens on the first too
    port = setting_value(rest, environ, PORT_FLAGS, PORT_ENV, str(DEFAULT_PORT))
    return args, host, port


def demo_cache_setup(rest: Sequence[str], environ: Mapping[str, str], cuda: Sequence[str] | None
                     ) -> tuple[list[str], dict[str, str], str]:
    """What --demo adds to show the hot-expert cache: (llama-server flags to put before the user's,
    environment for the server, a line that says what the cache is). A setting the user's flags or
    environment already decide is left to them."""
    user_cache = user_decides(rest, environ, CACHE_SIZE_FLAGS, CACHE_SIZE_ENV)
    args: list[str] = []
    if not user_decides(rest, environ, EXPERT_PLACEMENT_FLAGS, EXPERT_PLACEMENT_ENV):
        args.append("--cpu-moe")  # the experts in host memory: what the cache serves from its slots
    if not user_decides(rest, environ, REPACK_FLAGS, REPACK_ENV):
        args.append("--no-repack")  # the cache cannot copy repacked experts into its slots
    if not user_cache:
        args += ["--moe-cache-slots", str(DEMO_CACHE_SLOTS)]
    if not user_decides(rest, environ, METRICS_FLAGS, METRICS_ENV):
        args.append("--metrics")
    env: dict[str, str] = {}
    if cuda:
        where = f"on {cuda[0]}"
    elif HOST_DEVICE_ENV in environ:
        where = f"(no CUDA device; your {HOST_DEVICE_ENV}={environ[HOST_DEVICE_ENV]} decides where)"
    else:
        env[HOST_DEVICE_ENV] = "1"
        where = f"in host memory (no CUDA device: {HOST_DEVICE_ENV}=1, the test device)"
    if user_cache:
        what = f"hot-expert cache as your flags set it, slots {where}"
    else:
        what = f"hot-expert cache, {DEMO_CACHE_SLOTS} slots per layer {where}, experts in host memory"
    return args, env, what


def plan_request_from_args(model: str, rest: Sequence[str], environ: Mapping[str, str], gpu_mem: str | None):
    """The `moecache plan` request of a server command line: its -c (the total context), -np and -ub, and the
    whole command line as the arguments the plan is probed with (so that its -fa, KV types, ... count)."""
    from .plan import PlanError, Request, _gib_list

    def number(flags, env, default: int, what: str) -> int:
        text = setting_value(rest, environ, flags, env, str(default))
        try:
            return int(text)
        except ValueError:
            raise PlanError(f"--plan auto: {what} is not a number ({text!r})") from None

    users = max(1, number(PARALLEL_FLAGS, PARALLEL_ENV, 1, "-np"))
    ctx_total = number(CTX_FLAGS, CTX_ENV, 0, "-c")
    ctx = ctx_total // users if ctx_total > 0 else 8192
    try:
        budgets = _gib_list(gpu_mem) if gpu_mem else None
    except argparse.ArgumentTypeError as e:
        raise PlanError(f"--plan-gpu-mem: {e}") from None
    return Request(Path(model), ctx=max(1, ctx), users=users, ubatch=number(UBATCH_FLAGS, UBATCH_ENV, 512, "-ub"),
                   gpu_mem_gib=budgets, probe_args=list(rest), slots_by_layer=switch_setting(
                       rest, environ, SLOTS_BY_LAYER_FLAGS, MOE_CACHE_OPTIONS["moe_cache_slots_by_layer"].env_names, True))


SLOTS_BY_LAYER_FLAGS = ("--moe-cache-slots-by-layer", "--no-moe-cache-slots-by-layer")


def moe_expert_count(model: str) -> int | None:
    """The routed experts per layer a GGUF's metadata declares (0: a dense model), None if it cannot be read
    (llama-server will say why)."""
    from .gguf import GGUFError, GGUFReader

    try:
        with GGUFReader(model) as r:
            arch = r.get("general.architecture")
            count = r.get(f"{arch}.expert_count", 0) if arch else 0
    except (GGUFError, OSError, ValueError):
        return None
    try:
        return int(count or 0)
    except (TypeError, ValueError):
        return None


def startup_plan(prog: str, model: str, rest: Sequence[str], environ: Mapping[str, str], gpu_mem: str | None,
                 explicit: bool, profile: Path | None = None, lines: list[str] | None = None,
                 bandwidth: str | None = None) -> list[str] | None:
    """The plan's flags to add before starting (what your flags and environment leave open), [] for none, None
    when an asked-for plan (--plan auto) cannot be made. Without --plan (the default) a MoE model that does not
    fit the GPUs is planned; a dense model, one that fits, a machine without a GPU or a plan that cannot be made
    start with llama-server's own placement, said in one line. `profile`: where the cache's expert profile is
    kept (default: one per model file in moecache's cache); `lines`: the lines said are appended there too."""
    from .plan import PlanError, add_bandwidth, make_plan, place_layers

    def say(text: str) -> None:
        if lines is not None:  # the caller says them
            lines.append(f"plan: {text}")
        else:
            print(f"{prog}: plan: {text}", file=sys.stderr, flush=True)

    if not model:
        if explicit:
            print(f"{prog}: --plan auto plans for a model: give -m MODEL.gguf", file=sys.stderr)
            return None
        return []  # -hf, --help, ...: llama-server decides
    if not explicit:
        n_expert = moe_expert_count(model)
        if not n_expert:
            return []  # a dense model (or an unreadable file): llama-server's placement, nothing to say
    from .paths import profile_path

    try:
        req = plan_request_from_args(model, rest, environ, gpu_mem)
        req.profile = Path(profile) if profile is not None else profile_path(model)  # earlier runs' routing
        plan = make_plan(req, environ=environ)
        if not plan.all_in_vram:
            add_bandwidth(plan, bandwidth if bandwidth is not None else environ.get("LLAMA_ARG_PLAN_BANDWIDTH"))
            plan = place_layers(plan, environ=environ)  # per layer, whole experts in VRAM against slots
    except (PlanError, FileNotFoundError, ValueError) as e:
        if explicit:
            print(f"{prog}: --plan auto: {e}", file=sys.stderr)
            return None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        say(f"none, llama-server's own placement ({first}) [--plan off: no plan, no line]")
        return []
    if not explicit and plan.all_in_vram:
        say("none: the whole model fits the GPUs, llama-server's own placement [--plan off: no plan, no line]")
        return []
    args = plan.args()
    if plan.slots:
        # the server keeps the cache's expert profile across restarts: it starts warm at once
        where = req.profile
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            # ... and sizes each layer's slots from it (no effect until a run has written it)
            args += ["--moe-cache-profile", str(where), "--moe-cache-slots-by-layer"]
        except OSError as e:
            say(f"no expert profile ({where.parent}: {e.strerror}): the cache starts cold at each start")
    added = planned_args(args, rest, environ)
    if explicit:
        print(plan.render(), file=sys.stderr)
    what, why = plan.summary()
    say(f"{what}; added: {' '.join(added) or '(nothing: your flags and environment set it all)'}")
    say(f"why: {why} [--plan off: llama-server's own placement; your flags win over the plan's]")
    return added


# --------------------------------------------------------------------------- running the server


def _announce_when_ready(proc: subprocess.Popen, url: str, out) -> None:
    """Print one line once `url`/health answers 200 (in a daemon thread; gives up if the server exits)."""
    def poll():
        while proc.poll() is None:
            try:
                if http_request(url + "/health", timeout=2.0)[0] == 200:
                    print(f"moecache-server: ready at {url}", file=out, flush=True)
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.25)

    threading.Thread(target=poll, name="moecache-ready", daemon=True).start()


def run_forwarding(cmd: Sequence[str], env: Mapping[str, str] | None = None, ready_url: str | None = None) -> int:
    """Run `cmd`, forward SIGINT/SIGTERM/SIGHUP to it, return its exit code (128+N if killed by N).
    With `ready_url`, print a line when the server there reports healthy. The child gets SIGTERM
    when this process dies without forwarding anything (SIGKILL), where the system allows it."""
    # a session of its own: a terminal's Ctrl-C reaches only us, and we forward it once (a second
    # SIGINT would make llama-server exit at once instead of shutting down cleanly)
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None,
                            start_new_session=os.name == "posix", preexec_fn=die_with_parent_hook())
    if ready_url:
        _announce_when_ready(proc, ready_url, sys.stderr)
    forwarded = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP"):
        forwarded.append(signal.SIGHUP)
    old = {}

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    for s in forwarded:
        old[s] = signal.signal(s, forward)
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # only if a handler was replaced behind our back
                forward(signal.SIGINT, None)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def print_help(out=None, prog: str = PROG) -> None:
    out = out or sys.stdout
    out.write(build_parser(prog).format_help())
    out.write("\nEvery llama-server flag is accepted too, and passed through unchanged "
              "(e.g. -m MODEL, -ngl 99, -ot exps=CPU, -c 8192, --port 8080).\n")
    try:
        exe = _server_binary()
    except FileNotFoundError as e:
        out.write(f"\nllama-server's own help cannot be shown: {e}\n")
        out.flush()
        return
    out.write(f"\nllama-server's own help ({exe} --help) follows.\n\n")
    out.flush()
    try:
        r = subprocess.run([str(exe), "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, errors="replace", timeout=60)
        out.write(r.stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        out.write(f"(running `{exe} --help` failed: {e})\n")
    out.flush()


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = split_args(argv, prog)
    if ours.help:
        print_help(prog=prog)
        return 0
    problem = check_basic_settings(rest, os.environ)
    if problem:  # before anything starts: llama-server would assert, or listen elsewhere than it says
        print(f"{prog}: {problem}", file=sys.stderr)
        return EXIT_USAGE

    if ours.demo:
        if has_flag(rest, MODEL_FLAGS):
            print("moecache-server: --demo serves its own synthetic model and cannot be combined with "
                  "-m/--model. Fix: drop --demo to serve your model, or drop -m.", file=sys.stderr)
            return EXIT_USAGE
        if _env_set(os.environ, MODEL_ENV):
            print(f"moecache-server: --demo serves its own synthetic model, but {MODEL_ENV[0]} is set "
                  f"({os.environ[MODEL_ENV[0]].strip()}). Fix: drop --demo to serve that model, or unset "
                  f"{MODEL_ENV[0]} for the demo.", file=sys.stderr)
            return EXIT_USAGE
        try:
            path = ensure_synth_model(demo_model_path(), DEMO_PRESET, seed=DEMO_SEED)
        except KeyboardInterrupt:
            print("moecache-server: interrupted while making the demo model (nothing partial is kept).",
                  file=sys.stderr)
            return 130
        except Exception as e:  # SynthError, a missing vocab file, a full disk: say what and stop
            print(f"moecache-server: cannot make the demo model: {e}\nFix: see the message above; "
                  f"reinstalling moecache restores missing data files.", file=sys.stderr)
            return 1
        try:
            cuda = cuda_devices(_server_binary())
        except FileNotFoundError:
            cuda = None  # said below, where the binary is needed
        cache_args, cache_env, cache_what = demo_cache_setup(rest, os.environ, cuda)
        listen_args, host, port = demo_server_setup(rest, os.environ)
        rest = ["-m", str(path)] + listen_args + cache_args + rest
        env = {**os.environ, **cache_env} if cache_env else None
        url_host = f"[{host}]" if ":" in host else host
        ready_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else url_host}:{port}"
        print("moecache-server --demo\n"
              f"  model: {path}\n"
              "  NOTE: this model has SYNTHETIC, RANDOM weights. The text it writes is gibberish: it\n"
              "  demonstrates the server and its API, not a language model. Serve a real model\n"
              "  with `moecache-server -m MODEL.gguf`.\n"
              f"  URL:   http://{url_host}:{port}  (the dashboard; OpenAI-compatible API under /v1, health at /health; "
              "Ctrl-C stops it)\n"
              f"  cache: {cache_what}\n"
              f"         stats: http://{url_host}:{port}/moe-cache (JSON) and http://{url_host}:{port}/metrics\n"
              f"  flags: {' '.join(cache_args) or '(none added: yours decide)'}"
              f"{''.join(f' {k}={v}' for k, v in cache_env.items())}\n"
              "  Starting llama-server; a 'ready' line follows when the model is loaded.",
              file=sys.stderr, flush=True)
    else:
        ready_url = None
        env = None

    tune_config = ours.tune_config or os.environ.get("LLAMA_ARG_TUNE_CONFIG", "").strip() or None
    if tune_config:
        from .tune import ConfigError, config_args, load_config

        try:
            options = load_config(tune_config)
        except ConfigError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return EXIT_USAGE
        added = config_args(options, rest, os.environ)
        rest = added + rest
        print(f"{prog}: tune config {tune_config}: {' '.join(added) or '(every setting already set by your flags or environment)'}",
              file=sys.stderr, flush=True)

    rest = dashboard_args(ours.dashboard, rest, os.environ) + rest

    model = find_flag_value(rest, MODEL_FLAGS)
    if model is not None:
        problem = check_model_file(model)
        if problem:
            print(f"moecache-server: {problem}", file=sys.stderr)
            return EXIT_USAGE
    verify = ours.verify_model
    if verify is None:
        verify = os.environ.get("LLAMA_ARG_VERIFY_MODEL", "").strip().lower() in _TRUE_WORDS
    if verify:
        path = model or setting_value(rest, os.environ, MODEL_FLAGS, MODEL_ENV, "")
        if not path:
            print(f"{prog}: --verify-model checks the model given by -m: give -m MODEL.gguf", file=sys.stderr)
            return EXIT_USAGE
        from .check import check_model
        from .gguf import GGUFError

        try:
            report = check_model(path, progress=True)
        except (GGUFError, OSError) as e:
            print(f"{prog}: --verify-model: {e}", file=sys.stderr)
            return EXIT_USAGE
        print(report.render(), file=sys.stderr, flush=True)
        if not report.ok:
            print(f"{prog}: --verify-model: the model is damaged; nothing was started.", file=sys.stderr)
            return EXIT_USAGE

    env_plan = os.environ.get("LLAMA_ARG_PLAN", "").strip().lower()
    plan_mode = ours.plan or env_plan or "default"
    if ours.plan is None and env_plan and env_plan not in ("auto", "off"):
        print(f"{prog}: LLAMA_ARG_PLAN must be auto or off (got {os.environ['LLAMA_ARG_PLAN'].strip()!r})",
              file=sys.stderr)
        return EXIT_USAGE
    if plan_mode == "auto" or (plan_mode == "default" and not ours.demo):
        bandwidth = ours.plan_bandwidth or os.environ.get("LLAMA_ARG_PLAN_BANDWIDTH", "").strip() or None
        if bandwidth not in (None, "auto", "none"):
            from .plan import parse_bandwidth

            try:
                parse_bandwidth(bandwidth)
            except ValueError as e:
                print(f"{prog}: --plan-bandwidth: {e} (or auto, none)", file=sys.stderr)
                return EXIT_USAGE
        ours.plan_bandwidth = bandwidth
        model = model or setting_value(rest, os.environ, MODEL_FLAGS, MODEL_ENV, "")
        gpu_mem = ours.plan_gpu_mem or os.environ.get("LLAMA_ARG_PLAN_GPU_MEM", "").strip() or None
        planned = startup_plan(prog, model, rest, {**os.environ, **(env or {})}, gpu_mem,
                               explicit=plan_mode == "auto", bandwidth=ours.plan_bandwidth)
        if planned is None:
            return EXIT_USAGE
        rest = planned + rest

    try:
        exe = _server_binary()
    except FileNotFoundError as e:
        print(f"moecache-server: {e}", file=sys.stderr)
        return 1
    return run_forwarding([str(exe), *rest], env=env, ready_url=ready_url)


if __name__ == "__main__":
    sys.exit(main())
