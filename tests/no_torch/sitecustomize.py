"""On the PYTHONPATH of the tests' trainer and tool subprocesses (tests/train_helpers.py's ``train_env``): PyTorch
is not importable there, as in a user's runtime (pyproject.toml: PyTorch is in the test extra only, for the
transformers references the test processes compare against). tensorboardX and transformers import it when it
is installed: 1.3 of a tiny 2-step trainer run's 11 CPU seconds."""

import sys

sys.modules.setdefault("torch", None)  # ``import torch`` raises ImportError; importlib.util.find_spec finds none
