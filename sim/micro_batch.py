"""A micro-batch in flight on a pipelined replica (sim/pipeline.py), and what a pipeline run
(sim/pipeline_run.py) leaves in flight: its own module so both import it without a cycle."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MicroBatch:
    plan: object  # the StepPlan it runs
    step: int  # its row in the recorder
    end: float  # when its tokens come out of the last stage
    members: tuple[int, ...]  # request ids in it (scheduled and padding): invisible to the policy meanwhile
