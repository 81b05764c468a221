#!/usr/bin/env bash
# Build pydflash with CUDA (sm_90a, as the GPU machine's own build) on this GPU-less machine and pack the installed
# package into .device/pyd_cuda.tgz, so that a hold skips the GPU machine's build (~6 minutes of device time a cold
# machine: tools/gpu_hold.sh with PREBUILT=.device/pyd_cuda.tgz). ~40 minutes on 2 cores.
#
# Needs, besides nvcc 13.0 (here): a pristine pinned ggml in .device/ggml-src (tools/prepare_gpu_carry.py), and what
# the CUDA toolkit here lacks, kept in .device/cuda-extra: cuBLAS 13.0's headers and libraries (the PyPI wheel
# nvidia-cublas==13.0.2.14, the GPU machine's CUDA minor version) and a stub libcuda.so (soname libcuda.so.1, no
# symbols: a shared library may leave the driver's symbols to the real libcuda.so.1 it names, so the link keeps the
# name though no symbol comes from it: --no-as-needed; with --as-needed, this machine's default, ggml-cuda's cuMem*
# calls would find no library to bind to at load). The CPU backend is built without -march=native (this machine's CPU
# is not the GPU machine's).
#
#   tools/build_cuda_here.sh [BUILD_PYTHON]   (a Python with scikit-build-core, cffi, cmake and ninja; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
[ -d .device/ggml-src/src/ggml-cuda ] || { echo "no .device/ggml-src: run python tools/prepare_gpu_carry.py first" >&2; exit 2; }
extra=$PWD/.device/cuda-extra
if [ ! -e "$extra/lib/libcublas.so" ]; then
    rm -rf "$extra" && mkdir -p "$extra/wheel" "$extra/lib"
    "$py" -m pip download -q --no-deps --dest "$extra/wheel" nvidia-cublas==13.0.2.14
    "$py" -m zipfile -e "$extra"/wheel/nvidia_cublas-*.whl "$extra/wheel"
    mv "$extra/wheel/nvidia/cu13/include" "$extra/include"
    mv "$extra"/wheel/nvidia/cu13/lib/* "$extra/lib/"
    ln -s libcublas.so.13 "$extra/lib/libcublas.so" && ln -s libcublasLt.so.13 "$extra/lib/libcublasLt.so"
    echo "" | gcc -x c -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$extra/lib/libcuda.so" -
    rm -rf "$extra/wheel"
fi
# a copy of the committed tree (a build folder of its own; the working tree's build/ is left alone)
src=$(mktemp -d) target=$(mktemp -d)
trap 'rm -rf "$src" "$target"' EXIT
git archive HEAD | tar x -C "$src"
inc="-I$extra/include"
root=$PWD
(cd "$src" && PYDFLASH_GGML_SOURCE=$root/.device/ggml-src PYDFLASH_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=OFF -DCUDA_cublas_LIBRARY=$extra/lib/libcublas.so \
-DCUDA_cublasLt_LIBRARY=$extra/lib/libcublasLt.so -DCUDA_cuda_driver_LIBRARY=$extra/lib/libcuda.so \
-DCMAKE_CUDA_FLAGS=$inc -DCMAKE_CXX_FLAGS=$inc -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--no-as-needed" \
    "$py" -m pip install --no-build-isolation --no-deps --target "$target" .)
tar czf .device/pyd_cuda.tgz -C "$target" pydflash
echo ".device/pyd_cuda.tgz: $(du -h .device/pyd_cuda.tgz | cut -f1), built from $(git rev-parse --short HEAD)"
