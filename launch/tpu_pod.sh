#!/usr/bin/env bash
# Train on a Cloud TPU slice: create it, install pacs_jax on every worker, run, watch, stop, delete.
#
#   launch/tpu_pod.sh COMMAND --name NAME --zone ZONE [options] [-- TRAIN_FLAGS...]
#
# Commands:
#   create   create the slice (on-demand, spot or queued resource); a queued resource that ends
#            FAILED is deleted and requested again (--retries)
#   setup    on every worker (--worker=all): uv, Python 3.12, a clone of --repo at --ref, pacs_jax
#            and jax[tpu] in ~/pacs_jax/.venv, and the training data, data/deepscaler/train.jsonl
#            (--data: made by tools/prepare_data.py deepscaler, or copied from gs://)
#   run      create and set up if needed, then start `python -m pacs_jax.train --multihost` on every
#            worker with the same flags, under launch/supervise.sh (restarts after a crash; the run
#            resumes from its workdir), and stream worker 0's log. With --keep-alive it then watches
#            the slice and, after a preemption, re-creates it, sets it up and starts the run again.
#   logs     stream worker 0's training log
#   stop     stop the training on every worker (SIGTERM: a checkpoint is written first)
#   delete   delete the slice (and its queued resource)
#   status   the slice's state and the last lines of worker 0's log
#
# Every argument is checked before anything is created (`run` needs --config, and --repo or an
# 'origin' remote that is a URL the workers can clone, not a local path). `run` then runs the trainer's
# own check of the config and its inputs on this machine (python -m pacs_jax.check_config: the setup
# name, every override, every value, the mesh against --accelerator's devices, and the model folder and
# data files that are on this machine or on gs://; paths only on the workers' disks are left to the
# trainer), before gcloud is asked for anything: a refusal is one line naming the field or file and exit
# status 78. PACS_PYTHON names the Python with pacs_jax installed (default: this checkout's .venv/bin/python,
# else python3). `create` (also when `run` or --keep-alive creates) records how it created the
# slice (--mode, --spot, --accelerator, --runtime-version) in a state file, one key=value a line:
# $PACS_TPU_POD_STATE_DIR (default ~/.local/state/pacs_jax/tpu_pod)/PROJECT_ZONE_NAME (PROJECT:
# --project or "default"). Later commands on that slice use the recorded values for the options they
# are not given: `run --keep-alive` re-creates a preempted queued slice as a queued resource again,
# `delete` deletes the queued resource. `delete` removes the record.
#
# Options:
#   --name NAME  --zone ZONE  --project PROJECT (default: gcloud's)
#   --accelerator TYPE     v4-*, v5e-* (v5litepod-*), v5p-* or v6e-* (default v5p-64)
#   --runtime-version V    default per accelerator: v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite,
#                          v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e
#   --mode MODE            on-demand (default), spot or queued (a queued resource, spot with --spot)
#   --spot                 with --mode queued: a spot queued resource
#   --retries N            create attempts (default 5)
#   --repo URL --ref REF   what to install (default: this checkout's origin remote, when it is a URL,
#                          and its HEAD commit)
#   --data SOURCE          (setup, run) the paper configs' training set, data/deepscaler/train.jsonl, on
#                          every worker: deepscaler (default: tools/prepare_data.py deepscaler downloads
#                          it from the Hugging Face hub where it is missing), gs://.../train.jsonl (copied),
#                          or none (the run's --config.data.train_files are on the workers already)
#   --config SPEC          e.g. configs/paper.py:qwen25_7b,pacs_beta1
#   --workdir DIR          the run's workdir; use gs://BUCKET/... so checkpoints outlive the slice
#   --keep-alive           (run) re-create and restart after preemption
#   --dry-run              print every command instead of running it
#   TRAIN_FLAGS            passed to pacs_jax.train unchanged, e.g. --config.model.path=/data/Qwen2.5-7B;
#                          model.path, data.tokenizer, critic.path and the data files (data.train_files,
#                          eval.set_files) are paths on every worker's disk, or gs:// paths (an HF folder
#                          there is copied to each host's cache once), as --workdir may be
#
# Example (model.path and data.tokenizer are folders on every worker's disk, e.g. copied there with
# `gcloud compute tpus tpu-vm ssh NAME --worker=all --command="gcloud storage cp -r gs://... ~/"`; gs://
# folders work too):
#   launch/tpu_pod.sh run --name pacs-7b --zone us-east5-a --accelerator v5p-64 \
#       --config configs/paper.py:qwen25_7b,pacs_beta1 --workdir gs://my-bucket/pacs_7b -- \
#       --config.model.path=/home/$USER/Qwen2.5-7B --config.data.tokenizer=/home/$USER/Qwen2.5-7B
set -euo pipefail

# shellcheck source=launch/common.sh
. "$(dirname "$0")/common.sh"

[ $# -gt 0 ] || usage
case "$1" in
  -h|--help) usage 0 ;;
  create|setup|run|logs|stop|delete|status) command=$1; shift ;;
  *) die "unknown command '$1' (create | setup | run | logs | stop | delete | status)" ;;
esac

name="" zone="" project="" accelerator="" runtime="" mode="" spot="" retries=5
repo="" ref="" config="" workdir="" data=deepscaler keep_alive=0 dry_run=0
train_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --zone) zone=${2:?--zone needs a value}; shift 2 ;;
    --project) project=${2:?--project needs a value}; shift 2 ;;
    --accelerator) accelerator=${2:?--accelerator needs a value}; shift 2 ;;
    --runtime-version) runtime=${2:?--runtime-version needs a value}; shift 2 ;;
    --mode) mode=${2:?--mode needs a value}; shift 2 ;;
    --spot) spot=1; shift ;;
    --retries) retries=${2:?--retries needs a value}; shift 2 ;;
    --repo) repo=${2:?--repo needs a value}; shift 2 ;;
    --ref) ref=${2:?--ref needs a value}; shift 2 ;;
    --config) config=${2:?--config needs a value}; shift 2 ;;
    --workdir) workdir=${2:?--workdir needs a value}; shift 2 ;;
    --data) data=${2:?--data needs a value}; shift 2 ;;
    --keep-alive) keep_alive=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_flags+=("$@"); break ;;
    --config.*) train_flags+=("$1"); shift ;;
    *) die "unknown option '$1' (train flags go after --)" ;;
  esac
done
[ -n "$name" ] || die "--name is required"
[ -n "$zone" ] || die "--zone is required"
[[ "$retries" =~ ^[1-9][0-9]*$ ]] || die "--retries must be a positive integer"
if [ "$command" = run ] && [ -z "$config" ]; then
  die "--config is required for run (e.g. configs/paper.py:qwen25_7b,pacs_beta1)"
fi
# clonable URL: what a worker can clone (scheme://host/path or user@host:path), not a path on this machine
clonable() { [[ "$1" =~ ^(https?|ssh|git)://[^/]+/. ]] || [[ "$1" =~ ^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^/] ]]; }
if [ "$command" = run ] || [ "$command" = setup ]; then  # what setup installs, before any slice exists
  if [ -z "$repo" ]; then
    repo=$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null) \
      || die "--repo is required (this checkout has no 'origin' remote)"
    clonable "$repo" || die "--repo is required: this checkout's 'origin' remote is a local path ($repo), which" \
      "the workers cannot clone; pass --repo URL (https://..., ssh://... or git@host:org/repo.git)"
  fi
  clonable "$repo" || die "--repo '$repo': not a URL the workers can clone (https://..., ssh://... or git@host:path)"
  [ -n "$ref" ] || ref=$(git -C "$(dirname "$0")/.." rev-parse HEAD 2>/dev/null) || ref=main
  case "$data" in
    deepscaler|none|gs://?*) ;;
    *) die "--data must be deepscaler, none or gs://BUCKET/.../train.jsonl, not '$data'" ;;
  esac
fi

# How the slice was created (see the header): the recorded values fill in the options not given.
state_file="${PACS_TPU_POD_STATE_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/pacs_jax/tpu_pod}/${project:-default}_${zone}_${name}"
if [ "$command" != create ] && [ -f "$state_file" ]; then
  rec_mode="" rec_spot="" rec_accelerator="" rec_runtime="" used=()
  while IFS='=' read -r key value; do
    case "$key" in
      mode) rec_mode=$value ;;
      spot) rec_spot=$value ;;
      accelerator) rec_accelerator=$value ;;
      runtime) rec_runtime=$value ;;
    esac
  done < "$state_file"
  if [ -z "$mode" ] && [ -n "$rec_mode" ]; then mode=$rec_mode; used+=(--mode "$mode"); fi
  if [ -z "$spot" ] && [ "$rec_spot" = 1 ]; then spot=1; used+=(--spot); fi
  if [ -z "$accelerator" ] && [ -n "$rec_accelerator" ]; then
    accelerator=$rec_accelerator; used+=(--accelerator "$accelerator")
    if [ -z "$runtime" ] && [ -n "$rec_runtime" ]; then runtime=$rec_runtime; used+=(--runtime-version "$runtime"); fi
  fi
  [ ${#used[@]} -eq 0 ] || echo "tpu_pod.sh: $name was created with ${used[*]} (recorded in $state_file)" >&2
fi
mode=${mode:-on-demand} spot=${spot:-0} accelerator=${accelerator:-v5p-64}
case "$mode" in on-demand|spot|queued) ;; *) die "--mode must be on-demand, spot or queued, not '$mode'" ;; esac

if [ -z "$runtime" ]; then
  case "$accelerator" in
    v4-*) runtime=tpu-ubuntu2204-base ;;
    v5e-*|v5litepod-*) runtime=v2-alpha-tpuv5-lite ;;
    v5p-*) runtime=v2-alpha-tpuv5 ;;
    v6e-*) runtime=v2-alpha-tpuv6e ;;
    *) die "--accelerator '$accelerator': expected v4-N, v5e-N (v5litepod-N), v5p-N or v6e-N" ;;
  esac
fi
case "$accelerator" in v5e-*) accelerator="v5litepod-${accelerator#v5e-}" ;; esac  # the API's name for v5e

jax_version=0.12.0.1
scope=(--zone="$zone")
[ -z "$project" ] || scope+=(--project="$project")

# ----------------------------------------------------------------------------------- helpers
# on_workers SCRIPT: run a bash script on every worker of the slice.
on_workers() {
  run gcloud compute tpus tpu-vm ssh "$name" "${scope[@]}" --worker=all --command="$1"
}

state() {  # the slice's state (READY, PREEMPTED, ...) or NOT_FOUND
  if [ "$dry_run" -eq 1 ]; then
    run gcloud compute tpus tpu-vm describe "$name" "${scope[@]}" --format='value(state)' >&2
    echo "${DRY_RUN_STATE:-NOT_FOUND}"
    return
  fi
  gcloud compute tpus tpu-vm describe "$name" "${scope[@]}" --format='value(state)' 2>/dev/null || echo NOT_FOUND
}

queued_state() {
  if [ "$dry_run" -eq 1 ]; then
    run gcloud compute tpus queued-resources describe "$name" "${scope[@]}" --format='value(state.state)' >&2
    echo ACTIVE
    return
  fi
  gcloud compute tpus queued-resources describe "$name" "${scope[@]}" --format='value(state.state)' 2>/dev/null \
    || echo NOT_FOUND
}

# record_creation: remember how the slice is created (see the header), before asking for it, so that
# a queued request interrupted while waiting is still deleted as one.
record_creation() {
  local lines
  lines=$(printf 'mode=%s\nspot=%s\naccelerator=%s\nruntime=%s' "$mode" "$spot" "$accelerator" "$runtime")
  if [ "$dry_run" -eq 1 ]; then
    echo "tpu_pod.sh: would record in $state_file: ${lines//$'\n'/ }" >&2
    return
  fi
  mkdir -p "$(dirname "$state_file")"
  printf '%s\n' "$lines" > "$state_file"
}

create() {
  local attempt s
  record_creation
  for ((attempt = 1; attempt <= retries; attempt++)); do
    if [ "$mode" = queued ]; then
      local spot_flag=()
      [ "$spot" -eq 0 ] || spot_flag=(--spot)
      run gcloud compute tpus queued-resources create "$name" "${scope[@]}" --node-id="$name" \
        --accelerator-type="$accelerator" --runtime-version="$runtime" "${spot_flag[@]}"
      while true; do
        s=$(queued_state)
        case "$s" in
          ACTIVE) return 0 ;;
          FAILED|SUSPENDED|NOT_FOUND)
            echo "tpu_pod.sh: queued resource $name is $s (attempt $attempt of $retries); requesting again" >&2
            run gcloud compute tpus queued-resources delete "$name" "${scope[@]}" --force --quiet || true
            break ;;
          *) sleep 60 ;;  # WAITING_FOR_RESOURCES, PROVISIONING, ...
        esac
      done
    else
      local spot_flag=()
      [ "$mode" = on-demand ] || spot_flag=(--spot)
      if run gcloud compute tpus tpu-vm create "$name" "${scope[@]}" --accelerator-type="$accelerator" \
           --version="$runtime" "${spot_flag[@]}"; then
        return 0
      fi
      echo "tpu_pod.sh: create failed (attempt $attempt of $retries); retrying in 60 s" >&2
      sleep 60
    fi
  done
  die "could not create $name after $retries attempts"
}

delete() {
  if [ "$mode" = queued ]; then
    run gcloud compute tpus queued-resources delete "$name" "${scope[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$name" "${scope[@]}" --quiet
  fi
  [ "$dry_run" -eq 1 ] || rm -f "$state_file"
}

setup() {  # $repo and $ref were resolved with the arguments
  local steps=(
    "set -euo pipefail"
    "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh"
    "export PATH=\"\$HOME/.local/bin:\$PATH\""
    "[ -d ~/pacs_jax/.git ] || git clone $(printf '%q' "$repo") ~/pacs_jax"
    "cd ~/pacs_jax && git fetch --quiet origin && git checkout --quiet $(printf '%q' "$ref")"
    "uv venv --allow-existing --python 3.12 .venv"
    # gcsfs: gs:// workdirs
    "uv pip install --python .venv/bin/python -r requirements.txt -e . 'jax[tpu]==$jax_version' gcsfs"
  )
  # the training data the paper configs read (data/deepscaler/train.jsonl), on every worker
  case "$data" in
    deepscaler) steps+=("[ -f data/deepscaler/train.jsonl ] || .venv/bin/python tools/prepare_data.py deepscaler") ;;
    gs://*) steps+=("mkdir -p data/deepscaler"
                    "gcloud storage cp $(printf '%q' "$data") data/deepscaler/train.jsonl") ;;
  esac
  local script
  script=$(printf '%s; ' "${steps[@]}")
  on_workers "$script"
}

start_training() {  # $config was checked with the arguments
  local train=(.venv/bin/python -m pacs_jax.train --multihost "--config=$config")
  [ -z "$workdir" ] || train+=("--workdir=$workdir")
  train+=("${train_flags[@]}")
  local quoted
  quoted=$(printf '%q ' "${train[@]}")
  on_workers "cd ~/pacs_jax && setsid nohup bash launch/supervise.sh -- ${quoted% } > ~/pacs_train.log 2>&1 < /dev/null &"
}

logs() {
  run gcloud compute tpus tpu-vm ssh "$name" "${scope[@]}" --worker=0 --command="tail -n 200 -F ~/pacs_train.log"
}

check_config() {  # the trainer's check on this machine (see the header); exits 78 on a refusal
  local root python overrides=() flag status=0
  root=$(cd "$(dirname "$0")/.." && pwd)
  python=${PACS_PYTHON:-}
  if [ -z "$python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then python=$root/.venv/bin/python; else python=python3; fi
  fi
  for flag in "${train_flags[@]}"; do
    case "$flag" in --config.*) overrides+=("$flag") ;; esac
  done
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pacs_jax.check_config "--accelerator=$accelerator" \
    "--config=$config" "${overrides[@]}" >&2 || status=$?
  [ "$status" -ne 78 ] || exit 78  # its one line names the field or file
  [ "$status" -eq 0 ] || die "the config check could not run with $python (status $status; the lines above say" \
    "why): set PACS_PYTHON to a Python with pacs_jax installed"
}

# ----------------------------------------------------------------------------------- commands
case "$command" in
  create) create ;;
  setup) setup ;;
  delete) delete ;;
  stop) on_workers "pkill -TERM -f 'launch/supervise.sh' || true" ;;
  status)
    state
    run gcloud compute tpus tpu-vm ssh "$name" "${scope[@]}" --worker=0 --command="tail -n 20 ~/pacs_train.log" ;;
  logs) logs ;;
  run)
    check_config
    if [ "$(state)" = NOT_FOUND ]; then
      create
      setup
    fi
    start_training
    if [ "$keep_alive" -eq 0 ]; then
      logs
      exit 0
    fi
    logs &
    while [ "$dry_run" -eq 0 ]; do
      sleep 120
      s=$(state)
      case "$s" in
        PREEMPTED|TERMINATED|NOT_FOUND)
          echo "tpu_pod.sh: slice $name is $s: re-creating it and resuming the run" >&2
          [ "$s" = NOT_FOUND ] || delete
          create
          setup
          start_training ;;
      esac
    done ;;
esac
