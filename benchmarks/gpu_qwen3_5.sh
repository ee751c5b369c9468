#!/usr/bin/env bash
# benchmarks/gpu_qwen3_5.sh MODE -- Qwen3.5 (Gated DeltaNet hybrid) on ONE H200, after vLLM is installed (the top of
# benchmarks/gpu_env.sh; fla-core and einops travel in .gpu/wheels: ../shared/gpu/fetch_wheels.sh). Modes:
#   tests    tests/test_qwen3_5_gpu.py: fla-core's kernels on packed rows against each sample alone, the engine gets one
#            GDN layer after a sync and after a level-2 sleep (dense and MoE), the two demos' agreement (~6 min)
#   matrix   the learning matrix's two Qwen3.5 rows side by side, then each row's parity check (~5 min)
#   9b       the Qwen3.5-9B shape (9.41B, random weights), pure bf16, 16 prompts x 8 x 1024 tokens, 2 steps (~7 min)
#   9b_bare  its generation beside bare vLLM on the same model, one call (engine-ablation rows bare, all_ours; ROWS=
#            bare,banned,all_ours_no_lp,all_ours tells the pad tokens' ban from the log-probs: 1.163x on 2026-12-03)
#   35b      the Qwen3.5-35B-A3B shape (35.1B, 256 experts), LoRA r64 on a bf16 base, --sleep-level 2, nothing on disk,
#            8 prompts x 8 x 512 tokens, as the Qwen3-VL-30B-A3B row (benchmarks/gpu_moe30b.sh) but 3 GiB of KV cache (~8 min)
#   35b_offload  the same with --offload-params (not run: the fallback if 35b does not fit)
# Seen on the H200 (2026-12-03): vLLM 0.26 needs compressed-tensors 0.17.0 and loguru for Qwen3.5
# (in .gpu/wheels beside fetch_wheels.sh's: pip download --no-deps compressed-tensors==0.17.0 loguru).
# Results in $OUT: each run's log, metrics, summary, and report.md / memory_table.md for the benches.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
case "${1:-}" in
  tests)
    python -c "import tiny_model; [tiny_model.build_tiny_model(arch=a) for a in ('qwen3_5', 'qwen3_5_moe')]" \
      > "$OUT/build.log" 2>&1
    timeout -k 20 "${LIMIT:-560}" python -m pytest -m gpu -q -s tests/test_qwen3_5_gpu.py ${K:+-k "$K"} \
      > "$OUT/test_qwen3_5_gpu.log" 2>&1  # K="not demo": the engine checks only (the matrix runs the demos)
    echo "tests/test_qwen3_5_gpu.py: exit $?: $(tail -1 "$OUT/test_qwen3_5_gpu.log")"
    grep -E "^\[(gdn|qwen3_5)" "$OUT/test_qwen3_5_gpu.log"
    exit ;;
  matrix)
    timeout -k 20 "${LIMIT:-560}" python -m benchmarks.matrix run --rows qwen35_colour,qwen35_moe --parity \
      --out "$OUT/matrix" --timeout "${ROW_LIMIT:-420}" > "$OUT/matrix.log" 2>&1
    echo "matrix: exit $?"; tail -8 "$OUT/matrix.log"
    exit ;;
  9b)
    prepare qwen3_5_9b
    # 16k-token micro-batches: with 64k ones step 2's update ran out of memory (2026-12-03; the GDN layers' plain-torch
    # backward under the image's Triton 3.6 keeps ~365 KiB a token a layer, the memory model knows it since)
    run_bench bench9b_qwen35_bf16_1gpu_16x8 0 "${LIMIT:-480}" --preset qwen3_5_9b --precision bf16 \
      --max-steps "${STEPS:-2}" --rollout-batch-size 16 --global-batch-size 16 --gpu-memory-utilization 0.3 \
      --max-token-len-per-device 16384 ;;
  9b_bare)
    prepare qwen3_5_9b
    timeout -k 20 "${LIMIT:-480}" python -m benchmarks.bench engine-ablation --preset qwen3_5_9b --precision bf16 \
      --rollout-batch-size 16 --global-batch-size 16 --gpu-memory-utilization 0.3 --max-token-len-per-device 16384 --rows "${ROWS:-bare,all_ours}" \
      --repeats "${REPEATS:-1}" --bare-memory-share 0 --output-dir /tmp/abl9b > "$OUT/ablation9b.log" 2>&1
    echo "9b engine-ablation: exit $?"; cp /tmp/abl9b/engine_ablation.json "$OUT/ablation9b.json" 2> /dev/null
    python -c "import json, sys; from benchmarks import engine_bench as e; print(e.table(json.load(open(sys.argv[1]))))" \
      "$OUT/ablation9b.json" 2> /dev/null || tail -20 "$OUT/ablation9b.log"
    exit ;;
  35b)
    # 3 GiB of KV cache, not the 30B-A3B's 6: on 2026-12-04 it ran out of memory allocating 6 GiB (the trainer held 67.1 GiB
    # when the engine started, its weights 65.5, its profiling run's leftovers ~1.9 reserved and 0.6 in CUDA graphs:
    # 139.8 less those leaves ~4.7). At 6 GiB vLLM counted room for 96 sequences of 1,536 tokens; 3 GiB is about half
    # that for the step's 64 of ~960 (any that do not fit wait for a slot: slower, not wrong). 2026-12-04: at 3 GiB
    # the engine started, then ran out of memory in its first prefill (16,384 tokens a step, its activations never
    # profiled with a fixed KV cache: engine 69.7 GiB, trainer 66.4, 0.9 free); at 4,096 a step, eager (no compile, no
    # graphs: 107 s to start, not 193), generation finished (awake: engine 69.5 GiB, trainer 67.3) and the call's limit
    # cut the trainer's first pass
    PREPARE_LIMIT=120 prepare qwen3_5_35b_a3b
    run_bench moe35b_qwen35_lora_bf16 0 "${LIMIT:-480}" --preset qwen3_5_35b_a3b --lora-rank 64 --precision bf16 \
      --sleep-level 2 --rollout-batch-size 8 --global-batch-size 8 --n 8 --max-response-length 512 \
      --kv-cache-memory-gb 3 --max-num-batched-tokens 4096 --enforce-eager --gpu-memory-utilization 0.5 \
      --torch-compile off --checkpoint-layers 1 \
      --max-steps "${STEPS:-3}" ;;
  35b_offload)  # the fallback if 35b's 3 GiB does not fit either: the trainer's weights on the host while vLLM
    # generates (the memory model: 0 GiB of trainer state beside the engine, 18.8 in the update; each micro-batch
    # copies the 65 GiB base in, so slower)
    PREPARE_LIMIT=120 prepare qwen3_5_35b_a3b
    run_bench moe35b_qwen35_lora_bf16_offload 0 "${LIMIT:-480}" --preset qwen3_5_35b_a3b --lora-rank 64 \
      --precision bf16 --offload-params --sleep-level 2 --rollout-batch-size 8 --global-batch-size 8 --n 8 \
      --max-response-length 512 --kv-cache-memory-gb 6 --gpu-memory-utilization 0.5 --torch-compile off \
      --checkpoint-layers 1 --max-steps "${STEPS:-3}" ;;
  *) echo "usage: bash benchmarks/gpu_qwen3_5.sh [tests | matrix | 9b | 9b_bare | 35b | 35b_offload]"; exit 2 ;;
esac
python -m benchmarks.bench report "$OUT"/*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
python -m benchmarks.bench table "$OUT"/*_summary.json > "$OUT/memory_table.md" 2>&1; grep -E '^\| (bench9b|moe35b)' "$OUT/memory_table.md"
