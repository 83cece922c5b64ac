"""`moecache info`: what was built, where it lives, and the devices llama.cpp sees."""

from __future__ import annotations

import argparse
import json
import sys


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def version_line() -> str:
    """`moecache <version> (llama.cpp <pin>)`: what `moecache --version` prints and `moecache info` starts with."""
    from . import __version__
    from .orchestrator.upstream import PIN

    return f"moecache {__version__} (llama.cpp {PIN.commit})"


def collect() -> dict:
    """Build and system facts; native parts are None (with a reason) when they are not built."""
    from . import __version__, api, paths
    from .orchestrator.upstream import PIN

    info: dict = {
        "moecache": __version__,
        "llama_cpp_commit": PIN.commit,
        "python": sys.version.split()[0],
        "native_module": None,
        "native_error": None,
        "system_info": None,
        "gpu_offload": None,
        "devices": [],
        "buffer_types": [],
        "binaries": {},
    }
    try:
        core = api.native_module()
        info["native_module"] = getattr(core, "__file__", None)
        info["system_info"] = core.system_info()
        info["gpu_offload"] = bool(core.supports_gpu_offload())
        info["devices"] = api.devices()
        info["buffer_types"] = api.buffer_types()
    except api.MoecacheError as e:
        info["native_error"] = str(e)
    for name in ("llama-server", "llama-bench", "llama-quantize"):
        try:
            info["binaries"][name] = str(paths.binary(name))
        except FileNotFoundError:
            info["binaries"][name] = None
    return info


def main(argv: list[str] | None = None, prog: str = "moecache info") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show the moecache build (native module, llama.cpp pin, binaries), llama.cpp's system "
                    "info and the devices it sees with their free/total memory. Exits 1 when the native "
                    "module is not built.",
    )
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    args = parser.parse_args(argv)

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0 if info["native_module"] else 1

    print(f"{version_line()}, Python {info['python']}")
    if info["native_module"]:
        print(f"native module: {info['native_module']}")
    else:
        print(f"native module: not available: {info['native_error']}")
    for name, path in info["binaries"].items():
        print(f"{name}: {path or 'not found (build moecache first)'}")
    if info["system_info"] is not None:
        print(f"GPU offload: {'yes' if info['gpu_offload'] else 'no'}")
        print(f"system info: {info['system_info'].strip()}")
        print("devices:")
        for d in info["devices"]:
            memory = f"{_gib(d['memory_free'])} free of {_gib(d['memory_total'])}" if d["memory_total"] else "memory n/a"
            print(f"  {d['name']:<10} {d['type']:<5} {memory:<28} {d['description']}")
        print(f"buffer types (for tensor_overrides / -ot): {', '.join(info['buffer_types'])}")
    return 0 if info["native_module"] else 1


if __name__ == "__main__":
    sys.exit(main())
