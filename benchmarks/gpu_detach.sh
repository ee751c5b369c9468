#!/usr/bin/env bash
# benchmarks/gpu_detach.sh start NAME COMMAND... | wait NAME SECONDS -- a device run longer than one call (10 minutes):
# `start` runs COMMAND detached (setsid nohup: it outlives the call) with OUT=/tmp/detach/NAME, and returns at once;
# `wait`, in the next call (a machine stays warm 30 s after a call returns: make it at once), waits up to SECONDS
# (keep them under the call's limit) for it to end, then copies what it left, its log and exit status into
# $OUT/NAME/. Call `wait` again while the log's last line says it still runs. E.g. the matrix's tool row:
#   bash benchmarks/gpu_detach.sh start zoom bash -c 'source benchmarks/gpu_env.sh && python -m benchmarks.matrix run \
#     --rows zoom_tools --stop-at-target --output-dir $OUT'
#   bash benchmarks/gpu_detach.sh wait zoom 560
set -u
cd "$(dirname "$0")/.."
mode=${1:?start NAME COMMAND... or wait NAME SECONDS}; name=${2:?NAME}; dir=/tmp/detach/$name
if [ "$mode" = start ]; then
  shift 2
  rm -rf "$dir" "$dir.rc" && mkdir -p "$dir"  # (an earlier run's exit status would end the next `wait` at once)
  OUT=$dir setsid nohup bash -c '"$@"; echo $? > "$OUT.rc"' _ "$@" > "$dir.log" 2>&1 < /dev/null &
  echo "$name: started (pid $!), its log in $dir.log"
  exit
fi
t0=$(date +%s)
while [ ! -f "$dir.rc" ] && [ $(( $(date +%s) - t0 )) -lt "${3:?SECONDS}" ]; do sleep 5; done
mkdir -p "${OUT:-/tmp/gpu_out}/$name"
cp -r "$dir/." "${OUT:-/tmp/gpu_out}/$name/" 2> /dev/null
cp "$dir.log" "${OUT:-/tmp/gpu_out}/$name/run.log"
if [ -f "$dir.rc" ]; then
  echo "$name: exit $(cat "$dir.rc") after $(( $(date +%s) - t0 )) s of waiting"
else
  echo "$name: still running after $3 s (call wait again): $(tail -1 "$dir.log")"
fi
