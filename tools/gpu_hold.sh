#!/usr/bin/env bash
# A build hold: one warm GPU machine for a session's own measurements. tools/gpu_run.sh builds pydflash and
# llama-bench and writes the 27B-shaped pair (ONLY=none: nothing else), and a job of yours runs as soon as the
# build is done, both in the background, so that the device call that starts them can return at once and the
# next calls (made within ~30 s of each other, so that the machine stays warm) only watch.
#
# Usage, in the repo root on the GPU machine, with .device and .whl carried (tools/prepare_gpu_carry.py) and JOB
# (a bash file, carried too if it is ignored):
#   tools/gpu_hold.sh start JOB     copy the tree to /tmp/src, start the build, the models and JOB
#     PREBUILT=.device/pyd_cuda.tgz   (carried) install the package tools/build_cuda_here.sh built instead of building
#                                     it here (~6 minutes of a cold machine); llama-bench, which needs that build, too
#                                     is then skipped, and SKIP=models skips the models as gpu_run.sh's SKIP does
#   tools/gpu_hold.sh wait SECONDS  print JOB's log once it ends, or after SECONDS
# JOB runs from /tmp with PYTHONPATH and LD_LIBRARY_PATH set to the build, and can use:
#   $src (the tree), $data (q27.gguf, d27, ...), $llama_bench, pytest_cuda ARGS..., wait_models (models and
#   llama-bench ready). Its log: /tmp/hold/job.log; gpu_run.sh's: /tmp/hold/gpu_run.log.
set -uo pipefail
hold=/tmp/hold
case "${1:-}" in
start)
    job=$(realpath "$2")
    rm -rf /tmp/src "$hold" && mkdir -p /tmp/src "$hold" && cp -a . /tmp/src/ && cp "$job" "$hold/job.sh"
    cd /tmp/src
    if [ -n "${PREBUILT:-}" ]; then   # (the build phase stamped done: gpu_run.sh goes on to the wheels and models)
        rm -rf /tmp/pydflash-gpu/pyd && mkdir -p /tmp/pydflash-gpu/pyd && tar xzf "$PREBUILT" -C /tmp/pydflash-gpu/pyd
        touch /tmp/pydflash-gpu/build.done
        export SKIP="${SKIP:-} llama_bench"
    fi
    STATE=/tmp/pydflash-gpu setsid nohup bash -c "ONLY=none tools/gpu_run.sh .whl .device/ggml-src .device/llama \
        .device/pylibs 1750" > "$hold/gpu_run.log" 2>&1 < /dev/null &
    setsid nohup bash "$0" run > "$hold/job.log" 2>&1 < /dev/null &
    echo "started: build, models and $2"
    ;;
run)   # (the background part of start)
    export state=/tmp/pydflash-gpu
    export src=/tmp/src data=$state/data llama_bench=/tmp/src/build/cp312-cp312-linux_x86_64/bin/llama-bench
    export PYTHONPATH=$state/pyd:$state/site:$src/.device/pylibs LD_LIBRARY_PATH=$state/pyd/pydflash/lib
    # (a PREBUILT package's libraries find cuBLAS in the machine's toolkit, not where they were linked)
    LD_LIBRARY_PATH+=:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
    export PYTHONUNBUFFERED=1
    # (chat's and the server's tests have no CUDA case and import clients the GPU image lacks: pexpect, openai,
    # anthropic; ignored, so that a whole tests/ directory collects)
    pytest_cuda() { python3 -m pytest -q -p no:cacheprovider --rootdir "$src" -c "$src/pyproject.toml" -m cuda \
        --ignore="$src/tests/test_chat.py" --ignore="$src/tests/test_server_api.py" \
        --ignore="$src/tests/test_server_demo.py" --ignore="$src/tests/test_server_tools.py" "$@"; }
    wait_models() { while [ ! -e "$state/models.done" ] || { [[ " ${SKIP:-} " != *" llama_bench "* ]] &&
                                                                [ ! -e "$state/llama_bench.done" ]; }; do sleep 5; done; }
    export -f pytest_cuda wait_models
    while [ ! -e "$state/build.done" ] || [ ! -e "$state/wheels.done" ]; do   # (PREBUILT: build.done comes first)
        grep -q "rc=[1-9]" "$hold/gpu_run.log" 2>/dev/null && { echo "the build failed:"; tail -30 "$hold/gpu_run.log"; exit 1; }
        sleep 5
    done
    echo "build done $(date)"
    cd /tmp && bash "$hold/job.sh"
    echo "JOB DONE rc=$? $(date)"
    ;;
wait)
    # (a machine given back between calls comes back bare: say so at once instead of waiting for a log)
    [ -d "$hold" ] || { echo "no hold on this machine ($hold is missing): it was given back; start a new one" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^JOB DONE\|the build failed" "$hold/job.log" 2>/dev/null; do sleep 5; done
    tail -3 "$hold/gpu_run.log"; cat "$hold/job.log"
    ;;
*)
    echo "usage: tools/gpu_hold.sh start JOB | wait [SECONDS]" >&2; exit 2 ;;
esac
