#!/usr/bin/env bash
# Run K processes of one multi-process JAX program on this machine (CPU collectives, simulated devices).
#
#   launch/local.sh --processes K --devices_per_process D [--port P] -- COMMAND [ARGS...]
#   e.g. launch/local.sh --processes 2 --devices_per_process 4 -- python -m pacs_jax.train --workdir=/tmp/run
#
# Each process gets JAX_COORDINATOR_ADDRESS=localhost:P (a free port unless --port; P + 1 is the
# start-up barrier), JAX_NUM_PROCESSES=K, JAX_PROCESS_ID=i, D CPU devices and gloo collectives;
# pacs_jax.train reads those variables. Every output line is prefixed with "[i] ". When a process
# fails, the others are stopped and this script exits with the failing process's status.
#
# Ctrl-C (SIGINT) or SIGTERM reaching this script is passed on to every process (with its children, as
# a terminal's Ctrl-C would), and the script waits for every one of them with their output still
# flowing: the trainers stop together at their next warm-start step or RL step (after writing its
# checkpoint), exiting with status 79 (resume needed). A process that exits non-zero
# after that is named, and the script exits with the first such status once all have exited. Ctrl-C
# again aborts them at once.
set -euo pipefail

# shellcheck source=launch/common.sh
. "$(dirname "$0")/common.sh"

processes="" devices="" port=""
while [ $# -gt 0 ]; do
  case "$1" in
    --processes) processes=${2:?}; shift 2 ;;
    --devices_per_process) devices=${2:?}; shift 2 ;;
    --port) port=${2:?}; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ $# -gt 0 ] || die "no COMMAND after -- (see --help)"
[[ "$processes" =~ ^[1-9][0-9]*$ ]] || die "--processes must be a positive integer"
[[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "--devices_per_process must be a positive integer"

if [ -z "$port" ]; then  # a free port whose successor is free too (the start-up barrier)
  port=$(python3 - <<'EOF'
import socket
while True:
    with socket.socket() as a:
        a.bind(("localhost", 0))
        port = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("localhost", port + 1))
        except OSError:
            continue
    print(port)
    break
EOF
)
fi

pids=()
signal_all() {  # $1: the signal, to each process's group (the prefixing sed ignores INT and TERM)
  for pid in "${pids[@]}"; do kill "-$1" -- "-$pid" 2>/dev/null || true; done
}
cleanup() { signal_all TERM; }
interrupts=0
forward() {  # a stop signal to this script: the processes get it too; this script keeps waiting for them
  interrupts=$((interrupts + 1))
  if [ "$interrupts" -eq 1 ]; then
    echo "local.sh: $1: passed on to the $processes processes; waiting for them to stop at their next" \
         "warm-start step or RL phase boundary (Ctrl-C again to abort at once)" >&2
  else
    echo "local.sh: $1 again: passed on; the processes abort" >&2
  fi
  signal_all "$1"
}
trap 'forward INT' INT
trap 'forward TERM' TERM

set -m  # each process in its own process group, so that stopping it stops its children too
for ((i = 0; i < processes; i++)); do
  (
    set -o pipefail
    JAX_COORDINATOR_ADDRESS="localhost:$port" JAX_NUM_PROCESSES="$processes" JAX_PROCESS_ID="$i" \
      JAX_PLATFORMS=cpu JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
      "$@" 2>&1 | (trap '' INT TERM; exec sed -u "s/^/[$i] /")  # sed ends when the process's output does
  ) &
  pids+=($!)
done
set +m

running=("${pids[@]}")
stopped=0  # after a stop signal: the first non-zero status of a process
while [ "${#running[@]}" -gt 0 ]; do
  finished="" status=0
  wait -n -p finished "${running[@]}" || status=$?
  [ -n "${finished:-}" ] || continue  # a trapped signal interrupted the wait (and unset finished): keep waiting
  still=()
  for pid in "${running[@]}"; do [ "$pid" = "$finished" ] || still+=("$pid"); done
  running=("${still[@]}")
  [ "$status" -ne 0 ] || continue
  if [ "$interrupts" -gt 0 ]; then  # stopping on a signal: the others stop on their own
    for ((i = 0; i < processes; i++)); do [ "${pids[i]}" != "$finished" ] || break; done
    echo "local.sh: process $i exited with status $status" >&2
    [ "$stopped" -ne 0 ] || stopped=$status
    continue
  fi
  echo "local.sh: a process (pid $finished) exited with status $status; stopping the others" >&2
  cleanup
  wait || true
  exit "$status"
done
[ "$stopped" -eq 0 ] || exit "$stopped"  # the first non-zero status after a stop signal
