#!/usr/bin/env bash
# benchmarks/gpu_matrix.sh MODE -- the learning matrix on one GPU, after vLLM is installed (the top of
# benchmarks/gpu_env.sh). Longer than one device call: start it detached and collect it in the next calls,
#   bash benchmarks/gpu_detach.sh start m bash benchmarks/gpu_matrix.sh all
#   bash benchmarks/gpu_detach.sh wait m 560; tar czf $OUT/m.tgz -C $OUT m && rm -rf $OUT/m   # (8 files come back)
# Modes:
#   all       every row of benchmarks/matrix.py side by side with --parity, Gemma 4's row a second time (seed 2:
#             two runs of it in one call), and tests/test_tools_gpu.py beside them. ~11 min on one H200.
#   gemma4    what decides why Gemma 4's row loses a colour on the GPU and not on the CPU: its row at three seeds
#             (the GPU's defaults: vLLM, AMP bf16), the HF engine instead of vLLM (bf16), the HF engine and the
#             trainer in fp32 (the CPU's arithmetic on the GPU), vLLM and the trainer in fp32; beside them the rows
#             the hold rule put at risk (dapo, internvl_colour), and tests/test_tools_gpu.py. ~6 min on one H200.
# Results in $OUT: matrix/ (matrix.json, matrix.md, each row's log, metrics and validation samples) and the test's log.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
( GPU_TESTS_SHARED=1 timeout -k 20 "${TOOLS_LIMIT:-560}" python -m pytest -m gpu -q -rs tests/test_tools_gpu.py \
    > "$OUT/test_tools_gpu.log" 2>&1; echo "test_tools_gpu.py: exit $?: $(tail -1 "$OUT/test_tools_gpu.log")" ) &
case "${1:-}" in
  all)
    python -m benchmarks.matrix run --seeds 1 --rows "$(python -c 'from benchmarks import matrix; print(",".join(matrix.ROWS))'),gemma4_colour/s2" \
      --parity --timeout "${LIMIT:-900}" --out "$OUT/matrix" ;;
  gemma4)
    python -m benchmarks.matrix run --timeout "${LIMIT:-540}" --out "$OUT/matrix" \
      --variant hf="--rollout-engine hf" --variant fp32hf="--rollout-engine hf --dtype fp32" \
      --variant fp32="--dtype fp32" \
      --rows gemma4_colour,gemma4_colour/s2,gemma4_colour/s3,gemma4_colour+hf,gemma4_colour+hf/s2,gemma4_colour+fp32hf,gemma4_colour+fp32hf/s2,gemma4_colour+fp32,qwen25vl_colour+fp32hf,dapo,internvl_colour ;;
  *) echo "usage: bash benchmarks/gpu_matrix.sh all|gemma4"; exit 2 ;;
esac
echo "matrix: exit $?"
wait
