"""Recorder: what happened, kept compactly while the simulation runs; computed on afterwards.

Steps are rows in growable numpy columns, indexed by a global step number (all replicas share
the numbering; each row names its replica).

Output tokens are not stored one by one. A request's tokens come in *runs*: maximal sequences of
consecutive steps of one replica in each of which it produced one token (a decode batch that
keeps it every step is one run; a prefill-only step, a preemption or a move to another replica
ends it). A run is (request id, first step, last step, tokens) and a token's time is the end of
its step, so every token time and every inter-token gap can be reconstructed exactly from the
step table, at a memory cost of one run instead of hundreds of tokens.

Three integer aggregates describe what a step's attention read and computed, for the efficiency
columns computed afterwards (sim/metrics/step_efficiency.py): the decode rows' contexts summed (padding
rows included: they run like decode rows), the prefill rows' histories summed (KV tokens already
cached that each chunk reads), and the prefill rows' causal query-key pairs summed. They are exact
integers; a prefill row (c, h) has c * h + c * (c + 1) / 2 pairs.
"""
from __future__ import annotations

from array import array

import numpy as np

from .growable import Column
from ..request import Request

STEP_COLUMNS = {  # compact types: ~68 bytes a step
    "replica": np.int16,
    "start": np.float64,
    "end": np.float64,
    "prefill_tokens": np.int32,
    "decode_tokens": np.int32,
    "padding_tokens": np.int32,
    "num_seqs": np.int32,
    "kv_blocks_used": np.int32,
    "preemptions": np.int16,
    "swap_bytes": np.float64,
    "decode_context_tokens": np.int64,  # sum of the decode rows' context lengths (KV tokens they read)
    "prefill_history_tokens": np.int32,  # sum of h over prefill rows (c, h)
    "prefill_attention_pairs": np.int64,  # sum of c * h + c * (c + 1) / 2 over prefill rows
}
AGGREGATES = ("decode_context_tokens", "prefill_history_tokens", "prefill_attention_pairs")  # 0 unless given


class Recorder:
    def __init__(self):
        self.columns = {name: Column(dtype) for name, dtype in STEP_COLUMNS.items()}
        self._appends = [column.data.append for column in self.columns.values()]  # in STEP_COLUMNS order
        self._start = self.columns["start"].data
        self.run_request = array("q")
        self.run_first_step = array("q")
        self.run_last_step = array("q")
        self.run_tokens = array("q")

    @property
    def num_steps(self) -> int:
        return len(self._start)

    def add_step(self, replica: int, start: float, end: float, prefill_tokens: int, decode_tokens: int,
                 padding_tokens: int, num_seqs: int, kv_blocks_used: int, preemptions: int,
                 swap_bytes: float, decode_context_tokens: int = 0, prefill_history_tokens: int = 0,
                 prefill_attention_pairs: int = 0) -> int:
        """Append one step row; returns its global step index (called once per simulated step)."""
        index = len(self._start)
        a = self._appends  # in STEP_COLUMNS order; spelled out, this runs once per step
        a[0](replica), a[1](start), a[2](end), a[3](prefill_tokens), a[4](decode_tokens)
        a[5](padding_tokens), a[6](num_seqs), a[7](kv_blocks_used), a[8](preemptions), a[9](swap_bytes)
        a[10](decode_context_tokens), a[11](prefill_history_tokens), a[12](prefill_attention_pairs)
        return index

    def set_end(self, step: int, end: float) -> None:
        """Close a step row opened at the step's start (its end is known only when it finishes)."""
        self.columns["end"].set(step, end)

    def add_steps(self, **rows) -> int:
        """Append many step rows at once (scalars broadcast; an aggregate left out is 0); returns the
        first new index."""
        first = len(self._start)
        count = len(rows["start"])
        for name, column in self.columns.items():  # once per fast-forwarded run: the columns' arrays directly
            value = rows.get(name, 0) if name in AGGREGATES else rows[name]
            if isinstance(value, list):
                column.data.extend(value)
            elif isinstance(value, np.ndarray):
                column.extend(value)
            else:
                column.data.extend([value] * count)
        return first

    def token(self, req: Request, step: int, previous_step: int) -> None:
        """Note that `req` produced one token in `step`; `previous_step` is its replica's last step."""
        if req.run_tokens and req.last_token_step == previous_step:
            req.run_tokens += 1
        else:
            self.close_run(req)
            req.run_start_step = step
            req.run_tokens = 1
        req.last_token_step = step

    def tokens_bulk(self, reqs, first_step: int, last_step: int) -> None:
        """Every request in `reqs` produced a token in each of the consecutive steps first..last."""
        count = last_step - first_step + 1
        for req in reqs:
            # the caller guarantees each request's run reaches first_step - 1
            req.run_tokens += count
            req.last_token_step = last_step

    def close_run(self, req: Request) -> None:
        """End the request's open run, if any (on a break, a preemption or its completion)."""
        if req.run_tokens:
            self.run_request.append(req.id)
            self.run_first_step.append(req.run_start_step)
            self.run_last_step.append(req.last_token_step)
            self.run_tokens.append(req.run_tokens)
            req.run_tokens = 0

    def step_table(self) -> dict[str, np.ndarray]:
        return {name: column.array() for name, column in self.columns.items()}

    def run_table(self) -> dict[str, np.ndarray]:
        return {
            "request_id": np.frombuffer(self.run_request, dtype=np.int64) if self.run_request else np.zeros(0, np.int64),
            "first_step": np.frombuffer(self.run_first_step, dtype=np.int64) if self.run_first_step else np.zeros(0, np.int64),
            "last_step": np.frombuffer(self.run_last_step, dtype=np.int64) if self.run_last_step else np.zeros(0, np.int64),
            "tokens": np.frombuffer(self.run_tokens, dtype=np.int64) if self.run_tokens else np.zeros(0, np.int64),
        }
