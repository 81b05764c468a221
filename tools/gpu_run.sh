#!/usr/bin/env bash
# A GPU session's work in phases that survive the 10-minute limit of one device call: build pydflash with CUDA
# and llama-bench (and the `pydflash bench` peers) on the same ggml, run the CUDA tests, run the benchmarks of
# docs/benchmarks.md. A finished phase leaves a stamp under $STATE, so running the same command again (on the
# same, still warm machine) goes on where the last call stopped; a phase that would not fit in the time left
# waits for the next call (tools/gpu_phases.sh).
#
# (For a session's own measurements on one warm machine, tools/gpu_hold.sh runs the build and models of this script
# in the background and a job of yours after them.)
#
# Usage: first, here, `python tools/prepare_gpu_carry.py` (makes .device/ and .whl/); then, in the repo root on
# the GPU machine, with .device and .whl carried:
#   tools/gpu_run.sh .whl .device/ggml-src .device/llama .device/pylibs [SECONDS]
# in general:
#   tools/gpu_run.sh WHEELS GGML_SRC LLAMA_SRC PYLIBS [SECONDS]
#     WHEELS    wheels the machine lacks (cffi, pycparser, gguf, diskcache, dflash)
#     GGML_SRC  the pristine pinned ggml tree (the 76 MB archive cannot travel)
#     LLAMA_SRC the pinned llama.cpp tree for llama-bench (tools/build_llama_bench.sh says which parts)
#     PYLIBS    folder holding llama_cpp (the oracle of the target tests)
#     SECONDS   time this call may use (default 560)
# Phases to skip: SKIP="bench_tq3 tests_rest" (ONLY="lc_" runs just the phases whose name starts so, besides
# wheels, build, models and llama_bench). Logs: $STATE/logs; each call leaves $OUT/summary.md and
# $OUT/logs.tgz.
set -uo pipefail
src=$(pwd)
wheels=$(realpath "$1"); ggml_src=$(realpath "$2"); llama_src=$(realpath "$3"); pylibs=$(realpath "$4")
deadline=$(( $(date +%s) + ${5:-560} ))
state=${STATE:-/tmp/pydflash-gpu}; logs=$state/logs; data=$state/data
out=${OUT:-$state/out}
mkdir -p "$logs" "$data" "$out"
build=$src/build/cp312-cp312-linux_x86_64          # pip's build folder (pyproject: build/{wheel_tag})
export PYTHONPATH=$state/pyd:$state/site:$pylibs PYDFLASH_GGML_SOURCE=$ggml_src PYDFLASH_CUDA=1 PYTHONUNBUFFERED=1
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export LD_LIBRARY_PATH=$state/pyd/pydflash/lib   # llama-bench runs on the same ggml libraries as pydflash

ALWAYS="wheels build models llama_bench"
. "$src/tools/gpu_phases.sh"     # phase, left, finish

build_pydflash() {   # from the source root: pip's build folder is relative to it
    cd "$src" && python3 -m pip install --no-build-isolation --no-deps --upgrade --target "$state/pyd" .
}

pytest_cuda() {
    python3 -m pytest -q -s -p no:cacheprovider --rootdir "$src" -c "$src/pyproject.toml" -m cuda "$@"
}

write_models() {   # the 27B-shaped target and draft, and the draft bench's 5-layer pair
    set -e
    echo $$ > "$state/models.pid"
    cd /tmp                          # not the source tree: it would shadow the installed package
    python3 -m pydflash.testing write-qwen35 "$data/q27.gguf" --preset 27b
    python3 -m pydflash.testing write-dflash "$data/d27" --target "$data/q27.gguf" --n-layer 5 --n-head 32 \
        --n-head-kv 8 --head-dim 128 --n-ff 17408
    python3 "$src/bench/draft_step.py" --prepare-only --dir "$data/dfb"
    touch "$state/models.done"
}

writer_alive() { [ -e "$state/models.pid" ] && kill -0 "$(cat "$state/models.pid")" 2>/dev/null; }

wait_models() {
    while [ ! -e "$state/models.done" ]; do
        writer_alive || { echo "the model writer stopped:"; tail -20 "$logs/models-writer.log"; return 1; }
        sleep 5
    done
}

model_of_depth() {   # path of the 27B-shaped model cut to $1 layers, written on first use
    local model=$data/q${1}l.gguf
    [ -e "$model" ] || python3 -m pydflash.testing write-qwen35 "$model" --preset 27b --n-layer "$1" >&2
    echo "$model"
}

model_arg() {   # $1: a GGUF path, or a layer count of the 27B-shaped model
    if [[ "$1" == *.gguf ]]; then echo "$1"; else model_of_depth "$1"; fi
}

profile_decode() {   # GPU kernel time per decode step, pydflash vs llama.cpp, on $1 (model_arg)
    set -e
    cd /tmp
    local model tag
    model=$(model_arg "$1"); tag=$(basename "$model" .gguf)
    export GGML_CUDA_DISABLE_GRAPHS=1                 # kernels launched one by one, so ncu sees each
    local ncu="ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none"
    $ncu python3 "$src/bench/ar_decode.py" "$model" --device cuda --n-gen 2 --reps 1 > "$logs/ncu_pydflash_$tag.csv"
    $ncu "$build/bin/llama-bench" -m "$model" -p 0 -n 2 -r 1 -fa 1 -ngl 99 > "$logs/ncu_llama_$tag.csv"
    # steps: ar_decode runs a warm-up and one rep of 2; llama-bench a 1-token warm-up and one rep of 2
    python3 "$src/tools/ncu_compare.py" "$logs/ncu_pydflash_$tag.csv" 4 "$logs/ncu_llama_$tag.csv" 3
}

# wall time per step against time inside compute, CUDA graphs on and off, pydflash and llama.cpp, on $1 (model_arg)
decode_overhead() {
    set -e
    cd /tmp
    local model
    model=$(model_arg "$1")
    python3 "$src/bench/ar_decode.py" "$model" --device cuda --n-gen 128 --reps 5 --llama-bench "$build/bin/llama-bench"
    echo "| model | device | graphs | us/step | inside compute | rest |"
    python3 "$src/bench/decode_overhead.py" "$model" --device cuda
    GGML_CUDA_DISABLE_GRAPHS=1 python3 "$src/bench/decode_overhead.py" "$model" --device cuda
    GGML_CUDA_DISABLE_GRAPHS=1 "$build/bin/llama-bench" -m "$model" -p 0 -n 128 -r 5 -fa 1 -ngl 99 -o md
}

export -f model_of_depth model_arg decode_overhead profile_decode build_pydflash pytest_cuda write_models writer_alive wait_models
export src state logs data build

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$logs/summary.md"
phase wheels 30 python3 -m pip install -q --no-index --no-deps --no-compile --target "$state/site" "$wheels"/*.whl \
    || finish 1
phase build 330 build_pydflash || finish 1
# the model writer runs in its own session, so it outlives this call while the machine stays warm
if [ ! -e "$state/models.done" ] && ! writer_alive && [[ " ${SKIP:-} " != *" models "* ]]; then
    rm -f "$state/models.pid"
    setsid bash -c write_models > "$logs/models-writer.log" 2>&1 < /dev/null &
    sleep 2
fi
phase llama_bench 200 "$src/tools/build_llama_bench.sh" "$llama_src" "$build"
phase tests_engine 120 pytest_cuda "$src/tests/test_engine.py"
phase tests_draft 120 pytest_cuda "$src/tests/test_dflash_draft.py"
phase tests_topk 60 pytest_cuda "$src/tests/test_top_k_logp.py"
phase tests_target 150 pytest_cuda "$src/tests/test_qwen35.py" "$src/tests/test_target_tq3.py"
phase models 120 wait_models
# our quantised matmul (ggml_qmatmul) vs ggml's mul_mat on the 27B weight shapes, 1..48 columns
phase bench_qmatmul 90 python3 "$src/bench/qmatmul.py" --device cuda
phase bench_ar 150 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda --n-gen 128 --reps 5 \
    --llama-bench "$build/bin/llama-bench"
# the draft's top-k alone: ggml_top_k_logp against top_k + soft_max + get_rows on [n_vocab, 15] logits
phase bench_topk 60 python3 "$src/bench/top_k_logp.py" --device cuda --reps 200
phase bench_draft 120 python3 "$src/bench/draft_step.py" --device cuda --ctx 2048 --window 2048 --top-k 8 \
    --reps 50 --dir "$data/dfb"
phase bench_ddtree 240 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --budget 22 --n-gen 64 --reps 5
# pydflash.Llama's llama-cpp-python surface against the bare engine, and the examples on the 27B-shaped pair
phase bench_compat 200 python3 "$src/bench/llama_compat_overhead.py" "$data/q27.gguf" --draft "$data/d27" \
    --device cuda --n-gen 128 --reps 3
phase examples 240 bash -c 'python3 "$src/examples/quickstart.py" "$data/q27.gguf" "$data/d27" &&
    python3 "$src/examples/bench_speedup.py" "$data/q27.gguf" "$data/d27" "" 64'
# bench_ar and bench_ddtree again with the input norms as their own kernels (PYDFLASH_NORM_IN_QMATMUL=0; the
# default computes them inside ggml_qmatmul, docs/benchmarks.md)
phase bench_ar_norm_separate 150 env PYDFLASH_NORM_IN_QMATMUL=0 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" \
    --device cuda --n-gen 128 --reps 5
phase bench_ddtree_norm_separate 240 env PYDFLASH_NORM_IN_QMATMUL=0 python3 "$src/bench/ddtree_step.py" \
    "$data/q27.gguf" --draft "$data/d27" --device cuda --budget 22 --n-gen 64 --reps 5
# bench_ddtree again with every product on the int8 kernels (PYDFLASH_QMATMUL_F16=0; by default the FFN gate/up
# takes ggml_qmatmul's f16 kernel on Hopper, docs/benchmarks.md "An f16 kernel for verify")
phase bench_ddtree_int8 240 env PYDFLASH_QMATMUL_F16=0 python3 "$src/bench/ddtree_step.py" \
    "$data/q27.gguf" --draft "$data/d27" --device cuda --budget 22 --n-gen 64 --reps 5
# oracle draft (AR's own continuation, a wrong top-1 every 8th position): realistic path lengths for commit
phase bench_oracle 200 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --device cuda --budget 22 --n-gen 128 \
    --reps 3
phase bench_f16 150 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --budget 22 --n-gen 32 --reps 5 --f16-states
# bench_ar and bench_ddtree again with the GPU weight matmuls through ggml_qmatmul (opt-in: PYDFLASH_QMATMUL=1), side by side
phase bench_ar_qmatmul 150 env PYDFLASH_QMATMUL=1 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda \
    --n-gen 128 --reps 5
phase bench_ddtree_qmatmul 240 env PYDFLASH_QMATMUL=1 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" \
    --draft "$data/d27" --device cuda --budget 22 --n-gen 64 --reps 5
# time to first token of a chat's turn 2 (2,000-token turn 1), with and without prefix reuse
phase bench_prefix 300 python3 "$src/bench/prefix_reuse.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --prompt-len 2000 --reply 64 --user 64 --reps 3
# llama.cpp's own batched forwards of 1..40 tokens, beside our verify-size table
phase bench_llama_pp 120 "$build/bin/llama-bench" -m "$data/q27.gguf" -p 1,2,4,8,16,23,32,40 -n 0 -r 5 -fa 1 \
    -ngl 99 -o md
phase bench_tq3 150 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda --n-gen 128 --reps 3 \
    --kv tq3_0 --n-depth 512 --n-ctx 1024
# what the load-time validation (issue 18) costs next to a complete load of the 27B-shaped file on the GPU
phase bench_load_validation 150 python3 "$src/bench/load_validation.py" "$data/q27.gguf" --device cuda --full \
    --repeat 3
# sampling: the sampler op, verify/AR step with it against greedy, acceptance at T=0.7/1.0 (oracle, then DFlash draft)
phase bench_sampling 200 python3 "$src/bench/sampling_step.py" "$data/q27.gguf" --device cuda --budget 22 \
    --n-gen 64 --reps 10
phase bench_sampling_draft 200 python3 "$src/bench/sampling_step.py" "$data/q27.gguf" --draft "$data/d27" \
    --device cuda --budget 22 --n-gen 64 --reps 5
# the attention-only architectures: a Qwen2.5-Coder-1.5B-shaped qwen2 (random weights, Q4_K_M, tied head; the
# real file cannot travel to this machine) against llama-bench, decode and a 512-token prefill
phase model_qwen2 200 python3 -m pydflash.testing write-llama "$data/qwen2-1.5b.gguf" --arch qwen2 --type Q4_K_M \
    --n-layer 28 --n-embd 1536 --n-ff 8960 --n-head 12 --n-head-kv 2 --n-vocab 151936 --tie-embeddings
phase bench_ar_qwen2 200 python3 "$src/bench/ar_decode.py" "$data/qwen2-1.5b.gguf" --device cuda --n-gen 128 \
    --reps 5 --n-prompt 512 --llama-bench "$build/bin/llama-bench"
phase tests_rest 300 pytest_cuda "$src/tests" --ignore="$src/tests/test_engine.py" \
    --ignore="$src/tests/test_dflash_draft.py" --ignore="$src/tests/test_qwen35.py" \
    --ignore="$src/tests/test_target_tq3.py" --ignore="$src/tests/test_chat.py" --ignore="$src/tests/test_server_api.py" \
    --ignore="$src/tests/test_server_demo.py" --ignore="$src/tests/test_server_tools.py"   # no cuda tests; clients absent
phase profile 200 profile_decode 8
phase profile64 400 profile_decode 64
phase overhead 150 decode_overhead 8
phase overhead64 200 decode_overhead 64
# long context (issue 14): the memory plan, DDTree step and AR by depth per KV type beside llama-bench -d (a real
# prefill of each depth, so its deep runs get phases of their own), prefill by prompt length, peak memory at 256K
lc_plan() {
    for vram in 24GiB 48GiB 80GiB; do
        python3 -m pydflash.cli plan --target "$data/q27.gguf" --draft "$data/d27" --vram $vram || true
        python3 -m pydflash.cli plan --target "$data/q27.gguf" --draft "$data/d27" --vram $vram --state-type f16 || true
        python3 -m pydflash.cli plan --target "$data/q27.gguf" --vram $vram --mode ar || true
    done
}
export -f lc_plan
lc="$src/bench/long_context.py"
llama_tg() { "$build/bin/llama-bench" -m "$data/q27.gguf" -p 0 -n 128 -r 1 -fa 1 -ngl 99 -o md "$@"; }
export -f llama_tg
phase lc_plan 60 lc_plan
phase lc_depth_tq3_0 500 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda --kv tq3_0 \
    --depths 2048,8192,32768,131072,262144
phase lc_depth_f16 400 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda --kv f16 \
    --depths 2048,8192,32768,131072
phase lc_depth_q8_0 400 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda --kv q8_0 \
    --depths 2048,8192,32768,131072
phase lc_memory 300 python3 "$lc" memory "$data/q27.gguf" --draft "$data/d27" --device cuda --kv tq3_0 --ctx 262144
phase lc_memory_f16 300 python3 "$lc" memory "$data/q27.gguf" --draft "$data/d27" --device cuda --kv tq3_0 \
    --ctx 262144 --f16-states
phase lc_memory_ar 300 python3 "$lc" memory "$data/q27.gguf" --device cuda --kv tq3_0 --ctx 262144
phase lc_prefill 500 python3 "$lc" prefill "$data/q27.gguf" --device cuda --lengths 2048,8192,32768 \
    --llama-bench "$build/bin/llama-bench"
phase lc_llama_f16 300 llama_tg -d 2048,8192,32768 -ctk f16 -ctv f16
phase lc_llama_q8_0 300 llama_tg -d 2048,8192,32768 -ctk q8_0 -ctv q8_0
phase lc_llama_f16_128k 500 llama_tg -d 131072 -ctk f16 -ctv f16
phase lc_llama_q8_0_128k 500 llama_tg -d 131072 -ctk q8_0 -ctv q8_0
phase bench_server 400 python3 "$src/bench/server_overhead.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --n-gen 256 --reps 3 --prompt-tokens 2000
phase tests_qmatmul 150 pytest_cuda "$src/tests/test_qmatmul.py"
# ggml_qmatmul at every forced row-tile count per (shape, N), for the kernel's choice (bench/qmatmul.py --sweep)
phase bench_qmatmul_sweep_q4k 400 python3 "$src/bench/qmatmul.py" --device cuda --sweep --shapes ffn_up,gdn_qkv,attn_q,gdn_out
phase bench_qmatmul_sweep_rest 400 python3 "$src/bench/qmatmul.py" --device cuda --sweep --shapes ffn_down,lm_head,ffn_up_q5k,ffn_up_q8_0
# a real GGUF shipped to this machine (tools/ship_file.py): REAL_MODEL=/path/q15.gguf. Where its decode time goes
if [ -n "${REAL_MODEL:-}" ]; then
    phase real_overhead 150 decode_overhead "$REAL_MODEL"
    phase real_profile 200 profile_decode "$REAL_MODEL"
fi
# bit-exact mode (PYDFLASH_BITEXACT=1; ONLY=bx_ runs just these): its CUDA tests (a failure names the first differing
# graph node), then its cost beside the default kernels, on the same machine in the same call
phase bx_tests 500 pytest_cuda "$src/tests/test_verify_bitexact.py" "$src/tests/test_flash_attn_ordered.py"
phase bx_attn 120 python3 "$src/bench/attn_ordered.py" --device cuda
phase bx_ar_default 150 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda --n-gen 128 --reps 5
phase bx_ar 150 env PYDFLASH_BITEXACT=1 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda --n-gen 128 \
    --reps 5
phase bx_ddtree_default 240 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --budget 22 --n-gen 64 --reps 5
phase bx_ddtree 240 env PYDFLASH_BITEXACT=1 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --draft "$data/d27" \
    --device cuda --budget 22 --n-gen 64 --reps 5
phase bx_ar_d8k_default 200 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda --n-gen 64 --reps 3 \
    --n-depth 8192 --n-ctx 8448
phase bx_ar_d8k 200 env PYDFLASH_BITEXACT=1 python3 "$src/bench/ar_decode.py" "$data/q27.gguf" --device cuda \
    --n-gen 64 --reps 3 --n-depth 8192 --n-ctx 8448
# long context in ~10 minutes (ONLY=lcq_): the 256K peak with the compact options, AR and DDTree step by depth
# (TQ3_0 2K/32K/128K, f16 and q8_0 at 32K) beside llama-bench -d, prefill beside llama-bench -p. Each phase is
# bounded by its own timeout (--preserve-status: a cut phase is stamped, its log kept, the others still run).
lcq() { local s=$1; shift; timeout --preserve-status "$s" bash -c '"$@"' _ "$@"; }
llama_tgq() { "$build/bin/llama-bench" -m "$data/q27.gguf" -p 0 -n 32 -r 1 -fa 1 -ngl 99 -o md "$@"; }
export -f lcq llama_tgq
phase lcq_tests 120 lcq 120 pytest_cuda "$src/tests/test_long_context_options.py"
phase lcq_memory 150 lcq 150 python3 "$lc" memory "$data/q27.gguf" --draft "$data/d27" --device cuda --kv tq3_0 \
    --ctx 262144 --draft-type q8_0 --state-type replay
phase lcq_depth_tq3_0 100 lcq 100 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda --kv tq3_0 \
    --depths 2048,32768,131072 --n-gen 32 --n-steps 8
phase lcq_depth_replay 80 lcq 80 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --kv tq3_0 --depths 2048,131072 --n-gen 8 --n-steps 16 --state-type replay
phase lcq_llama_tg_f16 200 lcq 200 llama_tgq -d 2048,32768,131072 -ctk f16 -ctv f16
phase lcq_prefill 120 lcq 120 python3 "$lc" prefill "$data/q27.gguf" --device cuda --lengths 2048,8192,32768 \
    --reps 1 --no-fixed --llama-bench "$build/bin/llama-bench"
phase lcq_depth_f16_32k 60 lcq 60 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda --kv f16 \
    --depths 32768 --n-gen 32 --n-steps 8
phase lcq_depth_q8_0_32k 60 lcq 60 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --kv q8_0 --depths 32768 --n-gen 32 --n-steps 8
phase lcq_llama_tg_q8_0 50 lcq 50 llama_tgq -d 32768 -ctk q8_0 -ctv q8_0
phase lcq_draft_quant 90 lcq 90 python3 "$src/bench/draft_quant.py" "$data/q27.gguf" --draft "$data/d27" \
    --device cuda --n-steps 32 --n-gen 32
# replayed verify states (issue 14; ONLY=replay_): the CUDA copy into strided rows (vendor/patches/0003), replay's
# commit against the f32 store, the end-to-end replay test with its xfail mark ignored; then replay's step time
# beside f32 states at 2K and 128K, same arguments
phase replay_tests 300 pytest_cuda "$src/tests/test_ggml_ops.py" "$src/tests/test_long_context_options.py" \
    -k "cpy or replay" --runxfail
phase replay_depth 120 lcq 120 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --kv tq3_0 --depths 2048,131072 --n-gen 8 --n-steps 16 --state-type replay
phase replay_depth_f32 120 lcq 120 python3 "$lc" depth "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --kv tq3_0 --depths 2048,131072 --n-gen 8 --n-steps 16 --state-type f32
# real GGUFs (issue 16), where this machine has them: REAL_MODELS="a.gguf b.gguf" beside llama-bench (tg128, pp512);
# the real Qwen2.5-Coder-1.5B's CUDA greedy test takes its path from PYDFLASH_REAL_QWEN2_1_5B, and compares with
# llama.cpp's own CUDA logits (llama-logits, built beside llama-bench)
real_models() { [ -n "${REAL_MODELS:-}" ] || { echo "REAL_MODELS unset: skipped"; return 0; }; python3 "$src/bench/real_models.py" $REAL_MODELS --device cuda --llama-bench "$build/bin/llama-bench"; }
export -f real_models
phase bench_real_models 500 real_models
phase tests_real_qwen2 300 env PYDFLASH_LLAMA_BIN="$build/bin" bash -c 'pytest_cuda "$@"' _ "$src/tests/test_real_models.py" -rs
# the sampler op alone (issue 13) with 8 (Hopper default), 16 and 1 (pre-Hopper kernel) blocks per row; its CUDA tests
sampling_op() { for b in 8 16 1; do PYDFLASH_SAMPLE_BLOCKS=$b python3 "$src/bench/sampling_step.py" --op-only --device cuda --reps 20 || return 1; done; }
export -f sampling_op
phase bench_sampling_op 120 sampling_op
phase tests_sampling 400 pytest_cuda "$src/tests/test_sampling.py"
phase tq3attn_tests 200 pytest_cuda "$src/tests/test_tq3.py" -k "flash_attention or cuda_attention"
phase tq3attn_bench 500 python3 "$src/bench/tq3_attention.py" --device cuda --n-q 1 23 \
    --ctx 2048 8192 32768 131072 262144
phase tq3attn_bench_scalar 300 env PYDFLASH_TQ3_FA_SCALAR=1 python3 "$src/bench/tq3_attention.py" --device cuda \
    --n-q 1 --types TQ3_0 --ctx 2048 32768 131072
# the draft's matrices in q4_k (issue 15; ONLY=draftq_): draft step and 8-position commit on the 27B draft shape
# with stored, q8_0 and q4_k matrices (q4_k's products take ggml_qmatmul at 15-16 columns), then q4_k's proposals
# against stored on the 27B-shaped pair
for t in stored q8_0 q4_k; do
    phase draftq_step_$t 120 python3 "$src/bench/draft_step.py" --device cuda --ctx 2048 --window 2048 --top-k 8 \
        --reps 50 --dir "$data/dfb" --draft-type $t
done
phase draftq_quant_q4_k 90 lcq 90 python3 "$src/bench/draft_quant.py" "$data/q27.gguf" --draft "$data/d27" \
    --device cuda --n-steps 32 --n-gen 32 --draft-type q4_k
phase draftq_ddtree_q4_k 240 python3 "$src/bench/ddtree_step.py" "$data/q27.gguf" --draft "$data/d27" --device cuda \
    --budget 22 --n-gen 64 --reps 5 --draft-type q4_k
echo "all phases done" | tee -a "$logs/summary.md"
finish 0
