#!/usr/bin/env bash
# benchmarks/gpu_gemma4.sh MODE -- Gemma 4 at real size on ONE H200, after vLLM is installed (the top of
# benchmarks/gpu_env.sh), as benchmarks/gpu_qwen3_5.sh runs the Qwen3.5 shapes. Modes:
#   e2b   the google/gemma-4-E2B-it shape (presets.py gemma4_e2b: 5.10B with its audio tower, random weights, 10 GB
#         on disk), pure bf16, 16 prompts x 8 samples x 1024 tokens, 2 steps. Estimated ~7 min: prepare ~1.5, vLLM's
#         start ~2, torch.compile ~2 in step 1; the run is cut at LIMIT (420 s) keeping its finished steps, so that
#         prepare, run and report fit one 10-minute call. Seconds per phase (report.md) and each phase's trainer peak
#         beside the memory model's (memory_table.md). The model (GiB): trainer 45.8 generating, 63.2 in the log-prob
#         passes, 84.8 in the update (micro-batches of 44 x 1470 tokens; 4096-token chunks of the 262144-wide
#         soft-capped logits, 16 GiB, its largest activation); the engine at 0.3 of the card (42 GiB: 9.5 of weights,
#         the rest KV cache and graphs, where 128 samples x ~1400 tokens need ~3) beside the trainer's 45.8: ~88 of
#         ~139. Not yet run on a GPU.
# Generic path (families.py): padded rows, each image through the vision tower once per sample (512 x 512 resized to
# 768 x 768: 2304 patches, padded to 2520; 256 soft tokens), whose activations the memory model leaves out (~2.5 GiB
# of checkpointed vision-layer inputs in the update). The audio tower is there as in the checkpoint: vLLM loads it
# (and may profile it on a dummy clip at its start); the trainer never runs it (no gradient, no optimizer state).
# ARGS: more bench.py flags (after the recipe's: the last one wins); STEPS (2) and LIMIT (420 s) override.
# Results in $OUT: bench_gemma4_e2b_bf16_1gpu_16x8.log, _metrics.jsonl, _summary.json, report.md, memory_table.md.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
case "${1:-}" in
  e2b)
    prepare gemma4_e2b
    run_bench bench_gemma4_e2b_bf16_1gpu_16x8 0 "${LIMIT:-420}" --preset gemma4_e2b --precision bf16 \
      --max-steps "${STEPS:-2}" --rollout-batch-size 16 --global-batch-size 16 --gpu-memory-utilization 0.3 ;;
  *) echo "usage: bash benchmarks/gpu_gemma4.sh e2b"; exit 2 ;;
esac
python -m benchmarks.bench report "$OUT"/*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
python -m benchmarks.bench table "$OUT"/*_summary.json > "$OUT/memory_table.md" 2>&1
grep -E '^\| (bench_gemma4|gemma4_e2b)' "$OUT/memory_table.md"
