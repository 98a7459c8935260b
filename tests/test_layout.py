"""The layout docs/development.md describes: the run path does not import the GPU profiler's runner."""
from __future__ import annotations

import subprocess
import sys

RUN = """
import sys
from cbsim.api import run_experiment
run_experiment({'workload': {'num_requests': 20, 'arrival': {'type': 'poisson', 'rate': 4.0},
                             'prompt_len': {'type': 'fixed', 'value': 300},
                             'output_len': {'type': 'fixed', 'value': 20}},
                'policy': {'name': 'sarathi'}})
print([m for m in ('torch', 'cbsim.profiler.run', 'cbsim.profiler.backends') if m in sys.modules])
"""


def test_a_run_imports_neither_torch_nor_the_layer_runner(tmp_path):
    out = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_package_folder_is_in_pyproject():
    """pyproject.toml lists every folder with an __init__.py under the mapped roots, and nothing else."""
    import tomllib

    from paths import ROOT

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in conf["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    assert set(conf["packages"]) == found


def test_test_files_have_unique_names():
    """tests/ mirrors the tree and every folder is importable by module name (conftest.py): names must not clash."""
    from collections import Counter

    from paths import TESTS

    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
