#!/usr/bin/env bash
# Pack the pinned llama.cpp tree for the offline GPU machine: .carry/llama-src.tar.gz.
# The sdist (77 MB) is larger than what travels to the device; docs, media and all vocab files
# but the ones synth uses are left out. They are outside the source fingerprint, so the GPU
# script can point MOECACHE_LLAMA_SRC at the unpacked tree and still pass the pin check.
set -euo pipefail
cd "$(dirname "$0")/../.."
tree=$(python3 -c 'import sys; sys.path.insert(0, "src"); from moecache.orchestrator.upstream import pristine_tree; print(pristine_tree())')
mkdir -p .carry
(cd "$tree" && find . -path ./docs -prune -o -path ./media -prune -o -path ./models -prune \
    -o -name .moecache-extracted -prune -o -path ./.git -prune -o -type f -print; echo ./models/ggml-vocab-qwen2.gguf) \
    | sort | tar -C "$tree" -czf .carry/llama-src.tar.gz --no-recursion -T -
ls -la .carry/llama-src.tar.gz
