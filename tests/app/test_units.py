"""Units: durations with a unit wherever a user writes one, vLLM's metric:ms limits, one printing rule."""
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.core.schema import field_help
from cbsim.core.units import limit_seconds, parse_duration
from cbsim.sim.metrics import MetricsConfig
from cbsim.sim.metrics.summary_units import display, schema_markdown, unit_of

runner = CliRunner()
QUICKSTART = "experiments/quickstart.yaml"


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("0.5s", 0.5), ("2 s", 2.0), ("1.5min", 90.0),
                                           ("250us", 250e-6), ("1h", 3600.0), (2, 2.0), (0.25, 0.25), ("3", 3.0)])
def test_durations_take_a_unit_and_a_bare_number_is_seconds(text, seconds):
    assert parse_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5 parsecs", "ms", "1m", True, [1], "nan s"])
def test_a_bad_duration_names_the_key_and_the_units(bad):
    with pytest.raises(ConfigError, match=r"^a\.b: expected a (finite )?duration"):
        parse_duration(bad, "a.b")


def test_slo_fields_accept_units_through_set():
    cfg = load_config(QUICKSTART, ["metrics.slo.ttft=500ms", "metrics.slo.tpot=50 ms", "sim.max_time=10min"])
    assert (cfg.metrics.slo.ttft, cfg.metrics.slo.tpot, cfg.sim.max_time) == (0.5, 0.05, 600.0)


def test_a_bare_slo_that_looks_like_milliseconds_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="cbsim"):
        cfg = load_config(QUICKSTART, ["metrics.slo.ttft=500"])
    assert cfg.metrics.slo.ttft == 500.0  # a bare number keeps its meaning: seconds
    assert "metrics.slo.ttft: 500 is read as seconds" in caplog.text and "'500ms'" in caplog.text


def test_the_reference_calls_a_duration_a_duration():
    rows = {name: (kind, text) for name, kind, _, text in field_help(type(MetricsConfig().slo))}
    assert rows["ttft"][0] == "duration or null" and "bare number is seconds" in rows["ttft"][1]


def is_time(metric):
    return unit_of(metric) == "s"


@pytest.mark.parametrize("item, limit", [("ttft_p99:500", 0.5), ("ttft_p99=500ms", 0.5), ("ttft_p99=0.5", 0.5),
                                         ("itl_p99 = 100 ms", 0.1), ("slo_attainment=0.9", 0.9)])
def test_limits_take_vllm_metric_colon_ms_and_units(item, limit):
    assert limit_seconds(item, "--slo", is_time)[1] == pytest.approx(limit)


@pytest.mark.parametrize("item, words", [("num_preemptions:3", "not one"), ("ttft_p99", "metric=limit"),
                                         ("ttft_p99:fast", "milliseconds with a number"),
                                         ("slo_attainment=high", "slo_attainment=<number>")])
def test_a_bad_limit_says_which_form_it_takes(item, words):
    with pytest.raises(ConfigError, match="--slo") as err:
        limit_seconds(item, "--slo", is_time)
    assert words in str(err.value)


def test_capacity_refuses_a_bad_slo_in_one_line():
    result = runner.invoke(app, ["capacity", QUICKSTART, "--slo", "ttft_p99=soon"])
    assert result.exit_code == 2 and "--slo ttft_p99: expected a duration" in result.output


def test_tune_slo_limits_take_units(tmp_path):
    from cbsim.tools.tune.spec import load_tune

    path = tmp_path / "tune.yaml"
    path.write_text(f"base: {Path(QUICKSTART).resolve()}\nslo: {{ttft_p99: 500ms, itl_p99: 0.1}}\ngpus: {{count: 1}}\n")
    spec = load_tune(path)
    assert spec.slo == {"ttft_p99": 0.5, "itl_p99": 0.1}


def test_every_command_prints_latencies_in_ms():
    assert display("ttft_p99", 0.272) == "272 ms" and display("queue_delay_p50", 0.004) == "4 ms"
    assert display("makespan", 507.6) == "507.6 s" and display("slo_attainment", 0.9985) == "99.85 %"
    assert display("num_stalls", 3) == "3" and display("goodput_requests_per_s", None) == "n/a"


def test_calibrate_prints_the_compare_table_in_ms():
    from cbsim.cli.calibrate import _summary

    report = {"terms": {"step_overhead_s": 0.001}, "fitted": ["step_overhead_s"],
              "errors": {"training": {"case": {"ttft_p50": {"measured": 0.05, "simulated": 0.055, "error": 0.1},
                                               "throughput_tokens_per_s": {"measured": 100.0, "simulated": 90.0,
                                                                           "error": -0.1}}}}}
    text = _summary(report)
    assert "measured (ms)" in text and "50" in text and "55" in text and "measured (/s)" in text


def test_schema_summary_documents_every_unit():
    result = runner.invoke(app, ["schema", "--summary"])
    assert result.exit_code == 0 and result.output == schema_markdown()
    assert "| `ttft_p<q>`, `ttft_max`, `ttft_mean` | s | ms |" in result.output


def test_no_slo_no_attainment(tmp_path):
    """Without metrics.slo there is nothing to attain: summary.json stores null and run prints no line."""
    import json

    result = runner.invoke(app, ["run", QUICKSTART, "--set", "metrics.slo=null", "--set", "workload.num_requests=50",
                                 "--set", "output.plots=false", "--set", "output.trace=false",
                                 "--out", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["slo_attainment"] is None and summary["goodput_requests_per_s"] is None
    assert summary["goodput_per_gpu"] is None and summary["throughput_requests_per_s"] > 0
    assert "slo_attainment" not in result.output
    assert json.loads((tmp_path / "bench.json").read_text())["request_goodput"] is None


def test_capacity_min_attainment_needs_an_slo():
    from cbsim.tools.sweep.capacity import find_capacity

    with pytest.raises(ConfigError, match="min_attainment: expected an experiment with metrics.slo set"):
        find_capacity(QUICKSTART, {}, overrides=["metrics.slo=null"], min_attainment=0.9)


def test_a_long_end_to_end_limit_is_not_taken_for_milliseconds(caplog):
    with caplog.at_level(logging.WARNING, logger="cbsim"):
        assert limit_seconds("e2e_p99=300", "--slo", is_time) == ("e2e_p99", 300.0)
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="cbsim"):
        limit_seconds("ttft_p99=300", "--slo", is_time)
    assert "--slo ttft_p99: 300 is read as seconds" in caplog.text
