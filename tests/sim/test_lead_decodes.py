"""The plan's leading-decode shortcut changes nothing: StepPlan.decode_requests / decode_contexts /
decode_grows (filled by BatchBuilder.schedule_decodes, taken as they are by the replica's begin and
commit) give the same step tables, token runs and request times, bit for bit, as the same plans with
the shortcut stripped (begin and commit then look up and classify every entry, the general path).
Random workloads through every policy, tight KV (preemptions, block growth mid-scan), stepped and
fast-forwarded."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.policies.batch import BatchBuilder
from factories import assert_same_run
from test_fast_path import COSTS, POLICIES, WORKLOADS, run

_build = BatchBuilder.build


def build_without_shortcut(self, *args, **kwargs):
    plan = _build(self, *args, **kwargs)
    return dataclasses.replace(plan, decode_requests=(), decode_contexts=(), decode_grows=())


def test_the_shortcut_is_taken():
    """The comparison below is not vacuous: a sarathi step of running decodes carries them as leading decodes."""
    seen = []

    def spy(self, *args, **kwargs):
        plan = _build(self, *args, **kwargs)
        seen.append(len(plan.decode_requests))
        return plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchBuilder, "build", spy)
        run("sarathi", "linear", [(0.0, 30, 40), (0.0, 20, 40), (0.5, 100, 10)], 200, fast_forward=False)
    assert max(seen) >= 2


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.sampled_from(sorted(COSTS)), WORKLOADS, st.integers(26, 200),
       st.booleans())
def test_shortcut_matches_general_path(policy, cost, specs, num_blocks, fast_forward):
    lean = run(policy, cost, specs, num_blocks, fast_forward=fast_forward)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchBuilder, "build", build_without_shortcut)
        general = run(policy, cost, specs, num_blocks, fast_forward=fast_forward)
    assert_same_run(lean, general)
