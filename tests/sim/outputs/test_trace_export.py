"""The Chrome trace's step events (sim/outputs/trace_export.py) are formatted column by column; the
file must be exactly what json.dumps of each event, one per line, writes (the format before issue 12)."""
import json

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.outputs.trace_export import ARG_COLUMNS, json_texts, step_name, write_chrome_trace


def reference_trace(steps: pd.DataFrame, max_steps: int) -> str:
    """The trace as the event-by-event writer wrote it: a dict per event through json.dumps."""
    chosen = steps.sort_values("step").head(max_steps)
    cols = {name: chosen[name].tolist() for name in ("step", "replica", "start", "end", *ARG_COLUMNS)}
    events = []
    for r in sorted(set(cols["replica"])):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"replica {r}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "steps"}})
    for i in range(len(chosen)):
        args = {name: cols[name][i] for name in ARG_COLUMNS}
        args["step"] = cols["step"][i]
        pid, start = cols["replica"][i], cols["start"][i]
        name = step_name(args["prefill_tokens"], args["decode_tokens"], args["padding_tokens"])
        events.append({"ph": "X", "cat": "step", "name": name, "pid": pid, "tid": 0, "ts": round(start * 1e6, 3),
                       "dur": round((cols["end"][i] - start) * 1e6, 3), "args": args})
        events.append({"ph": "C", "name": "kv_blocks_used", "pid": pid, "ts": round(start * 1e6, 3),
                       "args": {"blocks": args["kv_blocks_used"]}})
    other = {"steps_total": len(steps), "steps_written": len(chosen), "truncated": len(chosen) < len(steps),
             "time_unit": "microseconds"}
    return ('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(other) + ', "traceEvents": [\n'
            + ",\n".join(map(json.dumps, events)) + "\n]}\n")


def random_steps(rng: np.random.Generator, n: int, swap_float: bool) -> pd.DataFrame:
    start = np.cumsum(rng.exponential(0.01, n)) * rng.choice([1.0, 1e3])
    frame = pd.DataFrame({
        "step": rng.permutation(n), "replica": rng.integers(0, 3, n), "start": start,
        "end": start + rng.exponential(0.005, n), "prefill_tokens": rng.integers(0, 3, n) * rng.integers(0, 2048, n),
        "decode_tokens": rng.integers(0, 64, n), "padding_tokens": rng.integers(0, 2, n) * 3,
        "num_seqs": rng.integers(0, 65, n), "kv_blocks_used": rng.integers(0, 10**6, n),
        "preemptions": rng.integers(0, 2, n), "swap_bytes": rng.integers(0, 2, n) * 1e6 if swap_float
        else rng.integers(0, 2, n) * 10**6})
    return frame


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40), cap=st.integers(0, 50), swap_float=st.booleans())
def test_the_trace_is_byte_identical_to_json_dumps_per_event(tmp_path_factory, seed, n, cap, swap_float):
    steps = random_steps(np.random.default_rng(seed), n, swap_float)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    assert write_chrome_trace(steps, path, cap) == min(n, cap)
    assert path.read_text() == reference_trace(steps, cap)


def test_a_long_trace_spans_several_blocks(tmp_path, monkeypatch):
    import cbsim.sim.outputs.trace_export as trace_export

    monkeypatch.setattr(trace_export, "BLOCK", 7)
    steps = random_steps(np.random.default_rng(3), 50, True)
    write_chrome_trace(steps, tmp_path / "t.json", 1000)
    assert (tmp_path / "t.json").read_text() == reference_trace(steps, 1000)


def test_json_texts_match_json_dumps_for_every_kind():
    values = [[1, 2, -3], [0.1, 1e-7, 1e22, -0.0], [1.5, float("nan"), float("inf")], [True, False], [1, 2.5],
              ["a", None]]
    for column in values:
        assert json_texts(column) == [json.dumps(v) for v in column]
