"""cbsim: a discrete-event simulator of LLM serving schedulers on calibrated cost models."""
from __future__ import annotations

__version__ = "0.1.0"


def run_experiment(config, **kwargs):
    """Run one experiment (a config mapping, an ExperimentConfig or a YAML path); see cbsim.api."""
    from cbsim.api import run_experiment as _run

    return _run(config, **kwargs)
