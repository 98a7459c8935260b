"""The plan's leading-decode shortcut changes nothing: StepPlan.decode_requests / decode_contexts /
decode_grows (filled by BatchBuilder.schedule_decodes, taken as they are by the replica's begin and
commit) give the same step tables, token runs and request times, bit for bit, as the same plans with
the shortcut stripped (begin and commit then look up and classify every entry, the general path).
Random workloads through every policy, tight KV (preemptions, block growth mid-scan), stepped and
fast-forwarded."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.policies.batch import BatchBuilder
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
    for a, b in zip(lean[0], general[0]):
        assert (a.status, a.first_token_time, a.completion_time, a.num_preemptions, a.first_scheduled) == \
            (b.status, b.first_token_time, b.completion_time, b.num_preemptions, b.first_scheduled), a.id
    lean_steps, general_steps = lean[1].step_table(), general[1].step_table()
    for name in lean_steps:
        assert np.array_equal(lean_steps[name], general_steps[name]), name
    for name, column in lean[1].run_table().items():
        assert np.array_equal(column, general[1].run_table()[name]), name
