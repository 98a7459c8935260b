"""A real trace as a workload source: where the file is, and which of its rows to replay.

Invariant: `load_trace` applies its steps in one fixed order, every row it removes is counted in
`TraceData.dropped` under the rule that removed it, and a step that leaves no request at all is a
ConfigError naming its key (never an empty run):

1. read the file (traces.py), arrivals in seconds from the first row (rows that cannot be requests,
   such as NaN lengths or timestamps, are dropped and counted there);
2. drop rows with prompt_len < 1 or output_len < 1 (a request needs a prompt and at least one
   output token; the shipped traces have none, other files may);
3. Mooncake: spread each coarse arrival slot's requests uniformly over the slot (seeded);
4. keep arrivals in [start, start + duration) and shift them so `start` becomes 0;
5. drop rows over max_prompt_len, then rows over max_total_len;
6. `sample`: keep N rows drawn without replacement (seeded), in their original order;
7. `max_requests`: keep the first N rows;
8. divide arrivals by time_scale (k > 1 replays k times faster).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from cbsim.core.data import DATA_ENV, data_dir
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require
from cbsim.core.units import Seconds

from cbsim.workloads.datasets import NO_REPLY, SHORT_CONVERSATION
from cbsim.workloads.prefixes import session_chains
from cbsim.workloads.tokens import token_counter
from cbsim.workloads.readers import UNREADABLE, TraceData
from cbsim.workloads.traces import LENGTH_ONLY_FORMATS, TEXT_FORMATS, detect_slot_width, read_trace, spread_slots

# rules the user did not choose: their drops are warned about
CLEANING = UNREADABLE + ("zero length", SHORT_CONVERSATION, NO_REPLY)


def drop_warnings(dropped: dict[str, int] | None) -> list[str]:
    """One warning line per cleaning rule that dropped rows (window, filters and sampling are chosen
    by the experiment and only reported)."""
    return [f"warning: {n} trace rows dropped: {reason}" for reason, n in (dropped or {}).items()
            if reason in CLEANING]


@dataclass
class TraceConfig:
    """A trace file and the options that select which of its requests to replay."""

    format: Literal["azure", "mooncake", "sharegpt", "arxiv", "vidur", "sharegpt_json", "burstgpt", "generic_csv",
                    "generic_jsonl", "vllm_bench"] = option(
        help="file format: azure (Azure LLM 2023 CSV), mooncake (FAST'25 JSONL with hash_ids), "
             "sharegpt / arxiv (length-statistics CSVs, no timestamps), vidur (processed_traces CSV), "
             "sharegpt_json (raw ShareGPT conversations, no timestamps), burstgpt (BurstGPT CSV), "
             "generic_csv / generic_jsonl (arrival_s, prompt_len, output_len[, prefix_hashes][, session_id][, tenant]"
             "[, adapter]), "
             "vllm_bench (a vllm bench serve --save-result file: its input_lens/output_lens, no timestamps)")
    path: str = option(help="the file: absolute, or relative to the experiment file's folder, then to "
                            "the data folder ($CBSIM_DATA, else shared/data beside the repository), then to "
                            "the current directory")
    time_scale: float = option(1.0, help="replay speed-up: arrivals are divided by it (2.0 replays twice as fast)")
    start: Seconds = option(0.0, help="start of the replayed window in trace seconds (before time_scale); "
                                    "arrivals are shifted so the window starts at 0")
    duration: Seconds | None = option(None, help="length of the replayed window in trace seconds; null for the rest")
    max_requests: int | None = option(None, help="keep only the first N requests (after the other options)")
    max_prompt_len: int | None = option(None, help="drop requests whose prompt is longer (counted, not clamped)")
    max_total_len: int | None = option(None, help="drop requests whose prompt + output is longer (counted)")
    sample: int | None = option(None, help="keep N requests drawn at random without replacement (seeded), "
                                           "in trace order; all of them if the trace has fewer")
    hash_block_size: int = option(512, help="tokens per block of the trace's prefix hashes (Mooncake hash_ids: 512)")
    slot_width: Seconds | None = option(None, help="mooncake: seconds over which each timestamp slot's requests are "
                                                 "spread; null detects it from the data, 0 keeps raw timestamps")
    tokenizer: str | None = option(None, help="sharegpt_json: a local HuggingFace tokenizer.json (or its folder) "
                                              "counting the text's tokens (needs the 'tokenizers' extra); null, "
                                              "or the package missing: ceil(characters / 4), flagged in the summary")
    turns: Literal["first", "all"] = option(
        "first", help="sharegpt_json: first (the first turn is the prompt, the second's length the output, as vLLM's "
                      "benchmark) or all (every turn pair a request of the conversation's session, its prompt the "
                      "conversation so far, with prefix hashes of hash_block_size tokens: set it to the KV block size)")

    def validate(self):
        require(self.time_scale > 0, "time_scale", "a speed-up > 0", self.time_scale)
        require(self.start >= 0, "start", "a start >= 0", self.start)
        for name in ("duration",):
            value = getattr(self, name)
            require(value is None or value > 0, name, "a duration > 0 or null", value)
        for name in ("max_requests", "max_prompt_len", "sample", "hash_block_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, "an integer >= 1 or null", value)
        require(self.max_total_len is None or self.max_total_len >= 2, "max_total_len",
                "an integer >= 2 (a prompt token and an output token) or null", self.max_total_len)
        require(self.slot_width is None or self.slot_width >= 0, "slot_width", "a width >= 0 or null", self.slot_width)
        if self.slot_width is not None:
            require(self.format == "mooncake", "slot_width", "null (slot spreading is for mooncake traces)",
                    self.slot_width)
        if self.tokenizer is not None:
            require(self.format in TEXT_FORMATS, "tokenizer", "null (only text datasets are tokenised: "
                    + ", ".join(TEXT_FORMATS) + ")", self.tokenizer)
        require(self.turns == "first" or self.format == "sharegpt_json", "turns",
                "first (turns: all is for sharegpt_json conversations)", self.turns)
        if self.format in LENGTH_ONLY_FORMATS:
            for name, default in (("time_scale", 1.0), ("start", 0.0), ("duration", None)):
                require(getattr(self, name) == default, name,
                        f"{default} ({self.format} traces have no timestamps; arrivals come from workload.arrival)",
                        getattr(self, name))


def resolve_path(value: str, base_dir: Path | None, key: str) -> Path:
    """The file `value` names: absolute, else under base_dir, the data folder (cbsim.core.data) or the
    current directory."""
    given = Path(value).expanduser()
    if given.is_absolute():
        candidates = [given]
    else:
        roots = [base_dir, data_dir(), Path.cwd()]
        candidates = [Path(root) / given for root in roots if root is not None]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise ConfigError(key, f"an existing trace file (looked in: {looked}; set ${DATA_ENV} to the data folder)", value)


def load_trace(cfg: TraceConfig, rng: np.random.Generator, base_dir: Path | None = None,
               path: str = "workload.trace") -> TraceData:
    """The rows of the trace `cfg` selects, in arrival order (file order for lengths-only traces)."""
    file = resolve_path(cfg.path, base_dir, f"{path}.path")
    counter = token_counter(cfg.tokenizer, base_dir, f"{path}.tokenizer") if cfg.format in TEXT_FORMATS else None
    trace = read_trace(cfg.format, file, path, counter, cfg.turns)
    trace = trace.take((trace.prompt_len >= 1) & (trace.output_len >= 1), "zero length")
    _nonempty(trace, f"{path}.path", "a trace with at least one usable row", "none")
    if cfg.format == "mooncake":
        trace = _spread(trace, cfg, rng, path)
    elif trace.prefix_hashes is not None:
        _check_hash_blocks(trace, cfg.hash_block_size, path, exact=False)
    elif cfg.turns == "all":  # each turn's prompt extends the previous one's: one chain per conversation
        trace.prefix_hashes = session_chains(trace.sessions, trace.prompt_len, cfg.hash_block_size)
    if trace.arrival is not None:
        trace = trace.take(np.argsort(trace.arrival, kind="stable"), "unsorted")
        span = float(trace.arrival.max())
        trace = _window(trace, cfg)
        _nonempty(trace, f"{path}.start", f"a window [start, start + duration) holding arrivals (the trace's "
                  f"arrivals span 0 to {span:.6g} s)", {"start": cfg.start, "duration": cfg.duration})
    if cfg.max_prompt_len is not None:
        shortest = int(trace.prompt_len.min())
        trace = trace.take(trace.prompt_len <= cfg.max_prompt_len, "over max_prompt_len")
        _nonempty(trace, f"{path}.max_prompt_len", f"a limit keeping a request (the shortest prompt left has "
                  f"{shortest} tokens)", cfg.max_prompt_len)
    if cfg.max_total_len is not None:
        shortest = int((trace.prompt_len + trace.output_len).min())
        trace = trace.take(trace.prompt_len + trace.output_len <= cfg.max_total_len, "over max_total_len")
        _nonempty(trace, f"{path}.max_total_len", f"a limit keeping a request (the shortest request left has "
                  f"{shortest} tokens)", cfg.max_total_len)
    if cfg.sample is not None and cfg.sample < len(trace):
        trace = trace.take(np.sort(rng.choice(len(trace), size=cfg.sample, replace=False)), "not sampled")
    if cfg.max_requests is not None:
        trace = trace.take(np.arange(min(cfg.max_requests, len(trace))), "over max_requests")
    if trace.arrival is not None:
        trace.arrival = trace.arrival / cfg.time_scale
    return trace


def _nonempty(trace: TraceData, key: str, expected: str, got) -> None:
    """A rule that left no request is an error naming its key (and what every rule dropped)."""
    if len(trace) == 0:
        dropped = ", ".join(f"{reason}: {n}" for reason, n in trace.dropped.items()) or "the file has no rows"
        raise ConfigError(key, f"{expected}; rows dropped: {dropped}", got, file=trace.source)


def _spread(trace: TraceData, cfg: TraceConfig, rng: np.random.Generator, path: str) -> TraceData:
    _check_hash_blocks(trace, cfg.hash_block_size, path)
    width = detect_slot_width(trace.arrival) if cfg.slot_width is None else cfg.slot_width
    trace.arrival = spread_slots(trace.arrival, width, rng)
    trace.slot_width = width
    return trace


def _check_hash_blocks(trace: TraceData, block: int, path: str, exact: bool = True) -> None:
    """Mooncake rows carry ceil(input_length / block) hash ids (a mismatch means a wrong block size);
    a generic file's chain may cover less of the prompt (`exact` False), never more."""
    counts = np.fromiter((len(h) for h in trace.prefix_hashes), dtype=np.int64, count=len(trace))
    blocks = -(-trace.prompt_len // block)
    bad = np.flatnonzero(counts != blocks if exact else counts > blocks)
    if len(bad):
        i = bad[0]
        raise ConfigError(f"{path}.hash_block_size", "the block size of the trace's prefix hashes "
                          f"(row {i}: {counts[i]} ids for {trace.prompt_len[i]} tokens)", block, file=trace.source)


def _window(trace: TraceData, cfg: TraceConfig) -> TraceData:
    end = np.inf if cfg.duration is None else cfg.start + cfg.duration
    trace = trace.take((trace.arrival >= cfg.start) & (trace.arrival < end), "outside window")
    trace.arrival = trace.arrival - cfg.start
    return trace
