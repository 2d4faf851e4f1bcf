"""The README's runtime install (requirements.txt + `pip install -e .`) has what a real model's run needs.

The test requirements pull in torch, and torch pulls in jinja2, which transformers' apply_chat_template
needs: the suite alone would never notice a runtime requirement missing. So requirements.txt and
pyproject.toml are checked here, and CI (.ci/run) installs requirements.txt alone in a second, fresh
virtual environment and renders a real chat prompt with it (.ci/runtime_check.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib

from conftest import REPO


def _pinned(requirements: str) -> dict[str, str]:
    """{normalised name: version} of the ``name==version`` lines of a requirements file."""
    pins = {}
    for line in requirements.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return pins


def test_runtime_requirements_pin_the_chat_template_engine():
    pins = _pinned((REPO / "requirements.txt").read_text())
    assert "transformers" in pins and "jinja2" in pins, "requirements.txt: jinja2 (apply_chat_template) is not pinned"
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"jinja2\b", d, re.IGNORECASE) for d in dependencies), "pyproject.toml lacks jinja2"


def test_ci_runs_the_readme_tests_then_the_runtime_install_alone_in_a_fresh_venv():
    readme = (REPO / "README.md").read_text()
    test_command = "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements-test.txt -e . && pytest -q"
    assert test_command in readme
    ci = (REPO / ".ci" / "run").read_text()
    lines = [line.split("  #")[0] for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    # the README's test command (pip quiet), stopping CI on any failure
    tests = next(i for i, line in enumerate(lines) if "requirements-test.txt" in line)
    assert lines[tests].replace("pip install -q ", "pip install ").startswith(test_command)
    assert lines[tests].rstrip().endswith("|| exit")
    # then a second venv, in another folder, with requirements.txt alone, and the check that needs jinja2
    runtime = lines[tests + 1:]
    venvs = [shlex.split(line)[-1] for line in runtime if line.startswith("python3 -m venv ")]
    assert venvs and venvs[0] != ".venv"
    installs = [line for line in runtime if line.startswith("pip install")]
    assert installs == ["pip install -q -r requirements.txt -e ."]
    assert runtime[-1] == "python .ci/runtime_check.py"


def test_the_runtime_check_refuses_an_environment_with_the_test_extras():
    # here torch is installed (requirements-test.txt), which would hide a missing jinja2
    check = subprocess.run(["python", str(REPO / ".ci" / "runtime_check.py")], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
    assert check.returncode == 1 and "torch is installed here" in check.stderr
