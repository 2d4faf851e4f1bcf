# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run): usage text from the script's header, errors, dry runs.
# The sourcing script sets `dry_run` (0 or 1) before calling run.

# usage [STATUS]: print the script's header comment (up to `set -euo`) and exit.
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

# die MESSAGE: print "SCRIPT: MESSAGE" to stderr and exit 2.
die() { echo "$(basename "$0"): $*" >&2; exit 2; }

# run CMD...: run it, or print it (shell-quoted, on one line) when dry_run is 1.
run() {
  if [ "${dry_run:-0}" -eq 1 ]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}
