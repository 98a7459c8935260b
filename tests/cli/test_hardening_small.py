"""The smaller defects of issue 26 (item 16), each a one-line error with exit code 2 or a run that
works, never a traceback."""
from factories import TINY_EXPERIMENT as TINY
from factories import assert_user_error, cli, write_experiment


def experiment(tmp_path, **changes):
    return write_experiment(tmp_path, {**TINY, **changes})


def test_a_sigma_of_minus_zero_runs_as_zero(tmp_path):
    workload = {**TINY["workload"], "prompt_len": {"type": "lognormal", "median": 100, "sigma": -0.0}}
    result = cli("run", experiment(tmp_path, workload=workload), "--out", tmp_path / "o", "-q")
    assert result.exit_code == 0, result.output


def test_a_stage_rate_of_2_to_the_63_is_refused(tmp_path):
    workload = {**TINY["workload"], "arrival": {"type": "stages", "stages": [{"rate": 2.0**63, "duration": 1}]}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=workload)), "workload.arrival.stages",
                      "at most 10,000,000 arrivals")


def test_a_run_name_too_long_for_a_folder_is_refused(tmp_path):
    assert_user_error(cli("validate", experiment(tmp_path, name="x" * 300)), "exp.yaml", "name", "at most 200 bytes")
    assert_user_error(cli("run", experiment(tmp_path), "--set", "name=" + "é" * 150), "name", "at most 200 bytes")


def test_a_repeated_slo_is_refused_not_silently_replaced(tmp_path):
    assert_user_error(cli("capacity", experiment(tmp_path), "--slo", "ttft_p99=1", "--slo", "ttft_p99=2"),
                      "--slo", "each metric once")


def test_an_os_error_is_one_line(tmp_path, monkeypatch):
    import errno
    import os

    def refuse(*args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))

    monkeypatch.setattr("cbsim.cli.check_target", refuse, raising=False)
    monkeypatch.setattr("cbsim.core.atomic.check_target", refuse)
    assert_user_error(cli("run", experiment(tmp_path), "--out", tmp_path / "o"), "Permission denied")


def test_calibrate_with_too_few_evaluations_is_one_line(tmp_path):
    import json

    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps({"ttft_mean": 0.05, "itl_p50": 0.01}))
    result = cli("calibrate", "--serving", f"{experiment(tmp_path)}={measured}", "--max-evals", "0",
                 "--out", tmp_path / "engine.json")
    assert_user_error(result, "--max-evals", "more than")
    assert not (tmp_path / "engine.json").exists()


def test_arrivals_beyond_the_clock_are_refused_by_validate_naming_the_workload(tmp_path):
    """A rate of 1e-300, a trace row in year 9999 and an explicit arrival of 1e300 s passed validate and
    then failed at the first step, blamed on cost_model."""
    import json

    slow = {**TINY["workload"], "arrival": {"type": "poisson", "rate": 1e-300}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=slow)), "workload.arrival", "clock")
    explicit = {"requests": [{"arrival": 1e300, "prompt_len": 10, "output_len": 2}]}
    assert_user_error(cli("validate", experiment(tmp_path, workload=explicit)), "workload.requests", "arrival")
    year_9999 = 253402300799  # 9999-12-31 in Unix seconds
    rows = [{"timestamp": t * 1000, "input_length": 100, "output_length": 5, "hash_ids": [0]} for t in (0, year_9999)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = {"trace": {"format": "mooncake", "path": "t.jsonl", "slot_width": 0}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=trace)), "workload.trace", "clock")


def test_a_measured_step_of_1e300_seconds_is_refused(tmp_path):
    from cbsim.core.errors import ConfigError
    from cbsim.profiler.converters.step_table import read_steps

    table = tmp_path / "steps.jsonl"
    table.write_text('{"decode": [100], "time_s": 0.02}\n{"decode": [100], "time_s": 1e300}\n')
    try:
        read_steps(table)
    except ConfigError as err:
        assert "steps.jsonl" in str(err) and "line 2: time_s" in str(err)
    else:
        raise AssertionError("a step of 1e300 s was accepted")


SPLITWISE_HEADER = "model,hardware,tensor_parallel,prompt_size,batch_size,prompt_time,token_time,e2e_time\n"


def test_splitwise_rows_with_nan_or_negative_times_are_left_out_and_counted(tmp_path):
    csv = tmp_path / "perf.csv"
    csv.write_text(SPLITWISE_HEADER + "llama2-70b,a100-80gb,2,512,1,100,20,600\n"
                   "llama2-70b,a100-80gb,2,512,1,nan,20,600\nllama2-70b,a100-80gb,2,512,1,-5,20,600\n"
                   "llama2-70b,a100-80gb,2,1024,1,200,-1,900\n")
    result = cli("splitwise-steps", csv, "--out", tmp_path / "steps.jsonl")
    assert result.exit_code == 0, result.output
    assert "3 row(s) left out" in result.output and "2 steps" in result.output
    csv.write_text(SPLITWISE_HEADER + "llama2-70b,a100-80gb,2,512,1,nan,20,600\n")
    assert_user_error(cli("splitwise-steps", csv, "--out", tmp_path / "s2.jsonl"), "perf.csv", "finite numbers > 0")


def test_fit_errors_about_the_measurements_name_their_file(tmp_path):
    """Too few grid rows, no layer count: the fit's own errors name the CSV they are about."""
    csv = tmp_path / "m.csv"
    csv.write_text("batch_id,cls,source,prefill,decode,layer_s_median\n1,decode,grid,,16,0.001\n")
    assert_user_error(cli("fit", csv, "--out", tmp_path / "p.json"), "m.csv", "num_layers")
    assert_user_error(cli("fit", csv, "--out", tmp_path / "p.json", "--num-layers", "4"), "m.csv", "source",
                      "unflagged grid rows")
    assert not (tmp_path / "p.json").exists()


def test_a_torch_dtype_that_is_a_list_is_one_line(tmp_path):
    """Found by the fuzz battery: `torch_dtype: []` in a config.json gave TypeError: unhashable type."""
    import json

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 32000,
              "max_position_embeddings": 4096, "torch_dtype": ["bfloat16"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = {"model": str(tmp_path / "config.json"), "cost_model": {"type": "roofline", "gpu": "h100"}}
    assert_user_error(cli("validate", experiment(tmp_path, **data)), "config.json", "torch_dtype")
