#!/usr/bin/env bash
# Compile our CUDA sources for sm_90a (as a default CUDA build does, wgmma included) on a machine without a GPU (nvcc
# only, no cuBLAS headers), to catch errors and read ptxas's register and spill counts before a GPU hold. Needs the pinned ggml source that
# tools/prepare_gpu_carry.py writes to .device/ggml-src; compiles against that tree with vendor/patches applied, as the
# build does (vendor/fetch_ggml.py; kept in .device/ggml-patched until the source or a patch changes).
#
#   tools/cuda_check.sh [FILE.cu ...]     (default: every ggml_ext/cuda/*.cu; PTXAS_V=1 prints ptxas -v)
set -euo pipefail
cd "$(dirname "$0")/.."
G=.device/ggml-src
[ -d "$G/src/ggml-cuda" ] || { echo "no $G: run python tools/prepare_gpu_carry.py first" >&2; exit 2; }
G=$(PYDFLASH_GGML_SOURCE="$PWD/$G" python3 vendor/fetch_ggml.py --dest .device/ggml-patched)
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(ggml_ext/cuda/*.cu)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in "${files[@]}"; do
    echo "== $f"
    nvcc -std=c++17 -O3 -arch=sm_90a -c -o "$out/$(basename "$f").o" "$f" -DGGML_USE_CUDA -DGGML_EXT_WGMMA \
        -Itools/cuda_check -Iggml_ext/include -Iggml_ext/cuda -I$G/include -I$G/src -I$G/src/ggml-cuda \
        ${PTXAS_V:+-Xptxas -v}
done
echo "all compiled"
