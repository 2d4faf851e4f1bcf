"""How many times the package reads the raw config (an ``ml_collections.ConfigDict``) below its entry points?

    python tools/count_config_reads.py            # per module, then the total outside the spec's construction

A read is an attribute or subscript of a name that holds the raw config: ``self.config``, a parameter annotated
``ml_collections.ConfigDict`` (or ``ConfigDict``) or an unannotated ``config``, and a name assigned from such a name's attribute
(``tc = config.train``, ``tc, rc = config.train, config.rollout``: a section alias). Counted per
function, by walking each module of pacs_jax/ with ``ast`` (nothing is imported). The edge, where
the raw config is allowed: the CLIs (train.py, evaluate.py, check_config.py) and the spec's
construction (training/spec.py, the ``from_config`` classmethods).
"""

from __future__ import annotations

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
EDGE = ("pacs_jax/train.py", "pacs_jax/evaluate.py", "pacs_jax/check_config.py", "pacs_jax/training/spec.py")


def _is_config_annotation(node: ast.expr | None) -> bool:
    text = ast.unparse(node) if node is not None else ""
    return text.endswith("ConfigDict") or text.endswith("ConfigDict | None")


def _holder(node: ast.expr) -> str | None:
    """"self.config" for ``self.config`` (an object's raw config), the name for a name, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return "self.config"
    return node.id if isinstance(node, ast.Name) else None


def _base_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)) and _holder(node) is None:
        node = node.value
    return _holder(node)


def _function_reads(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Reads of the raw config in ``fn``'s own body (nested functions included: they close over it)."""
    args = fn.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
             if _is_config_annotation(a.annotation) or (a.arg == "config" and a.annotation is None)}
    names.add("self.config")
    for node in ast.walk(fn):  # section aliases: x = config.section, a, b = config.s1, config.s2
        if isinstance(node, ast.Assign):
            targets = node.targets[0]
            pairs = (zip(targets.elts, node.value.elts) if isinstance(targets, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(targets, node.value)])
            for target, value in pairs:
                if isinstance(target, ast.Name) and isinstance(value, (ast.Attribute, ast.Subscript)) \
                        and _base_name(value) in names:
                    names.add(target.id)
    reads = 0
    for node in ast.walk(fn):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and _holder(node.value) in names \
                and isinstance(node.ctx, ast.Load):
            reads += 1
    return reads


def module_reads(path: pathlib.Path) -> int:
    """Reads of the raw config in the module at ``path``, over its outermost functions and methods."""
    tree = ast.parse(path.read_text())
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "from_config":
            total += _function_reads(node)
    return total


def package_reads() -> dict[str, int]:
    """{module path: its reads of the raw config}, for the modules of pacs_jax/ that read it."""
    counts = {}
    for path in sorted((REPO / "pacs_jax").rglob("*.py")):
        reads = module_reads(path)
        if reads:
            counts[str(path.relative_to(REPO))] = reads
    return counts


def main(argv: list[str]) -> int:
    counts = package_reads()
    below = 0
    for rel, reads in sorted(counts.items(), key=lambda kv: -kv[1]):
        edge = rel in EDGE
        below += 0 if edge else reads
        print(f"{reads:5d}  {rel}{'  (edge)' if edge else ''}")
    print(f"{sum(counts.values()):5d}  in all; {below} below the entry points and outside the spec's construction")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
