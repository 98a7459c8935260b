"""Early admission control (sim/admission.py): predicted TTFT = prefill tokens queued ahead (plus
the request's own prompt) / recent prefill rate, a cold start priced by the cost model, rejection
with a reason, and its counts in the summary (off by default)."""
import pytest

from cbsim.api import run_experiment
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.admission import REASON_PREFIX, TTFTPredictor, prefill_tokens_ahead
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Status
from cbsim.sim.simulation import simulate

from factories import make_requests

# 1 ms per token, nothing else: a prefill runs at exactly 1,000 tokens/s, cold or observed
LINEAR = {"type": "linear", "base": 0.0, "per_token": 0.001}


def run(specs, limit):
    reqs = make_requests(specs)
    settings = ReplicaSettings(max_model_len=100_000, max_predicted_ttft=limit, admission_probe_tokens=1000)
    simulate(reqs, lambda: make_policy({"name": "sarathi", "token_budget": 512}), load_cost_model(LINEAR),
             lambda: KVCache(10_000, 16), settings)
    return reqs


def test_a_burst_is_cut_where_the_predicted_ttft_passes_the_limit():
    # six 1,000-token prompts at once: predicted TTFTs 1, 2, 3, 4, 5, 6 s at the cold-start rate
    reqs = run([(0, 1000, 1)] * 6 + [(20, 1000, 1)], limit=3.5)
    assert [r.status for r in reqs[:3]] == [Status.FINISHED] * 3
    for req in reqs[3:6]:
        assert req.status == Status.REJECTED and req.reject_reason.startswith(REASON_PREFIX)
    assert "predicted TTFT 4 s" in reqs[3].reject_reason and "3000 prefill tokens queued ahead" in reqs[3].reject_reason
    assert reqs[6].status == Status.FINISHED  # the queue drained: admitted again
    assert max(r.first_token_time - r.arrival for r in reqs if r.status == Status.FINISHED) <= 3.5


def test_without_a_limit_nothing_is_rejected():
    assert all(r.status == Status.FINISHED for r in run([(0, 1000, 1)] * 6, limit=None))


def test_cold_start_rate_comes_from_the_cost_model_and_observations_take_over():
    predictor = TTFTPredictor(2.0, load_cost_model(LINEAR), window=3, probe_tokens=1000)
    assert predictor.rate == pytest.approx(1000.0)
    assert predictor.predict(1000, 500) == pytest.approx(1.5)
    for _ in range(40):
        predictor.observe(100, 1.0)  # the replica turns out slower: 100 tokens/s
    assert predictor.rate == pytest.approx(100.0, rel=1e-6)
    assert predictor.reject_reason(0, 150) == ""
    assert predictor.reject_reason(100, 150).startswith(REASON_PREFIX)


def test_tokens_ahead_count_prefill_work_only():
    new, partial, decode, recompute = make_requests([(0, 100, 5), (0, 100, 5), (0, 100, 5), (0, 100, 5)])
    partial.num_computed_tokens = 60
    decode.num_computed_tokens, decode.num_output_tokens = 101, 2  # one token behind: a decode
    recompute.num_output_tokens = 3  # preempted by recompute: prompt and outputs again
    assert prefill_tokens_ahead([[new, partial], [decode, recompute]]) == 100 + 40 + 103


def test_summary_counts_admission_rejections_and_the_table_gives_the_reason():
    overload = ["workload.num_requests=120", "workload.arrival.rate=60", "output.dir=null"]
    off = run_experiment("experiments/quickstart.yaml", overrides=overload)
    on = run_experiment("experiments/quickstart.yaml", overrides=overload + ["admission.max_predicted_ttft=0.3"])
    assert off.summary["num_rejected_admission"] == 0
    rejected = on.requests[on.requests["reject_reason"].str.startswith(REASON_PREFIX)]
    assert on.summary["num_rejected_admission"] == len(rejected) > 0
    assert on.summary["num_rejected"] >= len(rejected)
    assert (rejected["status"] == "rejected").all()
    assert on.summary["ttft_p99"] < off.summary["ttft_p99"]


def test_admission_config_is_validated():
    with pytest.raises(ConfigError, match="admission.max_predicted_ttft"):
        load_config("experiments/quickstart.yaml", ["admission.max_predicted_ttft=-1"])
    assert load_config("experiments/quickstart.yaml").admission.max_predicted_ttft is None
