"""The CI regression check: comparison rules, baseline round trip, and the committed suite.

The committed suite (experiments/regression) must match its baseline, and a deliberately
perturbed policy (Sarathi's token budget halved through an override) must fail the check.
"""
import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cbsim.core.errors import ConfigError
from cbsim.tools.regress import (DIRECTIONS, Outcome, Tolerance, Tolerances, compare, format_report, load_tolerances,
                           read_baseline, run_suite, verdict, write_baseline)
from cbsim.cli.regress import register
from paths import ROOT

SUITE = ROOT / "experiments" / "regression"


def cli():
    app = typer.Typer()

    @app.callback()
    def main():
        """test app"""

    register(app)
    return app


def invoke(*args):
    return CliRunner().invoke(cli(), ["regress", *map(str, args)])


def outcome(**metrics):
    return Outcome(metrics, "digest", 0.0)


# ---------------------------------------------------------------- comparison rules


def test_verdict_follows_direction_and_tolerance():
    tight = Tolerance(rel=0.01)
    assert verdict("ttft_p50", 1.0, 1.005, tight) == "ok"
    assert verdict("ttft_p50", 1.0, 1.02, tight) == "regressed"
    assert verdict("ttft_p50", 1.0, 0.98, tight) == "improved"
    assert verdict("throughput_tokens_per_s", 100.0, 98.0, tight) == "regressed"
    assert verdict("throughput_tokens_per_s", 100.0, 102.0, tight) == "improved"
    assert verdict("num_preemptions", 0, 1, Tolerance(rel=0.0, abs=0.0)) == "regressed"
    assert verdict("num_preemptions", 0, 1, Tolerance(rel=0.0, abs=1.0)) == "ok"
    assert verdict("dec_at_p_mean", None, None, tight) == "ok"
    assert verdict("dec_at_p_mean", None, 3.0, tight) == "changed"


def test_compare_reports_missing_and_new_metrics_and_experiments():
    baseline = {"a": {"config_digest": "digest", "metrics": {"ttft_p50": 1.0, "itl_p99": 0.1}},
                "gone": {"config_digest": "x", "metrics": {"ttft_p50": 1.0}}}
    run = {"a": outcome(ttft_p50=1.0, makespan=5.0), "fresh": outcome(ttft_p50=2.0)}
    report = compare(baseline, run, Tolerances())
    got = {(r.experiment, r.metric): r.verdict for r in report.rows}
    assert got == {("a", "ttft_p50"): "ok", ("a", "itl_p99"): "missing", ("a", "makespan"): "new",
                   ("gone", "(experiment)"): "missing", ("fresh", "(experiment)"): "new"}
    assert not report.passed
    assert {(r.experiment, r.metric) for r in report.failures()} == {("a", "itl_p99"), ("gone", "(experiment)")}
    # restricted to what was asked for (--only a), the deleted experiment is not expected
    only = compare(baseline, {"a": run["a"]}, Tolerances(), expected=["a"])
    assert [r.verdict for r in only.failures()] == ["missing"]


def test_mode_any_fails_on_improvements_too():
    baseline = {"a": {"config_digest": "digest", "metrics": {"ttft_p50": 1.0}}}
    better = {"a": outcome(ttft_p50=0.5)}
    assert compare(baseline, better, Tolerances(mode="worse")).passed
    assert not compare(baseline, better, Tolerances(mode="any")).passed


def test_report_table_and_config_note():
    baseline = {"a": {"config_digest": "old", "metrics": {"ttft_p50": 1.0, "num_finished": 10}}}
    report = compare(baseline, {"a": outcome(ttft_p50=1.5, num_finished=10)}, Tolerances())
    text = format_report(report)
    assert text.splitlines()[0].split() == ["experiment", "metric", "baseline", "now", "change", "verdict"]
    assert "+50.00%  REGRESSED" in text
    assert "note: a: config differs" in text
    assert text.splitlines()[-1].startswith("FAIL (1 ok, 1 regressed")
    assert "num_finished" not in format_report(report, changes_only=True)


def test_tolerances_file_is_validated(tmp_path):
    (tmp_path / "tolerances.yaml").write_text("mode: worse\nmetrics:\n  ttft_p50: {rel: 0.5}\n")
    tol = load_tolerances(tmp_path)
    assert tol.of("ttft_p50").rel == 0.5 and tol.of("itl_p99") == tol.default
    (tmp_path / "tolerances.yaml").write_text("metrics:\n  sim_wall_seconds: {rel: 0.5}\n")
    with pytest.raises(ConfigError, match=r"tolerances.yaml: metrics.sim_wall_seconds: expected a tracked metric"):
        load_tolerances(tmp_path)
    (tmp_path / "tolerances.yaml").write_text("metrics:\n  ttft_p50: {rel: -1}\n")
    with pytest.raises(ConfigError, match=r"metrics.ttft_p50.rel: expected a number >= 0"):
        load_tolerances(tmp_path)


# ---------------------------------------------------------------- the committed suite


def test_suite_covers_every_policy_on_calibrated_cost_models():
    from cbsim.config import load_config

    from cbsim.policies.registry import load_all

    configs = [load_config(p) for p in sorted(SUITE.glob("*.yaml")) if p.name != "tolerances.yaml"]
    assert {c.policy["name"] for c in configs} == set(load_all())  # every registered policy
    assert any(c.cluster.mode == "pd" and c.cluster.kv_cache.prefix_caching for c in configs)
    assert any(c.policy.get("chunk_size") for c in configs if c.policy["name"] == "prefill_first")
    assert all(c.cost_model["type"] == "vidur" for c in configs)
    assert set(read_baseline(SUITE)) == {p.stem for p in SUITE.glob("*.yaml") if p.name != "tolerances.yaml"}
    tracked = next(iter(read_baseline(SUITE).values()))["metrics"]
    assert set(tracked) == set(DIRECTIONS) and "sim_wall_seconds" not in tracked


def test_committed_suite_matches_its_baseline():
    result = invoke("--suite", SUITE)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output.splitlines()[-1]


def test_halved_token_budget_fails_the_check():
    result = invoke("--suite", SUITE, "--only", "sarathi", "--set", "policy.token_budget=256", "--changes-only")
    assert result.exit_code == 1, result.output
    regressed = [line.split()[1] for line in result.output.splitlines() if line.endswith("REGRESSED")]
    assert "ttft_p50" in regressed
    assert "FAIL" in result.output.splitlines()[-1]


# ---------------------------------------------------------------- update round trip


def test_update_then_compare_in_a_fresh_suite(tmp_path):
    shutil.copy(SUITE / "sarathi.yaml", tmp_path / "sarathi.yaml")
    first = invoke("--suite", tmp_path)  # no baseline yet: an error, not a pass
    assert first.exit_code == 2 and "cbsim regress --update" in first.output
    updated = invoke("--suite", tmp_path, "--update")
    assert updated.exit_code == 0, updated.output
    assert invoke("--suite", tmp_path).exit_code == 0
    data = json.loads((tmp_path / "baseline.json").read_text())
    data["experiments"]["sarathi"]["metrics"]["itl_p99"] *= 0.5  # the baseline was better
    (tmp_path / "baseline.json").write_text(json.dumps(data))
    result = invoke("--suite", tmp_path)
    assert result.exit_code == 1 and "REGRESSED" in result.output
    refused = invoke("--suite", tmp_path, "--update", "--set", "policy.token_budget=256")
    assert refused.exit_code == 2 and "no overrides with --update" in refused.output


def test_update_with_only_keeps_the_other_entries(tmp_path):
    for name in ("sarathi", "splitfuse"):
        shutil.copy(SUITE / f"{name}.yaml", tmp_path / f"{name}.yaml")
    write_baseline(tmp_path, {"splitfuse": outcome(ttft_p50=1.0), "stale": outcome(ttft_p50=1.0)},
                   keep_others=False)
    write_baseline(tmp_path, run_suite(tmp_path, only=["sarathi"]))
    entries = read_baseline(tmp_path)
    assert set(entries) == {"sarathi", "splitfuse"}  # stale has no YAML any more: dropped
    assert entries["splitfuse"]["metrics"] == {"ttft_p50": 1.0}


# ---------------------------------------------------------------- CI output (issue 30)


def test_default_report_shows_changes_and_counts_the_rest():
    baseline = {"a": {"config_digest": "d", "metrics": {"ttft_p50": 1.0, "num_finished": 10, "itl_p99": 0.1}}}
    report = compare(baseline, {"a": outcome(ttft_p50=1.5, num_finished=10, itl_p99=0.1)}, Tolerances())
    lines = format_report(report, changes_only=True).splitlines()
    assert lines[0].startswith("experiment") and "REGRESSED" in lines[1] and len(lines) == 5  # + a note
    assert lines[2] == "(2 metrics within tolerance not shown; --all shows every row)"
    passing = compare(baseline, {"a": outcome(ttft_p50=1.0, num_finished=10, itl_p99=0.1)}, Tolerances())
    assert format_report(passing, changes_only=True).splitlines()[0].startswith("(3 metrics")


def test_json_and_junit_reports():
    import xml.etree.ElementTree as ET

    from cbsim.tools.regress_formats import report_json, report_junit

    baseline = {"a": {"config_digest": "d", "metrics": {"ttft_p50": 1.0}},
                "b": {"config_digest": "d", "metrics": {"ttft_p50": 1.0}}}
    report = compare(baseline, {"a": outcome(ttft_p50=1.5), "b": outcome(ttft_p50=0.5)}, Tolerances())
    data = json.loads(report_json(report))
    assert data["passed"] is False and data["counts"] == {"regressed": 1, "improved": 1}
    assert [r["fails"] for r in data["rows"]] == [True, False] and data["rows"][0]["change"] == 0.5
    suite = ET.fromstring(report_junit(report))
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    a, b = suite.findall("testcase")
    assert "ttft_p50: regressed" in a.find("failure").text and b.find("failure") is None
    assert "improved" in b.find("system-out").text


def test_cli_writes_a_junit_report(tmp_path):
    shutil.copy(SUITE / "sarathi.yaml", tmp_path / "sarathi.yaml")
    assert invoke("--suite", tmp_path, "--update").exit_code == 0
    result = invoke("--suite", tmp_path, "--format", "junit", "--report", tmp_path / "junit.xml")
    assert result.exit_code == 0 and "PASS" in result.output
    assert '<testsuite name="cbsim regress" tests="1" failures="0"' in (tmp_path / "junit.xml").read_text()
    assert invoke("--suite", tmp_path, "--format", "yaml").exit_code == 2
