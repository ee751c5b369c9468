#!/usr/bin/env bash
# benchmarks/gpu_moe30b.sh -- the Qwen3-VL-30B-A3B shape (31.07B parameters, 128 experts, 3B active) on ONE H200,
# in one device call: seconds per phase and memory per phase of a GRPO step with random weights (bench.py). Nothing
# of the model is written to disk (its bf16 checkpoint would be 62 GB of the machine's 64 GiB): `prepare` writes the
# config, tokenizer and processor only, the trainer builds the random model on the GPU from the config, vLLM starts
# on placeholder weights (load_format="dummy") and the first weight sync sends every weight before anything is
# generated (the engine/trainer log-prob difference, rollout/logprob_diff_*, shows that it arrived).
# On the one-H200 device, after vLLM is installed (the top of benchmarks/gpu_env.sh): `bash benchmarks/gpu_moe30b.sh`,
# e.g. in the install's second call:
#   cp .gpu/*.part-01 /tmp/vparts/ && bash .gpu/install_vllm.sh && bash benchmarks/gpu_moe30b.sh
# Not yet run on a GPU. Estimated ~6 min (budget below 9): prepare ~20 s, python and vLLM imports ~20 s, the random
# 31B model on the GPU ~20 s, vLLM's start on dummy weights (compilation, CUDA graphs) ~2 min, step 1 ~1.5 min (the
# first full sync, Triton's MoE kernels), steps 2 and 3 ~1 min each; the run is cut at LIMIT (480 s) keeping the
# metrics of its finished steps.
# The mode (README "Memory modes", the 30B-A3B rows; bench.py's memory model, GiB on the GPU):
#   LoRA rank 64 on a pure-bf16 base (--lora-rank 64 --precision bf16): the trainer holds the frozen base, 57.9, and
#     the adapters (attention q/k/v/o only: the experts are not nn.Linear) with their gradients and AdamW state, 0.3
#   --sleep-level 2: the engine drops its weights while the trainer works (no 58 GB copy to the host) and gets them
#     all again before each generation; with LoRA there is no reference model (the adapters switched off)
#   generation: trainer 58.2 + engine 57.9 weights + 6 KV cache (--kv-cache-memory-gb 6: 8 prompts x 8 samples x
#     ~958 tokens need ~5.6 at 96 KiB a token, less with the prompts' shared prefix) + ~3 activations and graphs
#     = ~125 of the card's ~139 usable; vLLM's start-up check asks 0.5 x 140 = 70 free beside the trainer's 58 (~81)
#   log-probs (adapters off): 66.3;  update: 79.9 (one micro-batch of 64 x 958 tokens; the engine asleep, holding 0)
# --torch-compile off: the trainer's fused elementwise kernels would compile for ~100 s inside this one call.
# If vLLM's start (torch.compile, CUDA graphs: not yet seen for this MoE) leaves too little of the call,
# ARGS=--enforce-eager starts it faster and decodes slower; out of memory while generating: a smaller
# --kv-cache-memory-gb in ARGS (it comes after the recipe's flags: the last one wins).
# ARGS: more bench.py flags; STEPS (3) and LIMIT (480 s) override. Results in $OUT: moe30b_lora_bf16.log,
# _metrics.jsonl, _summary.json, report.md (seconds per phase) and memory_table.md (memory per phase and the model's).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
PREPARE_LIMIT=120 prepare qwen3_vl_30b_a3b
run_bench moe30b_lora_bf16 0 "${LIMIT:-480}" --preset qwen3_vl_30b_a3b --lora-rank 64 --precision bf16 \
  --sleep-level 2 --rollout-batch-size 8 --global-batch-size 8 --n 8 --max-response-length 512 \
  --kv-cache-memory-gb 6 --gpu-memory-utilization 0.5 --torch-compile off --checkpoint-layers 1 --max-steps "${STEPS:-3}"
python -m benchmarks.bench report "$OUT"/moe30b_*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
python -m benchmarks.bench table "$OUT"/moe30b_*_summary.json > "$OUT/memory_table.md" 2>&1
grep '^| moe30b' "$OUT/memory_table.md"
