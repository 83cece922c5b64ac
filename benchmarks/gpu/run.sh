#!/usr/bin/env bash
# Build moecache with CUDA for sm_90, run the GPU tests and the baseline scenario on a GPU machine.
#
#   benchmarks/gpu/run.sh [build] [test] [diag] [repro] [backend-ops] [llama-archs] [model] [cpu-decode] [cpu-pages] [cpu-ops] [cpu-mmid] [cpu-types] [mapped-read] [mtp-profile] [qsa-ops] [plan] [drop-models] [build-ref] [bench SCENARIO...] [bench-ref SCENARIO...]
#   (default: build test backend-ops model bench; BENCH_ARGS: extra flags of moecache bench;
#   TEST_FILES: a subset of tests/gpu; BACKEND_OPS: the op backend-ops tests (MUL_MAT_ID);
#   QSA_OPS_ARGS, CPU_DECODE_ARGS, CPU_MMID_ARGS, REPRO_ARGS: the flags of those phases' tools)
#
# Before/after on one machine: `git archive -o .carry/ref-src.tar.gz REF` here, carry it; build-ref
# builds that tree's llama-server into /tmp/moecache-ref (in the background: the later phases go on, and
# bench-ref waits for it), and bench-ref runs scenarios with the reference build's binaries
# (MOECACHE_BIN_DIR) and this tree's bench, so both runs of a scenario share everything but the server.
#
# For a device call: MODEL_AHEAD=SCENARIO.toml[,SCENARIO.toml] makes those scenarios' synthetic models in the background
# from the first second (beside the build; the bench phase waits for it), and PACK_TO=DIR packs the
# output folder into DIR/<its name>.tgz every 15 s and at the end, so a call cut by its time limit
# still returns what was written (the device returns few files: point PACK_TO at the call's $OUT and
# OUT at a folder outside it).
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

if [ -n "${PACK_TO:-}" ]; then
    mkdir -p "$PACK_TO"
    case "$(cd "$PACK_TO" && pwd)/" in "$(cd "$out" && pwd)/"*)
        echo "run.sh: PACK_TO ($PACK_TO) must lie outside the output folder ($out): set OUT elsewhere" >&2; exit 2 ;;
    esac
    pack_name=$(basename "$out")
    pack() { tar -czf "$PACK_TO/$pack_name-part.tgz" -C "$out" . 2>/dev/null && mv "$PACK_TO/$pack_name-part.tgz" "$PACK_TO/$pack_name.tgz"; }
    (while sleep 15; do pack || true; done) &
    packer=$!
    trap 'kill $packer 2>/dev/null || true; pack || true' EXIT
fi

ahead_pid=$out/model-ahead.pid
if [ -n "${MODEL_AHEAD:-}" ]; then
    # the package's Python parts from the tree, so no install is needed yet
    # several scenarios: comma-separated, made one after the other
    (IFS=, read -ra ahead <<< "$MODEL_AHEAD"
     for sc in "${ahead[@]}"; do
         PYTHONPATH=$repo/src python3 -m moecache bench "$sc" --model-only >> "$out/model-ahead.log" 2>&1 || true
     done
     rm -f "$ahead_pid") &
    echo $! > "$ahead_pid"
    log "model-ahead: making the model of $MODEL_AHEAD in the background"
fi
# the phases that read a model wait until the ones made ahead are written
wait_ahead() {
    if [ -f "$ahead_pid" ]; then
        log "$1: waiting for the models made ahead"
        while [ -f "$ahead_pid" ] && kill -0 "$(cat "$ahead_pid")" 2>/dev/null; do sleep 2; done
        tail -2 "$out/model-ahead.log" | tee -a "$out/run.log"
    fi
}

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
        # TEST_FILES: a subset (names under tests/gpu, or paths from the repo), all files when unset
        for f in ${TEST_FILES:-"$repo"/tests/gpu/test_*.py}; do
            [ -f "$f" ] || f=tests/gpu/$f
            # pytest runs from /tmp, so a path from the repo must be made absolute
            case $f in /*) ;; *) f=$repo/$f ;; esac
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
        # why the in-process model load crashes in a CUDA build (benchmarks/gpu/diag-load.sh)
        log "diag: in-process load"
        bash "$repo/benchmarks/gpu/diag-load.sh" "$out" || true
        ;;
    backend-ops)
        # an op's cases on the GPU against the CPU: MUL_MAT_ID (the skip ids among them), or
        # BACKEND_OPS (TOP_K: the radix top-k)
        op=${BACKEND_OPS:-MUL_MAT_ID}
        log "backend-ops: test-backend-ops -o $op -b CUDA0"
        ops=$(python3 -c 'from moecache.paths import binary; print(binary("test-backend-ops"))')
        if (set -o pipefail; "$ops" test -o "$op" -b CUDA0 2>&1 | tee "$out/backend-ops.log" | tail -5); then
            log "backend-ops: passed"
        else
            log "backend-ops: FAILED (see backend-ops.log)"; failed=1
        fi
        ;;
    repro)
        # start llama-server on the demo model with REPRO_ARGS and print how it ends: the native frames of
        # a SIGSEGV (segv-backtrace.c preloaded) and its verbose log; the server is stopped once healthy
        mkdir -p "$models"
        demo=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("demo", "q8_0", 0))')
        [ -f "$demo" ] || python3 -m moecache synth "$demo" --preset demo --quant q8_0 --seed 0 2>&1 | tail -1
        cc -shared -fPIC -o /tmp/segv-backtrace.so "$repo/benchmarks/gpu/segv-backtrace.c"
        srv=$(python3 -c 'from moecache.paths import binary; print(binary("llama-server"))')
        args=${REPRO_ARGS:-"-t 8 -c 1024 -np 1 -ngl 99 --cpu-moe -lm none --no-webui --moe-cache-slots 8 --moe-cache-miss gpu"}
        rlog=$out/repro${REPRO_TAG:+-$REPRO_TAG}.log
        log "repro${REPRO_TAG:+ $REPRO_TAG}: llama-server $args (env ${REPRO_ENV:-none})"
        # shellcheck disable=SC2086 # REPRO_ARGS and REPRO_ENV are word lists
        env ${REPRO_ENV:-} LD_PRELOAD=/tmp/segv-backtrace.so "$srv" -m "$demo" --port 18599 -lv 4 $args > "$rlog" 2>&1 &
        pid=$!
        for _ in $(seq 120); do
            if ! kill -0 $pid 2>/dev/null; then break; fi
            if python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:18599/health", timeout=1)' 2>/dev/null; then
                log "repro${REPRO_TAG:+ $REPRO_TAG}: healthy"
                # one request through the same path, then stop
                python3 -c 'import json, urllib.request as u; r = u.urlopen(u.Request("http://127.0.0.1:18599/completion", data=json.dumps({"prompt": "The quick brown fox", "n_predict": 24}).encode()), timeout=60); print("repro: completion:", json.load(r)["content"][:80])' 2>&1 | tee -a "$out/run.log" || true
                kill $pid; break
            fi
            sleep 0.5
        done
        rc=0; wait $pid || rc=$?
        log "repro${REPRO_TAG:+ $REPRO_TAG}: exit status $rc"
        # frames as lib(symbol+off): demangled; lib(+off): resolved by addr2line where it is installed
        grep -A40 "segv-backtrace" "$rlog" | head -60 | while read -r line; do
            lib=${line%%(*}; off=$(echo "$line" | sed -n 's/.*(+\(0x[0-9a-f]*\)).*/\1/p')
            if [ -n "$off" ] && command -v addr2line > /dev/null; then
                echo "$line  =>  $(addr2line -f -C -e "$lib" "$off" | tr '\n' ' ')"
            else
                echo "$line" | (command -v c++filt > /dev/null && c++filt || cat)
            fi
        done || true
        tail -${REPRO_TAIL:-40} "$rlog"
        ;;
    cpu-decode)
        # issue 11 goal 2: where all-CPU-experts decode stands against the host's read bandwidth:
        # host-bandwidth.c per thread count, then llama-bench tg over threads, pinned vs pageable
        # (repacked) experts and polling on the 30B model (the model phase makes it)
        wait_ahead cpu-decode
        log "cpu-decode: $(lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\))' | tr -s ' ' | tr '\n' ';')"
        cc -O3 -march=native -fopenmp -o /tmp/host-bandwidth "$repo/benchmarks/gpu/host-bandwidth.c"
        /tmp/host-bandwidth 8 1,2,4,8,12,16 | tee "$out/host-bandwidth.jsonl" | tee -a "$out/run.log"
        q30=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("qwen3-30b-a3b", "q4_0", 0))')
        bench=$(python3 -c 'from moecache.paths import binary; print(binary("llama-bench"))')
        # a quoted default inside ${..:-..} would not be split into words: take it through a variable
        cargs=${CPU_DECODE_ARGS:-"-t 8,16 --no-host 0,1 --poll 50,100"}
        # GGML_SCHED_TIMES: each test's GPU, CPU, copy and host time per token, logged (-v) at
        # its context's end in test order; then every expert in VRAM, the GPU's share alone
        # shellcheck disable=SC2086 # CPU_DECODE_ARGS is a word list
        GGML_SCHED_TIMES=1 "$bench" -m "$q30" -p 0 -n 64 -r 2 -fa 1 -ngl 99 -ot exps=CPU -lm none $cargs -v \
            -o jsonl 2> "$out/cpu-decode.err" | tee "$out/cpu-decode.jsonl" \
            | python3 -c 'import json, sys; [print("cpu-decode: t=%s no_host=%s repack=%s poll=%s: %.1f t/s" % (r["n_threads"], r.get("no_host"), r.get("repack", r.get("use_extra_bufts")), r.get("poll"), r["avg_ts"])) for r in map(json.loads, sys.stdin)]' \
            | tee -a "$out/run.log" || { tail -20 "$out/cpu-decode.err"; failed=1; }
        GGML_SCHED_TIMES=1 "$bench" -m "$q30" -p 0 -n 64 -r 2 -fa 1 -ngl 99 -v -o jsonl 2> "$out/cpu-decode-vram.err" \
            | tee "$out/cpu-decode-vram.jsonl" | python3 -c 'import json, sys; [print("cpu-decode: all in VRAM: %.1f t/s" % r["avg_ts"]) for r in map(json.loads, sys.stdin)]' \
            | tee -a "$out/run.log" || { tail -20 "$out/cpu-decode-vram.err"; failed=1; }
        grep -h "ggml_sched_times" "$out/cpu-decode.err" "$out/cpu-decode-vram.err" | tee "$out/cpu-decode-times.log" | tee -a "$out/run.log" || true
        ;;
    cpu-pages)
        # issue 11 goal 2: does the page size of the experts' host memory decide all-CPU decode?
        # host-bandwidth.c over allocation kinds (THP advised or not, cudaMallocHost, huge pages
        # page-locked as --host-hugepages does), then llama-bench tg64 on the 30B model: pinned buffers
        # with GGML_CUDA_HOST_HUGEPAGES off and on, pageable GGUF-layout and repacked buffers
        wait_ahead cpu-pages
        log "cpu-pages: THP $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
        cuda=$(dirname "$(dirname "$(command -v nvcc)")")
        cc -O3 -march=native -fopenmp -DHOST_BW_CUDA -I"$cuda/include" -o /tmp/host-bandwidth-cuda \
            "$repo/benchmarks/gpu/host-bandwidth.c" -L"$cuda/lib64" -lcudart
        /tmp/host-bandwidth-cuda 8 16 default,thp,4k,cuda-host,cuda-host-thp 0,64 | tee "$out/host-bandwidth-pages.jsonl" | tee -a "$out/run.log"
        q30=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("qwen3-30b-a3b", "q4_0", 0))')
        bench=$(python3 -c 'from moecache.paths import binary; print(binary("llama-bench"))')
        : > "$out/cpu-pages.jsonl"
        : > "$out/cpu-pages.err"
        # CPU_PAGES_VARIANTS: "HUGE FLAGS;..." (HUGE: GGML_CUDA_HOST_HUGEPAGES; -lm none: the
        # --no-host buffers are allocated, not mapped from the file)
        IFS=';' read -r -a variants <<< "${CPU_PAGES_VARIANTS:-0 --no-host 0;1 --no-host 0;0 --no-host 1 --repack 0;0 --no-host 1 --repack 1}"
        for variant in "${variants[@]}"; do
            huge=${variant%% *}
            # the system's anonymous huge pages while it runs, at most: did THP back the buffers?
            echo 0 > /tmp/cpu-pages-huge
            (m=0; while sleep 2; do v=$(awk '/AnonHugePages/ {print $2}' /proc/meminfo); [ "$v" -gt "$m" ] && m=$v && echo "$m" > /tmp/cpu-pages-huge; done) &
            sampler=$!
            # shellcheck disable=SC2086 # the variant's flags are a word list
            GGML_CUDA_HOST_HUGEPAGES=$huge GGML_SCHED_TIMES=1 "$bench" -m "$q30" -p 0 -n 64 -r 3 -fa 1 -ngl 99 -ot exps=CPU -lm none \
                -t 16 ${variant#* } -v -o jsonl 2>> "$out/cpu-pages.err" \
                | H="$huge" python3 -c 'import json, sys, os; [print(json.dumps(dict(r, host_hugepages=int(os.environ["H"])))) for r in map(json.loads, sys.stdin)]' \
                | tee -a "$out/cpu-pages.jsonl" \
                | python3 -c 'import json, sys; [print("cpu-pages: hugepages=%s no_host=%s repack=%s mmap=%s: %.1f t/s" % (r["host_hugepages"], r.get("no_host"), r.get("repack"), r.get("use_mmap"), r["avg_ts"])) for r in map(json.loads, sys.stdin)]' \
                | tee -a "$out/run.log" || { tail -20 "$out/cpu-pages.err"; failed=1; }
            kill "$sampler" 2>/dev/null || true
            log "cpu-pages: hugepages=$huge ${variant#* }: at most $(cat /tmp/cpu-pages-huge) kB AnonHugePages while it ran"
        done
        grep -h "ggml_sched_times" "$out/cpu-pages.err" | tee "$out/cpu-pages-times.log" | tee -a "$out/run.log" || true
        ;;
    cpu-ops)
        # issue 11 goal 2: is the CPU's expert matmul at decode bound by the memory or by its kernel?
        # test-backend-ops perf of the 30B shape's MUL_MAT_ID (128 experts, 8 used, 768 x 2048, one token)
        # on the CPU backend (half the cores' threads): its repeated runs read the same 8 experts (7 MB in
        # Q4_0), which the caches hold, so its GB/s is the kernel's own rate at that thread count
        ops=$(python3 -c 'from moecache.paths import binary; print(binary("test-backend-ops"))')
        log "cpu-ops: test-backend-ops perf -b CPU -o MUL_MAT_ID, the 30B shape at one token"
        "$ops" perf -b CPU -o MUL_MAT_ID -p "n_mats=128,n_used=8,b=0,m=768,n=1,k=2048" 2>&1 \
            | tee "$out/cpu-ops.log" | grep -E "MUL_MAT_ID|threads" | tee -a "$out/run.log" || failed=1
        ;;
    cpu-mmid)
        # issue 11 goal 2: the CPU's part of an all-CPU-experts decode step of the 30B shape, taken apart
        # (benchmarks/native/bench_cpu_mmid.cpp): the three MUL_MAT_IDs of 48 layers streaming random
        # experts from DRAM in one graph (the kernels' rate) and one graph per layer with the GPU's part as
        # idle time between (what the hand-overs add), each with stock pages, huge pages, the flat
        # split and the four-row dot products, and repacked for the CPU with either split
        # (CPU_MMID_ARGS: the tool's flags)
        mb=$(python3 -c 'from moecache.paths import binary; print(binary("bench-cpu-mmid"))')
        margs=${CPU_MMID_ARGS:-"-t 8,16 -n 32"}
        : > "$out/cpu-mmid.jsonl"
        # GGML_CPU_MMID_FLAT|GGML_CPU_DOT_X4|flags
        for variant in "0|0|" "0|0|--hugepages" "1|0|--hugepages" "0|1|--hugepages" "1|1|--hugepages" "0|0|--repack" "1|0|--repack"; do
            IFS='|' read -r flat x4 flags <<< "$variant"
            log "cpu-mmid: GGML_CPU_MMID_FLAT=$flat GGML_CPU_DOT_X4=$x4 $flags $margs"
            # shellcheck disable=SC2086 # the flags are word lists
            GGML_CPU_MMID_FLAT=$flat GGML_CPU_DOT_X4=$x4 "$mb" $margs $flags \
                2>> "$out/cpu-mmid.err" | tee -a "$out/cpu-mmid.jsonl" \
                | python3 -c 'import json, sys; [print("cpu-mmid: %(mode)s t=%(threads)d huge=%(hugepages)d flat=%(mmid_flat)d x4=%(dot_x4)d repack=%(repack)d: %(ms_per_token).2f ms/token, %(gb_s).1f GB/s" % r) for r in map(json.loads, sys.stdin)]' \
                | tee -a "$out/run.log" || { tail -20 "$out/cpu-mmid.err"; failed=1; }
        done
        ;;
    mtp-profile)
        # where an MTP decode step's time goes (issue 49): the 35B-A3B shape with its MTP block, plain and with
        # draft-mtp, GGML_SCHED_TIMES per context (benchmarks/gpu/mtp-profile.py; the model: the MTP scenario's)
        wait_ahead mtp-profile
        m35=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("qwen3.5-35b-a3b-mtp", "q4_0", 0))')
        [ -f "$m35" ] || PYTHONPATH=$repo/src python3 -m moecache bench "$repo/benchmarks/scenarios/spec-mtp-cache-35b-12gib.toml" --model-only
        if python3 "$repo/benchmarks/gpu/mtp-profile.py" "$m35" "$out" 2>&1 | tee -a "$out/run.log"; then
            grep -h "ggml_sched_times\|llama_host_times" "$out"/mtp-profile-*.log | tail -60 > "$out/mtp-profile-times.log" || true
            log "mtp-profile: done (mtp-profile-*.log)"
        else
            log "mtp-profile: FAILED"; failed=1
        fi
        ;;
    mapped-read)
        # how fast the GPU brings a decode step's missed experts over the link (issue 48): copies from pinned
        # memory, a 16-byte gather kernel from mapped memory into VRAM, and 4-byte reads in place as the
        # expert kernels do (MAPPED_READ_ARGS: the tool's flags)
        log "mapped-read: nvcc benchmarks/native/bench_mapped_read.cu"
        if nvcc -O2 -arch=sm_90 -o /tmp/bench-mapped-read "$repo/benchmarks/native/bench_mapped_read.cu" \
                && (set -o pipefail; /tmp/bench-mapped-read ${MAPPED_READ_ARGS:-} 2>&1 | tee "$out/mapped-read.log" \
                    | tee -a "$out/run.log"); then
            log "mapped-read: done"
        else
            log "mapped-read: FAILED (see mapped-read.log)"; failed=1
        fi
        ;;
    cpu-types)
        # the CPU's experts in each type real files use against the host's read bound (issue 48): the 30B
        # shape's three MUL_MAT_IDs over 48 layers, one token, random experts from DRAM, in one graph, with the
        # stock and the flat split, on huge pages; then host-bandwidth.c's read at the same thread counts
        # (CPU_TYPES_ARGS: the tool's flags; CPU_TYPES: the types)
        mb=$(python3 -c 'from moecache.paths import binary; print(binary("bench-cpu-mmid"))')
        targs=${CPU_TYPES_ARGS:-"-t 16 -n 32 -m graph --hugepages"}
        : > "$out/cpu-types.jsonl"
        for t in ${CPU_TYPES:-q4_0 q4_K q5_K q6_K q8_0 iq4_xs mxfp4}; do
            # the stock split, the flat split, and the layout llama-server's defaults repack the CPU's experts to
            # (the comparison a user makes: its CPU layers run repacked, the cache's misses cannot)
            # (and the four-row dots, for the types that have them: Q4_0, MXFP4); --flat-both times the stock and
            # the flat split in one run, on the same weights and tokens (their checksums equal)
            for mode in split x4 repack; do
                extra=(); x4=0
                case $mode in split) extra=(--flat-both) ;; x4) x4=1; extra=(--flat-both) ;; repack) extra=(--repack) ;; esac
                case $mode/$t in x4/q4_0|x4/mxfp4|x4/) ;; x4/*) continue ;; esac
                # no repacked layout for the type on this CPU (bench-cpu-mmid exits with 3): llama-server keeps it
                if [ "$mode" = repack ] && { "$mb" -l 1 -n 1 -t 1 -m graph --type "$t" --repack > /dev/null 2>&1; [ $? -eq 3 ]; }; then
                    log "cpu-types: $t: no repacked layout on this CPU"; continue
                fi
                # shellcheck disable=SC2086 # the flags are word lists
                GGML_CPU_MMID_FLAT=0 GGML_CPU_DOT_X4=$x4 "$mb" $targs --type "$t" "${extra[@]}" 2>> "$out/cpu-types.err" | tee -a "$out/cpu-types.jsonl" \
                    | python3 -c 'import json, sys; [print("cpu-types: %(type)s t=%(threads)d flat=%(mmid_flat)d x4=%(dot_x4)d repack=%(repack)d: %(ms_per_token).2f ms/token, %(gb_s).1f GB/s" % r) for r in map(json.loads, sys.stdin)]' \
                    | tee -a "$out/run.log" || { tail -20 "$out/cpu-types.err"; failed=1; }
            done
        done
        cc -O3 -march=native -fopenmp -o /tmp/host-bandwidth "$repo/benchmarks/gpu/host-bandwidth.c"
        /tmp/host-bandwidth 8 8,16 | tee "$out/host-bandwidth.jsonl" | tee -a "$out/run.log"
        ;;
    qsa-ops)
        # where a QSA layer's indexer spends its time at depth, stage by stage on the GPU
        # (benchmarks/native/bench_qsa_indexer.cpp; QSA_OPS_ARGS: its flags)
        qargs=${QSA_OPS_ARGS:-"-k 5000,50000,150000,250000 -t 1,512 -r 10"}
        log "qsa-ops: bench-qsa-indexer $qargs"
        qb=$(python3 -c 'from moecache.paths import binary; print(binary("bench-qsa-indexer"))')
        # shellcheck disable=SC2086 # QSA_OPS_ARGS is a word list
        "$qb" $qargs 2> "$out/qsa-ops.err" | tee "$out/qsa-ops.jsonl" \
            | python3 -c 'import json, sys; [print("qsa-ops: %(stage)s n_kv=%(n_kv)d n_tps=%(n_tps)d: %(ms).3f ms" % r) for r in map(json.loads, sys.stdin)]' \
            | tee -a "$out/run.log" || { tail -20 "$out/qsa-ops.err"; failed=1; }
        ;;
    model)
        wait_ahead model
        mkdir -p "$models"
        # the file name `moecache bench` uses for { synth = "qwen3-30b-a3b", quant = "q4_0" } (it carries the
        # generator's version, so a model of an older generator is never reused)
        q30=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("qwen3-30b-a3b", "q4_0", 0))')
        if [ ! -f "$q30" ]; then
            log "model: synth qwen3-30b-a3b q4_0"
            t0=$(date +%s)
            python3 -m moecache synth "$q30" --preset qwen3-30b-a3b --quant q4_0 --seed 0 2>&1 | tail -3
            log "model: made in $(( $(date +%s) - t0 )) s"
        fi
        ;;
    plan)
        # `moecache plan` for the 30B shape (PLAN_ARGS: its flags; default a 24 GiB card, 2 users of 32k)
        wait_ahead plan
        q30=$models/$(python3 -c 'from moecache.synth import cached_model_name; print(cached_model_name("qwen3-30b-a3b", "q4_0", 0))')
        # shellcheck disable=SC2086
        set -- ${PLAN_ARGS:---gpu-mem 24 --ctx 32768 --users 2 --server-arg=-fa --server-arg=on}
        log "plan: moecache plan $(basename "$q30") $*"
        python3 -m moecache plan "$q30" "$@" 2>&1 | tee "$out/plan.txt" | tee -a "$out/run.log"
        python3 -m moecache plan "$q30" "$@" --json > "$out/plan.json" 2>> "$out/run.log" || true
        ;;
    drop-models)
        # the disk holds one large synthetic model at a time (64 GB): drop the cached ones before a
        # scenario of another shape makes its own
        log "drop-models: $(du -sh "$models" 2>/dev/null | cut -f1) in $models"
        rm -f "$models"/*.gguf
        ;;
    build-ref)
        # the reference tree's llama-server (CMake, its own series applied by its own orchestrator)
        ref=/tmp/moecache-ref
        [ -f .carry/ref-src.tar.gz ] || { echo "build-ref: no .carry/ref-src.tar.gz (git archive -o .carry/ref-src.tar.gz REF)" >&2; exit 2; }
        if [ -x "$ref/build/bin/llama-server" ]; then
            log "build-ref: $ref/build/bin/llama-server is there"
        else
            rm -rf "$ref" && mkdir -p "$ref/src"
            tar -xzf .carry/ref-src.tar.gz -C "$ref/src"
            log "build-ref: $(tar -tzf .carry/ref-src.tar.gz | head -1) in the background, ${REF_JOBS:-8} jobs"
            # a session of its own: it goes on after this call returns, while the machine is kept
            setsid bash -c '
                t0=$(date +%s)
                cmake -S "$1/src" -B "$1/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 \
                    -DGGML_NATIVE=on -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$2/build-ref.log" 2>&1 \
                && cmake --build "$1/build" --target llama-server -j "$3" >> "$2/build-ref.log" 2>&1 \
                && echo "[$(date +%H:%M:%S)] build-ref: done in $(( $(date +%s) - t0 )) s" >> "$2/run.log" \
                || echo "[$(date +%H:%M:%S)] build-ref: FAILED (see build-ref.log)" >> "$2/run.log"
                rm -f "$1.pid"' build-ref "$ref" "$out" "${REF_JOBS:-8}" < /dev/null > /dev/null 2>&1 &
            echo $! > "$ref.pid"
        fi
        ;;
    bench|bench-ref)
        wait_ahead "$phase"
        scenarios=()
        while [ $i -lt ${#phases[@]} ] && [[ ${phases[$i]} == *.toml ]]; do scenarios+=("${phases[$i]}"); i=$((i + 1)); done
        [ ${#scenarios[@]} -eq 0 ] && scenarios=(benchmarks/scenarios/baseline-h200.toml)
        bin_env=()
        if [ "$phase" = bench-ref ]; then
            ref=/tmp/moecache-ref
            while [ -f "$ref.pid" ] && kill -0 "$(cat "$ref.pid")" 2>/dev/null; do sleep 2; done
            [ -x "$ref/build/bin/llama-server" ] || { log "bench-ref: the reference build is missing"; failed=1; continue; }
            # REF_COMMIT: the reference's commit, for its result files (the tree has no git metadata)
            bin_env=(MOECACHE_BIN_DIR="$ref/build/bin" MOECACHE_COMMIT="${REF_COMMIT:-reference}")
        fi
        for s in "${scenarios[@]}"; do
            log "$phase: $s"
            # shellcheck disable=SC2086 # BENCH_ARGS: extra flags of moecache bench, e.g. "--vram-budget 16"
            env "${bin_env[@]}" python3 -m moecache bench "$s" --out "$out${bin_env:+/ref}" ${BENCH_ARGS:-} 2>&1 \
                | tee -a "$out/bench.log" | tail -30
        done
        ;;
    llama-archs)
        # the pin's own test-llama-archs: one small random model per architecture, run on CUDA0 against
        # the CPU (built with MOECACHE_BUILD_TESTS=ON): the series must break no architecture
        archs=$(python3 -c 'from moecache.paths import binary; print(binary("test-llama-archs"))')
        log "llama-archs: test-llama-archs -b CUDA0"
        if (set -o pipefail; "$archs" -b CUDA0 2>&1 | tee "$out/llama-archs.log" | tail -5); then
            log "llama-archs: passed"
        else
            log "llama-archs: FAILED (see llama-archs.log)"; failed=1
        fi
        ;;
    *) echo "unknown phase '$phase' (build, test, diag, repro, backend-ops, llama-archs, model, cpu-decode, cpu-pages, cpu-ops, cpu-mmid, cpu-types, mapped-read, mtp-profile, qsa-ops, plan, drop-models, build-ref, bench [SCENARIO.toml...], bench-ref [SCENARIO.toml...])" >&2; exit 2 ;;
    esac
done
if [ "${failed:-0}" = 1 ]; then log "done, with failures"; exit 1; fi
log "all phases done"
