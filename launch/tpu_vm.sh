#!/usr/bin/env bash
# Create a Cloud TPU VM slice, install pacs_jax on every worker, and start training on all of them.
#   launch/tpu_vm.sh NAME ZONE ACCELERATOR CONFIG [extra train flags...]
#   e.g. launch/tpu_vm.sh pacs-v5p zone-a v5p-64 configs/paper.py:qwen25_7b,pacs_beta1 \
#          --workdir=gs://BUCKET/pacs_7b --config.model.path=/data/Qwen2.5-7B --config.data.tokenizer=/data/Qwen2.5-7B
# Every host runs the same command; jax.distributed.initialize() finds the others (--multihost).
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,7p "$0"; exit 2; }
NAME=$1 ZONE=$2 ACCEL=$3 CONFIG=$4; shift 4
VERSION=${TPU_SOFTWARE_VERSION:-v2-alpha-tpuv5}
REPO=${PACS_JAX_REPO:-https://github.com/YOUR_ORG/pacs_jax.git}

gcloud compute tpus tpu-vm describe "$NAME" --zone "$ZONE" >/dev/null 2>&1 || \
  gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$ACCEL" --version "$VERSION"

gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d pacs_jax ] || git clone $REPO pacs_jax
  cd pacs_jax && python3 -m venv .venv && . .venv/bin/activate
  pip install -q -r requirements.txt -e . && pip install -q -U 'jax[tpu]==0.10.2'
  nohup python -m pacs_jax.train --multihost --config=$CONFIG $* > train.log 2>&1 &
"
echo "started on all workers of $NAME; logs: gcloud compute tpus tpu-vm ssh $NAME --zone $ZONE --worker=0 --command 'tail -f pacs_jax/train.log'"
