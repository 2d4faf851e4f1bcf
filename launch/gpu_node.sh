#!/usr/bin/env bash
# Train on one multi-GPU node (all local GPUs in one process), or one node of several:
#   launch/gpu_node.sh CONFIG [extra train flags...]
#   NUM_NODES=2 NODE_RANK=0 COORDINATOR=node0:1234 launch/gpu_node.sh CONFIG ...   (run on every node)
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,5p "$0"; exit 2; }
CONFIG=$1; shift
cd "$(dirname "$0")/.."
[ -d .venv ] || { python3 -m venv .venv && . .venv/bin/activate && pip install -q -r requirements.txt -e . \
  && pip install -q -U 'jax[cuda12]==0.10.2'; }
. .venv/bin/activate
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
if [ "${NUM_NODES:-1}" -gt 1 ]; then
  exec python -m pacs_jax.train --multihost --coordinator_address="$COORDINATOR" --num_processes="$NUM_NODES" \
    --process_id="$NODE_RANK" --config="$CONFIG" "$@"
fi
exec python -m pacs_jax.train --config="$CONFIG" "$@"
