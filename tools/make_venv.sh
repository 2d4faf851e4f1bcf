#!/bin/sh
# Creates a virtual environment with a Python >= 3.12 (JAX >= 0.11 and tokamax declare it; pip on 3.11 hides them).
#
#   sh tools/make_venv.sh DIR
#
# Looks, in this order, for python3 (when it is 3.12 or newer), python3.12, python3.13, then the oldest
# 3.12+ that pyenv holds (`pyenv versions`; its shims answer only inside a pyenv version): the floor the
# pins are tested on first. DIR that already
# holds a 3.12+ environment is kept, an older one replaced; a folder that is no environment is refused.
# Where no Python is found: one line naming what to install, exit status 1.
set -eu
dir=${1:?usage: sh tools/make_venv.sh DIR}

is_312() {  # $1: a Python interpreter; true when it runs and is 3.12 or newer
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null
}

if [ -x "$dir/bin/python" ] && is_312 "$dir/bin/python"; then
  echo "tools/make_venv.sh: $dir kept, with $("$dir/bin/python" --version)" >&2
  exit 0
fi

python=""
for candidate in python3 python3.12 python3.13; do
  if command -v "$candidate" >/dev/null 2>&1 && is_312 "$candidate"; then
    python=$(command -v "$candidate")
    break
  fi
done
if [ -z "$python" ] && command -v pyenv >/dev/null 2>&1; then
  for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])\.[0-9]+$' | sort -t. -k2,2n -k3,3nr); do
    candidate="$(pyenv root)/versions/$version/bin/python3"
    if is_312 "$candidate"; then
      python=$candidate
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "tools/make_venv.sh: no Python 3.12 or newer found (python3, python3.12, python3.13, pyenv): install one, e.g. 'apt install python3.12-venv' or 'pyenv install 3.12'" >&2
  exit 1
fi
if [ -e "$dir" ] && [ ! -f "$dir/pyvenv.cfg" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
  echo "tools/make_venv.sh: $dir exists and is not a virtual environment: name an empty or new folder" >&2
  exit 1
fi
"$python" -m venv --clear "$dir"  # an older Python's environment there is replaced
echo "tools/make_venv.sh: $dir with $("$dir/bin/python" --version)" >&2
