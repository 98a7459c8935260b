"""BatchBuilder.schedule_decodes: the decode pass hands the prefill pass only what it did not take."""
from cbsim.policies.batch import BatchBuilder
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState


def running_mix() -> list[Request]:
    """Running requests in admission order: decode, prefill in progress, decode, fresh prompt."""
    reqs = [Request(0, 0.0, 8, 4), Request(1, 0.0, 40, 4), Request(2, 0.0, 8, 4), Request(3, 0.0, 16, 4)]
    for req, computed, outputs in ((reqs[0], 9, 2), (reqs[1], 16, 0), (reqs[2], 8, 1), (reqs[3], 0, 0)):
        req.num_computed_tokens, req.num_output_tokens = computed, outputs
    return reqs


def builder(reqs, token_budget, max_num_seqs=8) -> BatchBuilder:
    kv = KVCache(100, 4)
    for req in reqs:
        kv.grow(req, kv.blocks_for(req.num_computed_tokens))
    return BatchBuilder(SchedulerState(kv=kv, max_model_len=1000, running=reqs), token_budget, max_num_seqs)


def test_returns_the_requests_it_did_not_take_in_order():
    reqs = running_mix()
    b = builder(reqs, token_budget=64)
    others = b.schedule_decodes(reqs)
    assert b.scheduled == {0: 1, 2: 1} and [r.id for r in others] == [1, 3]


def test_returns_everything_when_the_budget_stops_the_scan():
    reqs = running_mix()
    b = builder(reqs, token_budget=1)
    others = b.schedule_decodes(reqs)
    assert b.scheduled == {0: 1} and [r.id for r in others] == [0, 1, 2, 3]  # the caller re-checks all
