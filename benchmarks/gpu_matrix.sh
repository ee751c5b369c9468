#!/usr/bin/env bash
# benchmarks/gpu_matrix.sh MODE -- the learning matrix on one GPU, after vLLM is installed (the top of
# benchmarks/gpu_env.sh). Longer than one device call: start it detached and collect it in the next calls,
#   bash benchmarks/gpu_detach.sh start m bash benchmarks/gpu_matrix.sh all
#   bash benchmarks/gpu_detach.sh wait m 560; tar czf $OUT/m.tgz -C $OUT m && rm -rf $OUT/m   # (8 files come back)
# Modes:
#   all       every row of benchmarks/matrix.py side by side with --parity, Gemma 4's and dapo's rows a second time
#             (seed 2: two runs of each in one call), and tests/test_tools_gpu.py beside them. ~13 min on one H200;
#             ~90 GB of GPU memory with 2 GiB KV caches (H200); 0.5 GiB on a smaller GPU (KV= overrides). EXTRA=",ROW.."
#             adds rows (variants kl001, const); TWICE= (empty) leaves the second seeds out. On one H100 with three
#             more rows (2026-12-05 c) the rows' 900 s cut the four slowest (MoE, Qwen3.5, zoom): there, run it with
#             LIMIT=1500 over three calls, or no EXTRA.
#             With the colour demos' cosine lr: TOOLS=0 LIMIT=1500 EXTRA=",gemma4_colour/s3,bf16/s2" ran on one H100
#             (2026-12-05 d, ~20 min over three calls): 17 of 20 rows held. TOOLS=0 LIMIT=1500 bash
#             benchmarks/gpu_matrix.sh all: 18 of 18 held on one H100 (2026-12-06, ~20 min over three calls).
#   gemma4    what tells why Gemma 4's row lost a colour on the GPU and not on the CPU, at the KL weight it had then
#             (0.01): three seeds with the GPU's defaults (vLLM, AMP bf16), the HF engine instead of vLLM (bf16), the
#             HF engine and the trainer in fp32 (the CPU's arithmetic on the GPU) at two seeds; its row as fixed (KL
#             0.1) at two seeds; Qwen2.5-VL in fp32; dapo and internvl_colour (the hold rule put them at risk); the
#             tools test. Ran 2026-12-05 on one H100 (the rows of then: benchmarks/h100/, BENCHMARKS.md). ~10 min.
# Results in $OUT: matrix/ (matrix.json, matrix.md, each row's log, metrics and validation samples) and the test's log.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
[ "${TOOLS:-1}" = 1 ] && ( GPU_TESTS_SHARED=1 timeout -k 20 "${TOOLS_LIMIT:-560}" python -m pytest -m gpu -q -rs tests/test_tools_gpu.py \
    > "$OUT/test_tools_gpu.log" 2>&1; echo "test_tools_gpu.py: exit $?: $(tail -1 "$OUT/test_tools_gpu.log")" ) &
case "${1:-}" in
  all)
    KV=${KV:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 2 : 0.5}')}
    python -m benchmarks.matrix run --seeds 1 --rows "$(python -c 'from benchmarks import matrix; print(",".join(matrix.ROWS))')${TWICE-,gemma4_colour/s2,dapo/s2}${EXTRA:-}" \
      --variant kl001="--kl-coef 0.01" --variant const="--lr-scheduler-type constant" --parity --kv-gb "$KV" \
      --timeout "${LIMIT:-900}" --out "$OUT/matrix" ;;
  gemma4)
    python -m benchmarks.matrix run --timeout "${LIMIT:-560}" --out "$OUT/matrix" --variant old="--kl-coef 0.01" \
      --variant hf="--kl-coef 0.01 --rollout-engine hf" --variant fp32hf="--kl-coef 0.01 --rollout-engine hf --dtype fp32" \
      --variant qfp32hf="--rollout-engine hf --dtype fp32" \
      --rows gemma4_colour+old,gemma4_colour+old/s2,gemma4_colour+old/s3,gemma4_colour+hf,gemma4_colour+fp32hf,gemma4_colour+fp32hf/s2,gemma4_colour,gemma4_colour/s2,qwen25vl_colour+qfp32hf,dapo,internvl_colour ;;
  *) echo "usage: bash benchmarks/gpu_matrix.sh all|gemma4"; exit 2 ;;
esac
echo "matrix: exit $?"
wait
