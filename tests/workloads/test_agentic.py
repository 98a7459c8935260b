"""Agentic programs (workloads/agentic.py) and tool-call durations (workloads/tool_times.py): every turn's
prompt is its agent's whole history, its chain extends the previous turn's, waits name earlier rows of
the same session, parallel tool calls and sub-agents add what they return; bad sections are one-line
errors naming the key."""
from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.core.errors import ConfigError
from cbsim.workloads import build_run, parse_workload
from cbsim.workloads.config import parse_tagged
from cbsim.workloads.tool_times import TOOL_TIMES, sample_tool_times

AGENTIC = {
    "arrival": {"type": "poisson", "rate": 1.0},
    "prompt_len": {"type": "uniform", "min": 20, "max": 200},
    "output_len": {"type": "uniform", "min": 5, "max": 80},
    "agentic": {"sessions": 12, "system_prompt_len": 64, "turns": {"type": "uniform", "min": 1, "max": 6},
                "tool_calls": {"type": "uniform", "min": 1, "max": 4},
                "tool_time": {"type": "exponential", "mean": 2.0},
                "tool_result_len": {"type": "uniform", "min": 1, "max": 50},
                "subagent_probability": 0.3, "subagent_count": {"type": "uniform", "min": 1, "max": 3},
                "subagent_turns": {"type": "uniform", "min": 1, "max": 3}},
}


def program(mapping=AGENTIC, seed=0):
    run = build_run(parse_workload(mapping), np.random.default_rng(seed))
    return run, run.agentic


def test_each_turn_extends_its_agents_history_and_chain():
    run, p = program()
    block = 16
    for rid in range(len(p.agent)):
        req = run.requests[rid]
        assert req.prompt_len == p.prompt_len[rid] and req.prefix_hashes == p.hashes[rid]
        assert len(p.hashes[rid]) == p.prompt_len[rid] // block
        before = [w for w, _ in p.waits[rid] if p.agent[w] == p.agent[rid]]
        if not before:
            assert p.turn[rid] == 0
            continue
        prev = before[0]
        assert p.turn[prev] == p.turn[rid] - 1
        assert p.hashes[rid][:len(p.hashes[prev])] == p.hashes[prev]  # the prefix cache sees the history
        # the previous turn's output blocks carry the hashes this turn's chain gives them (cached as computed)
        outputs = p.output_hashes[prev]
        assert len(outputs) == (p.prompt_len[prev] + p.output_len[prev]) // block - len(p.hashes[prev])
        assert p.hashes[rid][len(p.hashes[prev]):len(p.hashes[prev]) + len(outputs)] == outputs
        assert run.requests[prev].output_hashes == (outputs or None)
        children = [w for w, _ in p.waits[rid] if p.agent[w] != p.agent[rid]]
        added = p.prompt_len[rid] - p.prompt_len[prev] - p.output_len[prev]
        if children:  # each sub-agent's final output joins the context
            assert added == sum(p.output_len[c] for c in children) and not p.tool_times[prev]
        else:  # the tool results, at least one token per call
            assert len(p.tool_times[prev]) >= 1 and added >= len(p.tool_times[prev])
            assert dict(p.waits[rid])[prev] == pytest.approx(max(p.tool_times[prev]))


def test_waits_name_earlier_rows_of_the_same_session_and_every_session_is_whole():
    _, p = program()
    assert p.parent.count(-1) == 12 and any(x >= 0 for x in p.parent)  # sub-agents were spawned
    rows = sorted(r for s in p.sessions for r in s)
    assert rows == list(range(len(p.agent)))
    for s, members in enumerate(p.sessions):
        assert not p.waits[members[0]] and p.turn[members[0]] == 0
        for rid in members:
            assert p.session[p.agent[rid]] == s
            assert all(w < rid and w in members for w, _ in p.waits[rid])
            assert all(delay >= 0 and math.isfinite(delay) for _, delay in p.waits[rid])
    for agent, parent in enumerate(p.parent):  # a sub-agent starts at its spawner's reply, no deeper
        if parent >= 0:
            first = min(r for r in range(len(p.agent)) if p.agent[r] == agent)
            assert p.waits[first] == ((p.spawn_row[agent], 0.0),) and p.agent[p.spawn_row[agent]] == parent
            assert p.parent[parent] == -1


def test_the_system_prompt_is_shared_across_sessions():
    _, p = program()
    firsts = [s[0] for s in p.sessions]
    heads = {p.hashes[r][:4] for r in firsts}
    assert len(heads) == 1 and len(p.hashes[firsts[0]]) >= 4  # 64 tokens: four shared 16-token blocks
    assert len({p.hashes[r][4:5] for r in firsts}) == len(firsts)  # then each session's own task


def test_the_program_is_seeded_and_requests_carry_their_agent():
    run_a, a = program(seed=5)
    run_b, b = program(seed=5)
    _, c = program(seed=6)
    assert a.waits == b.waits and a.hashes == b.hashes and a.waits != c.waits
    assert [r.session for r in run_a.requests] == a.agent.tolist()
    assert run_a.clients.waits == a.waits and run_a.clients.max_concurrency is None


@pytest.mark.parametrize("spec, mean", [({"type": "fixed", "value": 1.5}, 1.5), ({"type": "exponential", "mean": 2.0}, 2.0),
                                        ({"type": "empirical", "values": [1, 3]}, 2.0),
                                        ({"type": "lognormal", "median": 1.0, "sigma": 0.5}, math.exp(0.125))])
def test_tool_time_distributions_have_their_means(spec, mean):
    cfg = parse_tagged(TOOL_TIMES, spec, "t")
    draws = sample_tool_times(cfg, 40_000, np.random.default_rng(0))
    assert (draws >= 0).all() and draws.mean() == pytest.approx(mean, rel=0.03)


def test_a_lognormal_tool_time_is_truncated_by_redrawing():
    cfg = parse_tagged(TOOL_TIMES, {"type": "lognormal", "median": 1.0, "sigma": 2.0, "max": 3.0}, "t")
    draws = sample_tool_times(cfg, 5000, np.random.default_rng(0))
    assert draws.max() <= 3.0 and (draws > 2.9).mean() < 0.01  # no pile-up at the bound


def with_agentic(**changes):
    return {**AGENTIC, "agentic": {**AGENTIC["agentic"], **changes}}


@pytest.mark.parametrize("mapping, key", [
    (with_agentic(tool_time=None), "workload.agentic.tool_time"),
    (with_agentic(tool_time={"type": "gamma"}), "workload.agentic.tool_time.type"),
    (with_agentic(tool_time={"type": "exponential", "mean": -1}), "workload.agentic.tool_time.mean"),
    (with_agentic(subagent_probability=1.5), "workload.agentic.subagent_probability"),
    (with_agentic(sessions=0), "workload.agentic.sessions"),
    (with_agentic(turns={"type": "fixed", "value": 0}), "workload.agentic.turns.value"),
    (with_agentic(bogus=1), "workload.agentic"),
    ({**AGENTIC, "num_requests": 10}, "workload.num_requests"),
    ({**AGENTIC, "shared_prefix": {"mode": "multi_turn"}}, "workload.shared_prefix"),
    ({**AGENTIC, "max_concurrency": 4, "think_time": 1.0}, "workload.think_time"),
    ({**{k: v for k, v in AGENTIC.items() if k != "output_len"}}, "workload.output_len"),
])
def test_bad_agentic_sections_name_the_key(mapping, key):
    with pytest.raises(ConfigError) as err:
        parse_workload(mapping)
    assert err.value.path.startswith(key)


def test_the_cli_says_file_field_and_expectation_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "workload": with_agentic(tool_time={"type": "exponential",
                                                                                        "mean": 0})}))
    result = CliRunner().invoke(app, ["run", str(path), "--quiet"])
    assert result.exit_code == 2
    assert "bad.yaml" in result.output and "workload.agentic.tool_time.mean" in result.output
    assert "seconds > 0" in result.output and "Traceback" not in result.output
