#!/usr/bin/env bash
# Build llama.cpp's llama-bench against pydflash's own ggml build, for side-by-side speed on the same kernels
# (one CUDA compile instead of two). Usage: tools/build_llama_bench.sh LLAMA_SRC BUILD_DIR
#   LLAMA_SRC  the pinned llama.cpp tree; only src, include, common, vendor, cmake, LICENSE, licenses and
#              tools/llama-bench are read (ggml/ is not needed: ours is used)
#   BUILD_DIR  a pydflash CMake build folder that pip has configured and built (build/{wheel_tag})
# Prints the path of llama-bench. Run it with LD_LIBRARY_PATH set to the installed pydflash/lib.
set -euo pipefail
llama=$(realpath "$1"); build=$(realpath "$2")
work=$build/llama.cpp-src
rm -rf "$work"; mkdir -p "$work/tools"
for d in src include common vendor cmake licenses LICENSE CMakeLists.txt; do cp -r "$llama/$d" "$work/"; done
cp -r "$llama/tools/llama-bench" "$work/tools/"
echo 'add_subdirectory(llama-bench)' > "$work/tools/CMakeLists.txt"
ln -sfn "$build/ggml-src" "$work/ggml"     # llama.cpp's cmake/common.cmake includes ggml/cmake/common.cmake
cmake "$build" -DPYDFLASH_LLAMA_SRC="$work" > "$build/llama-configure.log" 2>&1 \
    || { tail -30 "$build/llama-configure.log"; exit 1; }
cmake --build "$build" --target llama-bench -j "$(nproc)" > "$build/llama-build.log" 2>&1 \
    || { tail -30 "$build/llama-build.log"; exit 1; }
echo "$build/bin/llama-bench"
