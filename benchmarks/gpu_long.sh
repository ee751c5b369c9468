#!/usr/bin/env bash
# benchmarks/gpu_long.sh MODE -- long answers (issue #55): the Qwen3-4B shape (preset qwen3_4b: Qwen/Qwen3-4B's
# config, random weights, a text LLM) with 16 prompts x 4 samples of forced answers, after vLLM is installed (the top of
# benchmarks/gpu_env.sh). Run once, on an H100 (2026-12-05): `PROMPTS=4 ... 16k`, step 1 of 2 before the call's
# limit (BENCHMARKS.md, "Long answers"); 32k, the bare rows and sp2 not yet run. Modes:
#   16k, 32k        two steps of 16,384 / 32,768 forced response tokens, pure bf16 (AMP's 16 bytes a parameter and
#                   the engine do not fit 80 GB beside 32k-token activations), micro-batches of one sample, the
#                   recomputed layers chosen by the memory model (--checkpoint-layers auto), vLLM's max_num_seqs from
#                   its KV cache (memory.engine_max_seqs: whole sequences, none preempted)
#   16k_bare, 32k_bare  the same step's generation beside bare vLLM on the same lengths (engine-ablation rows
#                   bare, all_ours)
#   sp2             on two GPUs: the 16k shape with --ulysses-size 2 against K = 1 (rollout/logprob_diff_*: the trainer
#                   against the engine, the agreement bar; timing/step)
# Time, measured on an H100 at 16k: vLLM holds 11 sequences of 17k tokens at --gpu-memory-utilization 0.45, and 16
# answers (two waves) took 266 s, the update 41 s, startup ~2 minutes; so one 16k step of 16 prompts (64 answers,
# six waves, four times the update) is ~16 minutes, and two steps, detached (gpu_detach.sh), more than 30 device
# minutes; 32k about twice that. PROMPTS=4 with STEPS=1 fits one 10-minute call; the summary's tokens per second and MFU are per step whatever
# the count. Results in $OUT: each run's log, metrics and summary, report.md.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
P=${PROMPTS:-16}
shape() {  # shape R: the bench flags of R forced response tokens
  echo --preset qwen3_4b --precision bf16 --rollout-batch-size "$P" --global-batch-size "$P" --n 4 \
    --max-prompt-length 1024 --max-response-length "$1" --max-token-len-per-device "$(($1 + 1024))" \
    --gpu-memory-utilization "${UTIL:-0.45}" --max-steps "${STEPS:-2}"
}
case "${1:-}" in
  16k|32k)
    R=$(( ${1%k} * 1024 ))
    prepare qwen3_4b
    run_bench "long_qwen3_4b_${1}_${P}x4" 0 "${LIMIT:-560}" $(shape "$R") ;;
  16k_bare|32k_bare)
    R=$(( ${1%k_bare} * 1024 ))
    prepare qwen3_4b
    timeout -k 20 "${LIMIT:-560}" python -m benchmarks.bench engine-ablation $(shape "$R") --rows "${ROWS:-bare,all_ours}" \
      --repeats 1 --bare-memory-share 0 --output-dir "/tmp/abl_$1" > "$OUT/ablation_$1.log" 2>&1
    echo "$1 engine-ablation: exit $?"; cp "/tmp/abl_$1/engine_ablation.json" "$OUT/ablation_$1.json" 2> /dev/null
    python -c "import json, sys; from benchmarks import engine_bench as e; print(e.table(json.load(open(sys.argv[1]))))" \
      "$OUT/ablation_$1.json" 2> /dev/null || tail -20 "$OUT/ablation_$1.log"
    exit ;;
  sp2)
    [ "$NGPU" -ge 2 ] || { echo "sp2 needs two GPUs (this machine has $NGPU)"; exit 2; }
    prepare qwen3_4b
    run_bench "long_qwen3_4b_16k_k1_2gpu" 0,1 "${LIMIT:-280}" $(shape 16384)
    run_bench "long_qwen3_4b_16k_k2_2gpu" 0,1 "${LIMIT:-280}" $(shape 16384) --ulysses-size 2
    for k in k1 k2; do python -c "import json, sys; rows = [json.loads(x) for x in open(sys.argv[1])]
print(sys.argv[2], [{k: round(r[k], 4) for k in ('rollout/logprob_diff_mean', 'rollout/logprob_diff_max',
      'timing/step', 'timing/update') if k in r} for r in rows])" "$OUT/long_qwen3_4b_16k_${k}_2gpu_metrics.jsonl" $k
    done ;;
  *) echo "usage: bash benchmarks/gpu_long.sh [16k | 32k | 16k_bare | 32k_bare | sp2]"; exit 2 ;;
esac
python -m benchmarks.bench report "$OUT"/*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
python -m benchmarks.bench table "$OUT"/*_summary.json > "$OUT/memory_table.md" 2>&1; grep -E '^\| long' "$OUT/memory_table.md"
