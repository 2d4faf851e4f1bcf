"""The import graph of pacs_jax: no cycles, the model / sampler never reach the trainer or the RL code,
and no module of the sampler uses another's private names (carry-over goes through the engine's seam).

The graph is read from the source with ``ast`` (every ``import`` statement, module level or inside a
function, so a lazy import does not hide a cycle). Importing ``a.b.c`` runs ``a`` and ``a.b`` first,
so an import also depends on the target's packages, except those the importer lies in (they are
already being imported when it runs).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_files(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every module of ``package`` under ``root``."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules of ``modules`` an import statement in ``module`` reads attributes of."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [name for name in names if name in modules]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            found.append(submodule)
        elif source in modules:
            found.append(source)
    return found


def _packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """{module: modules of ``package`` its import statements run} (targets and their packages)."""
    files = module_files(root, package)
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        own = set(_packages(module)) | ({module} if is_package else set())
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, is_package, set(files)):
                    edges |= {target, *(p for p in _packages(target) if p not in own and p in files)}
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of ``graph``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(root: pathlib.Path, package: str) -> list[str]:
    """"module:line name" for each private name (a leading underscore) of a module of ``package`` that
    another module of it imports (``from m import _f``) or reads off an imported module (``m._f``,
    ``pkg.m._f``)."""
    files = module_files(root, package)
    found = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        bound = {}  # local name -> the dotted module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:  # "import a.b" binds a, "import a.b as x" binds x to a.b
                    name = alias.asname or alias.name.split(".")[0]
                    bound[name] = alias.name if alias.asname else name
            elif isinstance(node, ast.ImportFrom):
                for alias, target in zip(node.names, _alias_targets(node, module, is_package, set(files))):
                    if target is not None and target.endswith("." + alias.name):
                        bound[alias.asname or alias.name] = target
                    elif target not in (None, module) and _private(alias.name):
                        found.append(f"{module}:{node.lineno} {target}.{alias.name}")

        def dotted(node) -> str | None:
            if isinstance(node, ast.Name):
                return bound.get(node.id)
            if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
                return f"{base}.{node.attr}"
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = dotted(node.value)
                if owner in files and owner != module:
                    found.append(f"{module}:{node.lineno} {owner}.{node.attr}")
    return found


def _alias_targets(node: ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str | None]:
    """For each name of a ``from ... import`` in ``module``: the module of ``modules`` it is (a
    submodule) or is read from, or None (outside them)."""
    targets = []
    for alias in node.names:
        found = _targets(ast.ImportFrom(module=node.module, names=[alias], level=node.level), module, is_package,
                         modules)
        targets.append(found[0] if found else None)
    return targets


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, cycle", [
    # a lazy import inside a function closes the circle
    ({"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import f\n",
      "pkg/b.py": "def f():\n    from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    # importing pkg.sub.x runs pkg/sub/__init__.py, which imports the importer
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "from pkg.top import g\n", "pkg/sub/x.py": "",
      "pkg/top.py": "from pkg.sub.x import *\n"}, ["pkg.sub", "pkg.top", "pkg.sub"]),
    # relative imports
    ({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import f\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
])
def test_finds_cycles(tmp_path, files, cycle):
    _write(tmp_path, files)
    assert find_cycle(import_graph(tmp_path, "pkg")) == cycle


def test_a_package_importing_its_submodules_is_no_cycle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from pkg.sub import x\n", "pkg/sub/__init__.py": "from .x import f\n",
                      "pkg/sub/x.py": "from pkg.sub.y import g\n", "pkg/sub/y.py": "import json\n"})
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.sub", "pkg.sub.x"}, "pkg.sub": {"pkg.sub.x"}, "pkg.sub.x": {"pkg.sub.y"},
                     "pkg.sub.y": set()}
    assert find_cycle(graph) is None


def test_pacs_jax_has_no_import_cycle():
    graph = import_graph(ROOT, "pacs_jax")
    assert {"pacs_jax.models", "pacs_jax.checkpoints", "pacs_jax.data.readers"} <= graph.keys()
    assert find_cycle(graph) is None


@pytest.mark.parametrize("lower", ["pacs_jax.models", "pacs_jax.sampling"])
def test_model_and_sampler_do_not_reach_training_or_rl(lower):
    graph = import_graph(ROOT, "pacs_jax")
    modules = [m for m in graph if m == lower or m.startswith(lower + ".")]
    assert len(modules) > 3
    for module in modules:
        bad = sorted(m for m in reachable(graph, module)
                     if m.split(".")[:2] in (["pacs_jax", "training"], ["pacs_jax", "rl"]))
        assert not bad, f"{module} imports (directly or through others) {bad}"


TRAINING = "pacs_jax.training"
ROLES = (f"{TRAINING}.engine", f"{TRAINING}.learner")
# the layer above both roles, which joins them: the step's programs, the schedules, the loop and the run
ABOVE_ROLES = {f"{TRAINING}.{name}" for name in ("step_programs", "rollout", "loop", "run", "workdir", "abstract_step")}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _training_graph() -> dict[str, set[str]]:
    graph = import_graph(ROOT, "pacs_jax")
    return {m: {t for t in edges if _in(t, TRAINING)} for m, edges in graph.items() if _in(m, TRAINING)}


@pytest.mark.parametrize("role, other", [ROLES, ROLES[::-1]])
def test_the_engine_and_the_learner_never_import_each_other(role, other):
    """training/engine/ and training/learner/ meet only in training/records.py: neither reaches the other,
    directly or through a shared module."""
    graph = _training_graph()
    modules = [m for m in graph if _in(m, role)]
    assert len(modules) > 3
    for module in modules:
        bad = sorted(m for m in reachable(graph, module) if _in(m, other))
        assert not bad, f"{module} imports (directly or through others) {bad}"


def test_the_records_import_neither_role():
    graph = _training_graph()
    bad = sorted(m for m in reachable(graph, f"{TRAINING}.records") if any(_in(m, role) for role in ROLES))
    assert not bad, f"training/records.py imports (directly or through others) {bad}"


def test_the_training_graph_is_acyclic_and_nothing_runs_back_up():
    """No cycle in pacs_jax.training; a role reaches nothing of the layer above it (the step's programs, the
    schedules, the loop, the run), and a shared module of training/ (spec, memory_check, progress, ...)
    reaches neither a role nor that layer."""
    graph = _training_graph()
    assert find_cycle(graph) is None
    assert ABOVE_ROLES & graph.keys() == ABOVE_ROLES
    for module in graph:
        if module in ABOVE_ROLES or module in (TRAINING, *ROLES):
            continue
        above = sorted(m for m in reachable(graph, module) if m in ABOVE_ROLES)
        assert not above, f"{module} imports (directly or through others) {above}, above it"
        if not any(_in(module, role) for role in ROLES):
            roles = sorted(m for m in reachable(graph, module) if any(_in(m, role) for role in ROLES))
            assert not roles, f"the shared {module} imports (directly or through others) the roles' {roles}"


def test_finds_private_names_used_across_modules(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def _f(): pass\ndef g(): _f()\n",
                      "pkg/b.py": "from pkg.a import _f, g\n", "pkg/c.py": "from pkg import a\nx = a._f\n",
                      "pkg/d.py": "from . import a as m\nimport pkg.a\ny = m.g, m._f, pkg.a._f\n"})
    assert private_uses(tmp_path, "pkg") == ["pkg.b:1 pkg.a._f", "pkg.c:2 pkg.a._f"] + ["pkg.d:3 pkg.a._f"] * 2


def test_no_sampler_module_uses_another_ones_private_names():
    """The one-call sampler (engine.py) and carry-over (carry_over*.py) share only the engine's public
    seam (seam.py); no module of pacs_jax.sampling imports or reads a private name of another."""
    assert len(module_files(ROOT, "pacs_jax/sampling")) > 10
    assert private_uses(ROOT, "pacs_jax/sampling") == []


def test_the_two_schedulers_meet_only_in_the_engine_seam():
    """The one-call sampler (sampling/engine.py) and carry-over (sampling/carry_over*.py) both build on
    sampling/seam.py and neither reaches the other."""
    graph = import_graph(ROOT, "pacs_jax")
    engine, seam = "pacs_jax.sampling.engine", "pacs_jax.sampling.seam"
    carry_over = sorted(m for m in graph if m.startswith("pacs_jax.sampling.carry_over"))
    assert len(carry_over) > 1
    assert seam in graph[engine] and not set(carry_over) & reachable(graph, engine)
    for module in carry_over:
        assert engine not in reachable(graph, module), f"{module} reaches {engine}"
    assert seam in graph["pacs_jax.sampling.carry_over_programs"]


def graph_figures(graph: dict[str, set[str]], package: str) -> tuple[int, int, int]:
    """(modules, layers, imports) of ``package``'s part of ``graph``: a module that imports none of the part
    is layer 1, any other one above the highest it imports (the graph is acyclic:
    test_pacs_jax_has_no_import_cycle)."""
    part = {m: {t for t in edges if _in(t, package)} for m, edges in graph.items() if _in(m, package)}
    layers: dict[str, int] = {}

    def layer(module: str) -> int:
        if module not in layers:
            layers[module] = 1 + max((layer(t) for t in part[module] if t != module), default=0)
        return layers[module]

    return len(part), max(map(layer, part)), sum(len(edges - {m}) for m, edges in part.items())



def test_graph_figures_count_modules_layers_and_imports(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/low.py": "", "pkg/mid.py": "from pkg import low\n",
                      "pkg/top.py": "from pkg import low, mid\nimport json\n"})
    # pkg, low: layer 1; mid imports low: 2; top imports low and mid: 3 (pkg, which they lie in, is no import)
    assert graph_figures(import_graph(tmp_path, "pkg"), "pkg") == (4, 3, 3)

if __name__ == "__main__":  # python tests/test_import_graph.py [CHECKOUT]: the figures of a checkout (this one)
    import sys

    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    whole = import_graph(root, "pacs_jax")
    for name in ("pacs_jax", "pacs_jax.training"):
        modules, layers, imports = graph_figures(whole, name)
        print(f"{name}: {modules} modules, {layers} layers, {imports} imports, cycle: {find_cycle(whole)}")
