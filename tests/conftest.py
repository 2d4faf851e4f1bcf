"""Test setup: 8 simulated CPU devices (set before jax is imported) and paths to the shared data."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """../shared/data beside the repository (the real datasets)."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path}")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> pathlib.Path:
    """../shared/tokenizers/qwen3: the real Qwen tokenizer files."""
    path = SHARED / "tokenizers" / "qwen3"
    if not path.is_dir():
        pytest.skip(f"Qwen tokenizer not found at {path}")
    return path
