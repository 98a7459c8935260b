"""Tests of cbsim.workloads: distributions, arrivals, explicit lists, trace readers, prefixes, errors."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate, stats

from cbsim.core.errors import ConfigError
from cbsim.workloads import (
    TraceConfig,
    build_requests,
    describe_requests,
    format_description,
    hash_chain,
    load_trace,
    parse_workload,
    plot_workload,
    sample_arrivals,
    sample_lengths,
)
from cbsim.workloads.arrivals import ARRIVALS
from cbsim.workloads.config import parse_tagged
from cbsim.workloads.lengths import LENGTHS
from cbsim.workloads.prefixes import SharedPrefixConfig, content_id, multi_turn, system_prompts
from cbsim.workloads.traces import detect_slot_width, read_mooncake, spread_slots
from paths import ROOT

DATA = Path(os.environ.get("CBSIM_DATA") or ROOT.parent / "shared" / "data")
TRACES = DATA / "traces"
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
MOONCAKE_CONV = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
MOONCAKE_SYN = TRACES / "mooncake_fast25" / "synthetic_trace.jsonl"
SHAREGPT = TRACES / "sharegpt_sarathi_serve" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
ARXIV = TRACES / "arxiv_summarization_vidur" / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
VIDUR = DATA / "vidur" / "data" / "processed_traces"

SYNTHETIC = {
    "num_requests": 500,
    "arrival": {"type": "poisson", "rate": 4.0},
    "prompt_len": {"type": "lognormal", "median": 1000, "sigma": 1.0, "max": 8192},
    "output_len": {"type": "uniform", "min": 10, "max": 300},
}


def needs(path: Path) -> Path:
    """Skip the test when a data file is not on this machine."""
    if not path.is_file():
        pytest.skip(f"trace data not found: {path} (set $CBSIM_DATA)")
    return path


def lengths(mapping: dict, n: int, seed: int = 0) -> np.ndarray:
    return sample_lengths(parse_tagged(LENGTHS, mapping, "len"), n, np.random.default_rng(seed))


def arrivals(mapping: dict, n: int, seed: int = 0) -> np.ndarray:
    return sample_arrivals(parse_tagged(ARRIVALS, mapping, "arrival"), n, np.random.default_rng(seed))


def trace_requests(trace: dict, seed: int = 0, **workload):
    return build_requests(parse_workload({"trace": trace, **workload}), np.random.default_rng(seed))


# ---------------------------------------------------------------- length distributions

def test_fixed_and_uniform_lengths():
    assert set(lengths({"type": "fixed", "value": 7}, 100)) == {7}
    values = lengths({"type": "uniform", "min": 10, "max": 20}, 20_000)
    assert values.min() == 10 and values.max() == 20
    assert values.mean() == pytest.approx(15.0, abs=0.1)
    assert values.dtype == np.int64


def test_lognormal_median_and_mean():
    values = lengths({"type": "lognormal", "median": 1000, "sigma": 0.5}, 40_000)
    assert np.median(values) == pytest.approx(1000, rel=0.03)
    assert values.mean() == pytest.approx(1000 * math.exp(0.5**2 / 2), rel=0.02)


def test_lognormal_truncation_redraws_instead_of_clamping():
    lo, hi = 200, 2000
    values = lengths({"type": "lognormal", "median": 1000, "sigma": 1.0, "min": lo, "max": hi}, 40_000)
    assert values.min() >= lo and values.max() <= hi
    # about 24% of the untruncated mass lies above 2000: clamping would pile it on the bound
    assert np.mean(values == hi) < 0.002 and np.mean(values == lo) < 0.002
    dist = stats.lognorm(s=1.0, scale=1000)
    mass = dist.cdf(hi + 0.5) - dist.cdf(lo - 0.5)
    mean = integrate.quad(lambda x: x * dist.pdf(x), lo - 0.5, hi + 0.5)[0] / mass
    assert values.mean() == pytest.approx(mean, rel=0.01)


def test_zipf_mode_share_and_truncation():
    a = 2.0
    values = lengths({"type": "zipf", "a": a, "min": 5}, 40_000)
    assert values.min() == 5
    assert np.mean(values == 5) == pytest.approx(1 / (math.pi**2 / 6), abs=0.01)
    bounded = lengths({"type": "zipf", "a": 1.5, "min": 1, "max": 50}, 40_000)
    assert bounded.max() <= 50
    k = np.arange(1, 51, dtype=float)
    weights = k**-1.5
    assert bounded.mean() == pytest.approx(float((k * weights).sum() / weights.sum()), rel=0.03)
    assert np.mean(bounded == 50) < 0.01  # not clamped


def test_empirical_values_frequencies():
    values = lengths({"type": "empirical", "values": [10, 10, 10, 40]}, 20_000)
    assert set(values) == {10, 40}
    assert np.mean(values == 10) == pytest.approx(0.75, abs=0.015)


def test_lengths_are_deterministic_for_equal_seeds():
    mapping = {"type": "lognormal", "median": 300, "sigma": 1.5, "min": 2, "max": 4000}
    assert np.array_equal(lengths(mapping, 1000, seed=3), lengths(mapping, 1000, seed=3))
    assert not np.array_equal(lengths(mapping, 1000, seed=3), lengths(mapping, 1000, seed=4))


# ---------------------------------------------------------------- arrival processes

def gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times)


def test_poisson_rate_and_cv():
    times = arrivals({"type": "poisson", "rate": 4.0}, 40_000)
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    assert gaps(times).mean() == pytest.approx(0.25, rel=0.02)
    assert gaps(times).std() / gaps(times).mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_cv_close_to_configured(cv):
    g = gaps(arrivals({"type": "gamma", "rate": 2.0, "cv": cv}, 60_000))
    assert g.mean() == pytest.approx(0.5, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.05)


def test_constant_and_all_at_once():
    assert np.allclose(arrivals({"type": "constant", "rate": 4.0}, 5), [0, 0.25, 0.5, 0.75, 1.0])
    assert np.array_equal(arrivals("all_at_once", 4), np.zeros(4))


def test_bursts_alternate_on_and_off():
    cfg = {"type": "bursts", "on_rate": 50.0, "off_rate": 0.0, "on_seconds": 2.0, "off_seconds": 8.0}
    times = arrivals(cfg, 5000)
    cycles = (times[-1] - times[0]) / 10.0
    assert len(times) / cycles == pytest.approx(100, rel=0.05)  # 50/s for 2 s per 10 s cycle
    long_gaps = np.sum(gaps(times) > 6.0)  # every quiet period is one gap of about 8 s
    assert long_gaps == pytest.approx(cycles, abs=1.5)
    mixed = arrivals(dict(cfg, off_rate=5.0), 20_000)
    assert len(mixed) / mixed[-1] == pytest.approx((50 * 2 + 5 * 8) / 10, rel=0.03)


def test_diurnal_rate_follows_the_sine():
    times = arrivals({"type": "diurnal", "mean_rate": 10.0, "amplitude": 0.5, "period": 100.0}, 50_000)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.02)
    phase = np.mod(times, 100.0)
    high, low = np.sum(phase < 50), np.sum(phase >= 50)
    expected = (1 + 2 * 0.5 / math.pi) / (1 - 2 * 0.5 / math.pi)  # mass of the positive half over the negative
    assert high / low == pytest.approx(expected, rel=0.05)


# ---------------------------------------------------------------- build_requests

def test_synthetic_build_contract_and_determinism():
    cfg = parse_workload(SYNTHETIC)
    a = build_requests(cfg, np.random.default_rng(7))
    b = build_requests(cfg, np.random.default_rng(7))
    c = build_requests(cfg, np.random.default_rng(8))
    assert [r.id for r in a] == list(range(500))
    assert a[0].arrival == 0.0 and all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    assert all(isinstance(r.prompt_len, int) and r.prompt_len >= 1 and 10 <= r.output_len <= 300 for r in a)
    key = lambda reqs: [(r.arrival, r.prompt_len, r.output_len) for r in reqs]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)


def test_explicit_list_sorted_stably_and_used_as_is():
    cfg = parse_workload({"requests": [
        {"arrival": 2.0, "prompt_len": 64, "output_len": 30},
        {"arrival": 1.5, "prompt_len": 10, "output_len": 5, "priority": 2},
        {"arrival": 2.0, "prompt_len": 7, "output_len": 1},
    ]})
    reqs = build_requests(cfg, np.random.default_rng(0))
    assert [(r.id, r.arrival, r.prompt_len, r.output_len, r.priority) for r in reqs] == [
        (0, 1.5, 10, 5, 2), (1, 2.0, 64, 30, 0), (2, 2.0, 7, 1, 0)]


# ---------------------------------------------------------------- trace readers (real files)

@pytest.fixture(scope="module")
def azure_conv():
    return trace_requests({"format": "azure", "path": str(needs(AZURE_CONV))})


def test_azure_conv_reader(azure_conv):
    s = describe_requests(azure_conv)
    assert s["count"] == 19_366
    assert s["duration"] == pytest.approx(3501.72, abs=0.01)
    assert s["prompt_len"]["mean"] == pytest.approx(1155, abs=1) and s["prompt_len"]["max"] == 14_050
    assert s["output_len"]["mean"] == pytest.approx(211, abs=1) and s["output_len"]["max"] == 1000
    assert azure_conv[0].arrival == 0.0 and azure_conv[1].arrival == pytest.approx(4.314579)


def test_azure_code_is_bursty():
    s = describe_requests(trace_requests({"format": "azure", "path": str(needs(AZURE_CODE))}))
    assert s["count"] == 8819 and s["arrival_cv"] > 5
    assert s["prompt_len"]["p50"] == 1469


def test_vidur_processed_trace_matches_azure(azure_conv):
    vidur = trace_requests({"format": "vidur", "path": str(needs(VIDUR / "splitwise_conv.csv"))})
    assert [r.prompt_len for r in vidur] == [r.prompt_len for r in azure_conv]
    assert [r.output_len for r in vidur] == [r.output_len for r in azure_conv]
    assert np.allclose([r.arrival for r in vidur], [r.arrival for r in azure_conv], atol=1e-3)


def test_vidur_file_without_timestamps_needs_an_arrival_process():
    cfg = parse_workload({"trace": {"format": "vidur", "path": str(needs(
        VIDUR / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"))}})
    with pytest.raises(ConfigError, match=r"workload\.arrival"):
        build_requests(cfg, np.random.default_rng(0))


@pytest.mark.parametrize("fmt, path, count, limit", [
    ("sharegpt", SHAREGPT, 30_731, 8192), ("arxiv", ARXIV, 28_257, 4096)])
def test_length_statistics_traces_take_arrivals_from_the_process(fmt, path, count, limit):
    reqs = trace_requests({"format": fmt, "path": str(needs(path))}, arrival={"type": "constant", "rate": 10.0})
    assert len(reqs) == count
    assert all(r.prompt_len + r.output_len <= limit for r in reqs)
    assert reqs[1].arrival == pytest.approx(0.1)
    sampled = trace_requests({"format": fmt, "path": str(path), "sample": 100}, arrival={"type": "poisson", "rate": 1.0})
    assert len(sampled) == 100


@pytest.fixture(scope="module")
def mooncake_conv():
    return load_trace(TraceConfig(format="mooncake", path=str(needs(MOONCAKE_CONV))), np.random.default_rng(0))


def test_mooncake_reader_hashes_and_prefix_reuse(mooncake_conv):
    assert len(mooncake_conv) == 12_031 and mooncake_conv.slot_width == pytest.approx(3.0)
    blocks = [len(h) for h in mooncake_conv.prefix_hashes]
    assert blocks == list(-(-mooncake_conv.prompt_len // 512))
    reqs = trace_requests({"format": "mooncake", "path": str(MOONCAKE_CONV)})
    assert describe_requests(reqs)["prefix_hit_ratio"] == pytest.approx(0.366, abs=0.002)  # SOURCE.md: 36.6%


def dispersion(times: np.ndarray) -> float:
    """Index of dispersion (variance / mean) of per-second arrival counts."""
    counts = np.bincount(np.floor(times).astype(int))
    return float(counts.var() / counts.mean())


def test_mooncake_slots_are_spread_within_their_slot(mooncake_conv):
    raw = read_mooncake(MOONCAKE_CONV, "workload.trace")
    assert len(np.unique(raw.arrival)) == 1180 and detect_slot_width(raw.arrival) == pytest.approx(3.0)
    offsets = spread_slots(raw.arrival, 3.0, np.random.default_rng(0)) - raw.arrival
    assert offsets.min() >= 0 and offsets.max() < 3.0 and offsets.mean() == pytest.approx(1.5, abs=0.05)
    # load_trace spreads with the run's rng (same draws), then sorts
    assert np.array_equal(mooncake_conv.arrival, np.sort(raw.arrival + offsets))
    assert len(np.unique(mooncake_conv.arrival)) == len(mooncake_conv)
    assert dispersion(raw.arrival) > 5 and dispersion(mooncake_conv.arrival) < 2  # the artificial bursts are gone
    path = str(MOONCAKE_CONV)
    again = load_trace(TraceConfig(format="mooncake", path=path), np.random.default_rng(0))
    other = load_trace(TraceConfig(format="mooncake", path=path), np.random.default_rng(1))
    assert np.array_equal(again.arrival, mooncake_conv.arrival)
    assert not np.array_equal(other.arrival, mooncake_conv.arrival)
    kept = load_trace(TraceConfig(format="mooncake", path=path, slot_width=0.0), np.random.default_rng(0))
    assert np.array_equal(kept.arrival, raw.arrival)


def test_mooncake_synthetic_trace_is_not_slotted():
    trace = load_trace(TraceConfig(format="mooncake", path=str(needs(MOONCAKE_SYN))), np.random.default_rng(0))
    raw = read_mooncake(MOONCAKE_SYN, "workload.trace")
    assert trace.slot_width == 0.0 and np.array_equal(trace.arrival, raw.arrival)


def test_time_scale_and_window(azure_conv):
    path = str(needs(AZURE_CONV))
    full = np.array([r.arrival for r in azure_conv])
    fast = trace_requests({"format": "azure", "path": path, "time_scale": 2.0})
    assert np.allclose([r.arrival for r in fast], full / 2)
    window = trace_requests({"format": "azure", "path": path, "start": 600.0, "duration": 300.0, "time_scale": 3.0})
    inside = full[(full >= 600) & (full < 900)]
    assert len(window) == len(inside)
    assert np.allclose([r.arrival for r in window], (inside - 600) / 3)
    assert all(0 <= r.arrival < 100 for r in window)


def test_filters_sample_and_max_requests(azure_conv):
    path = str(needs(AZURE_CONV))
    cfg = TraceConfig(format="azure", path=path, max_prompt_len=2000, max_total_len=2100)
    trace = load_trace(cfg, np.random.default_rng(0))
    assert trace.prompt_len.max() <= 2000 and (trace.prompt_len + trace.output_len).max() <= 2100
    assert len(trace) + sum(trace.dropped.values()) == 19_366
    assert set(trace.dropped) == {"over max_prompt_len", "over max_total_len"}
    first = trace_requests({"format": "azure", "path": path, "max_requests": 50})
    assert [r.prompt_len for r in first] == [r.prompt_len for r in azure_conv[:50]]
    sample = lambda seed: trace_requests({"format": "azure", "path": path, "sample": 200}, seed=seed)  # noqa: E731
    a, b, c = sample(5), sample(5), sample(6)
    assert len(a) == 200 and all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    assert [r.arrival for r in a] == [r.arrival for r in b] != [r.arrival for r in c]
    full_arrivals = {r.arrival for r in azure_conv}
    assert all(r.arrival in full_arrivals for r in a)


def test_zero_length_rows_are_dropped_and_counted(tmp_path):
    file = tmp_path / "tiny.csv"
    file.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:00:00.0000000,100,0\n"
                    "2023-11-16 18:00:01.5000000,200,20\n"
                    "2023-11-16 18:00:03.0000000,0,5\n"
                    "2023-11-16 18:00:04.0000000,300,30\n")
    trace = load_trace(TraceConfig(format="azure", path=str(file)), np.random.default_rng(0))
    assert trace.dropped == {"zero length": 2}
    assert list(trace.arrival) == [1.5, 4.0] and list(trace.output_len) == [20, 30]


def test_trace_path_resolution(tmp_path, monkeypatch):
    needs(AZURE_CODE)
    relative = "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    cfg = parse_workload({"trace": {"format": "azure", "path": relative, "max_requests": 3}})
    monkeypatch.delenv("CBSIM_DATA", raising=False)
    assert len(build_requests(cfg, np.random.default_rng(0), base_dir=DATA)) == 3
    monkeypatch.setenv("CBSIM_DATA", str(DATA))
    assert len(build_requests(cfg, np.random.default_rng(0), base_dir=tmp_path)) == 3
    monkeypatch.setenv("CBSIM_DATA", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        build_requests(cfg, np.random.default_rng(0), base_dir=tmp_path / "exp")
    message = str(err.value)
    assert message.startswith("workload.trace.path: expected an existing trace file")
    assert str(tmp_path / "exp" / relative) in message and str(Path.cwd() / relative) in message


def test_empirical_lengths_from_a_trace():
    needs(SHAREGPT)
    workload = dict(SYNTHETIC, prompt_len={"type": "empirical", "trace": {"format": "sharegpt", "path": str(SHAREGPT)}},
                    output_len={"type": "empirical", "trace": {"format": "sharegpt", "path": str(SHAREGPT),
                                                                "max_total_len": 1000}})
    reqs = build_requests(parse_workload(workload), np.random.default_rng(0))
    trace = load_trace(TraceConfig(format="sharegpt", path=str(SHAREGPT)), np.random.default_rng(0))
    assert {r.prompt_len for r in reqs} <= set(trace.prompt_len.tolist())
    assert max(r.output_len for r in reqs) < 1000


# ---------------------------------------------------------------- configuration errors

@pytest.mark.parametrize("change, where", [
    ({"arrival": {"type": "posson", "rate": 1}}, "workload.arrival.type: expected one of poisson"),
    ({"arrival": {"type": "poisson", "rate": -1}}, "workload.arrival.rate: expected a rate > 0"),
    ({"arrival": {"rate": 3}}, "workload.arrival.type: expected a value"),
    ({"arrival": {"type": "gamma", "rate": 1}}, "workload.arrival.cv: expected a value"),
    ({"prompt_len": {"type": "uniform", "min": 5, "max": 2}}, "workload.prompt_len.max: expected a value >= min"),
    ({"prompt_len": {"type": "lognormal", "median": 1000, "sigma": 0.1, "max": 10}},
     "workload.prompt_len.max: expected bounds that keep"),
    ({"output_len": {"type": "zipf", "a": 0.9}}, "workload.output_len.a: expected an exponent a > 1"),
    ({"output_len": {"type": "empirical"}}, "workload.output_len.values: expected exactly one"),
    ({"num_requests": None}, "workload.num_requests: expected a value"),
    ({"num_requests": 0}, "workload.num_requests: expected an integer >= 1"),
    ({"bogus": 1}, "workload.bogus: expected one of the keys"),
    ({"trace": {"format": "azure", "path": "x.csv"}}, "workload.num_requests: expected null with a trace"),
    ({"shared_prefix": {"turns": 0}}, "workload.shared_prefix.turns: expected an integer >= 1"),
])
def test_config_errors_name_the_key(change, where):
    mapping = {k: v for k, v in {**SYNTHETIC, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        parse_workload(mapping)
    assert str(err.value).startswith(where)


@pytest.mark.parametrize("mapping, where", [
    ({}, "workload: expected one source"),
    ({"trace": {"format": "azur", "path": "x"}}, "workload.trace.format: expected one of"),
    ({"trace": {"format": "azure", "path": "x", "time_scale": 0}}, "workload.trace.time_scale: expected"),
    ({"trace": {"format": "sharegpt", "path": "x"}}, "workload.arrival: expected a value"),
    ({"trace": {"format": "sharegpt", "path": "x", "start": 5}}, "workload.trace.start: expected 0.0"),
    ({"trace": {"format": "mooncake", "path": "x"}, "shared_prefix": {}}, "workload.shared_prefix: expected no"),
    ({"requests": [{"arrival": 0, "prompt_len": 1, "output_len": 0}]}, "workload.requests[0].output_len"),
    ({"requests": [{"arrival": 0, "prompt_len": 1, "output_len": 1}], "num_requests": 3},
     "workload.num_requests: expected nothing beside"),
    ([1, 2], "workload: expected a mapping"),
])
def test_source_errors_name_the_key(mapping, where):
    with pytest.raises(ConfigError) as err:
        parse_workload(mapping)
    assert str(err.value).startswith(where)


def test_wrong_mooncake_block_size_is_reported():
    cfg = parse_workload({"trace": {"format": "mooncake", "path": str(needs(MOONCAKE_SYN)), "hash_block_size": 16}})
    with pytest.raises(ConfigError, match=r"workload\.trace\.hash_block_size"):
        build_requests(cfg, np.random.default_rng(0))


# ---------------------------------------------------------------- shared prefixes

def test_hash_chains_agree_exactly_as_far_as_contents_agree():
    a = hash_chain([1, 2, 3, 4])
    b = hash_chain([1, 2, 9, 4])
    assert a == hash_chain([1, 2, 3, 4]) and a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # a block's hash depends on everything before it


def test_system_prompts_share_chains():
    cfg = SharedPrefixConfig(mode="system_prompts", num_prefixes=3, prefix_len=100, hash_block_size=16)
    own = np.array([5, 50, 500] * 100)
    prompt, chains = system_prompts(cfg, own, np.random.default_rng(0))
    assert np.array_equal(prompt, own + 100)
    assert all(len(c) == 100 // 16 for c in chains)
    assert len(set(chains)) == 3  # one chain per system prompt, shared by every request that uses it
    assert len({c[0] for c in chains}) == 3  # different prompts differ from the first block


def test_system_prompt_zipf_popularity():
    cfg = parse_workload(dict(SYNTHETIC, num_requests=3000,
                              shared_prefix={"num_prefixes": 4, "prefix_len": 64, "popularity": "zipf", "zipf_a": 1.0}))
    reqs = build_requests(cfg, np.random.default_rng(0))
    counts = sorted((sum(1 for r in reqs if r.prefix_hashes == c) for c in {r.prefix_hashes for r in reqs}), reverse=True)
    shares = np.array(counts) / len(reqs)
    assert np.allclose(shares, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12), atol=0.03)
    assert all(r.prompt_len > 64 for r in reqs)


def test_multi_turn_prompts_grow_and_chains_extend():
    cfg = SharedPrefixConfig(mode="multi_turn", num_prefixes=1, prefix_len=40, hash_block_size=16, turns=3,
                             think_time=5.0)
    user = np.array([30, 20, 10, 30, 20, 10, 25])
    output = np.array([16, 8, 4, 16, 8, 4, 9])
    arrival, prompt, chains, outputs = multi_turn(cfg, np.array([0.0, 1.0, 2.0]), user, output,
                                                  np.random.default_rng(0))
    assert list(prompt) == [70, 70 + 16 + 20, 106 + 8 + 10, 70, 106, 124, 65]  # 7 requests: turns 3, 3, 1
    for c in (0, 1):
        turns = slice(3 * c, 3 * c + 3)
        assert np.all(np.diff(arrival[turns]) > 0) and arrival[3 * c] == float(c)
        for k in range(3 * c, 3 * c + 2):
            assert chains[k + 1][:len(chains[k])] == chains[k]  # each turn extends the previous chain
        assert [len(chains[k]) for k in range(3 * c, 3 * c + 3)] == [70 // 16, 106 // 16, 124 // 16]
    # conversations share exactly the system prompt's full blocks (40 tokens: 2 blocks of 16)
    system = hash_chain(content_id(1, 0, j) for j in range(2))
    assert chains[0][:2] == chains[3][:2] == system and chains[0][2] != chains[3][2]
    # a turn's output hashes continue its chain over the full blocks of prompt + output: the blocks its
    # next turn's chain holds there (70 + 16 = 86 tokens: block 4 of 16 full, the next turn's 5th block)
    assert outputs[0] == chains[1][len(chains[0]):86 // 16]
    for k in range(7):
        assert len(chains[k]) + len(outputs[k]) == (prompt[k] + output[k]) // 16
        if k + 1 < 7 and k % 3 != 2:
            assert chains[k + 1][:len(chains[k]) + len(outputs[k])] == chains[k] + outputs[k]


def test_multi_turn_requests_carry_their_output_hashes():
    """build_run gives each multi_turn request its output hashes, in arrival order: a conversation's
    outputs are the next turn's prompt blocks, so a prefix cache that keeps computed outputs serves them."""
    workload = dict(SYNTHETIC, num_requests=12, shared_prefix={"mode": "multi_turn", "num_prefixes": 0, "turns": 3,
                                                                "hash_block_size": 16})
    reqs = build_requests(parse_workload(workload), np.random.default_rng(4))
    followed = 0
    for r in reqs:
        assert len(r.prefix_hashes) + len(r.output_hashes or ()) == (r.prompt_len + r.output_len) // 16
        following = [q for q in reqs if q.prefix_hashes[:len(r.prefix_hashes)] == r.prefix_hashes and q is not r
                     and len(q.prefix_hashes) > len(r.prefix_hashes)]
        for q in following:
            followed += 1
            assert q.prefix_hashes[len(r.prefix_hashes):][:len(r.output_hashes or ())] == (r.output_hashes or ())
    assert followed  # some turn had a later one


def test_multi_turn_build_is_deterministic_and_counts_requests():
    workload = dict(SYNTHETIC, num_requests=10, shared_prefix={"mode": "multi_turn", "num_prefixes": 0, "turns": 4})
    a = build_requests(parse_workload(workload), np.random.default_rng(2))
    b = build_requests(parse_workload(workload), np.random.default_rng(2))
    assert len(a) == 10 and a[0].arrival == 0.0
    assert [(r.arrival, r.prompt_len, r.prefix_hashes) for r in a] == [(r.arrival, r.prompt_len, r.prefix_hashes) for r in b]
    extended = sum(1 for r in a for s in a if s is not r and r.prefix_hashes
                   and s.prefix_hashes[:len(r.prefix_hashes)] == r.prefix_hashes and s.arrival > r.arrival)
    assert extended == 6 + 6 + 1  # conversations of 4, 4 and 2 turns: every later turn extends every earlier one


# ---------------------------------------------------------------- description

def test_describe_and_plot(tmp_path):
    reqs = build_requests(parse_workload({"requests": [
        {"arrival": 0.0, "prompt_len": 10, "output_len": 1},
        {"arrival": 1.0, "prompt_len": 20, "output_len": 3},
        {"arrival": 3.0, "prompt_len": 30, "output_len": 5},
    ]}), np.random.default_rng(0))
    s = describe_requests(reqs)
    assert s["count"] == 3 and s["duration"] == 3.0 and s["rate"] == 1.0
    assert s["arrival_cv"] == pytest.approx(0.5 / 1.5)
    assert s["prompt_len"] == {"mean": 20.0, "p50": 20.0, "p90": 28.0, "p99": 29.8, "max": 30.0}
    assert "prefix_hit_ratio" not in s and "3 requests over 3.0 s" in format_description(s)
    out = plot_workload(reqs, tmp_path / "workload.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
