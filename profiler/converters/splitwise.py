"""The Splitwise profiling CSV (shared/data/measured/splitwise_a100_llama2_70b/) as measured steps.

Columns (see that folder's SOURCE.md): `prompt_size`, `batch_size`, `token_size`, `prompt_time`
and `token_time` (ms), `e2e_time` (ms), `tensor_parallel`, `model`, `hardware`. Rows repeat
(several runs of a configuration): the median per (model, hardware, tp, prompt, batch) is taken.
Each configuration gives two steps:
  prefill: `batch_size` prompts of `prompt_size` tokens, no history, `prompt_time`;
  decode:  `batch_size` sequences at the run's mean context prompt + (g + 1) / 2, with
           g = (e2e_time - prompt_time) / token_time decode iterations, `token_time`.
The TP2 batch-64 prompt rows are about 8x below the batch-32 ones (the batch did not fit in
memory, SOURCE.md): prefill rows whose time per token falls below half that of the same
configuration's smaller batches are left out and counted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core.errors import ConfigError
from cbsim.sim.shape import StepShape

from cbsim.profiler.converters.step_table import MeasuredStep

COLUMNS = ("model", "hardware", "prompt_size", "batch_size", "prompt_time", "token_time", "e2e_time",
           "tensor_parallel")
MODELS = {"llama2-70b": "llama-2-70b", "llama2-13b": "llama-2-13b", "llama2-7b": "llama-2-7b",
          "bloom-176b": "bloom-176b"}
GPUS = {"a100-80gb": "a100", "h100-80gb": "h100"}


def read_splitwise(path) -> tuple[list[MeasuredStep], list[str]]:
    """(measured steps, notes on rows left out) from a Splitwise perf_model CSV."""
    path = Path(path)
    try:
        table = pd.read_csv(path)
    except (FileNotFoundError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ConfigError("splitwise", f"a readable Splitwise perf_model CSV ({type(err).__name__})", str(path)) from None
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ConfigError(missing[0], "a Splitwise perf_model column (" + ", ".join(COLUMNS) + ")", has_got=False,
                          file=str(path))
    table, notes = _usable_rows(table, path)
    keys = ["model", "hardware", "tensor_parallel", "prompt_size", "batch_size"]
    med = table.groupby(keys, sort=True)[["prompt_time", "token_time", "e2e_time"]].median().reset_index()
    steps = []
    for row in med.itertuples(index=False):
        model, gpu = MODELS.get(row.model, row.model), GPUS.get(row.hardware, row.hardware)
        tp, prompt, batch = int(row.tensor_parallel), int(row.prompt_size), int(row.batch_size)
        common = dict(tp=tp, model=model, gpu=gpu)
        if _prefill_ok(med, row):
            shape = StepShape.from_batch(prefill=[(prompt, 0)] * batch)
            steps.append(MeasuredStep(shape, row.prompt_time / 1e3, **common))
        else:
            notes.append(f"{row.model} {row.hardware} TP{tp} prompt {prompt} x {batch}: prefill row left out "
                         f"({row.prompt_time:.0f} ms, below half the time per token of smaller batches)")
        iterations = (row.e2e_time - row.prompt_time) / row.token_time
        context = prompt + int(round((iterations + 1) / 2))
        steps.append(MeasuredStep(StepShape.from_batch(decode=[context] * batch), row.token_time / 1e3, **common))
    return steps, notes


def _usable_rows(table: pd.DataFrame, path: Path) -> tuple[pd.DataFrame, list[str]]:
    """The rows whose sizes and times are finite numbers > 0 (sizes whole), and a note counting the rest
    (a NaN or negative time would otherwise enter the medians, or end a run with a traceback)."""
    numbers = table[list(COLUMNS[2:])].apply(pd.to_numeric, errors="coerce")
    sizes = numbers[["prompt_size", "batch_size", "tensor_parallel"]]
    good = (np.isfinite(numbers) & (numbers > 0)).all(axis=1) & (sizes == sizes.round()).all(axis=1)
    kept = table.loc[good].assign(**{c: numbers.loc[good, c] for c in numbers.columns})
    if kept.empty:
        raise ConfigError("<rows>", "at least one row whose sizes and times are finite numbers > 0", has_got=False,
                          file=str(path))
    dropped = int((~good).sum())
    return kept, [f"{dropped} row(s) left out: a size or time missing, not a number, infinite, or <= 0"] if dropped else []


def _prefill_ok(med: pd.DataFrame, row) -> bool:
    """False for a prefill row far faster per token than the same setup's smaller batches."""
    same = med[(med.model == row.model) & (med.hardware == row.hardware) & (med.tensor_parallel == row.tensor_parallel)
               & (med.prompt_size == row.prompt_size) & (med.batch_size < row.batch_size)]
    if same.empty:
        return True
    per_token = same.prompt_time / same.batch_size
    return row.prompt_time / row.batch_size >= 0.5 * per_token.min()
