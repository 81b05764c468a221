#!/usr/bin/env bash
# A kernel A/B in one device call, for sessions short of device time: a lab binary built on the CPU machine (carried)
# runs on the GPU while pydflash builds on the CPUs (tools/gpu_run.sh's build phase only: no llama-bench, no models),
# then bench/qmatmul.py once per value of a run-time switch, side by side, and the CUDA tests named by the arguments.
# Everything lands in $OUT (lab.txt, build.txt, bench.txt, tests.txt). A call cut short leaves gpu_run.sh's build
# stamp, so the same command on the still-warm machine goes on without rebuilding.
#
# Usage, in the repo root on the GPU machine, with .device/ggml-src and .whl carried (tools/prepare_gpu_carry.py)
# and the lab binary in .device/lab (optional):
#   AB_VAR=PYDFLASH_QMATMUL_DEEP_STAGES AB_VALUES="0 1" \
#   BENCH_ARGS="--shapes gdn_out,attn_qk,gdn_qkv_z_ba --cols 1,16,23,24,32,48 --reps 20" \
#   LAB="QMM_LAB_SHARED=1 QMM_LAB_COLS=1,16,23,24 QMM_LAB_STAGES=1 ./qmm_lab gdn_out attn_qk" \
#   tools/gpu_ab.sh tests/test_qmatmul.py -k "f16_kernel or bit_identical"      (pytest's arguments; none: no tests)
set -uo pipefail
src=$(pwd)
out=${OUT:-/tmp/gpu-ab}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/lab.txt"
if [ -n "${LAB:-}" ] && [ -x .device/lab/qmm_lab ]; then
    (cd .device/lab && timeout 240 env $LAB) >> "$out/lab.txt" 2>&1 &
fi
SKIP="models llama_bench" ONLY=none timeout "${BUILD_SECONDS:-380}" tools/gpu_run.sh .whl .device/ggml-src \
    .device/llama .device/pylibs "${BUILD_SECONDS:-380}" > "$out/build.txt" 2>&1
echo "build rc=$? at ${SECONDS} s" >> "$out/build.txt"
wait
state=${STATE:-/tmp/pydflash-gpu}   # (gpu_run.sh's)
[ -e "$state/build.done" ] || { echo "no build: $out/build.txt"; tail -20 "$out/build.txt"; exit 1; }
export PYTHONPATH=$state/pyd:$state/site:$src/.device/pylibs LD_LIBRARY_PATH=$state/pyd/pydflash/lib PYTHONUNBUFFERED=1
cd /tmp   # (not the source tree: it would shadow the installed package)
for v in ${AB_VALUES:-}; do
    echo "=== $AB_VAR=$v" >> "$out/bench.txt"
    env "$AB_VAR=$v" timeout 120 python3 "$src/bench/qmatmul.py" --device cuda ${BENCH_ARGS:-} >> "$out/bench.txt" 2>&1
done
if [ $# -gt 0 ]; then
    args=()
    for a in "$@"; do   # (paths under tests/ made absolute: pytest runs from /tmp, as in gpu_run.sh)
        [[ "$a" == tests/* ]] && args+=("$src/$a") || args+=("$a")
    done
    timeout 180 python3 -m pytest -q -p no:cacheprovider --rootdir "$src" -c "$src/pyproject.toml" -m cuda \
        "${args[@]}" > "$out/tests.txt" 2>&1
    echo "tests rc=$? at ${SECONDS} s" >> "$out/tests.txt"
fi
grep -v "^          " "$out/lab.txt"; cat "$out/bench.txt"; tail -5 "$out/tests.txt" 2>/dev/null
