"""The house's floors (issue 25), read from the source: every import statement, inside functions too
(a cycle hidden in a function body is still a cycle); imports under `if TYPE_CHECKING:` are left out,
since they never run.

- No import cycle anywhere in the package.
- cbsim/core/ (the foundation) imports nothing of cbsim.
- sim/ (the engine, with its cost models) imports only the foundation and itself: never the config
  layer, the tools, the CLI, the workloads, the policies or the profiler.
- profiler/ (the GPU tool) never imports the application's config, tools or CLI; it may run the
  simulator through cbsim.api (heldout.py records held-out batches from simulated schedulers).

An edge `from a.b import c` goes to the module a.b.c when c is a module, else to a.b; a module's own
ancestor packages are not edges (Python initialises them before the module in any case).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"cbsim": "cbsim", "cbsim.sim": "sim", "cbsim.policies": "policies", "cbsim.profiler": "profiler",
            "cbsim.workloads": "workloads"}
APPLICATION = ("cbsim.config", "cbsim.tools", "cbsim.cli", "cbsim.server", "cbsim.preflight",
               "cbsim.reference", "cbsim.pools", "cbsim.replica_gpus")


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package (the setuptools package-dir mapping)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join((package, *parts)).removesuffix(".__init__")] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    return skipped


def _targets(node, package: str, known) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (TYPE_CHECKING aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            found |= {t for t in _targets(node, package, known) if t in known}
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return found - {name} - ancestors


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _offending(graph, floor: str, allowed) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == floor or m.startswith(floor + ".")
                  for t in targets if not any(t == a or t.startswith(a + ".") for a in allowed))


def test_the_foundation_imports_nothing_of_cbsim(graph):
    assert _offending(graph, "cbsim.core", ("cbsim.core",)) == []


def test_the_engine_imports_only_the_foundation(graph):
    assert _offending(graph, "cbsim.sim", ("cbsim.core", "cbsim.sim")) == []


def test_the_profiler_does_not_import_the_application(graph):
    bad = [line for line in _offending(graph, "cbsim.profiler", ()) if line.split(" -> ")[1].startswith(APPLICATION)]
    assert bad == []


def test_a_new_cycle_would_be_seen(graph):
    """The check reads function-level imports: a back edge from the foundation closes a cycle."""
    assert cycles({**graph, "cbsim.core.errors": graph["cbsim.core.errors"] | {"cbsim.config"}})
