"""Dataset readers on small excerpts of real files (tests/data/real/, with SOURCE.md and licenses).

Every expected value below was counted from the excerpt itself, outside cbsim (a csv/json read and
a calculator), and is written out here:

- burstgpt_1_head.csv: 102 rows; 5 failures (0 request and 0 response tokens, at t = 1106, 4525, 4608,
  4725, 11738 s) leave 97 requests: 77 ChatGPT, 20 GPT-4, 2 of them API log; request tokens sum to
  70,451 and response tokens to 28,316; the first row is at t = 5 s and the last kept one at 28,829 s.
- burstgpt_3_head.csv: 59 rows, no failures, request tokens sum 41,234; 27 sessions by first appearance
  (the session codes listed in SESSION_CODES), the three API log rows without one; the longest session
  (bda1996c-...) is rows 42-47 and 50-52; t from 19,440,110 to 19,457,291 s.
- mooncake_conversation_head25.jsonl: 25 requests, 10 at 0 ms and 15 at 3,000 ms (the trace's 3 s slots); input lengths
  sum 354,721, outputs 10,025; each has ceil(input / 512) block hashes, all starting with block 0.
- azure_conv_2023_head30.csv: 30 rows from 18:15:46.6805900; the next arrivals 4.314579, 4.541877,
  4.710427 s after it, the last 19.913927 s; context tokens sum 22,332, generated 2,826.
- sharegpt_v3_two_conversations.json: i6IyJda_0 72 and 420 characters (ceil(/4): 18, 105); A5AbcES_0
  191 and 1,900 characters (48, 475).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cbsim.workloads import build_run, parse_workload
from cbsim.workloads.tokens import APPROXIMATION
from cbsim.workloads.traces import read_trace
from paths import TESTS

REAL = TESTS / "data" / "real"
KEY = "workload.trace"
FAILED_AT = [1106, 4525, 4608, 4725, 11738]
SESSION_CODES = [0, 1, 2, 3, 0, 4, 3, 5, 5, 5, 3, 3, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13, 13, 14, 14, 14, 14, 14, 12,
                 15, 16, 17, 17, 18, 12, 18, 19, 20, 21, 22, 22, 22, 23, 23, 23, 23, 23, 23, 24, 25, 23, 23, 23, 26,
                 -1, -1, -1, 26, 26]


def run_of(fmt: str, name: str, **workload):
    trace = {"format": fmt, "path": str(REAL / name), **workload.pop("trace", {})}
    return build_run(parse_workload({"trace": trace, **workload}), np.random.default_rng(0))


def test_excerpts_are_small():
    sizes = {p.name: p.stat().st_size for p in REAL.iterdir() if p.suffix in (".csv", ".json", ".jsonl")}
    assert len(sizes) == 5 and max(sizes.values()) < 50_000


def test_burstgpt_v1_rows_failures_and_arrivals():
    run = run_of("burstgpt", "burstgpt_1_head.csv")
    assert len(run.requests) == 97 and run.dropped == {"zero length": 5}
    prompts = [r.prompt_len for r in run.requests]
    outputs = [r.output_len for r in run.requests]
    assert sum(prompts) == 70_451 and sum(outputs) == 28_316
    assert list(zip(prompts[:3], outputs[:3])) == [(472, 18), (1087, 230), (417, 276)]
    assert (prompts[-1], outputs[-1]) == (929, 80)  # the last row, an API log
    arrivals = [r.arrival for r in run.requests]
    assert arrivals[:4] == [0.0, 40.0, 113.0, 180.0] and arrivals[-1] == 28_829 - 5
    assert not set(t - 5 for t in FAILED_AT) & set(arrivals)
    assert arrivals == sorted(arrivals)


def test_burstgpt_v3_sessions_follow_the_session_id_column():
    trace = read_trace("burstgpt", REAL / "burstgpt_3_head.csv", KEY)
    assert len(trace) == 59 and int(trace.prompt_len.sum()) == 41_234
    assert trace.sessions.tolist() == SESSION_CODES
    assert trace.arrival[0] == 0.0 and trace.arrival[-1] == 19_457_291 - 19_440_110  # from the first row
    run = run_of("burstgpt", "burstgpt_3_head.csv", max_concurrency=4)
    assert [r.arrival for r in run.requests][:3] == [0.0, 51.0, 82.0]
    longest = max(run.clients.sessions, key=len)
    assert longest == [42, 43, 44, 45, 46, 47, 50, 51, 52]  # bda1996c-..., its turns in order
    assert len(run.clients.sessions) == 27 + 3  # each API log row is a session of its own


def test_mooncake_excerpt_lengths_slots_and_shared_first_block():
    trace = read_trace("mooncake", REAL / "mooncake_conversation_head25.jsonl", KEY)
    assert len(trace) == 25 and int(trace.prompt_len.sum()) == 354_721 and int(trace.output_len.sum()) == 10_025
    assert trace.arrival.tolist() == [0.0] * 10 + [3.0] * 15
    assert (trace.prompt_len[0], trace.output_len[0]) == (6758, 500)
    for prompt, chain in zip(trace.prompt_len, trace.prefix_hashes):
        assert len(chain) == math.ceil(prompt / 512) and chain[0] == 0
    assert trace.prefix_hashes[0] == tuple(range(14)) and trace.prefix_hashes[1][:2] == (0, 14)
    run = run_of("mooncake", "mooncake_conversation_head25.jsonl")  # requests spread over their 3 s slot
    arrivals = np.array([r.arrival for r in run.requests])
    assert ((0 <= arrivals[:10]) & (arrivals[:10] < 3)).all() and ((3 <= arrivals[10:]) & (arrivals[10:] < 6)).all()
    prompts = [r.prompt_len for r in run.requests]  # re-ordered by the spread arrivals, within each slot
    assert sorted(prompts[:10]) == sorted(trace.prompt_len[:10].tolist())
    assert sorted(prompts[10:]) == sorted(trace.prompt_len[10:].tolist())


def test_azure_excerpt_arrivals_from_wall_clock_stamps():
    run = run_of("azure", "azure_conv_2023_head30.csv")
    assert len(run.requests) == 30 and not run.dropped
    arrivals = [r.arrival for r in run.requests]
    assert arrivals[:4] == pytest.approx([0.0, 4.314579, 4.541877, 4.710427], abs=1e-9)
    assert arrivals[-1] == pytest.approx(19.913927, abs=1e-9)
    assert sum(r.prompt_len for r in run.requests) == 22_332
    assert sum(r.output_len for r in run.requests) == 2_826
    assert (run.requests[0].prompt_len, run.requests[0].output_len) == (374, 44)


def test_sharegpt_v3_records_first_turns_with_the_approximation():
    run = run_of("sharegpt_json", "sharegpt_v3_two_conversations.json", arrival={"type": "constant", "rate": 1.0})
    assert [(r.prompt_len, r.output_len) for r in run.requests] == [(18, 105), (48, 475)]
    assert not run.dropped and run.notes["token_lengths"] == APPROXIMATION
    trace = read_trace("sharegpt_json", REAL / "sharegpt_v3_two_conversations.json", KEY, turns="all")
    assert trace.prompt_len.tolist() == [18, 48] and trace.sessions.tolist() == [0, 1]
