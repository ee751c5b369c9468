#!/usr/bin/env bash
# benchmarks/gpu_matrix.sh MODE -- the learning matrix on one GPU, after vLLM is installed (the top of
# benchmarks/gpu_env.sh). Longer than one device call: start it detached and collect it in the next calls,
#   bash benchmarks/gpu_detach.sh start m bash benchmarks/gpu_matrix.sh all
#   bash benchmarks/gpu_detach.sh wait m 560; tar czf $OUT/m.tgz -C $OUT m && rm -rf $OUT/m   # (8 files come back)
# Modes:
#   all       every row of benchmarks/matrix.py side by side with --parity, Gemma 4's row a second time (seed 2:
#             two runs of it in one call), and tests/test_tools_gpu.py beside them. ~11 min on one H200.
#   gemma4    what tells why Gemma 4's row loses a colour on the GPU and not on the CPU (beside `all`, which runs
#             it at seeds 1 and 2 with the GPU's defaults: vLLM, AMP bf16): a third seed, the HF engine instead of
#             vLLM (bf16), the HF engine and the trainer in fp32 (the CPU's arithmetic on the GPU) at two seeds, the
#             KL weight 0.1; and Qwen2.5-VL's row in fp32 (does the GPU learn it later than the CPU for the same
#             reason?). No parity check, no tools test (TOOLS=0). ~6 min alone on one H200.
# Results in $OUT: matrix/ (matrix.json, matrix.md, each row's log, metrics and validation samples) and the test's log.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
[ "${TOOLS:-1}" = 1 ] && ( GPU_TESTS_SHARED=1 timeout -k 20 "${TOOLS_LIMIT:-560}" python -m pytest -m gpu -q -rs tests/test_tools_gpu.py \
    > "$OUT/test_tools_gpu.log" 2>&1; echo "test_tools_gpu.py: exit $?: $(tail -1 "$OUT/test_tools_gpu.log")" ) &
case "${1:-}" in
  all)
    python -m benchmarks.matrix run --seeds 1 --rows "$(python -c 'from benchmarks import matrix; print(",".join(matrix.ROWS))'),gemma4_colour/s2" \
      --parity --timeout "${LIMIT:-900}" --out "$OUT/matrix" ;;
  gemma4)
    python -m benchmarks.matrix run --timeout "${LIMIT:-900}" --out "$OUT/matrix" --runs-dir /tmp/matrix_runs_gemma4 \
      --variant hf="--rollout-engine hf" --variant fp32hf="--rollout-engine hf --dtype fp32" \
      --variant kl="--kl-coef 0.1 --kv-cache-memory-gb 0.5" --variant s3="--seed 3 --kv-cache-memory-gb 0.5" \
      --rows gemma4_colour+s3,gemma4_colour+hf,gemma4_colour+fp32hf,gemma4_colour+fp32hf/s2,gemma4_colour+kl,qwen25vl_colour+fp32hf ;;
  *) echo "usage: bash benchmarks/gpu_matrix.sh all|gemma4"; exit 2 ;;
esac
echo "matrix: exit $?"
wait
