"""The sim2real pieces that need no engine: token prompts, the workload gate, the linear fit, bench.json."""
from pathlib import Path

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import load_measured
from cbsim.profiler.converters.step_table import read_steps
from cbsim.tools.sim2real.driver import Served, bench_json
from cbsim.tools.sim2real.linear_fit import fit_linear
from cbsim.tools.sim2real.workload import experiment_requests, token_prompt
from paths import ROOT

EXPERIMENTS = ROOT / "experiments" / "sim2real"


def test_requests_sharing_a_hash_chain_share_their_token_prefix():
    chain = (11, 12, 13)
    a = token_prompt(0, 100, chain, 32, 4096)
    b = token_prompt(1, 80, chain[:2], 32, 4096)
    c = token_prompt(2, 100, (99, 12, 13), 32, 4096)
    assert len(a) == 100 and len(b) == 80
    assert a[:64] == b[:64] and a[64:80] != b[64:80]  # two shared blocks, then their own tokens
    assert a[:32] != c[:32]  # another chain: nothing shared
    assert min(a) >= 3 and max(a) < 4096


def test_the_shared_prefix_workload_shares_whole_system_prompts():
    _, requests = experiment_requests(EXPERIMENTS / "shared_prefix.yaml", 4096, 2048)
    heads = {tuple(r.prompt[:512]) for r in requests}
    assert 1 < len(heads) <= 4  # four system prompts of 512 tokens (uniform popularity)
    assert len({tuple(r.prompt) for r in requests}) == len(requests)


def test_a_request_longer_than_the_engine_takes_is_an_error():
    with pytest.raises(ConfigError, match=r"long_prompts.yaml: workload \(request \d+\): expected prompt_len "
                                          r"\+ output_len <= the engine's max_model_len 1024"):
        experiment_requests(EXPERIMENTS / "long_prompts.yaml", 4096, 1024)


def test_a_client_timeout_is_an_error(tmp_path):
    path = tmp_path / "closed.yaml"
    path.write_text("workload: {num_requests: 4, max_concurrency: 2, timeout: 5, prompt_len: {type: fixed, value: 8}, "
                    "output_len: {type: fixed, value: 4}}\n")
    with pytest.raises(ConfigError, match=r"closed.yaml: workload.timeout: expected no client timeout"):
        experiment_requests(path, 4096, 2048)


def test_closed_loop_clients_send_when_cbsims_clients_would():
    """Two clients, five one-turn sessions, service times fixed: a client sends its next request its think
    time after a reply, never more than two in flight (workloads/clients.py's rule, driven by senders.py)."""
    from cbsim.tools.sim2real.senders import senders
    from cbsim.workloads.clients import ClientPlan

    plan = ClientPlan(max_concurrency=2, think=np.array([0.5, 0.1, 0.2, 0.3, 0.4]))
    sends = senders([0.0] * 5, plan)
    service = [1.0, 2.0, 1.5, 0.7, 1.1]
    clock, in_flight, log = 0.0, {}, []
    while sends.left or in_flight:
        for sent, i in sends.due(clock):
            log.append((sent, i))
            in_flight[i] = sent + service[i]
        assert len(in_flight) <= 2
        clock = min([*in_flight.values(), sends.next_time])
        for i, end in sorted(in_flight.items()):
            if end <= clock:
                del in_flight[i]
                sends.replied(i, end)
    # 0 ends at 1.0: 2 goes at 1.0 + 0.2; 1 ends at 2.0: 3 at 2.3; 2 ends at 2.7: 4 at 3.1
    assert log == [(0.0, 0), (0.0, 1), (1.2, 2), (2.3, 3), (pytest.approx(3.1), 4)]


def test_a_closed_loop_workload_comes_with_its_client_plan():
    meta, requests = experiment_requests(EXPERIMENTS / "closed_loop.yaml", 4096, 2048)
    plan = meta["clients"]
    assert plan.closed_loop and plan.max_concurrency == 4 and len(plan.think) == len(requests)


def test_the_linear_fit_recovers_the_step_times_it_was_made_from(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(60):
        prefill = [[int(c), int(h)] for c, h in zip(rng.integers(1, 400, 2), rng.integers(0, 300, 2))]
        decode = [int(x) for x in rng.integers(10, 500, int(rng.integers(0, 8)))]
        tokens = sum(c for c, _ in prefill) + len(decode)
        reads = sum(h for _, h in prefill) + sum(decode)
        rows.append({"prefill": prefill, "decode": decode,
                     "time_s": 0.02 + 1e-4 * tokens + 2e-3 * (len(prefill) + len(decode)) + 1e-6 * reads})
    fit = fit_linear(rows)
    terms = fit["cost_model"]
    assert terms["type"] == "linear" and fit["median_abs_error"] < 1e-6
    assert terms["base"] == pytest.approx(0.02) and terms["per_token"] == pytest.approx(1e-4)
    path = tmp_path / "steps.jsonl"  # the recorder's rows are the table `cbsim calibrate --steps` reads
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    assert len(read_steps(path)) == 60


def test_bench_json_is_what_load_measured_reads(tmp_path):
    served = [Served(0.0, 10, 3, [0.5, 0.6, 0.8]), Served(0.2, 20, 1, [0.9]), Served(0.4, 5, 2, [1.0, 1.1])]
    path = tmp_path / "bench.json"
    path.write_text(__import__("json").dumps(bench_json(served, "t")))
    run = load_measured(path)
    assert run.format == "vllm" and run.metrics["ttft_mean"] == pytest.approx((0.5 + 0.7 + 0.6) / 3)
    assert run.metrics["e2e_p50"] == pytest.approx(0.7)
    assert run.metrics["tpot_mean"] == pytest.approx((0.15 + 0.1) / 2)  # requests with > 1 token
    assert run.metrics["itl_mean"] == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert run.metrics["throughput_requests_per_s"] == pytest.approx(3 / 1.1)


def test_an_experiment_sets_its_own_engine_by_vllm_flags():
    from cbsim.tools.sim2real.engine_flags import EngineFlags

    flags = EngineFlags().for_experiment(EXPERIMENTS / "preempting.yaml")
    assert (flags.num_gpu_blocks_override, flags.max_model_len, flags.enable_prefix_caching) == (40, 1024, False)
    assert flags.max_num_batched_tokens == EngineFlags().max_num_batched_tokens  # the rest: the command's
    assert EngineFlags().for_experiment(EXPERIMENTS / "bursty.yaml") == EngineFlags()  # no server block
    assert EngineFlags().with_args({"max_num_batched_tokens": 128}, "x").max_num_batched_tokens == 128


def test_a_flag_the_real_engine_is_not_started_with_is_an_error(tmp_path):
    from cbsim.tools.sim2real.engine_flags import EngineFlags

    with pytest.raises(ConfigError, match=r"server.args --tensor-parallel-size: expected a flag the sim2real "
                                          r"engine is started with \(--max-num-batched-tokens"):
        EngineFlags().with_args("--tensor-parallel-size 2", "server.args")
    path = tmp_path / "x.yaml"
    path.write_text("server: {engine: sglang}\nworkload: {num_requests: 1}\n")
    with pytest.raises(ConfigError, match=r"x.yaml: server: expected a vLLM server block"):
        EngineFlags().for_experiment(path)
