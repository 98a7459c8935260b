"""The step recorder inside an engine-core process of its own (as `vllm serve` runs it), installed by
vLLM's plugin mechanism (cbsim/tools/sim2real/plugin.py, the `vllm.general_plugins` entry point in
pyproject.toml). Slow: one engine start. Needs vLLM (skipped without it, a failure in CI)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbsim.profiler.converters.step_table import read_steps
from sim2real_engine import require_engine

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("serve_recorded.py")


def test_the_plugin_records_every_step_of_a_separate_engine_core_process(tmp_path):
    require_engine()
    from importlib.metadata import entry_points

    assert "cbsim_step_recorder" in {e.name for e in entry_points(group="vllm.general_plugins")}
    env = {**os.environ, "CBSIM_RECORD_STEPS": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT), "300", "40"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and "output tokens 10" in done.stdout, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "engine0" / "trace.jsonl").read_text().splitlines()]
    assert rows[0]["prefill"] == [[256, 0]]  # max_num_batched_tokens 256: the 300-token prompt chunks
    tokens: dict[str, int] = {}
    for row in rows:
        for req_id, n, _ in row["requests"]:
            tokens[req_id] = tokens.get(req_id, 0) + n
    assert sorted(tokens.values()) == [40 + 4, 300 + 4]  # prompts and outputs but the last (5 each)
    assert len(read_steps(tmp_path / "engine0" / "steps.jsonl")) == len(rows)


def test_without_the_variable_the_plugin_changes_nothing(monkeypatch):
    vllm = require_engine()  # noqa: F841
    from vllm.v1.engine import core

    from cbsim.tools.sim2real import plugin

    monkeypatch.delenv(plugin.ENV, raising=False)
    before = core.EngineCoreProc.run_busy_loop
    plugin.register()
    assert core.EngineCoreProc.run_busy_loop is before
