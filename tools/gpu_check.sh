#!/usr/bin/env bash
# Build pydflash with CUDA and run the CUDA-marked tests, on the lent GPU machine (no registry there).
# Usage: tools/gpu_check.sh SRC WHEELS GGML_SRC [pytest args...]
#   SRC       a pydflash source tree          WHEELS    folder of wheels the machine lacks (cffi, gguf, ...)
#   GGML_SRC  the pristine upstream ggml tree (PYDFLASH_GGML_SOURCE), since the 76 MB archive cannot travel
# Logs go to $OUT (build.log, tests.log); the last lines printed are a summary.
set -uo pipefail
src=$(realpath "$1"); wheels=$(realpath "$2"); ggml_src=$(realpath "$3"); shift 3
out=${OUT:-/tmp/out}; mkdir -p "$out"

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl || exit 1
# EXTRA_PYTHONPATH: packages carried as folders (e.g. llama_cpp, the oracle of the target tests)
export PYTHONPATH=/tmp/pyd:/tmp/site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYDFLASH_GGML_SOURCE=$ggml_src PYDFLASH_CUDA=1
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
(cd "$src" && python3 -m pip install --no-build-isolation --no-deps --upgrade --target /tmp/pyd . ) \
    > "$out/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
echo "build: rc=$build_rc, $((t1 - t0)) s on $(nproc) cores"
[ $build_rc -eq 0 ] || { tail -40 "$out/build.log"; exit 1; }

cd /tmp && python3 -m pydflash.cli info --device cuda 2>&1 | tee "$out/info.txt"
t2=$(date +%s)
python3 -m pytest -q -p no:cacheprovider --rootdir "$src" -c "$src/pyproject.toml" -m cuda "$@" 2>&1 \
    | tee "$out/tests.log" | tail -25
t3=$(date +%s)
echo "build: $((t1 - t0)) s; tests: $((t3 - t2)) s"
