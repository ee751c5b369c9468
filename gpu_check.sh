#!/usr/bin/env bash
# gpu_check.sh PHASE -- the GPU runs behind BENCHMARKS.md, as run on the H200 device (vLLM installed in /tmp/vsite).
#   a: [GPU0] vLLM engine tests, short 1-GPU demo, stale-sync check  ||  [GPU1] 3B-shaped phase benchmark
#   c: [GPU0] the full 1-GPU demo with vLLM, the engine tests (TESTS_TIMEOUT)  ||  [GPU1] the 3B benchmark (BENCH_STEPS)
#   b: 2 GPUs under torchrun: demo at TP 1 (two data-parallel engines) and at TP 2; the trainer's GPU tests (TESTS_TIMEOUT)
#   s1, s2, s3: session 3's calls (see each below)
#   p: the trainer alone on the 3B bench (no engine, no vLLM needed): phase seconds + the last step's kernel table
#   q: Qwen3: [GPU0] the Qwen3-VL demo with vLLM, then tests/test_qwen3_gpu.py (engine checks, deepstack-only sync,
#      both Qwen3 demos' log-prob agreement)
#   t: the text demo (tiny Qwen3, largest digit, unseen validation) with vLLM on one GPU, as far as 220 s take it
#      (expected ~4 min in all: build, engine start, steps); its engine tests run in phase q
#   q8: 2 GPUs under torchrun: the Qwen3-VL-8B-shaped benchmark (8.77B parameters: fp32 weights, gradients and AdamW
#      state are 140 GB, more than one H200 holds; FSDP over 2 GPUs halves it)
# Results go to $OUT (logs and metrics.jsonl files).
set -u
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
DEMO="--rollout-engine vllm --enforce-eager --gpu-memory-utilization ${GPU_MEM:-0.25}"
python -c "import tiny_model, data; tiny_model.build_tiny_model(); tiny_model.build_tiny_model(arch='qwen3_vl'); data.demo_data()" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-a}" in
a)  # first lease: engine tests, a short 1-GPU demo, the stale-sync check, the 3B benchmark (in parallel on GPU1)
  (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-530} python bench.py --preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} \
     > "$OUT/bench3b.log" 2>&1; cp ~/.cache/vlm_rl/bench-qwen2_5_vl_3b/run/metrics.jsonl "$OUT/bench3b_metrics.jsonl") &
  CUDA_VISIBLE_DEVICES=0 timeout 200 python -m pytest -m gpu -q -s -x tests/test_vllm_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python grpo.py $DEMO --output-dir /tmp/demo1 ${DEMO1_ARGS:-} > "$OUT/demo1.log" 2>&1
  cp /tmp/demo1/metrics.jsonl "$OUT/demo1_metrics.jsonl"; tail -2 "$OUT/demo1.log"
  CUDA_VISIBLE_DEVICES=0 timeout 100 python grpo.py $DEMO --debug-skip-sync --max-steps ${STALE_STEPS:-20} --val-freq 0 \
     --output-dir /tmp/stale > "$OUT/stale.log" 2>&1
  cp /tmp/stale/metrics.jsonl "$OUT/stale_metrics.jsonl"; tail -2 "$OUT/stale.log"
  wait; tail -2 "$OUT/bench3b.log" ;;
c)  # [GPU0] the full 1-GPU demo with vLLM, then the engine tests  ||  [GPU1] the 3B benchmark (when BENCH_STEPS is set)
  if [ -n "${BENCH_STEPS:-}" ]; then
    (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-330} python bench.py --preset qwen2_5_vl_3b --max-steps $BENCH_STEPS \
       --output-dir /tmp/bench3b ${BENCH_ARGS:-} > "$OUT/bench3b.log" 2>&1; cp /tmp/bench3b/metrics.jsonl "$OUT/bench3b_metrics.jsonl") &
  fi
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO1_TIMEOUT:-300} python grpo.py $DEMO --output-dir /tmp/gpu1 ${DEMO1_ARGS:-} \
    > "$OUT/gpu1.log" 2>&1; cp /tmp/gpu1/metrics.jsonl "$OUT/gpu1_metrics.jsonl"; tail -c 300 "$OUT/gpu1.log"
  if [ -n "${TESTS_TIMEOUT:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout $TESTS_TIMEOUT python -m pytest -m gpu -q -s tests/test_vllm_gpu.py > "$OUT/gpu_tests.log" 2>&1
    tail -3 "$OUT/gpu_tests.log"
  fi
  wait; tail -2 "$OUT/bench3b.log" 2>/dev/null ;;
b)  # 2 GPUs under torchrun: the demo at TP 1 (two data-parallel engines) and at TP 2; then the trainer's GPU tests
  for tp in ${TPS:-1 2}; do
    timeout ${DEMO2_TIMEOUT:-280} torchrun --standalone --nproc_per_node 2 grpo.py $DEMO --tensor-parallel-size $tp \
      --output-dir /tmp/tp$tp ${DEMO2_ARGS:-} > "$OUT/tp$tp.log" 2>&1; cp /tmp/tp$tp/metrics.jsonl "$OUT/tp${tp}_metrics.jsonl"
    tail -c 300 "$OUT/tp$tp.log"
  done
  if [ -n "${TESTS_TIMEOUT:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout $TESTS_TIMEOUT python -m pytest -m gpu -q -s tests/test_grpo_gpu.py > "$OUT/grpo_gpu_tests.log" 2>&1
    tail -3 "$OUT/grpo_gpu_tests.log"
  fi ;;
p)  # the trainer alone (random responses instead of generation): where the 3B update's time goes
  CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-400} python bench.py --preset qwen2_5_vl_3b --trainer-only --profile \
    --max-steps ${BENCH_STEPS:-2} --output-dir /tmp/prof3b ${BENCH_ARGS:-} > "$OUT/prof3b.log" 2>&1
  cp /tmp/prof3b/metrics.jsonl "$OUT/prof3b_metrics.jsonl"; cp /tmp/prof3b/profile.txt "$OUT/prof3b_profile.txt"
  tail -2 "$OUT/prof3b.log" ;;
s1)  # session 3, call 1: [GPU1] the 3B forced benchmark (padding-free, varlen vision)  ||  [GPU0] every GPU test, then
    # the LoRA demo with vLLM
  (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-520} python bench.py --preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} \
     --output-dir /tmp/b3f > "$OUT/bench3b_forced.log" 2>&1; cp /tmp/b3f/metrics.jsonl "$OUT/bench3b_forced.jsonl") &
  CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_TIMEOUT:-330} python -m pytest -m gpu -q -rs tests > "$OUT/gpu_tests.log" 2>&1
  tail -4 "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO_TIMEOUT:-170} python grpo.py $DEMO --lora-rank 16 --lora-modules-to-save lm_head \
    --output-dir /tmp/lora ${DEMO_ARGS:-} > "$OUT/lora_demo.log" 2>&1; cp /tmp/lora/metrics.jsonl "$OUT/lora_demo.jsonl"
  tail -c 400 "$OUT/lora_demo.log"; wait; tail -c 600 "$OUT/bench3b_forced.log" ;;
s2)  # call 2: the 3B realistic-length workload, padded [GPU0] against padding-free [GPU1]
  for pf in off on; do
    gpu=$([ $pf = off ] && echo 0 || echo 1)
    (CUDA_VISIBLE_DEVICES=$gpu timeout ${BENCH_TIMEOUT:-520} python bench.py --preset qwen2_5_vl_3b --workload realistic \
       --padding-free $pf --max-steps ${BENCH_STEPS:-3} --output-dir /tmp/b3r$pf > "$OUT/bench3b_real_pf$pf.log" 2>&1
     cp /tmp/b3r$pf/metrics.jsonl "$OUT/bench3b_real_pf$pf.jsonl") &
  done
  wait; tail -c 400 "$OUT"/bench3b_real_pf*.log ;;
s3)  # call 3: [GPU0] the Qwen3-VL demo with vLLM  ||  [GPU1] the Qwen3-VL-8B-shaped benchmark
  (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-480} python bench.py --preset qwen3_vl_8b --max-steps ${BENCH_STEPS:-3} \
     --output-dir /tmp/b8 > "$OUT/bench8b.log" 2>&1; cp /tmp/b8/metrics.jsonl "$OUT/bench8b.jsonl") &
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO_TIMEOUT:-450} python grpo.py $DEMO --demo-model qwen3_vl --output-dir /tmp/q3vl \
    ${DEMO_ARGS:-} > "$OUT/q3vl_demo.log" 2>&1; cp /tmp/q3vl/metrics.jsonl "$OUT/q3vl_demo.jsonl"
  tail -c 400 "$OUT/q3vl_demo.log"; wait; tail -c 600 "$OUT/bench8b.log" ;;
q)  # Qwen3-VL and Qwen3 (tiny) on one GPU
  python -c "import tiny_model, data; [tiny_model.build_tiny_model(arch=a) for a in ('qwen3_vl', 'qwen3')]; data.demo_max_data()"
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO1_TIMEOUT:-300} python grpo.py $DEMO --demo-model qwen3_vl --output-dir /tmp/q3vl \
    ${DEMO1_ARGS:-} > "$OUT/q3vl.log" 2>&1; cp /tmp/q3vl/metrics.jsonl "$OUT/q3vl_metrics.jsonl"; tail -c 300 "$OUT/q3vl.log"
  CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_TIMEOUT:-500} python -m pytest -m gpu -q -s tests/test_qwen3_gpu.py \
    > "$OUT/q3_gpu_tests.log" 2>&1; tail -3 "$OUT/q3_gpu_tests.log" ;;
t)  # the text demo with vLLM: metrics of every step it reaches in DEMO1_TIMEOUT (the CPU run: val 0.82 at step 100)
  python -c "import tiny_model, data; tiny_model.build_tiny_model(arch='qwen3'); data.demo_max_data()"
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO1_TIMEOUT:-220} python grpo.py $DEMO --demo-model qwen3 --output-dir /tmp/q3txt \
    ${DEMO1_ARGS:-} > "$OUT/q3txt.log" 2>&1; cp /tmp/q3txt/metrics.jsonl "$OUT/q3txt_metrics.jsonl"; tail -c 300 "$OUT/q3txt.log"
  python bench.py report "$OUT/q3txt_metrics.jsonl" | head -3 ;;
q8)  # the Qwen3-VL-8B-shaped benchmark on 2 GPUs (one engine per GPU)
  timeout ${BENCH_TIMEOUT:-530} torchrun --standalone --nproc_per_node 2 bench.py --preset qwen3_vl_8b \
    --max-steps ${BENCH_STEPS:-3} --gpu-memory-utilization 0.3 --output-dir /tmp/bench8b ${BENCH_ARGS:-} > "$OUT/bench8b.log" 2>&1
  cp /tmp/bench8b/metrics.jsonl "$OUT/bench8b_metrics.jsonl"; tail -2 "$OUT/bench8b.log" ;;
esac
