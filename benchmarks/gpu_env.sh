# benchmarks/gpu_env.sh -- sourced by the GPU recipes (gpu_speed.sh, gpu_memory.sh, gpu_tests.sh): the environment they
# run in on the H200 device, and the helpers that keep each run's log, metrics and summary in $OUT.
#
# Before the first recipe on a fresh machine (../shared/gpu/README.md, "Recipe"). Once, here:
#   echo /.gpu/ >> .git/info/exclude
#   mkdir -p .gpu && cp ../shared/gpu/vllm-0.26.0/*.part-* ../shared/gpu/install_vllm.sh .gpu/
#   bash ../shared/gpu/fetch_wheels.sh .gpu/wheels   # tyro, datasets, math-verify: the device image lacks them
#   PKGS="compressed-tensors==0.17.0 loguru" bash ../shared/gpu/fetch_wheels.sh .gpu/wheels  # vLLM's Qwen3.5 imports
# Then two device calls on the one-H200 kind (`nvidia-h200`), back to back (a machine stays warm 30 s after a call):
#   1. carry .gpu/vllm026-slim.tar.xz.part-00:   mkdir -p /tmp/vparts && cp .gpu/*.part-00 /tmp/vparts/
#   2. carry .gpu/vllm026-slim.tar.xz.part-01, .gpu/install_vllm.sh and .gpu/wheels (a call carries at most 64 MiB
#      with the tracked tree, ~8 MB now: when it refuses, carry the part alone and copy it to /tmp/vparts, then
#      install.sh and the wheels in the next call; the tool's README splits part-00 in two the same way; since
#      2026-12-02 the tracked tree (9.4 MB) and part-01 (57.6 MB) pass 64 MiB together: `split -b 30M -d
#      .gpu/vllm026-slim.tar.xz.part-01 .gpu/p01.` and carry p01.00, then p01.01, cat-ing them in /tmp/vparts; on
#      2026-12-06 part-00 (60 MiB) and the tree (4.2 MB) passed it too: carry its first 59.5 MiB (`head -c 62390272`)
#      in call 1 and the rest (`tail -c +62390273`) with part-01 in call 2, cat-ing the two into part-00 there):
#      cp .gpu/*.part-01 /tmp/vparts/ && bash .gpu/install_vllm.sh && bash benchmarks/gpu_speed.sh bar
# EXTRA_PYTHONPATH: folders put first on the path (e.g. a torchvision installed apart: `pip install vllm` brings
# torchvision, the slim bundle does not; with it transformers and vLLM take the torchvision image processors).
# The install takes ~20 s; a later call on the same warm machine runs a recipe alone (`bash benchmarks/gpu_X.sh ...`).
# One call may run 10 minutes: each recipe says how long its modes take. What a call leaves in $OUT comes back.
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}/tmp/site:/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ ! -d /tmp/site ] && ls .gpu/wheels/*.whl > /dev/null 2>&1; then  # the carried wheels, installed once per machine
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
fi
# The slim bundle keeps FlashAttention 4's Python (vllm_flash_attn/cute) but not the CuTe DSL it imports (`cutlass`,
# nvidia-cutlass-dsl: 92 MB, which a full `pip install vllm` brings): vLLM then takes FA4 as present and Gemma 4 (two
# head sizes: FA4 for every layer) fails at its first forward. Without the folder vLLM falls back to TRITON_ATTN itself.
python -c "import cutlass" 2> /dev/null || rm -rf /tmp/vsite/vllm/vllm_flash_attn/cute
python -c "import vllm, tyro, datasets, compressed_tensors" 2> /dev/null || echo "gpu_env.sh: vllm, tyro, datasets or" \
  "compressed_tensors (vLLM's Qwen3.5) does not import: install them as the top of benchmarks/gpu_env.sh says" >&2
NGPU=$(nvidia-smi -L 2> /dev/null | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

prepare() {  # prepare PRESET: build the random model and the data set once, before the runs that share them
  timeout -k 20 "${PREPARE_LIMIT:-200}" python -m benchmarks.bench --preset "$1" --prepare-only > "$OUT/prepare_$1.log" 2>&1 \
    || { echo "prepare $1 failed:"; tail -5 "$OUT/prepare_$1.log"; }
}

smi_start() {  # smi_start NAME: the GPUs' clocks, temperature, power and throttle reasons once a second into
  # $OUT/NAME_gpu.csv while a run lasts (a phase that slows down between steps: is the GPU clocked down?), and the
  # host's cores and the run's threads into $OUT/NAME_host.csv (or is the engine loop short of CPU?)
  SMI_PID= HOST_PID=
  command -v nvidia-smi > /dev/null || return 0
  local why=clocks_event_reasons.active  # (older drivers: clocks_throttle_reasons.active)
  nvidia-smi --query-gpu=$why --format=csv > /dev/null 2>&1 || why=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,$why \
    --format=csv -l 1 > "$OUT/$1_gpu.csv" 2> /dev/null &
  SMI_PID=$!
  # the host's side each second: busy cores, stolen time, the run's busiest thread (bench.py phases joins the two)
  python "$(dirname "${BASH_SOURCE[0]}")/host_log.py" "$OUT/$1_host.csv" "--output-dir /tmp/$1" 2> /dev/null &
  HOST_PID=$!
}

smi_stop() {
  [ -n "${SMI_PID:-}" ] && kill "$SMI_PID" 2> /dev/null; SMI_PID=
  [ -n "${HOST_PID:-}" ] && kill "$HOST_PID" 2> /dev/null; HOST_PID=
}

run_bench() {  # run_bench NAME GPUS LIMIT_S BENCH_ARGS...: bench.py on GPUS ("0", or "0,1" under torchrun); its log,
  # metrics.jsonl and bench_summary.json in $OUT as NAME.log, NAME_metrics.jsonl, NAME_summary.json. A run cut by
  # its limit keeps the metrics of its finished steps. (timeout -k 20 here and in the recipes: a SIGKILL 20 s after the
  # SIGTERM, should the run's shutdown hang; a call of 2026-12-03 ran to the device's 600 s cap and returned nothing)
  local name=$1 gpus=$2 limit=$3; shift 3
  local launch=(python)
  [[ $gpus == *,* ]] && launch=(torchrun --standalone --nproc_per_node "$(tr ',' '\n' <<< "$gpus" | wc -l)")
  smi_start "$name"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 20 "$limit" "${launch[@]}" -m benchmarks.bench --output-dir "/tmp/$name" "$@" \
    ${ARGS:-} > "$OUT/$name.log" 2>&1
  local rc=$?
  smi_stop
  echo "$name: exit $rc ($(cat "/tmp/$name/metrics.jsonl" 2> /dev/null | grep -c '"timing/step"') steps)"
  cp "/tmp/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2> /dev/null
  cp "/tmp/$name/bench_summary.json" "$OUT/${name}_summary.json" 2> /dev/null
  cp "/tmp/$name/profile.txt" "$OUT/${name}_profile.txt" 2> /dev/null
  cp "/tmp/$name/gen_stacks.json" "$OUT/${name}_gen_stacks.json" 2> /dev/null  # (--sample-stacks)
  grep -o 'BENCH_RESULT.*' "$OUT/$name.log" | head -c 1200; echo
}
