"""A Python that compiles for NVIDIA GPUs on this CPU: a virtualenv (``.venv-gpu`` in the repository)
holding only JAX's CUDA plugin and cuDNN (requirements-gpu-compile.txt, installed once, ~1 GB) that
reads every other package from the test interpreter's own site-packages (a .pth file).

It is a separate interpreter because the CUDA plugin, once importable, logs its failed driver check
to stderr in every JAX process, which the CLI tests (one line of output on an error) would see."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig

REPO = pathlib.Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-gpu"
REQUIREMENTS = REPO / "requirements-gpu-compile.txt"
ATTEMPTS = 3  # the CUDA wheels are ~1 GB together; a download cut or corrupted on the way fails its hash check


def gpu_python() -> pathlib.Path:
    """The GPU-compiling interpreter, made on first use (pip reaches PyPI; later runs reuse it)."""
    python = VENV / "bin" / "python"
    stamp = VENV / "requirements-gpu-compile.txt"
    if python.exists() and stamp.exists() and stamp.read_text() == REQUIREMENTS.read_text():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # Every package but the CUDA compiler's from the test interpreter (jax, flax, pacs_jax's editable
    # install): its site-packages as a site directory, so that its own .pth files are read too.
    site = sysconfig.get_paths()["purelib"]
    (pathlib.Path(purelib) / "pacs_jax_test_env.pth").write_text(f"import site; site.addsitedir({site!r})\n")
    _pip_install(python)
    stamp.write_text(REQUIREMENTS.read_text())
    return python


def _pip_install(python: pathlib.Path) -> None:
    """Installs requirements-gpu-compile.txt, downloading afresh up to ATTEMPTS times: pip retries a refused
    connection itself but not a wheel whose bytes arrived wrong ("do not match the hashes"), which CI saw once."""
    command = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "-r", str(REQUIREMENTS)]
    for attempt in range(1, ATTEMPTS + 1):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            return
        print(f"gpu_compiler: pip install, attempt {attempt} of {ATTEMPTS}, failed:\n{done.stderr[-2000:]}",
              file=sys.stderr)
    raise subprocess.CalledProcessError(done.returncode, command, output=done.stdout, stderr=done.stderr)
