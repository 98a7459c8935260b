"""Record the steps of a running `vllm serve` (or any vLLM whose engine core runs in its own process).

vLLM loads every `vllm.general_plugins` entry point in each of its processes, the engine-core process
included (vllm/v1/engine/core.py, EngineCore.__init__ calls vllm.plugins.load_general_plugins). cbsim
declares `register` below as one (pyproject.toml), so once cbsim is installed in the engine's environment,

    CBSIM_RECORD_STEPS=recorded python -m vllm.entrypoints.openai.api_server --model ... (or `vllm serve`)

records every engine step of that server: `register` wraps the engine-core process's busy loop
(EngineCoreProc.run_busy_loop, and DPEngineCoreProc's) so that, before the first step, a
recorder.StepRecorder is installed on that engine core, writing each step as it ends to
recorded/engine<N>/steps.jsonl (the table `cbsim calibrate --steps` reads) and trace.jsonl (every field),
N being the engine's data-parallel index. Without CBSIM_RECORD_STEPS the plugin does nothing. The file is
appended and flushed a line a step, so a server stopped at any time leaves whole lines.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

ENV = "CBSIM_RECORD_STEPS"


def register() -> None:
    """vLLM's general-plugin hook: install the recording busy loop when CBSIM_RECORD_STEPS names a folder."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    from vllm.v1.engine import core

    for cls in (core.EngineCoreProc, core.DPEngineCoreProc):
        loop = vars(cls).get("run_busy_loop")
        if loop is not None and not getattr(loop, "cbsim_recording", False):
            cls.run_busy_loop = _recording(loop, Path(folder))


def _recording(loop, folder: Path):
    @functools.wraps(loop)
    def run_busy_loop(self, *args, **kwargs):
        from cbsim.tools.sim2real.recorder import StepRecorder

        StepRecorder(self, sink=JsonlSink(folder / f"engine{getattr(self, 'engine_index', 0)}"))
        return loop(self, *args, **kwargs)

    run_busy_loop.cbsim_recording = True
    return run_busy_loop


class JsonlSink:
    """Appends each recorded step to steps.jsonl and trace.jsonl in `folder`, a flushed line a step."""

    def __init__(self, folder: Path):
        from cbsim.tools.sim2real.recorder import steps_row

        folder.mkdir(parents=True, exist_ok=True)
        self.steps_row = steps_row
        self.steps = (folder / "steps.jsonl").open("a")
        self.trace = (folder / "trace.jsonl").open("a")

    def __call__(self, row: dict) -> None:
        self.steps.write(json.dumps(self.steps_row(row)) + "\n")
        self.trace.write(json.dumps(row) + "\n")
        self.steps.flush()
        self.trace.flush()
