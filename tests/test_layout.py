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
