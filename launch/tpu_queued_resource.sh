#!/usr/bin/env bash
# Request a TPU slice as a queued resource (spot/preemptible capacity), then start training on it.
#   launch/tpu_queued_resource.sh NAME ZONE ACCELERATOR CONFIG [extra train flags...]
# Preemption sends SIGTERM: the trainer writes a checkpoint and exits 0; re-running this script on
# the same --workdir resumes from that checkpoint.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,6p "$0"; exit 2; }
NAME=$1 ZONE=$2 ACCEL=$3
VERSION=${TPU_SOFTWARE_VERSION:-v2-alpha-tpuv5}

gcloud compute tpus queued-resources describe "$NAME" --zone "$ZONE" >/dev/null 2>&1 || \
  gcloud compute tpus queued-resources create "$NAME" --zone "$ZONE" --node-id "$NAME" \
    --accelerator-type "$ACCEL" --runtime-version "$VERSION" ${TPU_SPOT:+--spot}

until gcloud compute tpus queued-resources describe "$NAME" --zone "$ZONE" --format='value(state.state)' | grep -q ACTIVE; do
  echo "waiting for $NAME to become ACTIVE..."; sleep 60
done
exec "$(dirname "$0")/tpu_vm.sh" "$@"
