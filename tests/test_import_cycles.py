"""No import cycle between the run and the capacity search, nor between the fit and the cost check
(issue 12: the house). Imports are read from the source (every import statement, inside functions
too: a cycle hidden in a function is still a cycle), over the whole package."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"cbsim": "cbsim", "cbsim.sim": "sim", "cbsim.policies": "policies", "cbsim.profiler": "profiler",
            "cbsim.workloads": "workloads"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package (the setuptools package-dir mapping)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def reaches(graph, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


@pytest.mark.parametrize("user,used", [("cbsim.tools.sweep.capacity", "cbsim.api"), ("cbsim.profiler.fit", "cbsim.profiler.costcheck")])
def test_no_cycle(graph, user, used):
    assert reaches(graph, user, used), f"{user} should use {used} (the test reads the graph wrongly otherwise)"
    assert not reaches(graph, used, user), f"{used} imports {user} back (directly or through others)"
