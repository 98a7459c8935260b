"""Readers of users' datasets (workloads/datasets.py) on tiny hand-written fixtures, and load stages.

Every fixture row is accounted for: kept with its exact lengths, or dropped under a named rule.
A file that is not of its format is a ConfigError naming the file and the key (and row)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.workloads import build_run, parse_workload, sample_arrivals
from cbsim.workloads.arrivals import Stage, StagesArrival
from cbsim.workloads.tokens import APPROXIMATION, token_counter
from cbsim.workloads.traces import read_trace
from paths import TESTS

DATA = TESTS / "data" / "datasets"
KEY = "workload.trace"


def load(fmt: str, name: str, **workload):
    trace = {"format": fmt, "path": str(DATA / name), **workload.pop("trace", {})}
    return build_run(parse_workload({"trace": trace, **workload}), np.random.default_rng(0))


def lengths(run):
    return [(r.prompt_len, r.output_len) for r in run.requests]


# ---------------------------------------------------------------- ShareGPT JSON
def test_sharegpt_json_first_two_turns_with_the_approximation():
    run = load("sharegpt_json", "sharegpt_tiny.json", arrival={"type": "constant", "rate": 1.0})
    # ceil(chars / 4): "What is the capital of France?" 30 chars -> 8; "The capital of France is Paris." 31 -> 8
    assert lengths(run) == [(8, 8), (9, 20)]
    assert run.dropped == {"fewer than two turns": 2, "zero length": 1}
    assert run.notes["token_lengths"] == APPROXIMATION


def test_sharegpt_json_with_a_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "What", "is", "the", "capital", "of", "France", "?", "."]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    run = load("sharegpt_json", "sharegpt_tiny.json", arrival={"type": "constant", "rate": 1.0},
               trace={"tokenizer": str(tmp_path)})
    # whitespace/punctuation words: "What is the capital of France ?" = 7, "The capital of France is Paris ." = 7
    assert lengths(run)[0] == (7, 7)
    assert run.notes["token_lengths"].startswith("tokenizer ")


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"workload\.trace\.tokenizer.*tokenizer\.json"):
        load("sharegpt_json", "sharegpt_tiny.json", arrival={"type": "constant", "rate": 1.0},
             trace={"tokenizer": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"workload\.trace\.tokenizer"):
        parse_workload({"trace": {"format": "burstgpt", "path": "x.csv", "tokenizer": "t.json"}})


def test_token_counter_falls_back_when_tokenizers_is_missing(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # import fails
    counter = token_counter(str(tmp_path), None, "k")
    assert counter.approximated and "not installed" in counter.method
    assert counter.count(["abcde", ""]) == [2, 0]


def test_sharegpt_json_all_turns_are_sessions_whose_prompts_hold_the_conversation(tmp_path):
    run = load("sharegpt_json", "sharegpt_tiny.json", trace={"turns": "all", "hash_block_size": 4}, max_concurrency=1)
    # a1: 8 + 8 tokens, then "And of Italy?" (4) -> prompt 20, reply "Rome." (2); c3: 9 -> 20; d4: no reply tokens
    assert lengths(run) == [(8, 8), (20, 2), (9, 20)]
    assert run.dropped == {"fewer than two turns": 2, "zero length": 1}
    assert run.clients.sessions == [[0, 1], [2]]
    first, second = run.requests[0].prefix_hashes, run.requests[1].prefix_hashes
    assert len(first) == 2 and len(second) == 5 and second[:2] == first
    assert run.requests[2].prefix_hashes[0] != first[0]  # another conversation shares nothing
    odd = tmp_path / "odd.json"
    odd.write_text('[{"conversations": [{"from": "human", "value": "abcd"}, {"from": "gpt", "value": "efgh"}, '
                   '{"from": "human", "value": "unanswered"}]}]')
    trace = read_trace("sharegpt_json", odd, KEY, turns="all")
    assert trace.dropped == {"turn without a reply": 1} and list(trace.prompt_len) == [1]
    with pytest.raises(ConfigError, match=r"workload\.trace\.turns"):
        parse_workload({"trace": {"format": "burstgpt", "path": "x.csv", "turns": "all"}})


@pytest.mark.parametrize("content, key", [
    ("not json", r"workload\.trace: expected a JSON list"),
    ('{"a": 1}', r"workload\.trace: expected a JSON list"),
    ('[{"id": 1, "conversations": []}, {"id": 2}]', r"workload\.trace \(entry 1\)\.conversations"),
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 3}]}]',
     r"\(entry 0\)\.conversations\[1\]\.value"),
])
def test_bad_sharegpt_json_is_named(tmp_path, content, key):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=key) as err:
        read_trace("sharegpt_json", path, KEY)
    assert err.value.file == str(path)


# ---------------------------------------------------------------- BurstGPT
def test_burstgpt_rows_and_failures():
    run = load("burstgpt", "burstgpt_tiny.csv")
    assert lengths(run) == [(472, 18), (417, 228), (1360, 357)]
    assert [r.arrival for r in run.requests] == [0.0, 113.0, 155.0]
    assert run.dropped == {"missing or non-numeric value": 1, "zero length": 1}


def test_burstgpt_v3_session_ids_group_turns(tmp_path):
    path = tmp_path / "v3.csv"
    path.write_text("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "0,s1,1.0,ChatGPT,10,5,15,Conversation log\n1,s2,1.0,ChatGPT,20,5,25,Conversation log\n"
                    "2,s1,1.0,ChatGPT,40,5,45,Conversation log\n")
    run = build_run(parse_workload({"trace": {"format": "burstgpt", "path": str(path)}, "max_concurrency": 2}),
                    np.random.default_rng(0))
    assert run.clients.sessions == [[0, 2], [1]]


def test_burstgpt_missing_column_is_named(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens\n1,ChatGPT,5\n")
    with pytest.raises(ConfigError, match="Response tokens") as err:
        read_trace("burstgpt", path, KEY)
    assert err.value.file == str(path)


# ---------------------------------------------------------------- generic CSV / JSONL
@pytest.mark.parametrize("fmt, name, dropped", [
    ("generic_csv", "generic_tiny.csv", {"missing or non-numeric value": 1, "non-integer length": 1}),
    ("generic_jsonl", "generic_tiny.jsonl", {"missing or non-numeric value": 1, "zero length": 1}),
])
def test_generic_rows_hashes_and_sessions(fmt, name, dropped):
    run = load(fmt, name, trace={"hash_block_size": 16})
    assert lengths(run) == [(40, 8), (24, 16), (72, 4)]
    assert [r.arrival for r in run.requests] == [0.0, 0.5, 1.25]
    assert [r.prefix_hashes for r in run.requests] == [(11, 12), (), (11, 12, 13, 14)]
    assert run.dropped == dropped
    assert run.clients is None  # open loop: sessions matter only to closed-loop clients


def test_generic_sessions_group_turns_for_closed_loop_clients():
    run = load("generic_jsonl", "generic_tiny.jsonl", trace={"hash_block_size": 16}, max_concurrency=1)
    assert run.clients.sessions == [[0, 2], [1]]


def test_generic_hash_chain_longer_than_the_prompt_is_named():
    with pytest.raises(ConfigError, match=r"hash_block_size.*row 2: 4 ids for 72 tokens"):
        load("generic_csv", "generic_tiny.csv", trace={"hash_block_size": 32})


def test_bad_generic_rows_are_named(tmp_path):
    csv = tmp_path / "g.csv"
    csv.write_text("arrival_s,prompt_len,output_len,prefix_hashes\n0,10,2,1 2\n1,10,2,one\n")
    with pytest.raises(ConfigError, match=r"\(line 3\)\.prefix_hashes") as err:
        read_trace("generic_csv", csv, KEY)
    assert err.value.file == str(csv)
    jsonl = tmp_path / "g.jsonl"
    jsonl.write_text('{"arrival_s": 0, "prompt_len": 1, "output_len": 1}\n{"arrival_s": 0, "prompt_len": 1}\n')
    with pytest.raises(ConfigError, match=r"\(line 2\).*output_len"):
        read_trace("generic_jsonl", jsonl, KEY)
    with pytest.raises(ConfigError, match="arrival_s"):
        csv.write_text("prompt_len,output_len\n1,1\n")
        read_trace("generic_csv", csv, KEY)


# ---------------------------------------------------------------- vLLM bench results
def test_vllm_bench_replays_exact_lengths():
    run = load("vllm_bench", "vllm_bench_tiny.json", arrival={"type": "constant", "rate": 2.0})
    assert lengths(run) == [(128, 100), (64, 37), (300, 256)]  # the failed request (0 output) is dropped
    assert run.dropped == {"zero length": 1}
    assert [r.arrival for r in run.requests] == [0.0, 0.5, 1.0]


def test_vllm_bench_needs_arrivals_and_its_lists(tmp_path):
    with pytest.raises(ConfigError, match=r"workload\.arrival"):
        parse_workload({"trace": {"format": "vllm_bench", "path": "r.json"}})
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"input_lens": [1, 2]}))
    with pytest.raises(ConfigError, match=r"workload\.trace\.output_lens"):
        read_trace("vllm_bench", path, KEY)
    path.write_text(json.dumps({"input_lens": [1, 2], "output_lens": [1]}))
    with pytest.raises(ConfigError, match=r"output_lens: expected as many lengths as input_lens \(2\)"):
        read_trace("vllm_bench", path, KEY)


# ---------------------------------------------------------------- load stages
STAGES = {"type": "stages", "stages": [{"rate": 1.0, "duration": 10.0}, {"rate": 4.0, "duration": 5.0}]}
FIXED = {"prompt_len": {"type": "fixed", "value": 8}, "output_len": {"type": "fixed", "value": 2}}


def test_constant_stages_change_rate_at_the_boundary():
    run = build_run(parse_workload({"arrival": {**STAGES, "process": "constant"}, **FIXED}), np.random.default_rng(0))
    times = [r.arrival for r in run.requests]
    assert times == [float(t) for t in range(10)] + [10.0 + k / 4 for k in range(20)]


def test_poisson_stages_count_per_stage_and_cap():
    cfg = StagesArrival([Stage(50.0, 20.0), Stage(0.0, 10.0), Stage(200.0, 10.0)])
    times = sample_arrivals(cfg, 10 ** 6, np.random.default_rng(3))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0) and times[-1] < 40.0
    counts = np.histogram(times, bins=[0, 20, 30, 40])[0]
    assert abs(counts[0] - 1000) < 4 * np.sqrt(1000) and counts[1] == 0 and abs(counts[2] - 2000) < 4 * np.sqrt(2000)
    assert len(sample_arrivals(cfg, 17, np.random.default_rng(3))) == 17


def test_stages_with_a_trace_drop_rows_after_the_last_stage():
    arrival = {"type": "stages", "process": "constant", "stages": [{"rate": 1.0, "duration": 2.0}]}
    run = load("vllm_bench", "vllm_bench_tiny.json", arrival=arrival)
    assert len(run.requests) == 2 and run.dropped == {"zero length": 1, "after the last stage": 1}


def test_stage_errors_are_named():
    with pytest.raises(ConfigError, match=r"workload\.arrival\.stages"):
        parse_workload({"arrival": {"type": "stages", "stages": []}, **FIXED})
    with pytest.raises(ConfigError, match=r"workload\.arrival\.stages\[0\]\.duration"):
        parse_workload({"arrival": {"type": "stages", "stages": [{"rate": 1, "duration": 0}]}, **FIXED})
    with pytest.raises(ConfigError, match=r"workload\.num_requests"):
        parse_workload({"arrival": {"type": "poisson", "rate": 1}, **FIXED})
