"""``from pacs_jax.<package> import *`` works for every package of pacs_jax: each name of its ``__all__``
is defined (an undefined one makes the star import raise AttributeError) and named once."""

from __future__ import annotations

import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "pacs_jax").rglob("__init__.py"))


def test_every_package_is_found():
    assert {"pacs_jax", "pacs_jax.models", "pacs_jax.rl", "pacs_jax.training"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_star_import_defines_every_name_of_all(package):
    names = getattr(importlib.import_module(package), "__all__", None)
    namespace: dict = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the statement under test
    if names is not None:
        assert len(set(names)) == len(names), f"{package}.__all__ names some twice"
        assert set(names) <= set(namespace)
