"""The measurement file: one CSV row per measured batch (see COLUMNS), plus a metadata JSON.

Invariants: the CSV columns are exactly COLUMNS, in that order (the fitting half reads them); a
row is flushed and synced to disk as soon as it is written, so a run cut short keeps every batch
it finished. The batch composition is kept as strings ("c:h;c:h", "ctx;ctx") beside the derived
features, so new features can be computed later without measuring again. A decode-only batch
measured both eagerly and as a CUDA graph gives two rows with the same batch_id and graph 0/1.
This module needs no torch.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

COLUMNS = (
    "batch_id", "cls", "source", "prefill", "decode",
    "num_prefill_tokens", "num_decode", "num_tokens", "sum_c", "sum_c2", "sum_ch",
    "attn_pairs", "prefill_kv_read", "decode_kv_read", "max_ctx", "num_seqs",
    "layer_s_median", "layer_s_p10", "layer_s_p90", "lm_head_s", "graph", "repeats",
    "flops", "bytes", "flagged",
)

LONG_CONTEXT = 16384


def format_prefill(prefill) -> str:
    return ";".join(f"{c}:{h}" for c, h in prefill)


def format_decode(decode) -> str:
    return ";".join(str(x) for x in decode)


def parse_prefill(text: str) -> tuple[tuple[int, int], ...]:
    """Inverse of format_prefill."""
    return tuple((int(c), int(h)) for c, h in (p.split(":") for p in text.split(";") if p))


def parse_decode(text: str) -> tuple[int, ...]:
    """Inverse of format_decode."""
    return tuple(int(x) for x in text.split(";") if x)


def batch_class(prefill, decode) -> str:
    """long when the largest context reaches LONG_CONTEXT, else decode, prefill or mixed."""
    max_ctx = max([c + h for c, h in prefill] + list(decode), default=0)
    if max_ctx >= LONG_CONTEXT:
        return "long"
    if prefill and decode:
        return "mixed"
    return "prefill" if prefill else "decode"


def batch_features(prefill, decode) -> dict:
    """The derived columns of a batch, from its composition alone."""
    cs = [c for c, _ in prefill]
    return {
        "prefill": format_prefill(prefill),
        "decode": format_decode(decode),
        "num_prefill_tokens": sum(cs),
        "num_decode": len(decode),
        "num_tokens": sum(cs) + len(decode),
        "sum_c": sum(cs),
        "sum_c2": sum(c * c for c in cs),
        "sum_ch": sum(c * h for c, h in prefill),
        "attn_pairs": sum(c * (h + (c + 1) / 2) for c, h in prefill),
        "prefill_kv_read": sum(c + h for c, h in prefill),
        "decode_kv_read": sum(decode),
        "max_ctx": max([c + h for c, h in prefill] + list(decode), default=0),
        "num_seqs": len(prefill) + len(decode),
    }


def measurement_row(batch_id: int, source: str, prefill, decode, timing, lm_head_s: float, graph: bool,
                    flops: float, nbytes: float, flagged: bool) -> dict:
    """One CSV row; `timing` has median, p10, p90 and repeats (seconds for one layer)."""
    row = {"batch_id": batch_id, "cls": batch_class(prefill, decode), "source": source}
    row.update(batch_features(prefill, decode))
    row.update({
        "layer_s_median": timing.median, "layer_s_p10": timing.p10, "layer_s_p90": timing.p90,
        "lm_head_s": lm_head_s, "graph": int(graph), "repeats": timing.repeats,
        "flops": flops, "bytes": nbytes, "flagged": int(flagged),
    })
    return row


class CsvAppender:
    """A CSV file with a fixed header; every appended row is flushed and fsynced at once."""

    def __init__(self, path, columns):
        self.path = Path(path)
        self.columns = tuple(columns)
        self.rows = 0
        self._file = open(self.path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(self.columns)
        self._sync()

    def append(self, row: dict) -> None:
        if set(row) != set(self.columns):
            raise ValueError(f"row keys {sorted(row)} differ from the columns {self.columns}")
        self._writer.writerow([_cell(row[c]) for c in self.columns])
        self._sync()
        self.rows += 1

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cell(value):
    return repr(value) if isinstance(value, float) else value


def write_json(path, obj) -> None:
    """Write JSON atomically (temporary file, then rename), so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def git_revision(root=None) -> str:
    """The checked-out commit (with '+dirty' when the tree has changes), or 'unknown'."""
    root = root or Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
