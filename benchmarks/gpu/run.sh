#!/usr/bin/env bash
# Build moecache with CUDA for sm_90, run the GPU tests and the baseline scenario on a GPU machine.
#
#   benchmarks/gpu/run.sh [build] [test] [diag] [backend-ops] [model] [bench SCENARIO...]
#   (default: build test backend-ops model bench)
#
# Offline machines: pack the pinned tree here first (benchmarks/gpu/pack-source.sh) and carry
# .carry/; the script unpacks it and points MOECACHE_LLAMA_SRC at it. Logs and results go to
# $OUT (or benchmarks/results/gpu-logs when OUT is unset). Each phase can run in its own call:
# the build folder and the synthetic model are reused while the machine is kept. The device's copy
# of the tree has no git metadata: pass MOECACHE_COMMIT=$(git rev-parse --short HEAD) so result
# files name the commit.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
out=${OUT:-$repo/benchmarks/results/gpu-logs}
mkdir -p "$out"
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build test backend-ops model bench)
jobs=${JOBS:-$(nproc)}
# downloads, synthetic models: kept on the machine between calls
export MOECACHE_CACHE_DIR=${MOECACHE_CACHE_DIR:-/tmp/moecache-cache}
models=$MOECACHE_CACHE_DIR/models
export PYTHONUNBUFFERED=1

if [ -z "${MOECACHE_LLAMA_SRC:-}" ] && [ -f .carry/llama-src.tar.gz ]; then
    export MOECACHE_LLAMA_SRC=/tmp/moecache-llama-src
    if [ ! -f "$MOECACHE_LLAMA_SRC/CMakeLists.txt" ]; then
        mkdir -p "$MOECACHE_LLAMA_SRC"
        tar -xzf .carry/llama-src.tar.gz -C "$MOECACHE_LLAMA_SRC"
    fi
    export MOECACHE_DATA_DIR=$MOECACHE_LLAMA_SRC/models
fi

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/run.log"; }

i=0
while [ $i -lt ${#phases[@]} ]; do
    phase=${phases[$i]}; i=$((i + 1))
    case "$phase" in
    build)
        log "build: CUDA sm_90, $jobs jobs"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/run.log" || true
        t0=$(date +%s)
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=on -DMOECACHE_BUILD_TESTS=ON ${CMAKE_ARGS:-}" \
        CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
            python3 -m pip install --no-build-isolation --no-deps -v . > "$out/build.log" 2>&1 \
            || { tail -50 "$out/build.log"; exit 1; }
        log "build: done in $(( $(date +%s) - t0 )) s"
        python3 -m moecache info | tee -a "$out/run.log"
        ;;
    test)
        # one pytest process per file: a crash in one file does not hide the others' results
        for f in "$repo"/tests/gpu/test_*.py; do
            name=$(basename "$f" .py)
            log "test: $name"
            if (set -o pipefail; cd /tmp && timeout 600 python3 -m pytest -q -m gpu "$f" -p no:cacheprovider 2>&1 \
                    | tee "$out/$name.log" | tail -8); then
                log "test: $name passed"
            else
                log "test: $name FAILED (see $name.log)"; failed=1
            fi
        done
        ;;
    diag)
        # what the dynamic symbol table of libggml-cuda exports, and a native backtrace of the
        # in-process GPU test crash (tests/gpu/test_cuda.py)
        libdir=$(python3 -c 'from moecache.paths import binary; print(binary("llama-server").parent)')
        { echo "libggml-cuda.so dynamic symbols: $(nm -D --defined-only "$libdir/libggml-cuda.so" | wc -l)";
          echo "  of them not ggml_*: $(nm -D --defined-only "$libdir/libggml-cuda.so" | grep -vc ' ggml_')";
          nm -D --defined-only "$libdir/libggml-cuda.so" | grep -v ' ggml_' | head -20; } | tee "$out/diag.log"
        # the crash is in libllama's print_info (first std::stringstream) when _core loads a model, at
        # any -ngl, only in the CUDA build on this machine and only in the Python process. libcublas,
        # libcublasLt and libnccl export no std:: symbols, so it is not their interposition. Record:
        # the load with CUDA hidden, the native frames of the crash (a SIGSEGV handler preloaded, no
        # gdb here) resolved with addr2line, which library libllama's std:: symbols bind to, and the
        # load with libstdc++ preloaded.
        model=$(ls /tmp/pytest-of-*/pytest-*/moecache-cache*/models/tiny-default-seed0.gguf 2>/dev/null | head -1 || true)
        if [ -n "$model" ]; then
            load="import moecache, sys; moecache.Model(sys.argv[1], n_gpu_layers=0); print('loaded')"
            try_load() { # label, then env assignments
                local label=$1; shift
                echo "== load: $label" >> "$out/diag.log"
                (cd /tmp && env "$@" timeout 120 python3 -c "$load" "$model") > /tmp/diag-load.txt 2>&1 \
                    && echo "   ok" >> "$out/diag.log" || echo "   exit $?" >> "$out/diag.log"
                { grep -v "^llama_model_loader\|^print_info\|^load\|^init_tokenizer" /tmp/diag-load.txt || true; } | tail -40 >> "$out/diag.log"
            }
            try_load "CUDA hidden" CUDA_VISIBLE_DEVICES=
            if cc -shared -fPIC -o /tmp/segv-backtrace.so "$repo/benchmarks/gpu/segv-backtrace.c"; then
                try_load "native frames" LD_PRELOAD=/tmp/segv-backtrace.so
                { grep -o '^[^ (]*\.so[.0-9]*(+0x[0-9a-f]*)' /tmp/diag-load.txt || true; } | head -16 | while IFS='(' read -r lib off; do
                    off=${off%)}; echo "   $(basename "$lib") $off: $(addr2line -Cfp -e "$lib" "${off#+}" 2>/dev/null)" >> "$out/diag.log"
                done
            fi
            (cd /tmp && LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ld-bindings timeout 120 python3 -c "$load" "$model") > /dev/null 2>&1 || true
            { echo "== std:: bindings of libllama to libraries other than libstdc++:";
              cat /tmp/ld-bindings.* 2>/dev/null | grep "binding file [^ ]*libllama.so" | grep -v " to [^ ]*libstdc++" \
                  | grep "_ZNS\|_ZSt\|_ZNKS" | head -20 || true; } >> "$out/diag.log"
            try_load "libstdc++ preloaded" LD_PRELOAD="$(/sbin/ldconfig -p | awk '/libstdc\+\+\.so\.6 /{print $NF; exit}')"
            tail -40 "$out/diag.log"
        fi
        dbg=$(command -v gdb || command -v cuda-gdb || true)
        if [ -n "$dbg" ]; then
            (cd /tmp && timeout 300 "$dbg" -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -m pytest -x -q -m gpu \
                "$repo/tests/gpu/test_cuda.py" -p no:cacheprovider >> "$out/diag.log" 2>&1) || true
            grep -n -A40 "SIGSEGV" "$out/diag.log" | head -60 || true
        fi
        ;;
    backend-ops)
        # the MUL_MAT_ID cases (patch 0001's skip ids among them) on the GPU against the CPU
        log "backend-ops: test-backend-ops -o MUL_MAT_ID -b CUDA0"
        ops=$(python3 -c 'from moecache.paths import binary; print(binary("test-backend-ops"))')
        if (set -o pipefail; "$ops" test -o MUL_MAT_ID -b CUDA0 2>&1 | tee "$out/backend-ops.log" | tail -5); then
            log "backend-ops: passed"
        else
            log "backend-ops: FAILED (see backend-ops.log)"; failed=1
        fi
        ;;
    model)
        mkdir -p "$models"
        # the file name `moecache bench` uses for { synth = "qwen3-30b-a3b", quant = "q4_0" }
        if [ ! -f "$models/qwen3-30b-a3b-q4_0-seed0.gguf" ]; then
            log "model: synth qwen3-30b-a3b q4_0"
            t0=$(date +%s)
            python3 -m moecache synth "$models/qwen3-30b-a3b-q4_0-seed0.gguf" --preset qwen3-30b-a3b --quant q4_0 --seed 0 2>&1 | tail -3
            log "model: made in $(( $(date +%s) - t0 )) s"
        fi
        ;;
    bench)
        scenarios=()
        while [ $i -lt ${#phases[@]} ] && [[ ${phases[$i]} == *.toml ]]; do scenarios+=("${phases[$i]}"); i=$((i + 1)); done
        [ ${#scenarios[@]} -eq 0 ] && scenarios=(benchmarks/scenarios/baseline-h200.toml)
        for s in "${scenarios[@]}"; do
            log "bench: $s"
            python3 -m moecache bench "$s" --out "$out" 2>&1 | tee -a "$out/bench.log" | tail -30
        done
        ;;
    *) echo "unknown phase '$phase' (build, test, diag, backend-ops, model, bench [SCENARIO.toml...])" >&2; exit 2 ;;
    esac
done
if [ "${failed:-0}" = 1 ]; then log "done, with failures"; exit 1; fi
log "all phases done"
