"""vLLM's --max-loras (policies/lora.py): a step serves at most max_loras LoRA adapters; a waiting
request whose adapter does not fit is skipped, later ones may start, base-model requests never wait."""
from __future__ import annotations

import pytest
from factories import run_policy
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.request import Request, Status

SARATHI = {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8}


def requests(specs):
    """(arrival, prompt, output, adapter) -> Requests, ids in order."""
    return [Request(i, a, p, o, adapter=ad) for i, (a, p, o, ad) in enumerate(specs)]


def first_steps(run):
    """request id -> the index of the plan that first scheduled it."""
    seen = {}
    for index, (_, plan, _) in enumerate(run.policies[0].plans):
        for rid in plan.scheduled:
            seen.setdefault(rid, index)
    return seen


def test_a_request_whose_adapter_does_not_fit_is_skipped_and_later_ones_start():
    reqs = requests([(0.0, 8, 6, "a"), (0.5, 8, 2, "b"), (0.5, 8, 2, "a"), (0.5, 8, 2, None)])
    run = run_policy({**SARATHI, "max_loras": 1}, reqs, trace=True)
    first = first_steps(run)
    # step 0 admits 0 (adapter a); at t=1 the 'b' request is skipped, 'a' and the base one join
    assert first[2] == first[3] == 1 and first[1] > first[2]
    assert first[1] > max(i for i, (_, plan, _) in enumerate(run.policies[0].plans) if 0 in plan.scheduled)
    assert all(r.status == Status.FINISHED for r in reqs)
    unlimited = first_steps(run_policy(SARATHI, requests([(0.0, 8, 6, "a"), (0.5, 8, 2, "b"), (0.5, 8, 2, "a"),
                                                             (0.5, 8, 2, None)]), trace=True))
    assert unlimited[1] == 1  # without the limit 'b' joins at once


ADAPTERS = st.sampled_from([None, "a", "b", "c"])
WORKLOAD = st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.integers(1, 60), st.integers(1, 12), ADAPTERS),
                    min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(WORKLOAD, st.integers(1, 3), st.integers(8, 96), st.booleans())
def test_no_step_serves_more_adapters_than_max_loras(specs, max_loras, budget, fair):
    specs = sorted(specs, key=lambda s: s[0])
    policy = {**SARATHI, "token_budget": budget, "max_loras": max_loras}
    if fair:
        policy["queue_policy"] = "fair"
    reqs = requests(specs)
    run = run_policy(policy, reqs, trace=True, num_blocks=400, block_size=4)
    adapter = {r.id: r.adapter for r in reqs}
    for _, plan, _ in run.policies[0].plans:
        served = {adapter[rid] for rid in plan.scheduled} - {None}
        assert len(served) <= max_loras
    assert all(r.status == Status.FINISHED for r in reqs)


def test_max_loras_must_be_positive():
    with pytest.raises(ConfigError, match="max_loras"):
        make_policy({"name": "sarathi", "max_loras": 0})


# -- residency: GPU slots and host cache, LRU, load time (policies/lora.py LoraResidency) ----------------

from collections import OrderedDict  # noqa: E402

from test_encoder_budget import POLICIES, run_snapshots  # noqa: E402

from cbsim.policies.lora import adapter_bytes  # noqa: E402
from cbsim.sim.costmodels.catalog.lookup import model_spec  # noqa: E402


def one_at_a_time(adapters):
    """A request every 10 s (each done within 3 steps of 1 s), with these adapters."""
    return [Request(i, 10.0 * i, 8, 2, adapter=a) for i, a in enumerate(adapters)]


def loads_per_request(run, reqs):
    """Adapters loaded into GPU slots (and seconds charged) in the step that admitted each request."""
    out = []
    for _, plan in run.steps:
        if plan.admitted:
            out.append((plan.lora_loads, plan.extra_seconds))
    assert len(out) == len(reqs)
    return out


@pytest.mark.parametrize("cpu, reads", [(2, [1, 1, 0, 1, 1]), (3, [1, 1, 0, 1, 0])])
def test_lru_slots_and_host_cache_charge_each_miss(cpu, reads):
    """Two GPU slots: a, b load; a hits; c evicts b (least recently used); b evicts a. 1 MB adapters at
    1 GB/s over PCIe (1 ms a copy) and 0.1 GB/s from disk (10 ms a read); a host cache of 3 keeps b."""
    reqs = one_at_a_time(["a", "b", "a", "c", "b"])
    residency = {"adapter_bytes": 1e6, "pcie_bandwidth_gb_s": 1.0, "disk_bandwidth_gb_s": 0.1, "max_cpu_loras": cpu}
    run = run_snapshots({**SARATHI, "max_loras": 2, "lora_residency": residency}, reqs, ff=False)
    got = loads_per_request(run, reqs)
    assert [n for n, _ in got] == [1, 1, 0, 1, 1]
    assert [s for _, s in got] == pytest.approx([0.001 * n + 0.01 * r for (n, _), r in zip(got, reads)])
    assert all(r.status == Status.FINISHED for r in reqs)


def test_adapter_bytes_of_a_llama_3_8b_rank_16_adapter_on_every_linear_layer():
    """r x sum(d_in + d_out) x layers: 16 x 81,920 x 32 = 41.9 M parameters, 83.9 MB in bf16."""
    assert adapter_bytes(model_spec("llama-3-8b"), 16, ALL) == 16 * 81_920 * 32 * 2


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_residency_options_name_the_key():
    for bad, key in (({"lora_residency": {"pcie_bandwidth_gb_s": 1, "adapter_bytes": 1}}, "lora_residency"),
                     ({"max_loras": 2, "lora_residency": {"pcie_bandwidth_gb_s": 1}}, "adapter_bytes"),
                     ({"max_loras": 2, "lora_residency": {"pcie_bandwidth_gb_s": 1, "rank": 8}}, "model"),
                     ({"max_loras": 2, "lora_residency": {"pcie_bandwidth_gb_s": 1, "rank": 8, "model": "nope"}},
                      "model"),
                     ({"max_loras": 2, "lora_residency": {"pcie_bandwidth_gb_s": 1, "adapter_bytes": 1,
                                                          "max_cpu_loras": 1}}, "max_cpu_loras")):
        with pytest.raises(ConfigError, match=key):
            make_policy({"name": "sarathi", **bad})


@settings(max_examples=60, deadline=None)
@given(WORKLOAD, st.sampled_from(POLICIES), st.integers(1, 3), st.integers(8, 96))
def test_every_policy_serves_at_most_max_loras_and_charges_exactly_the_lru_misses(specs, name, max_loras, budget):
    specs = sorted(specs, key=lambda s: s[0])
    reqs = requests(specs)
    residency = {"adapter_bytes": 1e9, "pcie_bandwidth_gb_s": 1.0}
    if name in ("static", "orca", "prefill_first"):  # (prefill_first as drawn here does not chunk either)
        budget = max(budget, 72)  # whole prompts: prompt + output - 1 must fit a step (else rejected)
    policy = {"name": name, "token_budget": budget, "max_loras": max_loras, "lora_residency": residency}
    run = run_snapshots(policy, reqs, num_blocks=400, block_size=4)
    gpu: OrderedDict = OrderedDict()
    for before, plan in run.steps:
        running = [req for rid, (_, status, req) in before.items() if status == Status.RUNNING]
        admitted = {rid: before[rid][2] for rid in plan.admitted}
        used = list(dict.fromkeys(r.adapter for r in [*running, *admitted.values()]
                                  if r.id in plan.scheduled and r.adapter is not None))
        assert len(used) <= max_loras
        misses = [a for a in used if a not in gpu]
        for a in used:
            gpu[a] = gpu.pop(a, None)
        while len(gpu) > max_loras:
            del gpu[next(a for a in gpu if a not in used)]
        assert plan.lora_loads == len(misses)
        assert plan.extra_seconds == pytest.approx(len(misses) * 1.0)
    assert all(r.status == Status.FINISHED for r in reqs)
