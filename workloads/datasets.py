"""Readers for the datasets users have: raw ShareGPT JSON, BurstGPT CSV, a generic per-request
CSV or JSONL, and the result file of `vllm bench serve --save-result`.

Invariant: as traces.py, a reader returns the file's rows as they are and draws nothing; a row
that cannot be a request is dropped and counted in `TraceData.dropped` under its rule (traces.py's
UNREADABLE, and here `fewer than two turns`); a file that is not of its format at all (not JSON, a
missing column, a malformed row) is a ConfigError naming the file, the key and the row.

- sharegpt_json: a JSON list of `{id, conversations: [{from: human|gpt, value: text}, ...]}`. As in
  vLLM's benchmark (ShareGPTDataset), a conversation's first turn is the prompt and its second turn's
  length is the output length; conversations with fewer than two turns are dropped. Lengths are
  counted with tokens.py (a local tokenizer, else the documented approximation). No timestamps.
  With `turns="all"` every (prompt, reply) pair of turns 2k, 2k+1 is a request of the conversation's
  session, its prompt the whole conversation so far (previous turns + the new one, token counts
  summed) and its output the reply; a last turn without a reply is dropped (`turn without a reply`).
- burstgpt: BurstGPT's CSV (`Timestamp` in seconds, `Model`, `Request tokens`, `Response tokens`,
  `Total tokens`, `Log Type`; release v3 adds `Session ID`, read as the rows' sessions); failed
  requests (0 response tokens) are later dropped as zero length.
- generic_csv / generic_jsonl: `arrival_s`, `prompt_len`, `output_len`, and optionally
  `prefix_hashes` (a block hash chain: a JSON list in JSONL, space-separated integers or a JSON list
  in a CSV cell), `session_id` (any value; rows of one session are one conversation's turns), and
  `tenant` and `adapter` (any value, read as a string; empty or missing: none) for fair queueing
  (policies/fairness.py) and the request table, and `mm_inputs` (a request's images: a JSON list of
  [offset, length] pairs, or "offset:length" items in a CSV cell; workloads/multimodal.py).
- vllm_bench: the JSON `vllm bench serve --save-result --save-detailed` writes; its `input_lens` and
  `output_lens` (the lengths the benchmark actually sent and received) are replayed exactly, in the
  file's order. No timestamps (its requests were drawn from a rate; set workload.arrival).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core import bounds
from cbsim.core.errors import ConfigError

from cbsim.workloads.multimodal import check_mm_inputs, parse_mm_inputs
from cbsim.workloads.tokens import TokenCounter
from cbsim.workloads.readers import TraceData, json_number, numeric_column, read_csv_columns, read_json_lines, trace_rows

SHORT_CONVERSATION = "fewer than two turns"
NO_REPLY = "turn without a reply"
GENERIC_COLUMNS = ("arrival_s", "prompt_len", "output_len")
LABEL_COLUMNS = ("tenant", "adapter")  # optional string columns of the generic formats


def read_sharegpt_json(path: Path, key: str, counter: TokenCounter | None, turns: str = "first") -> TraceData:
    """Raw ShareGPT: first turn = prompt, second turn = output (vLLM's benchmark reads it so); with
    turns="all", every pair of turns, the prompt holding the conversation so far (module docstring)."""
    counter = counter or TokenCounter()
    data = _load_json(path, key, "a JSON list of ShareGPT conversations")
    if not isinstance(data, list):
        raise ConfigError(key, "a JSON list of {id, conversations: [{from, value}, ...]}", type(data).__name__,
                          file=str(path))
    texts, owner, short, unanswered = [], [], 0, 0
    for i, entry in enumerate(data):
        conversation = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conversation, list):
            raise ConfigError(f"{key} (entry {i}).conversations", "a list of {from, value} turns",
                              conversation if isinstance(entry, dict) else entry, file=str(path))
        if len(conversation) < 2:
            short += 1
            continue
        used = 2 if turns == "first" else len(conversation) - len(conversation) % 2
        unanswered += len(conversation) % 2 if turns == "all" else 0
        texts.extend(_turn_text(conversation, j, i, key, path) for j in range(used))
        owner.extend([i] * (used // 2))
    counts = np.asarray(counter.count(texts), dtype=np.int64).reshape(-1, 2)  # (prompt turn, reply) pairs
    prompts, sessions = _with_history(counts, np.asarray(owner, dtype=np.int64)), None
    if turns == "all":
        sessions = pd.factorize(np.asarray(owner, dtype=np.int64), sort=False)[0].astype(np.int64)
    trace = trace_rows(str(path), None, prompts, counts[:, 1], sessions=sessions)
    early = {SHORT_CONVERSATION: short, NO_REPLY: unanswered}
    trace.dropped = {**{k: n for k, n in early.items() if n}, **trace.dropped}
    trace.token_lengths = counter.method
    return trace


def _with_history(counts: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Prompt lengths holding the conversation so far: each pair's prompt turn plus every earlier turn
    (prompts and replies) of the same conversation."""
    total = counts.sum(axis=1)
    before = np.cumsum(total) - total  # tokens of all earlier pairs, any conversation
    first = np.r_[True, owner[1:] != owner[:-1]] if len(owner) else np.zeros(0, dtype=bool)
    start = np.maximum.accumulate(np.where(first, before, 0))  # tokens before the conversation's first pair
    return before - start + counts[:, 0]


def _turn_text(turns: list, j: int, i: int, key: str, path: Path) -> str:
    turn = turns[j]
    value = turn.get("value") if isinstance(turn, dict) else None
    if not isinstance(value, str):
        raise ConfigError(f"{key} (entry {i}).conversations[{j}].value", "the turn's text (a string)",
                          value if isinstance(turn, dict) else turn, file=str(path))
    return value


def read_burstgpt(path: Path, key: str, counter=None) -> TraceData:
    """BurstGPT: `Timestamp` (seconds), `Request tokens`, `Response tokens`."""
    frame = read_csv_columns(path, key, ("Timestamp", "Request tokens", "Response tokens"))
    sessions = _sessions(frame["Session ID"].tolist()) if "Session ID" in frame.columns else None
    return trace_rows(str(path), numeric_column(frame, "Timestamp"), numeric_column(frame, "Request tokens"),
                 numeric_column(frame, "Response tokens"), sessions=sessions)


def read_generic_csv(path: Path, key: str, counter=None) -> TraceData:
    """One request per row: arrival_s, prompt_len, output_len[, prefix_hashes][, session_id][, tenant][, adapter]
    [, mm_inputs]."""
    frame = read_csv_columns(path, key, GENERIC_COLUMNS)
    hashes = None
    if "prefix_hashes" in frame.columns:
        hashes = [_csv_hashes(cell, row + 2, key, path) for row, cell in enumerate(frame["prefix_hashes"])]
    sessions = _sessions(frame["session_id"].tolist()) if "session_id" in frame.columns else None
    labels = {f"{c}s": _labels(frame[c].tolist()) for c in LABEL_COLUMNS if c in frame.columns}
    prompts = numeric_column(frame, "prompt_len")
    if "mm_inputs" in frame.columns:
        labels["mm_inputs"] = _images(frame["mm_inputs"].tolist(), prompts, key, path, first_line=2)
    return trace_rows(str(path), numeric_column(frame, "arrival_s"), prompts, numeric_column(frame, "output_len"), hashes, sessions,
                 **labels)


def _images(cells: list, prompts, key: str, path: Path, first_line: int) -> list:
    """Each row's images from its `mm_inputs` cell (workloads/multimodal.py), checked to lie within
    the row's prompt; an error names the file and line."""
    out = []
    for row, (cell, prompt) in enumerate(zip(cells, prompts)):
        where = f"{key} (line {row + first_line}).mm_inputs"
        try:
            pairs = parse_mm_inputs(cell, where)
            if pairs is not None and np.isfinite(prompt):
                check_mm_inputs(pairs, int(prompt), where)
        except ConfigError as err:
            raise err.in_file(str(path)) from None
        out.append(pairs)
    return out


def _labels(values: list) -> list:
    """A string per row, None for an empty or missing cell (a CSV reads "7" as 7: back to "7")."""
    out = []
    for v in values:
        if v is None or (isinstance(v, float) and np.isnan(v)) or v == "":
            out.append(None)
        elif isinstance(v, float) and v.is_integer():
            out.append(str(int(v)))
        else:
            out.append(str(v))
    return out


def _csv_hashes(cell, line: int, key: str, path: Path) -> tuple[int, ...]:
    """A CSV cell's hash chain: empty, space-separated integers, or a JSON list of integers."""
    if cell is None or (isinstance(cell, float) and np.isnan(cell)):
        return ()
    text = str(cell).strip()
    try:
        values = bounds.loads(text) if text.startswith("[") else text.split()
        return tuple(int(v) for v in values)
    except (ValueError, TypeError):
        raise ConfigError(f"{key} (line {line}).prefix_hashes", "integers separated by spaces, or a JSON list",
                          text, file=str(path)) from None


def read_generic_jsonl(path: Path, key: str, counter=None) -> TraceData:
    """One JSON object per line with the generic columns (prefix_hashes a list of integers)."""
    stamps, prompts, outputs, hashes, sessions, images = [], [], [], [], [], []
    labels = {c: [] for c in LABEL_COLUMNS}
    with_hashes = with_sessions = False
    expected = ("UTF-8 JSON lines with arrival_s, prompt_len, output_len (optional prefix_hashes, session_id, "
                "tenant, adapter, mm_inputs)")

    def parse(row: dict) -> tuple:
        values = [json_number(row, name) for name in GENERIC_COLUMNS]
        chain = row.get("prefix_hashes")
        return row, values, chain, () if chain is None else tuple(int(h) for h in chain)

    for row, values, chain, chain_tuple in read_json_lines(path, key, expected, parse):
        hashes.append(chain_tuple)
        for column, value in zip((stamps, prompts, outputs), values):
            column.append(value)
        with_hashes |= chain is not None
        with_sessions |= row.get("session_id") is not None
        sessions.append(row.get("session_id"))
        for column, found in labels.items():
            found.append(row.get(column))
        images.append(row.get("mm_inputs"))
    present = {f"{c}s": _labels(v) for c, v in labels.items() if any(x is not None for x in v)}
    if any(cell is not None for cell in images):
        present["mm_inputs"] = _images(images, prompts, key, path, first_line=1)
    return trace_rows(str(path), stamps, prompts, outputs, hashes if with_hashes else None,
                 _sessions(sessions) if with_sessions else None, **present)


def _sessions(values: list) -> np.ndarray:
    """Session numbers 0, 1, ... in order of first appearance; -1 for a row without one."""
    names = [None if v is None or (isinstance(v, float) and np.isnan(v)) else str(v) for v in values]
    codes, _ = pd.factorize(pd.Series(names, dtype=object), sort=False)
    return codes.astype(np.int64)


def read_vllm_bench(path: Path, key: str, counter=None) -> TraceData:
    """`vllm bench serve` results: replay `input_lens` / `output_lens` exactly, in order."""
    data = _load_json(path, key, "a vllm bench serve result (JSON)")
    if not isinstance(data, dict):
        raise ConfigError(key, "a JSON object with input_lens and output_lens", type(data).__name__, file=str(path))
    columns = []
    for name in ("input_lens", "output_lens"):
        values = data.get(name)
        if not isinstance(values, list):
            raise ConfigError(f"{key}.{name}", "a list of per-request lengths (run vllm bench serve with "
                              "--save-result --save-detailed)", values, file=str(path), has_got=name in data)
        columns.append(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(dtype=np.float64))
    if len(columns[0]) != len(columns[1]):
        raise ConfigError(f"{key}.output_lens", f"as many lengths as input_lens ({len(columns[0])})",
                          len(columns[1]), file=str(path))
    return trace_rows(str(path), None, *columns)


def _load_json(path: Path, key: str, expected: str):
    try:
        with open(path, "rb") as handle:
            return bounds.loads(handle.read())
    except (ValueError, OSError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(key, expected, str(err), file=str(path)) from None


READERS = {
    "sharegpt_json": read_sharegpt_json,
    "burstgpt": read_burstgpt,
    "generic_csv": read_generic_csv,
    "generic_jsonl": read_generic_jsonl,
    "vllm_bench": read_vllm_bench,
}
