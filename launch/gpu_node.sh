#!/usr/bin/env bash
# Train on GPU nodes: one process per node drives all of its GPUs.
#
#   launch/gpu_node.sh --config SPEC [--workdir DIR] [--coordinator HOST:PORT --num_processes N --process_id I]
#                      [--no-supervise] [--dry-run] [-- TRAIN_FLAGS...]
#
#   one node:       launch/gpu_node.sh --config configs/paper.py:qwen25_3b,pacs_beta1 --workdir /data/runs/3b
#   Slurm:          srun --nodes=4 --ntasks-per-node=1 launch/gpu_node.sh --config ... --workdir /shared/runs/3b
#                   (JAX finds the other nodes from the SLURM_* variables: --multihost is passed for you)
#   other clusters: run on every node with the same --coordinator (node 0's address; PORT + 1 must be
#                   free too) and --num_processes, and each node's --process_id
#
# Sets up .venv (pacs_jax + jax[cuda12]) on first use, and installs jax[cuda12] into an existing .venv
# that has only the CPU build of JAX (requirements.txt pins it: a .venv made for the tests or the demo);
# then checks that JAX in .venv sees the GPUs and runs pacs_jax.train under launch/supervise.sh
# (restarts after a crash; the run resumes from its workdir) unless --no-supervise.
# --dry-run prints the commands instead of running them.
set -euo pipefail

# shellcheck source=launch/common.sh
. "$(dirname "$0")/common.sh"

config="" workdir="" coordinator="" num_processes="" process_id="" supervise=1 dry_run=0
train_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config=${2:?--config needs a value}; shift 2 ;;
    --workdir) workdir=${2:?--workdir needs a value}; shift 2 ;;
    --coordinator) coordinator=${2:?--coordinator needs a value}; shift 2 ;;
    --num_processes) num_processes=${2:?--num_processes needs a value}; shift 2 ;;
    --process_id) process_id=${2:?--process_id needs a value}; shift 2 ;;
    --no-supervise) supervise=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_flags+=("$@"); break ;;
    --config.*) train_flags+=("$1"); shift ;;
    *) die "unknown option '$1' (train flags go after --)" ;;
  esac
done
[ -n "$config" ] || die "--config is required (e.g. configs/paper.py:qwen25_3b,pacs_beta1)"

cd "$(dirname "$0")/.."
jax_version=0.12.0.1
# has_cuda_jax: .venv's JAX has a CUDA plugin of its own version (jax[cuda12], or jax[cuda13] installed by hand)
has_cuda_jax() {
  [ -x .venv/bin/python ] && .venv/bin/python - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
jax = m.version("jax")
plugins = []
for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
    try:
        plugins.append(m.version(name))
    except m.PackageNotFoundError:
        pass
sys.exit(0 if jax in plugins else 1)
PY
}
if [ ! -x .venv/bin/python ]; then
  run sh tools/make_venv.sh .venv  # a Python >= 3.12 (JAX >= 0.11 declares it)
fi
if ! has_cuda_jax; then  # a new .venv, or one with the CPU build only
  run .venv/bin/pip install -q -r requirements.txt -e . "jax[cuda12]==$jax_version"
fi
# the GPUs must be what JAX runs on: a CPU fallback would train a 7B for weeks without a word
run .venv/bin/python -c "import jax, sys; b = jax.default_backend(); sys.exit(0 if b == 'gpu' else \
f'gpu_node.sh: JAX in .venv runs on {b}, not on GPUs (driver, CUDA_VISIBLE_DEVICES?): {jax.devices()}')"

train=(.venv/bin/python -m pacs_jax.train "--config=$config")
[ -z "$workdir" ] || train+=("--workdir=$workdir")
if [ -n "$coordinator" ]; then
  [ -n "$num_processes" ] && [ -n "$process_id" ] || die "--coordinator needs --num_processes and --process_id"
  train+=("--coordinator=$coordinator" "--num_processes=$num_processes" "--process_id=$process_id")
elif [ "${SLURM_NTASKS:-1}" -gt 1 ]; then
  train+=(--multihost)
fi
train+=("${train_flags[@]}")

export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
if [ "$supervise" -eq 1 ]; then
  run bash launch/supervise.sh -- "${train[@]}"
else
  run "${train[@]}"
fi
