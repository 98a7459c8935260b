"""server.version 0.32: cbsim's V1 model follows what vLLM 0.32's scheduler does (no vLLM needed here).

The streams and vLLM's schedules are tests/sim2real_cases.py (tests/test_sim2real_parity.py holds vLLM
itself to them). An unversioned or older `server: {engine: vllm}` keeps cbsim's earlier V1 model, so
shipped results do not change.
"""
import pytest

from cbsim.server import Context
from cbsim.server import vllm as vllm_server
from cbsim.tools.sim2real.cbsim_scheduler import run_cbsim

from sim2real_cases import CASES, EXPECTED, first_steps

V032 = {"cluster.kv_cache.watermark": 0.0, "cluster.kv_cache.check_full_input": True,
        "policy.cap_lone_request": False, "policy.running_order": "admission"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cbsim_schedules_what_vllm_0_32_does(name):
    steps, requests = run_cbsim(CASES[name])
    scheduled, preempted = EXPECTED[name]
    assert first_steps(steps, len(scheduled)) == (scheduled, preempted)
    assert all(r.status.name == "FINISHED" for r in requests)


@pytest.mark.parametrize("name, before", [
    ("FULL_INPUT", [{0: 100, 1: 28}, {0: 1, 1: 127}]),  # the first chunk fits: admitted
    ("ADMISSION_ORDER", [{0: 48, 1: 48}, {0: 48, 1: 48}, {0: 48, 1: 3}, {1: 1}]),  # decodes first: 0 yields
    ("LONE", [{0: 48}, {0: 48}]),  # the cap holds alone
])
def test_without_a_version_cbsim_keeps_its_earlier_v1_model(name, before):
    steps, _ = run_cbsim(CASES[name], version=None)
    assert [s.scheduled for s in steps[:len(before)]] == before


@pytest.mark.parametrize("version, chunked", [((0, 32), True), ((0, 33), True), ((0, 32), False)])
def test_version_0_32_resolves_its_scheduler_settings(version, chunked):
    flags = {} if chunked else {"enable-chunked-prefill": False}
    settings, _ = vllm_server.resolve(flags, Context(None, 4096, version), "server.args")
    expected = V032 if chunked else {k: v for k, v in V032.items() if k.startswith("cluster.")}
    assert {k: settings[k] for k in expected} == expected
    assert chunked or "policy.running_order" not in settings


@pytest.mark.parametrize("version", [None, (0, 11), (0, 31)])
def test_earlier_versions_resolve_none_of_them(version):
    settings, _ = vllm_server.resolve({}, Context(None, 4096, version), "server.args")
    assert not set(V032) & set(settings)


@pytest.mark.parametrize("options, needle", [
    ({"running_order": "lifo"}, "decodes_first or admission"),
    ({"running_order": "admission", "queue_policy": "fair", "tenant_weights": {"a": 1}}, "queue_policy fair"),
    ({"running_order": "admission", "dynamic_chunk": {"target_chunk": 256}}, "dynamic_chunk"),
])
def test_running_order_is_checked(options, needle):
    from cbsim.core.errors import ConfigError
    from cbsim.policies import make_policy

    with pytest.raises(ConfigError, match="running_order") as err:
        make_policy({"name": "sarathi", **options})
    assert needle in str(err.value)
