"""Exact step-by-step membership of the seed scenarios under the unit cost model."""
from pathlib import Path

import pytest

from factories import make_requests, run_policy

GOLDEN = Path(__file__).parent / "golden"

SEED = [(0, 10, 30), (0, 10, 200), (0, 10, 80), (30.0, 10, 150)]
INTERFERENCE = [(0, 5, 40), (0, 5, 40), (0, 5, 40), (5.0, 64, 4)]


def membership_lines(run) -> list[str]:
    """One line per run of identical steps: 'a-b: members'."""
    rows = []
    for _, plan, decoding in run.policies[0].plans:
        parts = []
        for rid, n in plan.scheduled.items():
            parts.append(f"R{rid + 1}" if rid in decoding else f"R{rid + 1}:P{n}")
        parts += [f"R{rid + 1}:pad" for rid in plan.padding]
        rows.append(" ".join(parts))
    lines, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[start]:
            span = f"{start + 1}" if i - 1 == start else f"{start + 1}-{i}"
            lines.append(f"{span}: {rows[start]}")
            start = i
    return lines


def expected(name: str) -> list[str]:
    text = (GOLDEN / name).read_text().splitlines()
    return [line for line in text if line and not line.startswith("#")]


@pytest.mark.parametrize("policy, specs, golden", [
    ({"name": "orca", "max_num_seqs": 4}, SEED, "seed_orca.txt"),
    ({"name": "static", "max_num_seqs": 3}, SEED, "seed_static.txt"),
    ({"name": "prefill_first", "chunk_size": 16}, INTERFERENCE, "interference_prefill_first.txt"),
    ({"name": "sarathi", "token_budget": 19}, INTERFERENCE, "interference_sarathi.txt"),
])
def test_membership_matches_golden(policy, specs, golden):
    run = run_policy(policy, make_requests(specs), trace=True, fast_forward=False)
    assert membership_lines(run) == expected(golden)


def test_seed_completion_times():
    orca = run_policy({"name": "orca", "max_num_seqs": 4}, make_requests(SEED))
    static = run_policy({"name": "static", "max_num_seqs": 3}, make_requests(SEED))
    assert [r.completion_time for r in orca.requests] == [30.0, 200.0, 80.0, 180.0]
    # static: every member completes when the batch ends; R4 starts only after it
    assert [r.completion_time for r in static.requests] == [200.0, 200.0, 200.0, 350.0]
    assert static.requests[3].first_token_time == 201.0
