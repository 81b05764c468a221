#!/usr/bin/env bash
# Build llama.cpp's programs against pydflash's own ggml build, for side-by-side speed on the same kernels
# (one CUDA compile instead of two): llama-bench, and the two peers of `pydflash bench --llama-bin`
# (docs/benchmarks.md): llama-simple (greedy AR) and llama-speculative-simple (classic draft-model speculation);
# and tools/llama_logits (llama-logits: llama.cpp's logits along its greedy path, for tests on the GPU machine).
# Usage: tools/build_llama_bench.sh LLAMA_SRC BUILD_DIR
#   LLAMA_SRC  the pinned llama.cpp tree; only src, include, common, vendor, cmake, LICENSE, licenses,
#              tools/llama-bench, examples/simple and examples/speculative-simple are read (ggml/ is not needed:
#              ours is used)
#   BUILD_DIR  a pydflash CMake build folder that pip (or cmake) has configured
# Prints the folder holding the programs (BUILD_DIR/bin). Run them with LD_LIBRARY_PATH set to the installed
# pydflash/lib (or BUILD_DIR/bin).
set -euo pipefail
llama=$(realpath "$1"); build=$(realpath "$2")
work=$build/llama.cpp-src
rm -rf "$work"; mkdir -p "$work/tools"
for d in src include common vendor cmake licenses LICENSE CMakeLists.txt; do cp -r "$llama/$d" "$work/"; done
cp -r "$llama/tools/llama-bench" "$work/tools/"
# the two examples go under tools/ too: our CMakeLists.txt builds llama.cpp's tools but not its examples
cp -r "$llama/examples/simple" "$llama/examples/speculative-simple" "$work/tools/"
# and our llama-logits (tools/llama_logits: llama.cpp's logits on the same device, for tests)
cp -r "$(dirname "$0")/llama_logits" "$work/tools/"
printf 'add_subdirectory(%s)\n' llama-bench simple speculative-simple llama_logits > "$work/tools/CMakeLists.txt"
ln -sfn "$build/ggml-src" "$work/ggml"     # llama.cpp's cmake/common.cmake includes ggml/cmake/common.cmake
cmake "$build" -DPYDFLASH_LLAMA_SRC="$work" > "$build/llama-configure.log" 2>&1 \
    || { tail -30 "$build/llama-configure.log"; exit 1; }
cmake --build "$build" --target llama-bench llama-simple llama-speculative-simple llama-logits -j "$(nproc)" \
    > "$build/llama-build.log" 2>&1 || { tail -30 "$build/llama-build.log"; exit 1; }
echo "$build/bin"
