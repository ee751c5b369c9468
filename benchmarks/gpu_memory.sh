#!/usr/bin/env bash
# benchmarks/gpu_memory.sh [MODE] -- the memory cells of README "Memory modes": each run's trainer peak per phase and
# the engine's pool, next to bench.py's memory model (`python -m benchmarks.bench table`, written to
# $OUT/memory_table.md).
# Forced 1,024-token responses to 446-token prompts with one 512x512 image, 8 samples each, 2 steps (the first pays
# the compilation; the table keeps the second). On the one-H200 device, after vLLM is installed (the top of
# benchmarks/gpu_env.sh, from ../shared/gpu/README.md): `bash benchmarks/gpu_memory.sh 3b`. Modes, with their time:
#   3b          the Qwen2.5-VL-3B shape, 16 prompts per step, one run per mode of RUNS (default "amp bf16 lora offopt
#               offload"): amp, bf16 and lora ~3 min each, offopt ~5 min, offload ~8 min; more than one call holds,
#               so split them, e.g. RUNS="amp bf16 lora", then RUNS=offopt, then RUNS=offload
#   7b_lora_40  (~6 min) the Qwen2.5-VL-7B shape, 8 prompts per step, LoRA rank 64 in pure bf16 on the card capped to
#               40 GB, the KV cache fixed at 1.5 GB (run.sh lora_7b_40gb's settings)
#   7b_lora_80  (~5 min) the same in AMP, capped to 80 GB
# On two H200s (`nvidia-h200-x2`):
#   7b_x2       (~6 min) the 7B shape in full AMP, FSDP over both GPUs, one engine each (not yet run)
#   3b          as above, the runs of RUNS shared out over the two GPUs
# ARGS: more bench.py flags for every run; LIMIT (seconds per run) overrides a run's own.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
MODE=${1:-3b}
# every layer recomputes, as when these cells were measured (bench.py's default, --checkpoint-layers auto, would
# spend the headroom each cell leaves on kept activations: another measurement)
B3="--preset qwen2_5_vl_3b --max-steps 2 --rollout-batch-size 16 --global-batch-size 16 --checkpoint-layers 1"
B7="--preset qwen2_5_vl_7b --max-steps 2 --rollout-batch-size 8 --global-batch-size 8 --checkpoint-layers 1"
declare -A FLAGS=([amp]="" [bf16]="--precision bf16" [lora]="--lora-rank 64" [offopt]="--offload-optimizer"
                  [offload]="--offload-params")
declare -A LIMITS=([amp]=200 [bf16]=200 [lora]=200 [offopt]=330 [offload]=540)

runs_3b() {  # runs_3b GPU NAME...
  local gpu=$1; shift
  for name in "$@"; do
    run_bench "m3b_$name" "$gpu" "${LIMIT:-${LIMITS[$name]}}" $B3 ${FLAGS[$name]}
  done
}

case "$MODE" in
  3b)
    prepare qwen2_5_vl_3b
    runs=(${RUNS:-amp bf16 lora offopt offload})
    if [ "$NGPU" -ge 2 ]; then
      half=$(( (${#runs[@]} + 1) / 2 ))
      runs_3b 1 "${runs[@]:$half}" & runs_3b 0 "${runs[@]:0:$half}"; wait
    else
      runs_3b 0 "${runs[@]}"
    fi ;;
  7b_lora_40)  # vLLM's own KV cache (2.6 GB) ran out of memory at step 2 here, 0.27 GB short: the cache is fixed
    prepare qwen2_5_vl_7b
    run_bench m7b_lora_bf16_cap40 0 "${LIMIT:-330}" $B7 --lora-rank 64 --gpu-memory-cap-gb 40 --precision bf16 \
      --max-token-len-per-device 8192 --kv-cache-memory-gb 1.5 ;;
  7b_lora_80)
    prepare qwen2_5_vl_7b
    run_bench m7b_lora_amp_cap80 0 "${LIMIT:-330}" $B7 --lora-rank 64 --gpu-memory-cap-gb 80 ;;
  7b_x2)
    prepare qwen2_5_vl_7b
    run_bench m7b_amp_x2 0,1 "${LIMIT:-420}" $B7 --gpu-memory-utilization 0.3 ;;
  *) echo "usage: bash benchmarks/gpu_memory.sh [3b | 7b_lora_40 | 7b_lora_80 | 7b_x2]"; exit 2 ;;
esac
python -m benchmarks.bench table "$OUT"/*_summary.json > "$OUT/memory_table.md" 2>&1; grep '^| m' "$OUT/memory_table.md"
