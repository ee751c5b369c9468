#!/usr/bin/env bash
# benchmarks/gpu_speed.sh [MODE] -- seconds per phase of a GRPO step on random models with the real dimensions
# (bench.py: README "Speed"). On the one-H200 device, after vLLM is installed (the top of benchmarks/gpu_env.sh, from
# ../shared/gpu/README.md): `bash benchmarks/gpu_speed.sh bar`. Modes, with the time each takes there:
#   bar        (default; ~8 min: vLLM's start ~1 min, step 1 with the compilation ~2.5 min, steps 2 and 3 ~70 s each)
#              the speed bar: the Qwen2.5-VL-3B shape, 64 prompts x 8 samples x 1024 forced tokens, one 512x512
#              image and ~100 text tokens per prompt, 3 steps (README: 56.8 and 58.6 s per step in two runs, each the
#              mean of steps 2 and 3; 286-326 s for the call on 2026-12-02, the model built by an earlier call)
#   realistic  (~6 min) the same prompts with seeded log-normal response lengths, padding-free training on (174 s on
#              2026-12-02: README 28.9 s per step; 24.3 s on 2026-12-02's fastest machine), then off (padded rows: bench's
#              --checkpoint-layers auto recomputes every layer there; at the packed share, 29 of 36, that machine's ran
#              out of memory in step 1)
#   profile    (~4 min, no engine) the trainer alone on the 3B, 16 prompts x 8, 3 steps; the last step's kernel table
#   8b         (~5.5 min: 314 s on 2026-12-02 with the model build) the Qwen3-VL-8B shape in pure bf16, 16 prompts x 8 x
#              1024, 2 steps (README: 35.5 s per step with packed rows)
#   ablation   (measured 2026-12-01 at 32 prompts: 317 s with the model build; with 5 rows and REPEATS=2, 345 s
#              with the vLLM install; at 64 prompts
#              estimated ~8 min) bench.py engine-ablation on the 3B shape: the bar's generation (64
#              prompts x 8 x 1024 tokens, the same prompts and engine settings) with the engine alone, then with each
#              of our additions (log-probs, seeds, banned tokens, sleep/wake, a sync with sleep level 1 and with 2,
#              all of them, decoding and reward), and
#              bare in a second engine at the bare engine's memory share (0.6): one table (README Speed). Estimate:
#              model build ~1.5 min, engine start ~1 min, warm-up ~20 s, 9 timed generations x ~20-25 s, the second
#              engine ~1.5 min. REPEATS=2 times each row twice (~3 min more: on a machine where the model is built
#              already, with LIMIT=570; or with half the prompts, ARGS="--rollout-batch-size 32")
#   knobs      (measured 2026-12-01: 449 s for three runs, the first with --profile and 3 steps) the trainer alone (--trainer-only, no engine) on the 3B, 16 prompts
#              x 8 x 1024, 2 steps (step 1 pays torch.compile, step 2 is timed): today's defaults (64k-token
#              micro-batches, every layer recomputed), then both trainer knobs in one run (they act on different
#              phases: the reference pass and the update): --logprob-max-token-len-per-device 262144 (4 x 64k) with
#              --checkpoint-layers 0.5 (the first half of the layers recompute) and 32k-token update micro-batches (at
#              64k the kept layers would need 172 GiB by the memory model, at 32k 120 GiB); a third run,
#              --checkpoint-layers 0.75 at 64k (127 GiB), when the call has >= 150 s left. Prints each run's reference
#              and update seconds and MFU (report.md) and the memory model against the measured peaks. Estimate
#              (2026-12-01, trainer-only 3B 16x8 runs: ~100 s of compilation in step 1, ~14 s a step,
#              <= 200 s for 3 steps): model build ~1.5 min on a fresh machine, ~2.8 min per run
#   spread     (192 s on 2026-12-02) where the generation's time and its step-to-step spread go (19.8 and 25.1 s
#              in two steps of one bar run): bare and all of ours at 32 prompts, 4 rounds each, the engine loop's
#              parts timed (engine_bench.engine_loop_timers: the ablation table's loop lines) and its stack looked
#              at every 5 ms (--sample-stacks; biased to where the loop lets go of the GIL: 2026-12-02).
#              The bar's metrics carry the same loop timers (gen_loop/...) in every run.
#   pyspy      (135 s on a warm machine, 247 s on a fresh one with the install and the model build, 2026-12-02) bare
#              and all of ours at the bar's 64 prompts, once each, under py-spy (its wheel in .gpu/wheels: `pip
#              download py-spy --no-deps -d .gpu/wheels`): the engine loop's Python, unbiased. Its raw stacks come
#              back compressed (pyspy_raw.txt.xz; the ~30 MB text would not); `python -m benchmarks.bench pyspy RAW.xz`
#              reads them
# On two H200s (`nvidia-h200-x2`):
#   8b_x2      (~9 min) the 8B shape in AMP, FSDP over both GPUs, one engine each, 3 steps (not yet run)
#   two_turn   (~6 min at REPEATS=3 with the model build; a full-length warm-up since 2026-12-06) bench.py two-turn
#              on the 3B shape: the bar's 64 prompts x 8, 512 forced tokens, a tool's 512x512 picture, 512 more,
#              against one turn of 1024 forced tokens, REPEATS=2 rounds each (benchmarks/two_turn.py; the bar: at
#              most 1.3x, in two runs on one machine; two_turn makes the trainer's pixels as tools.rollout does: in
#              processes since 2026-12-06); its variants with
#              ARGS="--rows one_turn,two_turn,two_turn_distinct,two_turn_pixels_first,two_turn_pixels_on_threads"
#              (~30 s more each a round and in the warm-up, past the 500 s LIMIT at REPEATS=3 with two of them: give
#              LIMIT=590 and run it through benchmarks/gpu_detach.sh; the JSON is written after every round, so a
#              stopped run keeps its rounds). One GPU. Twice on one machine (the bar's proof; 4.8 min each on an H100
#              at REPEATS=3 with the short warm-up, ~1 min more now):
#              bash benchmarks/gpu_detach.sh start tt bash -c 'for r in 1 2; do OUT=$OUT/r$r REPEATS=3 \
#                bash benchmarks/gpu_speed.sh two_turn; done'; then, in calls while it runs, `bash
#                benchmarks/gpu_detach.sh wait tt 540` (at once: a machine idle 30 s goes back; tar only what is
#              needed) (keep each run's two_turn3b.json, two_turn3b_gpu.csv and two_turn3b_host.csv, xz'd, as
#              benchmarks/h100/two_turn3b_DATE_X_N*: record.py's two-turn table reads them). With ARGS="--rows
#              one_turn,two_turn,two_turn_pixels_on_threads" each run also times the threads (~6.5 min a run)
#   two        (~8 min) bar on GPU 0 beside realistic on GPU 1
# ARGS: more bench.py flags for every run (e.g. ARGS="--torch-compile off"); STEPS and LIMIT (seconds per run)
# override a mode's. Results in $OUT: <run>.log, <run>_metrics.jsonl, <run>_summary.json, <run>_gpu.csv (clocks,
# temperature, power, throttle reasons each second: nvidia-smi), <run>_host.csv (busy cores, stolen time, the run's
# busiest thread: benchmarks/host_log.py), report.md, phases.md (`bench.py phases` of each run: the GPU and host
# per phase).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
MODE=${1:-bar}

bar() {  # bar GPU
  prepare qwen2_5_vl_3b
  run_bench bench3b_forced "$1" "${LIMIT:-540}" --preset qwen2_5_vl_3b --max-steps "${STEPS:-3}"
}

realistic() {  # realistic GPU
  prepare qwen2_5_vl_3b
  for pf in on off; do
    run_bench "bench3b_realistic_pf_$pf" "$1" "${LIMIT:-200}" --preset qwen2_5_vl_3b --workload realistic \
      --padding-free $pf --max-steps "${STEPS:-3}"
  done
}

ablation() {  # ablation GPU
  prepare qwen2_5_vl_3b
  local name=engine3b_ablation
  smi_start "$name"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 20 "${LIMIT:-500}" python -m benchmarks.bench engine-ablation --preset qwen2_5_vl_3b \
    --repeats "${REPEATS:-1}" --output-dir "/tmp/$name" ${ARGS:-} > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
  smi_stop
  cp "/tmp/$name/engine_ablation.json" "$OUT/$name.json" 2> /dev/null
  cp "/tmp/$name/memory_share/child.log" "$OUT/${name}_memory_share.log" 2> /dev/null
  python -c "import json, sys; from benchmarks import engine_bench as e; print(e.table(json.load(open(sys.argv[1]))))" \
    "$OUT/$name.json" 2> /dev/null || tail -20 "$OUT/$name.log"
}

knobs() {  # knobs GPU: the two trainer knobs against today's defaults, the trainer alone
  prepare qwen2_5_vl_3b
  local t=(--preset qwen2_5_vl_3b --trainer-only --max-steps "${STEPS:-2}" --rollout-batch-size 16
           --global-batch-size 16)
  run_bench knobs3b_default "$1" "${LIMIT:-200}" "${t[@]}"
  run_bench knobs3b_lp4x_ckpt50_32k "$1" "${LIMIT:-200}" "${t[@]}" --logprob-max-token-len-per-device 262144 \
    --checkpoint-layers 0.5 --max-token-len-per-device 32768
  local left=$(( ${BUDGET:-570} - SECONDS ))  # (SECONDS: since this script started)
  if (( left >= 150 )); then
    run_bench knobs3b_lp4x_ckpt75 "$1" "$left" "${t[@]}" --logprob-max-token-len-per-device 262144 \
      --checkpoint-layers 0.75
  else
    echo "knobs3b_lp4x_ckpt75: skipped, $left s left in the call"
  fi
  python -m benchmarks.bench table "$OUT"/knobs3b_*_summary.json 2> /dev/null | sed -n '/^Measured/,$p' \
    > "$OUT/knobs_memory.md"
  cat "$OUT/knobs_memory.md"
}

case "$MODE" in
  bar) bar 0 ;;
  ablation) ablation 0; exit ;;  # (no metrics.jsonl: no report.md)
  two_turn)
    prepare qwen2_5_vl_3b
    rm -rf /tmp/two_turn3b  # (an earlier run's JSON is not this one's)
    smi_start two_turn3b  # (2026-12-04: one turn took 20.1 s in round 1 and 28.8-29.3 in rounds 2-3: clocks?)
    timeout -k 20 "${LIMIT:-500}" python -m benchmarks.bench two-turn --preset qwen2_5_vl_3b \
      --repeats "${REPEATS:-2}" --output-dir /tmp/two_turn3b ${ARGS:-} > "$OUT/two_turn3b.log" 2>&1  # (the dir:
    # what smi_start's host log finds the process by)
    rc=$?; smi_stop; echo "two_turn3b: exit $rc"; cp /tmp/two_turn3b/two_turn.json "$OUT/two_turn3b.json" 2> /dev/null
    cp /tmp/two_turn3b/intake_profile.txt "$OUT/" 2> /dev/null  # (ARGS=--profile: where turn two's intake goes)
    tail -6 "$OUT/two_turn3b.log"; exit ;;
  realistic) realistic 0 ;;
  knobs) knobs 0 ;;
  spread) REPEATS=${REPEATS:-4} ARGS="--rollout-batch-size 32 --rows bare,all_ours --sample-stacks 5 \
    --bare-memory-share 0 ${ARGS:-}" ablation 0; exit ;;
  pyspy)  # the spread's two rows at the bar's 64 prompts under py-spy (a sampler outside the process: it reads the
    # stacks without waiting for the GIL, so no bias towards the calls that let go of it; --nonblocking: never pauses
    # the run); $OUT/pyspy_raw.txt is the collapsed stacks of every thread, idle ones included
    prepare qwen2_5_vl_3b
    spy=/tmp/site/bin/py-spy
    "$spy" record --nonblocking -d 2 -o /tmp/spy_check.txt --format raw -- python -c "sum(range(10**8))" \
      > "$OUT/pyspy_check.log" 2>&1 || { echo "py-spy does not run here:"; tail -3 "$OUT/pyspy_check.log"; spy=; }
    smi_start pyspy
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${LIMIT:-420}" ${spy:+$spy record --nonblocking --idle --threads --rate 200 \
      --format raw -o "$OUT/pyspy_raw.txt" --} python -m benchmarks.bench engine-ablation --preset qwen2_5_vl_3b \
      --rows bare,all_ours --repeats "${REPEATS:-1}" --bare-memory-share 0 --output-dir /tmp/pyspy ${ARGS:-} \
      > "$OUT/pyspy.log" 2>&1
    echo "pyspy: exit $?"
    smi_stop
    [ -f "$OUT/pyspy_raw.txt" ] && xz -6 -T4 "$OUT/pyspy_raw.txt"  # (uncompressed, too large to come back)
    cp /tmp/pyspy/engine_ablation.json "$OUT/pyspy_ablation.json" 2> /dev/null
    python -c "import json, sys; from benchmarks import engine_bench as e; r = json.load(open(sys.argv[1])); \
print(e.table(r)); print(e.loop_table(r))" "$OUT/pyspy_ablation.json" 2> /dev/null || tail -20 "$OUT/pyspy.log"
    exit ;;
  profile)  # the trainer alone (random responses instead of generation): where the 3B step's time goes
    prepare qwen2_5_vl_3b
    run_bench trainer3b_profile 0 "${LIMIT:-240}" --preset qwen2_5_vl_3b --trainer-only --profile \
      --max-steps "${STEPS:-3}" --rollout-batch-size 16 --global-batch-size 16 ;;
  8b)  # pure bf16 (10 bytes per parameter with Kahan's buffer): AMP's 16 do not fit one H200 beside the engine
    prepare qwen3_vl_8b
    run_bench bench8b_qwen3vl_bf16_1gpu_16x8 0 "${LIMIT:-420}" --preset qwen3_vl_8b --precision bf16 \
      --max-steps "${STEPS:-2}" --rollout-batch-size 16 --global-batch-size 16 --gpu-memory-utilization 0.3 ;;
  8b_x2)
    prepare qwen3_vl_8b
    run_bench bench8b_qwen3vl_amp_2gpu 0,1 "${LIMIT:-530}" --preset qwen3_vl_8b --max-steps "${STEPS:-3}" \
      --gpu-memory-utilization 0.3 ;;
  two)
    prepare qwen2_5_vl_3b
    bar 0 & realistic 1
    wait ;;
  *) echo "usage: bash benchmarks/gpu_speed.sh [bar | realistic | profile | knobs | 8b | ablation | spread | pyspy | 8b_x2 | two]"
     exit 2 ;;
esac
python -m benchmarks.bench report "$OUT"/*_metrics.jsonl > "$OUT/report.md" 2>&1; cat "$OUT/report.md"
for m in "$OUT"/*_metrics.jsonl; do  # the GPU's and the host's side of each phase
  r=${m%_metrics.jsonl}
  [ -f "${r}_gpu.csv" ] && { echo "## $(basename "$r")"; python -m benchmarks.bench phases "$m" "${r}_gpu.csv" \
    "$([ -f "${r}_host.csv" ] && echo "${r}_host.csv")"; echo; }
done > "$OUT/phases.md" 2>&1
