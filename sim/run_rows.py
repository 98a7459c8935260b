"""The step-table rows of a prompt run (sim/prompt_run.py), kept as the run makes them and built into
columns once, at its end.

A run has two kinds of steps. A chunk step has a row of its own. Decode-only steps come in segments
between two leaves, and their rows follow from the segment alone: n rows of step-0 context sum `total`
read total + n j in step j, and hold `used` blocks before the segment's first step, plus the rows'
block crossings step by step. So a segment is kept as one tuple, and a decode step costs nothing here;
`columns` expands the segments with numpy, a fixed number of array operations a run.

Invariant: the columns hold exactly what appending every step's row in order would give.
"""
from __future__ import annotations

import numpy as np

# the step-table columns a run fills; a chunk row gives them in this order
COLUMNS = ("prefill_tokens", "decode_tokens", "num_seqs", "kv_blocks_used", "decode_context_tokens",
           "prefill_history_tokens", "prefill_attention_pairs")
_DECODES, _SEQS, _BLOCKS, _CONTEXTS = (COLUMNS.index(name) for name in ("decode_tokens", "num_seqs",
                                                                         "kv_blocks_used", "decode_context_tokens"))


class RunRows:
    """The rows of steps 1.. of one run: chunk rows and decode-only segments."""

    __slots__ = ("chunks", "segments")

    def __init__(self):
        self.chunks: list[int] = []  # (step, *COLUMNS) a chunk step, flat
        self.segments: list[int] = []  # (first step, stop step, rows, step-0 context sum, blocks used before), flat

    def chunk(self, row: tuple) -> None:
        """A chunk step's row: (its step, *COLUMNS)."""
        self.chunks.extend(row)

    def decodes(self, first: int, stop: int, n: int, total: int, used: int) -> None:
        """Steps first..stop-1 decode n rows of step-0 context sum `total`; `used` blocks before the first."""
        if stop > first:
            self.segments.extend((first, stop, n, total, used))

    def columns(self, count: int, crossings: list[int]) -> dict[str, np.ndarray]:
        """Steps 1..count as step-table columns (int64: the rows of one array, filled a few operations a
        run, whatever its length; the recorder stores each in its own type); `crossings[j]`: the decode
        rows that grow by a block in step j (j = 0..count at least)."""
        block = np.zeros((len(COLUMNS), count), np.int64)
        if self.chunks:
            table = np.array(self.chunks, dtype=np.int64).reshape(-1, len(COLUMNS) + 1)
            block[:, table[:, 0] - 1] = table[:, 1:].T
        if self.segments:
            first, stop, n, total, used = np.array(self.segments, dtype=np.int64).reshape(-1, 5).T
            lengths = stop - first
            starts = np.cumsum(lengths) - lengths  # each segment's first place among the decode steps
            segment = np.repeat(np.arange(len(lengths)), lengths)
            steps = np.arange(int(lengths.sum())) - starts[segment] + first[segment]
            grows = np.array(crossings[:count + 1], dtype=np.int64)[steps]
            grown = np.cumsum(grows)
            grown -= (grown - grows)[starts][segment]  # since the segment's start
            rows, n = steps - 1, n[segment]
            block[_DECODES, rows] = n
            block[_SEQS, rows] = n
            block[_BLOCKS, rows] = used[segment] + grown
            block[_CONTEXTS, rows] = total[segment] + n * steps
        return dict(zip(COLUMNS, block))

