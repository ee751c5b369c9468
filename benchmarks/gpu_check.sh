#!/usr/bin/env bash
# benchmarks/gpu_check.sh PHASE -- the GPU runs behind benchmarks/BENCHMARKS.md, as run on the H200 device (vLLM installed in /tmp/vsite).
#   a: [GPU0] vLLM engine tests, short 1-GPU demo, stale-sync check  ||  [GPU1] 3B-shaped phase benchmark
#   c: [GPU0] the full 1-GPU demo with vLLM, the engine tests (TESTS_TIMEOUT)  ||  [GPU1] the 3B benchmark (BENCH_STEPS)
#   b: 2 GPUs under torchrun: demo at TP 1 (two data-parallel engines) and at TP 2; the trainer's GPU tests (TESTS_TIMEOUT)
#   s1, s2, s3: session 3's calls (see each below)
#   p: the trainer alone on the 3B bench (no engine, no vLLM needed): phase seconds + the last step's kernel table
#   q: Qwen3: [GPU0] the Qwen3-VL demo with vLLM, then tests/test_qwen3_gpu.py (engine checks, deepstack-only sync,
#      both Qwen3 demos' log-prob agreement)
#   v: videos (tiny Qwen2.5-VL and Qwen3-VL, one GPU): the video demo with vLLM (VIDEO_STEPS steps), then
#      tests/test_video_gpu.py (vLLM's video expansion, log-probs against HF, the frame rate on the time axis,
#      transformers' own video processor against video.py, the Qwen3-VL video demo's engine/trainer agreement)
#   x: the text demo (tiny Qwen3, largest digit, held-out validation) with vLLM on one GPU, as far as DEMO1_TIMEOUT
#      (220 s) takes it; expected ~4 min in all (build, engine start, steps); its engine tests run in phase q
#   q8: 2 GPUs under torchrun: the Qwen3-VL-8B-shaped benchmark (8.77B parameters: fp32 weights, gradients and AdamW
#      state are 140 GB, more than one H200 holds; FSDP over 2 GPUs halves it)
#   t: the trainer alone on the 3B bench, 16 prompts x 8 x 1024 (no vLLM needed; ~7 min on nvidia-h200-x2): [GPU0]
#      --torch-compile on (32k-token micro-batches, profiled), then on with 64k  ||  [GPU1] off with 64k (profiled),
#      then on without gradient checkpointing (16k)
#   f: session 4's final call: [GPU0] the 3B forced benchmark alone on its GPU (the issue-11 bar)  ||  [GPU1] the
#      phases named in F_GPU1 (e.g. "v q"), cut at F_GPU1_TIMEOUT (270 s) so that they end before the benchmark's
#      timed steps 2 and 3 (its engine start, step 1 and the compilation take ~5 min)
#   l: [GPU0] the tests' launch fixture on the GPU box (~3 min): a grpo.py run with vLLM (test_grpo_gpu) and an engine
#      check run as its own script (test_qwen3_gpu: the repo root reaches it through the fixture's PYTHONPATH)
#   m: memory modes (2 GPUs, ~9 min; PARTS=x2 or PARTS=lora for one half): [both] Qwen2.5-VL-7B full AMP under
#      torchrun x2; then, in parallel, 7B LoRA on one GPU capped to 40 GB (pure bf16) [GPU0] and to 80 GB (AMP) [GPU1]
#   m3: 3B: AMP, pure bf16, --offload-params, --offload-optimizer (M3_RUNS picks; 2 GPUs: two at a time, ~6 min)
#   mt: (~5 min) tests/test_memory_gpu.py
#   d3: session 5, one GPU: three demos with vLLM side by side (video on Qwen2.5-VL, text on Qwen3, LoRA on the colour
#      demo), each engine with a fixed KV cache (--kv-cache-memory-gb: vLLM's start-up memory profile assumes no other
#      process allocates or frees meanwhile, and the others' engines sleep and wake every step), cut at D3_TIMEOUT
#   b8: the Qwen3-VL-8B-shaped benchmark on ONE H200 in pure bf16 (--precision bf16: 10 bytes per parameter with
#      Kahan's buffer, 88 GB; AMP's 16 do not fit beside the engine), 16 prompts x 8 x 1024, 2 steps (~7 min)
#   fin: session 5's last call: the Qwen2.5-VL video engine check alone (the M-RoPE positions), then the 7B LoRA cell
#      capped to 40 GB in pure bf16 (the m phase's GPU0 run, with LORA_CAP / LORA_ARGS to pick another)
#   l7: where the 7B LoRA run's 0.44 engine/trainer log-prob gap comes from (session 5): one step each of the 7B in
#      pure bf16 without LoRA, with LoRA, and with LoRA in 8192-token micro-batches (no cap, no compile; ~8 min)
#   pk: the tiny model's log-probs when vLLM preempts requests (a KV cache too small for the batch), in three engine
#      settings; then the 7B LoRA cell LORA_NAME (phase lora7: fin's second half) if LORA_NAME is set
#   lora7: the 7B LoRA cell alone (LORA_CAP, LORA_ARGS, LORA_NAME; session 6: LORA_CAP=40 LORA_ARGS="--precision bf16
#      --max-token-len-per-device 8192 --kv-cache-memory-gb 1.5" fits, as does LORA_CAP=80 LORA_ARGS=" ")
#   tv: tests/test_video_gpu.py, then tests/test_memory_gpu.py (each engine alone on the GPU: they profile memory)
# Results go to $OUT (logs and metrics.jsonl files).
set -u
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
DEMO="--rollout-engine vllm --enforce-eager --gpu-memory-utilization ${GPU_MEM:-0.25}"
python -c "import tiny_model, data; tiny_model.build_tiny_model(); tiny_model.build_tiny_model(arch='qwen3_vl'); tiny_model.demo_data()" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-a}" in
a)  # first lease: engine tests, a short 1-GPU demo, the stale-sync check, the 3B benchmark (in parallel on GPU1)
  (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-530} python bench.py --preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} \
     > "$OUT/bench3b.log" 2>&1; cp ~/.cache/vlm_rl/bench-qwen2_5_vl_3b/run/metrics.jsonl "$OUT/bench3b_metrics.jsonl") &
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout 200 python -m pytest -m gpu -q -s -x tests/test_vllm_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout 240 python grpo.py $DEMO --output-dir /tmp/demo1 ${DEMO1_ARGS:-} > "$OUT/demo1.log" 2>&1
  cp /tmp/demo1/metrics.jsonl "$OUT/demo1_metrics.jsonl"; tail -2 "$OUT/demo1.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout 100 python grpo.py $DEMO --debug-skip-sync --max-steps ${STALE_STEPS:-20} --val-freq 0 \
     --output-dir /tmp/stale > "$OUT/stale.log" 2>&1
  cp /tmp/stale/metrics.jsonl "$OUT/stale_metrics.jsonl"; tail -2 "$OUT/stale.log"
  wait; tail -2 "$OUT/bench3b.log" ;;
c)  # [GPU0] the full 1-GPU demo with vLLM, then the engine tests  ||  [GPU1] the 3B benchmark (when BENCH_STEPS is set)
  if [ -n "${BENCH_STEPS:-}" ]; then
    (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-330} python bench.py --preset qwen2_5_vl_3b --max-steps $BENCH_STEPS \
       --output-dir /tmp/bench3b ${BENCH_ARGS:-} > "$OUT/bench3b.log" 2>&1; cp /tmp/bench3b/metrics.jsonl "$OUT/bench3b_metrics.jsonl") &
  fi
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${DEMO1_TIMEOUT:-300} python grpo.py $DEMO --output-dir /tmp/gpu1 ${DEMO1_ARGS:-} \
    > "$OUT/gpu1.log" 2>&1; cp /tmp/gpu1/metrics.jsonl "$OUT/gpu1_metrics.jsonl"; tail -c 300 "$OUT/gpu1.log"
  if [ -n "${TESTS_TIMEOUT:-}" ]; then
    CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout $TESTS_TIMEOUT python -m pytest -m gpu -q -s tests/test_vllm_gpu.py > "$OUT/gpu_tests.log" 2>&1
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
    CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout $TESTS_TIMEOUT python -m pytest -m gpu -q -s tests/test_grpo_gpu.py > "$OUT/grpo_gpu_tests.log" 2>&1
    tail -3 "$OUT/grpo_gpu_tests.log"
  fi ;;
p)  # the trainer alone (random responses instead of generation): where the 3B update's time goes
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-400} python bench.py --preset qwen2_5_vl_3b --trainer-only --profile \
    --max-steps ${BENCH_STEPS:-2} --output-dir /tmp/prof3b ${BENCH_ARGS:-} > "$OUT/prof3b.log" 2>&1
  cp /tmp/prof3b/metrics.jsonl "$OUT/prof3b_metrics.jsonl"; cp /tmp/prof3b/profile.txt "$OUT/prof3b_profile.txt"
  tail -2 "$OUT/prof3b.log" ;;
s1)  # session 3, call 1: [GPU1] the 3B forced benchmark (padding-free, varlen vision)  ||  [GPU0] every GPU test, then
    # the LoRA demo with vLLM
  (CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-520} python bench.py --preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} \
     --output-dir /tmp/b3f > "$OUT/bench3b_forced.log" 2>&1; cp /tmp/b3f/metrics.jsonl "$OUT/bench3b_forced.jsonl") &
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TESTS_TIMEOUT:-330} python -m pytest -m gpu -q -rs tests > "$OUT/gpu_tests.log" 2>&1
  tail -4 "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${DEMO_TIMEOUT:-170} python grpo.py $DEMO --lora-rank 16 --lora-modules-to-save lm_head \
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
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${DEMO_TIMEOUT:-450} python grpo.py $DEMO --demo-model qwen3_vl --output-dir /tmp/q3vl \
    ${DEMO_ARGS:-} > "$OUT/q3vl_demo.log" 2>&1; cp /tmp/q3vl/metrics.jsonl "$OUT/q3vl_demo.jsonl"
  tail -c 400 "$OUT/q3vl_demo.log"; wait; tail -c 600 "$OUT/bench8b.log" ;;
q)  # Qwen3-VL and Qwen3 (tiny) on one GPU
  python -c "import tiny_model, data; [tiny_model.build_tiny_model(arch=a) for a in ('qwen3_vl', 'qwen3')]; tiny_model.demo_max_data()"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${DEMO1_TIMEOUT:-300} python grpo.py $DEMO --demo-model qwen3_vl --output-dir /tmp/q3vl \
    ${DEMO1_ARGS:-} > "$OUT/q3vl.log" 2>&1; cp /tmp/q3vl/metrics.jsonl "$OUT/q3vl_metrics.jsonl"; tail -c 300 "$OUT/q3vl.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TESTS_TIMEOUT:-500} python -m pytest -m gpu -q -s tests/test_qwen3_gpu.py \
    > "$OUT/q3_gpu_tests.log" 2>&1; tail -3 "$OUT/q3_gpu_tests.log" ;;
v)  # videos on one GPU; expected ~4.5 min: engine start-up ~50 s + 30 steps (~1.5 min), the tests ~3 min (three vLLM
    # start-ups: one engine per process)
  python -c "import tiny_model, video; [tiny_model.build_tiny_model(arch=a) for a in ('qwen2_5_vl', 'qwen3_vl')]; video.demo_video_data()"
  CUDA_VISIBLE_DEVICES=0 timeout ${DEMO1_TIMEOUT:-200} python grpo.py $DEMO --demo-task video --max-steps ${VIDEO_STEPS:-30} \
    --output-dir /tmp/vdemo ${DEMO1_ARGS:-} > "$OUT/video_demo.log" 2>&1; cp /tmp/vdemo/metrics.jsonl "$OUT/video_demo_metrics.jsonl"
  tail -c 300 "$OUT/video_demo.log"
  CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_TIMEOUT:-330} python -m pytest -m gpu -q -s tests/test_video_gpu.py \
    > "$OUT/video_gpu_tests.log" 2>&1; tail -3 "$OUT/video_gpu_tests.log" ;;
x)  # the text demo with vLLM: the metrics of every step it reaches (the CPU run: val 0.875 at step 100, 1.0 at 110)
  python -c "import tiny_model; tiny_model.build_tiny_model(arch='qwen3'); tiny_model.demo_max_data()"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${DEMO1_TIMEOUT:-220} python grpo.py $DEMO --demo-model qwen3 \
    --output-dir /tmp/q3txt ${DEMO1_ARGS:-} > "$OUT/q3txt.log" 2>&1; cp /tmp/q3txt/metrics.jsonl "$OUT/q3txt_metrics.jsonl"
  tail -c 300 "$OUT/q3txt.log"; python bench.py report "$OUT/q3txt_metrics.jsonl" | head -3 ;;
q8)  # the Qwen3-VL-8B-shaped benchmark on 2 GPUs (one engine per GPU)
  timeout ${BENCH_TIMEOUT:-530} torchrun --standalone --nproc_per_node 2 bench.py --preset qwen3_vl_8b \
    --max-steps ${BENCH_STEPS:-3} --gpu-memory-utilization 0.3 --output-dir /tmp/bench8b ${BENCH_ARGS:-} > "$OUT/bench8b.log" 2>&1
  cp /tmp/bench8b/metrics.jsonl "$OUT/bench8b_metrics.jsonl"; tail -2 "$OUT/bench8b.log" ;;
f)
  (CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-560} python bench.py --preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} \
     --output-dir /tmp/b3f > "$OUT/bench3b_forced.log" 2>&1; cp /tmp/b3f/metrics.jsonl "$OUT/bench3b_forced_metrics.jsonl"
   cp /tmp/b3f/bench_summary.json "$OUT/bench3b_forced_summary.json") &
  for ph in ${F_GPU1:-}; do
    CUDA_VISIBLE_DEVICES=1 GPU_SLOT=1 timeout ${F_GPU1_TIMEOUT:-270} bash benchmarks/gpu_check.sh $ph > "$OUT/phase_$ph.log" 2>&1
    echo "phase $ph: $(tail -c 300 "$OUT/phase_$ph.log")"
  done
  wait; grep -o 'BENCH_RESULT.*' "$OUT/bench3b_forced.log" | head -c 1500; tail -c 400 "$OUT/bench3b_forced.log" ;;
t)  # speed probe of the trainer (issue 11): fused elementwise kernels on/off, each run's last step profiled
  timeout 200 python bench.py --preset qwen2_5_vl_3b --prepare-only > "$OUT/t_prepare.log" 2>&1; tail -1 "$OUT/t_prepare.log"
  tprobe() {  # tprobe NAME GPU ARGS...
    local name=$1 gpu=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout ${T_TIMEOUT:-200} python bench.py --preset qwen2_5_vl_3b --trainer-only --max-steps 3 \
      --rollout-batch-size 16 --global-batch-size 16 --output-dir /tmp/$name "$@" > "$OUT/$name.log" 2>&1
    cp /tmp/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl"; cp /tmp/$name/profile.txt "$OUT/${name}_profile.txt" 2>/dev/null
    echo "$name: $(grep -o 'BENCH_RESULT.*' "$OUT/$name.log" | head -c 600)"
  }
  (tprobe t_off_64k 1 --profile --torch-compile off --max-token-len-per-device 65536
   tprobe t_on_64k_nockpt 1 --torch-compile on --max-token-len-per-device 16384 --no-gradient-checkpointing) &
  tprobe t_on_32k 0 --profile --torch-compile on
  tprobe t_on_64k 0 --torch-compile on --max-token-len-per-device 65536
  wait ;;
l)  # tests/conftest.py's launch fixture with vLLM: one test of each GPU file whose subprocess it now starts
  python -c "import tiny_model; tiny_model.build_tiny_model(arch='qwen3')"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TESTS_TIMEOUT:-270} python -m pytest -m gpu -q -s \
    tests/test_grpo_gpu.py::test_a_skipped_sync_is_caught tests/test_qwen3_gpu.py::test_vllm_text_qwen3_engine_and_sync \
    > "$OUT/launch_gpu_tests.log" 2>&1; tail -3 "$OUT/launch_gpu_tests.log" ;;
m)  # memory modes, the README's hardware table: 8 prompts x 8 samples x 1024 forced tokens per step, 2 steps (the
    # first pays the warm-up; bench keeps the second). PARTS="x2 lora" (default) runs both parts in one call: ~1 min
    # to build the random 7B, ~4 min for x2, ~4 min for the LoRA pair; near the device's 10-minute limit, give each
    # part its own call (PARTS=x2, then PARTS=lora: the 7B is rebuilt on a fresh machine).
  python bench.py --preset qwen2_5_vl_7b --prepare-only > "$OUT/prep7b.log" 2>&1; tail -1 "$OUT/prep7b.log"
  M7="--preset qwen2_5_vl_7b --max-steps ${BENCH_STEPS:-2} --rollout-batch-size 8 --global-batch-size 8"
  if [[ " ${PARTS:-x2 lora} " == *" x2 "* ]]; then  # [both GPUs] full AMP, FSDP over 2, one engine per GPU
    # (the 7B LoRA runs of session 6: engine start ~60 s, step 1 ~130 s with the compilation, step 2 ~20-30 s)
    timeout ${BENCH_TIMEOUT:-420} torchrun --standalone --nproc_per_node 2 bench.py $M7 --gpu-memory-utilization 0.3 \
      --output-dir /tmp/m7amp ${BENCH_ARGS:-} > "$OUT/m7b_amp_x2.log" 2>&1
    cp /tmp/m7amp/metrics.jsonl "$OUT/m7b_amp_x2_metrics.jsonl"; cp /tmp/m7amp/bench_summary.json "$OUT/m7b_amp_x2_summary.json"
    tail -c 400 "$OUT/m7b_amp_x2.log"
  fi
  if [[ " ${PARTS:-x2 lora} " == *" lora "* ]]; then  # [GPU0] LoRA, pure bf16, 40 GB  ||  [GPU1] LoRA, AMP, 80 GB
    (CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-270} python bench.py $M7 --lora-rank 64 --precision bf16 \
       --gpu-memory-cap-gb 40 --max-token-len-per-device 8192 --output-dir /tmp/m7lora40 > "$OUT/m7b_lora_bf16_cap40.log" 2>&1
     cp /tmp/m7lora40/metrics.jsonl "$OUT/m7b_lora_bf16_cap40_metrics.jsonl"; cp /tmp/m7lora40/bench_summary.json "$OUT/m7b_lora_bf16_cap40_summary.json") &
    CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-270} python bench.py $M7 --lora-rank 64 --gpu-memory-cap-gb 80 \
      --output-dir /tmp/m7lora80 > "$OUT/m7b_lora_amp_cap80.log" 2>&1
    cp /tmp/m7lora80/metrics.jsonl "$OUT/m7b_lora_amp_cap80_metrics.jsonl"; cp /tmp/m7lora80/bench_summary.json "$OUT/m7b_lora_amp_cap80_summary.json"
    wait; tail -c 400 "$OUT"/m7b_lora_*.log
  fi
  python bench.py table "$OUT"/m7b_*_summary.json > "$OUT/memory_table.md" 2>&1; tail -8 "$OUT/memory_table.md" ;;
m3)  # 3B, 16 prompts x 8 samples x 1024 forced tokens, 3 steps each, for M3_RUNS (default: all four): amp, bf16
    # (--precision bf16), offload (--offload-params), offopt (--offload-optimizer), lora (--lora-rank 64). Two GPUs: the first half of the
    # list on GPU0, the rest on GPU1 at the same time (~6 min); one GPU: one after another (~3 min each: split the
    # list over calls, e.g. M3_RUNS="amp bf16" then M3_RUNS="offload offopt").
  M3="--preset qwen2_5_vl_3b --max-steps ${BENCH_STEPS:-3} --rollout-batch-size 16 --global-batch-size 16"
  python bench.py --preset qwen2_5_vl_3b --prepare-only > "$OUT/prep3b.log" 2>&1
  declare -A FLAGS=([amp]="" [bf16]="--precision bf16" [offload]="--offload-params" [offopt]="--offload-optimizer" [lora]="--lora-rank 64")
  m3run() {  # m3run GPU NAME...
    local gpu=$1; shift
    for name in "$@"; do
      CUDA_VISIBLE_DEVICES=$gpu timeout ${BENCH_TIMEOUT:-170} python bench.py $M3 ${FLAGS[$name]} --output-dir /tmp/m3$name \
        > "$OUT/m3b_$name.log" 2>&1
      cp /tmp/m3$name/metrics.jsonl "$OUT/m3b_${name}_metrics.jsonl"; cp /tmp/m3$name/bench_summary.json "$OUT/m3b_${name}_summary.json"
    done
  }
  runs=(${M3_RUNS:-amp bf16 offload offopt})
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    half=$(( (${#runs[@]} + 1) / 2 ))
    m3run 1 "${runs[@]:$half}" & m3run 0 "${runs[@]:0:$half}"; wait
  else
    m3run ${GPU_SLOT:-0} "${runs[@]}"
  fi
  tail -c 300 "$OUT"/m3b_*.log
  python bench.py table "$OUT"/m3b_*_summary.json > "$OUT/memory_table_3b.md" 2>&1; tail -6 "$OUT/memory_table_3b.md" ;;
mt)  # tests/test_memory_gpu.py on one GPU (the memory keys, pure bf16 and both offloads with the engine): ~5 min
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TESTS_TIMEOUT:-420} python -m pytest -m gpu -q -rs tests/test_memory_gpu.py \
    > "$OUT/memory_gpu_tests.log" 2>&1; tail -3 "$OUT/memory_gpu_tests.log" ;;
d3)  # three demos at once on one GPU (their metrics only: nothing here is timed)
  python -c "import tiny_model, video; [tiny_model.build_tiny_model(arch=a) for a in ('qwen2_5_vl', 'qwen3')]; video.demo_video_data(); tiny_model.demo_max_data(); tiny_model.demo_data()"
  SHARE="--rollout-engine vllm --enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-gb 2"
  for run in "video:--demo-task video" "text:--demo-model qwen3" "lora:--lora-rank 16 --lora-modules-to-save lm_head"; do
    name=${run%%:*}
    (CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} OMP_NUM_THREADS=4 timeout ${D3_TIMEOUT:-480} python grpo.py $SHARE ${run#*:} \
       --output-dir /tmp/d3$name > "$OUT/d3_$name.log" 2>&1; cp /tmp/d3$name/metrics.jsonl "$OUT/d3_${name}_metrics.jsonl"
     echo "$name: $(python bench.py report "$OUT/d3_${name}_metrics.jsonl" | sed -n 3p)") &
    sleep 5  # (start-ups a little apart: the model files are read once each)
  done
  wait ;;
b8)  # Qwen3-VL-8B shape, one GPU, pure bf16
  timeout 200 python bench.py --preset qwen3_vl_8b --prepare-only > "$OUT/prep8b.log" 2>&1; tail -1 "$OUT/prep8b.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-480} python bench.py --preset qwen3_vl_8b --precision bf16 \
    --max-steps ${BENCH_STEPS:-2} --rollout-batch-size 16 --global-batch-size 16 --gpu-memory-utilization 0.3 \
    --output-dir /tmp/b8 ${BENCH_ARGS:-} > "$OUT/bench8b_bf16_1gpu.log" 2>&1
  cp /tmp/b8/metrics.jsonl "$OUT/bench8b_bf16_1gpu_metrics.jsonl"; cp /tmp/b8/bench_summary.json "$OUT/bench8b_bf16_1gpu_summary.json"
  grep -o 'BENCH_RESULT.*' "$OUT/bench8b_bf16_1gpu.log" | head -c 1500; tail -c 600 "$OUT/bench8b_bf16_1gpu.log" ;;
fin)
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout 150 python tests/test_video_gpu.py qwen2_5_vl > "$OUT/video_q25_check.log" 2>&1
  grep "^\[qwen\|VIDEO_GPU_OK\|Error" "$OUT/video_q25_check.log" | cut -c1-400
  bash benchmarks/gpu_check.sh lora7 ;;
l7)
  timeout 150 python bench.py --preset qwen2_5_vl_7b --prepare-only > "$OUT/prep7b.log" 2>&1
  for run in "full:" "lora:--lora-rank 64" "lora8k:--lora-rank 64 --max-token-len-per-device 8192"; do name=${run%%:*}
    CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-170} python bench.py --preset qwen2_5_vl_7b --max-steps 1 \
      --rollout-batch-size 8 --global-batch-size 8 --precision bf16 --torch-compile off --gpu-memory-utilization 0.3 \
      ${run#*:} --output-dir /tmp/l7$name > "$OUT/l7_$name.log" 2>&1; cp /tmp/l7$name/metrics.jsonl "$OUT/l7_${name}_metrics.jsonl"
    echo "$name: $(grep -o 'lpdiff=[0-9.e+-]*' "$OUT/l7_$name.log" | tail -1)"
  done ;;
pk)  # session 6: is the 7B LoRA run's 0.44 gap vLLM preempting requests (its 2.6 GB KV cache held half the batch)?
    # The tiny model with a 1,536-token KV cache, three engines side by side (fixed caches: no memory profile):
    # default, async scheduling off, the older model runner; then the cell named by LORA_CAP/LORA_ARGS/LORA_NAME alone
  python -c "import tiny_model; tiny_model.build_tiny_model()"
  for mode in default sync v1; do
    (CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout 200 python tests/test_vllm_gpu.py --preempt $mode > "$OUT/preempt_$mode.log" 2>&1
     echo "$mode: $(grep '^\[vllm\|PREEMPT_OK\|Error' "$OUT/preempt_$mode.log" | cut -c1-300)") &
    sleep 3
  done
  wait
  [ -n "${LORA_NAME:-}" ] && bash benchmarks/gpu_check.sh lora7 ;;
lora7)  # the 7B LoRA cell alone on the GPU (see fin)
  timeout 150 python bench.py --preset qwen2_5_vl_7b --prepare-only > "$OUT/prep7b.log" 2>&1; tail -c 200 "$OUT/prep7b.log"
  name=m7b_lora_${LORA_NAME:-bf16_cap40}
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${BENCH_TIMEOUT:-330} python bench.py --preset qwen2_5_vl_7b --max-steps 2 \
    --rollout-batch-size 8 --global-batch-size 8 --lora-rank 64 --gpu-memory-cap-gb ${LORA_CAP:-40} \
    ${LORA_ARGS:---precision bf16 --max-token-len-per-device 8192} --output-dir /tmp/$name > "$OUT/$name.log" 2>&1
  cp /tmp/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl"; cp /tmp/$name/bench_summary.json "$OUT/${name}_summary.json"
  grep -o 'BENCH_RESULT.*' "$OUT/$name.log" | head -c 1200; grep -o 'step .*lpdiff=[0-9.e+-]*' "$OUT/$name.log" | cut -c1-200
  tail -c 300 "$OUT/$name.log" ;;
tv)  # the video engine tests, then the memory-mode tests, one engine at a time
  python -c "import tiny_model; [tiny_model.build_tiny_model(arch=a) for a in ('qwen2_5_vl', 'qwen3_vl')]"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TV_TIMEOUT:-240} python -m pytest -m gpu -q -s tests/test_video_gpu.py \
    > "$OUT/video_gpu_tests.log" 2>&1; tail -3 "$OUT/video_gpu_tests.log"
  CUDA_VISIBLE_DEVICES=${GPU_SLOT:-0} timeout ${TM_TIMEOUT:-320} python -m pytest -m gpu -q -rs tests/test_memory_gpu.py \
    > "$OUT/memory_gpu_tests.log" 2>&1; tail -3 "$OUT/memory_gpu_tests.log" ;;
esac
