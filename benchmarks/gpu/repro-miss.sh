#!/usr/bin/env bash
# The start-up SIGSEGV of --moe-cache-miss gpu on CUDA (seen with -lm none and --no-host
# under LLAMA_MOE_CACHE_HOLD_EMPTY, and at 128 slots on the 30B shape). Runs the repro phase of run.sh
# under each variant below and prints one line per variant (healthy / exit status); the logs are
# repro-<variant>.log under $OUT. Needs a built tree (run.sh build).
set -uo pipefail
cd "$(dirname "$0")/../.."
base="-t 8 -c 1024 -np 1 -ngl 99 --cpu-moe --no-webui --moe-cache-slots 8 --moe-cache-miss gpu"
hold=LLAMA_MOE_CACHE_HOLD_EMPTY=1
variants=(
    "none|-lm none|$hold"
    "none-nographs|-lm none|$hold GGML_CUDA_DISABLE_GRAPHS=1"
    "none-nofusion|-lm none|$hold GGML_CUDA_DISABLE_FUSION=1"
    "none-blocking|-lm none|$hold CUDA_LAUNCH_BLOCKING=1"
    "nohost|-lm none --no-host|$hold"
    "mmap|-lm mmap|$hold"
    "none-filled|-lm none|"
    "none-cpu-miss|-lm none --moe-cache-miss cpu|$hold"
)
for v in "${variants[@]}"; do
    IFS='|' read -r tag extra env <<< "$v"
    REPRO_TAG=$tag REPRO_ARGS="$base $extra" REPRO_ENV="$env" REPRO_TAIL=${REPRO_TAIL:-12} \
        timeout 90 bash benchmarks/gpu/run.sh repro 2>&1 | grep -v "^\[" || true
    echo "== $tag: $(grep -E "repro $tag: (healthy|exit)" "${OUT:-benchmarks/results/gpu-logs}/run.log" | tr '\n' ' ')"
done
