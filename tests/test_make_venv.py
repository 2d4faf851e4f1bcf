"""tools/make_venv.sh: the README's two commands and CI find a Python >= 3.12 on a fresh machine, or stop
with one line naming what to install (issue "Current JAX on Python 3.12", item 2)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "tools" / "make_venv.sh"


def _fake_python(path: pathlib.Path, minor: int) -> None:
    """An interpreter that answers the script's version check as Python 3.MINOR would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {0 if minor >= 12 else 1}\n")
    path.chmod(0o755)


def _run(bin_dir: pathlib.Path, target: pathlib.Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(["sh", str(SCRIPT), str(target)], capture_output=True, text=True, timeout=120, env=env)


def test_a_machine_with_only_python_3_11_gets_one_line_naming_what_to_install(tmp_path):
    bin_dir = tmp_path / "bin"
    for name in ("python3", "python3.11"):
        _fake_python(bin_dir / name, 11)
    for name in ("python3.12", "python3.13"):  # a pyenv shim outside its version: fails as 3.11's check would
        _fake_python(bin_dir / name, 11)
    run = _run(bin_dir, tmp_path / "venv")
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "no Python 3.12 or newer" in run.stderr and "install" in run.stderr
    assert not (tmp_path / "venv").exists()


def test_pyenv_s_oldest_3_12_plus_is_taken_where_pyenv_provides_it(tmp_path):
    """These machines: python3 is 3.11 and pyenv holds 3.12.1 and 3.13.0 beside it."""
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    _fake_python(bin_dir / "python3", 11)
    (bin_dir / "pyenv").write_text(f"#!/bin/sh\ncase \"$1\" in root) echo {root} ;;"
                                   " versions) printf '3.11.7\\n3.13.0\\n3.12.1\\nsystem\\n' ;; esac\n")
    (bin_dir / "pyenv").chmod(0o755)
    _fake_python(root / "versions" / "3.11.7" / "bin" / "python3", 11)
    _fake_python(root / "versions" / "3.13.0" / "bin" / "python3", 13)
    (root / "versions" / "3.12.1" / "bin").mkdir(parents=True)
    (root / "versions" / "3.12.1" / "bin" / "python3").symlink_to(sys.executable)  # this suite's 3.12+
    run = _run(bin_dir, tmp_path / "venv")
    assert run.returncode == 0, run.stderr
    version = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "--version"], capture_output=True,
                             text=True, check=True).stdout.split()[1]
    assert tuple(map(int, version.split(".")[:2])) >= (3, 12)
    assert f"with Python {version}" in run.stderr
    again = _run(bin_dir, tmp_path / "venv")  # an existing 3.12+ environment is kept, not rebuilt
    assert again.returncode == 0 and "kept" in again.stderr


def test_a_folder_that_is_not_an_environment_is_refused_not_emptied(tmp_path):
    """DIR is the user's word: a folder of other files (a typo, ``.``) is never cleared."""
    bin_dir, target = tmp_path / "bin", tmp_path / "project"
    (bin_dir).mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)  # a 3.12+ on PATH
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    run = _run(bin_dir, target)
    assert run.returncode == 1 and "is not a virtual environment" in run.stderr
    assert (target / "notes.txt").read_text() == "keep me"
