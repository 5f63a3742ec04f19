#!/usr/bin/env bash
# Several JAX processes on THIS machine (multi-controller runtime tested without a cluster):
#   launch/local_multiprocess.sh NUM_PROCESSES configs/NAME.py [--config.key=value ...]
# Each process gets LOCAL_DEVICES (default 2) fake CPU devices and joins the others through
# jax.distributed (coordinator on localhost, CPU collectives over gloo), exactly as hosts of a
# pod would. Logs: $LOG_DIR/process_<i>.log (default: a temp dir, printed). The script fails
# (and stops the others) as soon as any process fails; a SIGTERM to it goes on to every process
# (each then saves a checkpoint and exits 0, as on a pre-empted pod). EXTRA_XLA_FLAGS are
# appended to each process's XLA_FLAGS.
set -uo pipefail
NUM=${1:?usage: $0 NUM_PROCESSES configs/NAME.py [--config.key=value ...]}
CONFIG=${2:?usage: $0 NUM_PROCESSES configs/NAME.py [--config.key=value ...]}
shift 2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOCAL_DEVICES=${LOCAL_DEVICES:-2}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t dspark_mp.XXXXXX)}
mkdir -p "$LOG_DIR"
PORT=${COORDINATOR_PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}
echo "local_multiprocess: $NUM processes x $LOCAL_DEVICES CPU devices, coordinator localhost:$PORT, logs in $LOG_DIR"

pids=()
for ((i = 0; i < NUM; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$LOCAL_DEVICES ${EXTRA_XLA_FLAGS:-}" \
  DSPARK_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS="localhost:$PORT" \
  JAX_NUM_PROCESSES="$NUM" JAX_PROCESS_ID="$i" \
    $PY -m dspark_jax.train --config "$CONFIG" "$@" > "$LOG_DIR/process_$i.log" 2>&1 &
  pids+=($!)
done

stop_all() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; }
# SIGTERM (a pre-emption notice) is passed on: the processes save a checkpoint and exit 0
pass_term() {
  echo "local_multiprocess: SIGTERM passed on to the processes (they save and exit)" >&2
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
}
trap 'stop_all; exit 130' INT
trap pass_term TERM
rc=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  done_pid=""
  wait -n -p done_pid "${live[@]}"
  status=$?
  [[ -z ${done_pid:-} ]] && continue   # a trapped signal interrupted the wait
  live=($(for p in "${live[@]}"; do [[ $p != "$done_pid" ]] && echo "$p"; done))
  if ((status != 0)); then
    for ((i = 0; i < NUM; i++)); do [[ ${pids[$i]} == "$done_pid" ]] && who=$i; done
    echo "local_multiprocess: process ${who:-?} (pid $done_pid) failed with status $status; stopping the others" >&2
    tail -n 20 "$LOG_DIR/process_${who:-0}.log" >&2
    stop_all
    rc=$status
    break
  fi
done
wait 2>/dev/null
if ((rc == 0)); then tail -n 5 "$LOG_DIR/process_0.log"; fi
exit $rc
