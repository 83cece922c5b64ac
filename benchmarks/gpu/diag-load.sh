#!/usr/bin/env bash
# Why does an in-process model load (moecache._core) crash in a CUDA build when the server does not?
# benchmarks/gpu/run.sh diag calls this after the build; it writes $1/diag.log.
#
# It records what decides how the libraries are linked and loaded into a Python process, then
# loads one tiny model in several ways, each in its own process:
#   - the environment and the interpreter (LD_* variables, its dynamic section, what it links)
#   - _core's and libllama's dynamic sections and dependency tree
#   - the load as the API does it, with CUDA hidden, with a native SIGSEGV backtrace
#   - the libraries the crashing process had mapped (LD_DEBUG=libs) and where libllama's and
#     libstdc++'s std:: references bound (LD_DEBUG=bindings)
#   - the same load through ctypes alone (as llama-cpp-python loads libllama), through a C
#     program that dlopens libllama like Python does, and with _core opened RTLD_GLOBAL
set -uo pipefail
out=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
log=$out/diag.log
: > "$log"
say() { echo "$*" >> "$log"; }

libdir=$(python3 -c 'from moecache.paths import binary; print(binary("llama-server").parent)')
core=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("moecache._core").origin)')
model=/tmp/diag-tiny.gguf
python3 -m moecache synth "$model" --preset tiny --seed 0 > /dev/null 2>&1 || say "synth failed"

say "== environment"
env | grep -E '^(LD_|PYTHON|CUDA|VIRTUAL_ENV|PATH=|CC=|CXX=|CFLAGS=|CXXFLAGS=|LDFLAGS=)' >> "$log"
built_with=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$repo"/build/*/CMakeCache.txt 2>/dev/null | head -1)
for c in "${CXX:-}" "$built_with"; do  # the compiler the build used: a wrapper adding -static-libstdc++?
    [ -n "$c" ] && [ -e "$c" ] && say "compiler $c: $(file -b "$(readlink -f "$c")" | cut -c1-60)" \
        && { file -b "$(readlink -f "$c")" | grep -q text && head -c 600 "$c" >> "$log"; true; }
done
py=$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')
say "python: $py ($(python3 -c 'import sys; print(sys.version.split()[0])'))"
say "g++: $(g++ --version | head -1); nvcc: $(nvcc --version 2>/dev/null | tail -1)"
say "== python's dynamic section and libraries"
readelf -d "$py" | grep -E 'NEEDED|RPATH|RUNPATH' >> "$log"
ldd "$py" >> "$log" 2>&1
say "== _core: $core"
readelf -d "$core" | grep -E 'NEEDED|RPATH|RUNPATH' >> "$log"
say "== libllama"
readelf -d "$libdir/libllama.so" | grep -E 'NEEDED|RPATH|RUNPATH' >> "$log"
say "== ldd _core"
ldd "$core" >> "$log" 2>&1
say "== libraries in $libdir: dynamic std:: definitions (weak and unique ones interpose)"
for f in "$libdir"/*.so; do
    n=$(nm -D --defined-only "$f" 2>/dev/null | grep -c ' _ZNS\| _ZSt\| _ZNKS\| _ZGVNSt\| _ZTVNSt' || true)
    u=$(nm -D --defined-only "$f" 2>/dev/null | grep -c ' u ' || true)
    say "  $(basename "$f"): $n std:: symbols, $u unique"
done
for f in $(ldd "$core" | awk '/=> \//{print $3}' | grep -v "$libdir"); do
    n=$(nm -D --defined-only "$f" 2>/dev/null | grep -c ' _ZNS\| _ZSt\| _ZNKS' || true)
    say "  $f: $n std:: symbols"
done

load='import moecache, sys; moecache.Model(sys.argv[1], n_gpu_layers=0); print("loaded")'
try_load() { # label, env assignments..., then -- and the python code
    local label=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    say "== load: $label"
    (cd /tmp && env "${envs[@]}" timeout 120 python3 -c "$1" "$model") > /tmp/diag-load.txt 2>&1
    say "   exit $?"
    { grep -v "^llama_model_loader\|^print_info\|^load\|^init_tokenizer" /tmp/diag-load.txt || true; } | tail -25 >> "$log"
}
try_load "as the API does" -- "$load"
try_load "CUDA hidden" CUDA_VISIBLE_DEVICES= -- "$load"
try_load "_core opened RTLD_GLOBAL" -- "import os, sys; sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL); $load"
try_load "ctypes only (llama-cpp-python's way)" -- "
import ctypes, sys
from moecache.paths import binary
lib = ctypes.CDLL(str(binary('llama-server').parent / 'libllama.so'))
lib.llama_backend_init()
print('backend ok', flush=True)
# llama_model_params is passed by value; take upstream's defaults from the library itself
class P(ctypes.Structure):
    _fields_ = [('raw', ctypes.c_byte * 256)]
lib.llama_model_default_params.restype = P
lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, P]
lib.llama_model_load_from_file.restype = ctypes.c_void_p
m = lib.llama_model_load_from_file(sys.argv[1].encode(), lib.llama_model_default_params())
print('loaded' if m else 'load returned NULL')
"
if cc -shared -fPIC -o /tmp/segv-backtrace.so "$repo/benchmarks/gpu/segv-backtrace.c"; then
    try_load "native frames" LD_PRELOAD=/tmp/segv-backtrace.so -- "$load"
    { grep -o '^[^ (]*\.so[.0-9]*(+0x[0-9a-f]*)' /tmp/diag-load.txt || true; } | head -20 | while IFS='(' read -r lib off; do
        off=${off%)}; say "   $(basename "$lib") $off: $(addr2line -Cfp -e "$lib" "${off#+}" 2>/dev/null)"
    done
fi
# a C program that dlopens libllama RTLD_LOCAL and loads the model (a Python extension's situation
# without Python), and one linked against it (the server's situation)
cat > /tmp/diag-dlopen.c <<'EOF'
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char ** argv) {
    int mode = RTLD_NOW | (argc > 3 && strcmp(argv[3], "global") == 0 ? RTLD_GLOBAL : RTLD_LOCAL);
    void * h = dlopen(argv[1], mode);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    void (*init)(void) = (void (*)(void)) dlsym(h, "llama_backend_init");
    init();
    /* llama_model_params by value: 256 bytes of room, filled by llama_model_default_params */
    struct p { char raw[256]; };
    struct p (*defaults)(void) = (struct p (*)(void)) dlsym(h, "llama_model_default_params");
    void * (*load)(const char *, struct p) = (void * (*)(const char *, struct p)) dlsym(h, "llama_model_load_from_file");
    void * m = load(argv[2], defaults());
    printf(m ? "loaded\n" : "load returned NULL\n");
    return 0;
}
EOF
if cc -o /tmp/diag-dlopen /tmp/diag-dlopen.c -ldl; then
    for mode in local global; do
        say "== load: C program, dlopen libllama $mode"
        timeout 120 /tmp/diag-dlopen "$libdir/libllama.so" "$model" $mode > /tmp/diag-load.txt 2>&1
        say "   exit $?"; grep -v "^llama_model_loader\|^print_info\|^load\|^init_tokenizer" /tmp/diag-load.txt | tail -5 >> "$log"
    done
fi
say "== libraries mapped by the crashing load (LD_DEBUG=libs)"
(cd /tmp && LD_DEBUG=libs LD_DEBUG_OUTPUT=/tmp/ld-libs timeout 120 python3 -c "$load" "$model") > /dev/null 2>&1
cat /tmp/ld-libs.* 2>/dev/null | grep "calling init:" | sed 's/^ *[0-9]*: *//' >> "$log"
say "== std:: bindings to a library other than libstdc++ (LD_DEBUG=bindings)"
(cd /tmp && LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ld-bindings timeout 120 python3 -c "$load" "$model") > /dev/null 2>&1
cat /tmp/ld-bindings.* 2>/dev/null | grep "_ZNS\|_ZSt\|_ZNKS\|_ZGVNSt" | grep -v " to [^ ]*libstdc++[^ ]* \[" \
    | sed 's/^ *[0-9]*: *//' | awk '{print $3, "->", $6, $10}' | sort | uniq -c | sort -rn | head -40 >> "$log"
say "== bindings of num_put/locale ids (any library)"
cat /tmp/ld-bindings.* 2>/dev/null | grep "num_put\|num_get\|2idE\|ctype" | sed 's/^ *[0-9]*: *//' \
    | awk '{print $3, "->", $6, $10}' | sort | uniq -c | sort -rn | head -30 >> "$log"
dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)
if [ -n "$dbg" ]; then
    say "== $dbg backtrace"
    (cd /tmp && timeout 240 "$dbg" -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -c "$load" "$model") \
        2>&1 | grep -v "^\[New Thread\|^\[Thread\|^llama_model_loader\|^print_info\|^load" | tail -80 >> "$log"
fi
tail -c 6000 "$log"
