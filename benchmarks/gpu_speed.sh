#!/usr/bin/env bash
# benchmarks/gpu_speed.sh [MODE] -- the speed runs of issue 11 on the H200 device, after vLLM is installed in /tmp/vsite
# (shared/gpu/README.md: calls 1 and 2). Results go to $OUT: <run>.log, <run>_metrics.jsonl, <run>_summary.json,
# env.log (versions, the varlen kernel picked), varlen_gpu_tests.log, report.md (bench.py report over the runs).
#   two (default, nvidia-h200-x2; one call, at most ~9.5 min, ~8 expected):
#       GPU0: 3B forced bench (64 x 8 x 1024 forced tokens; padding-free and vision varlen on auto = on), then
#             pytest -m gpu tests/test_varlen_gpu.py
#       GPU1: 3B realistic bench with --padding-free on, then with --padding-free off (vision varlen on in both)
#   a, b (nvidia-h200, two calls of ~8 min): a = the GPU0 column, b = the GPU1 column
# Step counts and limits: FORCED_STEPS (3), REAL_STEPS (3), FORCED_TIMEOUT (320 s), REAL_TIMEOUT (200 s each),
# TESTS_TIMEOUT (110 s). A run cut by its limit keeps the metrics of its finished steps (report.md uses them).
set -u
export PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
MODE=${1:-two}
FORCED_STEPS=${FORCED_STEPS:-3}; REAL_STEPS=${REAL_STEPS:-3}
FORCED_TIMEOUT=${FORCED_TIMEOUT:-320}; REAL_TIMEOUT=${REAL_TIMEOUT:-200}; TESTS_TIMEOUT=${TESTS_TIMEOUT:-110}
G0=0; G1=1; [ "$MODE" = two ] || G1=0

bench() {  # bench NAME GPU TIMEOUT ARGS...: one bench.py run, its log, metrics and summary under $OUT
  local name=$1 gpu=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python bench.py --preset qwen2_5_vl_3b --output-dir "/tmp/$name" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc ($(grep -c '"timing/step"' /tmp/$name/metrics.jsonl 2>/dev/null) steps)"
  cp "/tmp/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  cp "/tmp/$name/bench_summary.json" "$OUT/${name}_summary.json" 2>/dev/null
}

col0() {  # the forced workload with the fast paths, then the GPU tests of the fast kernels
  bench forced_pf_auto $G0 "$FORCED_TIMEOUT" --max-steps "$FORCED_STEPS"
  CUDA_VISIBLE_DEVICES=$G0 timeout "$TESTS_TIMEOUT" python -m pytest -m gpu -q -x tests/test_varlen_gpu.py \
    > "$OUT/varlen_gpu_tests.log" 2>&1
  echo "varlen GPU tests: $(tail -1 "$OUT/varlen_gpu_tests.log")"
}

col1() {  # the realistic workload with and without padding-free training
  bench realistic_pf_on $G1 "$REAL_TIMEOUT" --workload realistic --padding-free on --max-steps "$REAL_STEPS"
  bench realistic_pf_off $G1 "$REAL_TIMEOUT" --workload realistic --padding-free off --max-steps "$REAL_STEPS"
}

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers, inspect; from torch.nn.attention.varlen import varlen_attn; \
print('torch', torch.__version__, 'transformers', transformers.__version__); print(inspect.signature(varlen_attn))"
  CUDA_VISIBLE_DEVICES=$G0 python -c "import varlen; k = varlen._fast_varlen_kernel(0); \
print('varlen kernel:', k.__qualname__ if k else None)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
# the random 3B model and the data set, built once before the parallel runs (each would otherwise build its own)
CUDA_VISIBLE_DEVICES=$G0 timeout 150 python bench.py --preset qwen2_5_vl_3b --prepare-only > "$OUT/prepare.log" 2>&1 \
  || { echo "prepare failed:"; tail -5 "$OUT/prepare.log"; }
case "$MODE" in
  two) col0 & col1; wait ;;
  a) col0 ;;
  b) col1 ;;
  *) echo "MODE: two | a | b"; exit 2 ;;
esac
python bench.py report "$OUT"/*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
