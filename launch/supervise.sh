#!/usr/bin/env bash
# Run a command until it succeeds, restarting it after a crash or preemption (the trainer resumes
# from its workdir's checkpoints by itself).
#
#   launch/supervise.sh [--max_restarts N] [--delay S] -- COMMAND [ARGS...]
#
# Exits 0 when COMMAND does; gives up (exit status of the last attempt) after N restarts (default 20),
# waiting S seconds before each (default 30).
# Exit status 78 is a permanent error (pacs_jax/errors.py: a config value, a flag or the data is
# wrong, and the trainer printed which): no restart follows, supervise.sh exits 78 at once.
# Exit status 79 (pacs_jax/errors.py RESUME_NEEDED_STATUS): a stop signal ended the trainer with its last
# finished step checkpointed (none yet when it came before RL). When the signal was COMMAND's alone (a
# preemption notice, a kill of the trainer), it is restarted and resumes; when supervise.sh got it too, supervise.sh stops with 79.
# SIGTERM / SIGINT are passed on to COMMAND, which then saves a checkpoint and exits; no restart follows.
set -uo pipefail

permanent_status=78  # pacs_jax/errors.py PERMANENT_ERROR_STATUS
resume_status=79     # pacs_jax/errors.py RESUME_NEEDED_STATUS
max_restarts=20 delay=30
while [ $# -gt 0 ]; do
  case "$1" in
    --max_restarts) max_restarts=${2:?}; shift 2 ;;
    --delay) delay=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) echo "supervise.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "supervise.sh: no COMMAND after --" >&2; exit 2; }

child="" stopping=0 trapped=0
forward() { stopping=1 trapped=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null; }
trap forward TERM INT

attempt=0
while true; do
  echo "supervise.sh: $(date -u +%FT%TZ) attempt $((attempt + 1)): $*"
  "$@" &
  child=$!
  # A trapped signal interrupts `wait` (status 128 + its number) whether the child still runs or has just
  # exited: wait again, which returns the child's own status (it is not reaped until a wait returns it).
  status=""
  while true; do
    trapped=0
    wait "$child"; waited=$?
    if [ "$waited" -eq 127 ] && [ -n "$status" ]; then break; fi  # reaped by the wait before the signal
    status=$waited
    [ "$trapped" -eq 1 ] || break
  done
  child=""
  if [ "$status" -eq "$resume_status" ] && [ "$stopping" -eq 1 ]; then
    echo "supervise.sh: $(date -u +%FT%TZ) stopped with status $status: the last finished step is" \
         "checkpointed; run the same command again to resume"
    exit "$status"
  fi
  if [ "$status" -eq 0 ] || [ "$stopping" -eq 1 ]; then
    echo "supervise.sh: $(date -u +%FT%TZ) finished with status $status"
    exit "$status"
  fi
  if [ "$status" -eq "$permanent_status" ]; then
    echo "supervise.sh: $(date -u +%FT%TZ) exited with status $status: a permanent error (config, flags or" \
         "data; its message is above); not restarting" >&2
    exit "$status"
  fi
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$max_restarts" ]; then
    echo "supervise.sh: giving up after $max_restarts restarts (last status $status)" >&2
    exit "$status"
  fi
  if [ "$status" -eq "$resume_status" ]; then
    echo "supervise.sh: $(date -u +%FT%TZ) stopped by a signal of its own (status $status); resuming in" \
         "${delay} s" >&2
  else
    echo "supervise.sh: $(date -u +%FT%TZ) exited with status $status; restarting in ${delay} s" >&2
  fi
  sleep "$delay"
done
