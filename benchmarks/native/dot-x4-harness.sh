#!/usr/bin/env bash
# Times the CPU's Q4_0 one-row and four-row dot kernels with the tree's arch/x86/quants.c
# compiled for each of several instruction sets, linked ahead of the built libggml-cpu, so that the AVX2
# path (CPUs without AVX512) is checked bit for bit and timed on any newer x86 machine; see
# dot_x4_harness.c. Needs the patched tree (moecache-build edit) and a build.
#   benchmarks/native/dot-x4-harness.sh [LLAMA_SRC] [BIN_DIR]   -> JSON lines, one per kernel and flag set
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${1:-$here/../../vendor/llama.cpp}
bin=${2:-$(python3 -c 'from moecache.paths import binary; print(binary("llama-server").parent)')}
ggml=$src/ggml
[ -f "$ggml/src/ggml-cpu/arch/x86/quants.c" ] || { echo "dot-x4-harness: no patched tree at $src (run moecache-build edit)" >&2; exit 2; }
[ -f "$bin/libggml-cpu.so" ] || { echo "dot-x4-harness: no libggml-cpu.so in $bin (build first)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for flags in "-march=native" "-mavx2 -mfma -mf16c" "-mavx2 -mfma -mf16c -mavxvnni"; do
    # shellcheck disable=SC2086 # flags is a word list
    gcc -O3 -std=gnu11 $flags -fopenmp -DNDEBUG -D_GNU_SOURCE -DGGML_USE_CPU_REPACK \
        -I"$ggml/include" -I"$ggml/src" -I"$ggml/src/ggml-cpu" \
        -c "$ggml/src/ggml-cpu/arch/x86/quants.c" -o "$tmp/quants.o"
    gcc -O2 "$here/dot_x4_harness.c" "$tmp/quants.o" -o "$tmp/harness" -L"$bin" -lggml-cpu -lggml-base -lm -Wl,-rpath,"$bin"
    for size in "4096 40" "300000 3"; do
        # shellcheck disable=SC2086 # rows and iterations
        "$tmp/harness" $size | sed "s/^{/{\"flags\": \"$flags\", /"
    done
done
