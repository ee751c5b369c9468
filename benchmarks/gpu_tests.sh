#!/usr/bin/env bash
# benchmarks/gpu_tests.sh [FILE... | spmd] -- the GPU tests (`pytest -m gpu`; CPU machines skip them), one test file at
# a time so that each vLLM engine has the GPU to itself (they profile its memory); default: every tests/*_gpu.py. On
# the one-H200 device, after vLLM is installed (the top of benchmarks/gpu_env.sh, from ../shared/gpu/README.md):
#   bash benchmarks/gpu_tests.sh test_varlen_gpu.py test_vllm_gpu.py test_grpo_gpu.py
# Seconds per file there (2026-12-01; its log: git show 5056416 --stat), alone / side by side:
#   test_varlen_gpu.py        - / 32   the variable-length attention kernels at the 3B's shapes
#   test_vllm_gpu.py           - / 122  the engine: prompts, log-probs, seeds, greedy, weight sync, sleep, preemption
#   test_grpo_gpu.py         152 / -    grpo.py with vLLM: engine and trainer agree after every sync (and with LoRA); a
#                                       skipped sync is caught
#   test_video_gpu.py          - / 146  vLLM's video prompts and M-RoPE positions against the trainer's
#   test_memory_gpu.py       172 / -    the memory keys; pure bf16 and both offloads with the engine
#   test_qwen3_gpu.py          - / 201  Qwen3-VL and Qwen3: the engine, deepstack-only sync, the demos' agreement
#   test_engine_growth_gpu.py  - / 77   50 steps of fresh pictures: no encoder cache left, no growth
#   test_llama_gpu.py          - / 110  the tiny Llama with vLLM (tied embeddings)
#   test_moe_gpu.py            - / 118  the tiny Qwen3-VL-MoE with vLLM: one expert's sync, the demo's agreement
#   test_tools_gpu.py        ~260 / -   the zoom demo's multi-turn rollouts with vLLM, 70 steps (2026-12-05: 40 steps
#                                       124 s, 60 steps 227 s): the call learned, agreement on the model's tokens
# Up to ~24 min one after another (the sum above), more than one call's 10. `shared` runs files side by side instead,
# each engine with a fixed KV cache (GPU_TESTS_SHARED=1, tests/test_grpo_gpu.py engine_memory): the seven files took
# 216 s together. Two calls hold them all:
#   bash benchmarks/gpu_tests.sh shared     # every file but the two below, at once
#   bash benchmarks/gpu_tests.sh test_grpo_gpu.py test_memory_gpu.py   # alone: they read the device's free memory
#                                                                      # around sleep and wake (the memory/* keys)
# On two H200s (`nvidia-h200-x2`), `spmd` (~3 min): tests/test_vllm_gpu.py under torchrun, one engine per rank at
# tensor parallel 1, then one engine over both at tensor parallel 2.
# Results in $OUT: one log per file, and summary.txt with each one's last line.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
declare -A LIMITS=([test_varlen_gpu.py]=150 [test_vllm_gpu.py]=200 [test_grpo_gpu.py]=200 [test_video_gpu.py]=300
                   [test_memory_gpu.py]=420 [test_qwen3_gpu.py]=540 [test_engine_growth_gpu.py]=240
                   [test_llama_gpu.py]=200 [test_moe_gpu.py]=240 [test_tools_gpu.py]=360)
python -c "import tiny_model; [tiny_model.build_tiny_model(arch=a) for a in tiny_model.ARCHS]" \
  > "$OUT/build_tiny_models.log" 2>&1  # once, before the tests' subprocesses would each wait for it
if [ "${1:-}" = spmd ]; then
  for tp in 1 2; do
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "${LIMIT:-200}" torchrun --standalone --nproc_per_node 2 tests/test_vllm_gpu.py \
      --tp $tp > "$OUT/vllm_spmd_tp$tp.log" 2>&1
    echo "torchrun x2 tests/test_vllm_gpu.py --tp $tp: exit $?: $(tail -1 "$OUT/vllm_spmd_tp$tp.log")" \
      | tee -a "$OUT/summary.txt"
  done
  exit
fi
if [ "${1:-}" = shared ]; then
  shift
  files=("$@")
  [ ${#files[@]} -gt 0 ] || files=(test_varlen_gpu.py test_vllm_gpu.py test_video_gpu.py test_qwen3_gpu.py
                                   test_engine_growth_gpu.py test_llama_gpu.py test_moe_gpu.py)
  t0=$(date +%s)
  for f in "${files[@]}"; do
    f=$(basename "$f")
    ( s=$(date +%s); GPU_TESTS_SHARED=1 CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${LIMIT:-540}" python -m pytest -m gpu -q -rs \
        "tests/$f" > "$OUT/${f%.py}.log" 2>&1
      echo "$f: exit $? after $(( $(date +%s) - s )) s (side by side): $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/${f%.py}.log" | tail -1)" \
        >> "$OUT/summary.txt" ) &
    sleep 5  # engine start-ups a little apart
  done
  wait
  echo "all side by side: $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  cat "$OUT/summary.txt"
  exit
fi
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(test_varlen_gpu.py test_vllm_gpu.py test_grpo_gpu.py test_video_gpu.py
                                 test_memory_gpu.py test_qwen3_gpu.py test_engine_growth_gpu.py test_llama_gpu.py
                                 test_moe_gpu.py test_tools_gpu.py)
for f in "${files[@]}"; do
  f=$(basename "$f")
  s=$(date +%s)
  CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${LIMIT:-${LIMITS[$f]:-300}}" python -m pytest -m gpu -q -rs "tests/$f" \
    > "$OUT/${f%.py}.log" 2>&1
  echo "$f: exit $? after $(( $(date +%s) - s )) s: $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/${f%.py}.log" | tail -1)" | tee -a "$OUT/summary.txt"
done
