#!/usr/bin/env bash
# Build llama.cpp's llama-bench with CUDA from the pinned source, for side-by-side benchmarks on the GPU machine.
# Usage: tools/build_llama_bench.sh LLAMA_SRC GGML_SRC BUILD_DIR
#   LLAMA_SRC  the pinned llama.cpp tree without ggml/ (src, include, common, vendor, cmake, tools/llama-bench)
#   GGML_SRC   the pristine pinned ggml tree (upstream ggml, unpatched: this is llama.cpp's own build)
set -euo pipefail
llama=$(realpath "$1"); ggml=$(realpath "$2"); build=$3
work=/tmp/llama.cpp-src
rm -rf "$work"; cp -r "$llama" "$work"; ln -sfn "$ggml" "$work/ggml"
cmake -S "$work" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_MTMD=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$build.configure.log" 2>&1
cmake --build "$build" --target llama-bench -j "$(nproc)" > "$build.build.log" 2>&1
echo "llama-bench: $(find "$build" -name llama-bench -type f | head -1)"
