"""The README a newcomer reads (issue 53 item 7, issue 64 item 4): about 200 lines, its table of commands names
every command the repository has, one line each, and its map of the code names paths that exist, one line a
package. (Its plan tables moved to docs/plan_tables.md: tests/test_plan_tables.py.)"""

from __future__ import annotations

from conftest import REPO

README = REPO / "README.md"


def _table(header: str) -> list[list[str]]:
    """The cells of each row of the README's one table headed ``header`` (a line such as "| command | for |")."""
    lines = README.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line == header]
    assert len(starts) == 1, f"README: {len(starts)} tables headed {header!r}"
    assert lines[starts[0] + 1].startswith("|---"), lines[starts[0] + 1]
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 2 and cells[0].startswith("`") and cells[0].endswith("`") and cells[1], line
        rows.append(cells)
    return rows


def test_the_readme_is_short():
    """A newcomer reads it in ten minutes: the details are in docs/guide.md, the figures in docs/measurements.md."""
    assert len(README.read_text().splitlines()) <= 220


def test_the_readme_has_a_one_line_map_of_every_command():
    """Every command the repository has is in the README's table of commands (the CLIs, each tool with a
    __main__, the launch scripts; the benchmarks as one row), and every row's command exists."""
    rows = [(cells[0].strip("`"), cells[1]) for cells in _table("| command | for |")]
    named = [command for command, _ in rows]
    clis = sorted(f"python -m pacs_jax.{p.stem}" for p in (REPO / "pacs_jax").glob("*.py")
                  if 'if __name__ == "__main__"' in p.read_text())
    assert clis == ["python -m pacs_jax.check_config", "python -m pacs_jax.evaluate", "python -m pacs_jax.train"]
    tools = sorted(f"python tools/{p.name}" for p in (REPO / "tools").glob("*.py")
                   if 'if __name__ == "__main__"' in p.read_text() and not p.name.startswith("bench_"))
    launch = sorted(f"launch/{p.name}" for p in (REPO / "launch").glob("*.sh") if p.name != "common.sh")
    missing = [c for c in (*clis, *tools, *launch, "python tools/bench_*.py", "pytest -q") if c not in named]
    assert not missing, f"not in the README's map: {missing}"
    for command in named:
        path = command.split()[-1] if command.startswith("python tools") or command.startswith("launch") else None
        assert path is None or list(REPO.glob(path)), f"{command}: no such file"
    assert len(rows) == len(set(named)) and len(rows) <= 25


def test_every_path_in_the_readme_s_map_of_the_code_exists():
    """The map of the code (a row a package or folder) names only paths the repository has: a folder written with
    its trailing slash is a folder, a file a file. Every package of pacs_jax is in it, and every top-level folder
    a user reads."""
    paths = [cells[0].strip("`") for cells in _table("| path | what |")]
    assert len(paths) == len(set(paths))
    wrong = [p for p in paths if not ((REPO / p).is_dir() if p.endswith("/") else (REPO / p).is_file())]
    assert not wrong, f"the README's map names paths that do not exist: {wrong}"
    packages = sorted(f"{p.parent.relative_to(REPO)}/" for p in (REPO / "pacs_jax").rglob("__init__.py"))
    folders = [f"{name}/" for name in ("configs", "tools", "launch", "tests", "data", "docs")]
    unmapped = [p for p in (*packages, *folders) if p not in paths]
    assert not unmapped, f"not in the README's map of the code: {unmapped}"
