"""The recorder keeps steps compactly (mostly-zero columns as their non-zero rows, a start only where it is
not the previous end of its replica) and gives back exactly what was recorded: random sequences of
single steps, runs, pipelined starts and late preemption counts over several replicas, against a plain
list of rows."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.metrics.growable import Column, SparseColumn
from cbsim.sim.metrics.recorder import SPARSE, STEP_COLUMNS, Recorder

OPS = st.lists(st.tuples(st.sampled_from(["step", "run", "run-array", "run-steps", "run-gapped", "pipelined", "preempt"]), st.integers(0, 2),
                         st.sampled_from([0.0, 0.0, 0.25, 1.0]), st.integers(1, 6),
                         st.one_of(st.integers(0, 3), st.sampled_from([127, 128, 40_000, 3_000_000]))),
               max_size=40)  # k past 127, 2**15 and (squared) 2**31 widens the narrow columns


def row(replica, start, end, k) -> dict:
    return {"replica": replica, "start": start, "end": end, "prefill_tokens": 7 * k, "decode_tokens": k + 1,
            "padding_tokens": k % 2, "num_seqs": k + 2, "kv_blocks_used": 3 + k, "preemptions": 0,
            "swap_bytes": 512.0 * (k == 2), "decode_context_tokens": 100 + k * k, "prefill_history_tokens": 5 * k,
            "prefill_attention_pairs": 9 * k}


@settings(max_examples=200)
@given(OPS)
def test_the_compact_recorder_gives_back_every_row(ops):
    recorder, expected, clock = Recorder(), [], [0.0, 0.0, 0.0]
    for kind, replica, gap, length, k in ops:
        start = clock[replica] + gap
        if kind in ("step", "pipelined"):
            values = row(replica, start, math.nan, k)
            index = recorder.add_step(**values)
            expected.append(values)
            if kind == "pipelined":  # its start moves before it ends (sim/pipeline.py)
                recorder.set_start(index, start + 0.5)
                values["start"] = start + 0.5
            end = start + 1.0 + gap
            recorder.set_end(index, end)
            values["end"] = end
        elif kind == "preempt" and expected:
            recorder.set_preemptions(len(expected) - 1, k % 4)
            expected[-1]["preemptions"] = k % 4
            continue
        else:
            ends = [start + j * 0.5 for j in range(length + 1)]
            rows = [row(replica, ends[j], ends[j + 1], k) for j in range(length)]
            if kind == "run-gapped":  # rows that do not abut: every start is kept
                for r in rows[1:]:
                    r["start"] -= 0.125
            columns = {name: [r[name] for r in rows] for name in STEP_COLUMNS}
            if kind in ("run-array", "run-gapped"):
                columns = {name: np.array(values) for name, values in columns.items()}
                columns["replica"] = replica  # a scalar, as the replicas pass it
            if kind in ("run", "run-array"):  # a replica's run: its boundaries (step_apply.commit_run)
                for name in ("replica", "start", "end"):
                    columns.pop(name)
                recorder.add_run(replica, np.array(ends) if kind == "run-array" else ends, **columns)
            else:
                recorder.add_steps(**columns)
            expected.extend(rows)
            end = ends[-1]
        clock[replica] = end
    table = recorder.step_table()
    assert list(table) == list(STEP_COLUMNS)
    for name, dtype in STEP_COLUMNS.items():
        want = np.array([r[name] for r in expected], dtype=dtype)
        assert table[name].dtype == want.dtype and np.array_equal(table[name], want, equal_nan=True), name
    sparse = recorder.step_table(sparse=True)  # over the recorder's own buffers (a stored zero: a copy)
    for name in SPARSE:
        assert sparse[name].dtype.subtype == table[name].dtype and np.all(sparse[name].sp_values != 0), name
        np.testing.assert_array_equal(sparse[name].to_numpy(), table[name])


def test_a_row_is_closed_once():
    recorder = Recorder()
    index = recorder.add_step(**row(0, 0.0, math.nan, 1))
    recorder.set_end(index, 1.0)
    try:
        recorder.set_end(index, 2.0)
    except RuntimeError as err:
        assert "closed twice" in str(err)
    else:
        raise AssertionError("a second end was accepted")


def test_a_sparse_frame_column_shares_the_recorders_buffers():
    recorder = Recorder()
    for k in range(6):
        recorder.add_step(**row(0, float(k), float(k + 1), k))
    column = recorder.step_table(sparse=True)["prefill_history_tokens"]
    kept = recorder.sparse["prefill_history_tokens"]
    assert np.shares_memory(column.sp_values, kept.value_array())
    assert np.shares_memory(column.sp_index.indices, kept.row_array())
    np.testing.assert_array_equal(column.to_numpy(), [5 * k for k in range(6)])


def test_a_stored_zero_is_left_out_of_the_sparse_array():
    column = SparseColumn(np.int16)
    column.put(1, 3)
    column.put(4, 2)
    column.set(1, 0)  # kept as a stored zero
    sparse = column.sparse_array(6)
    assert list(sparse.sp_index.indices) == [4] and list(sparse.to_numpy()) == [0, 0, 0, 0, 2, 0]


def test_rows_past_int32_widen_the_row_index():
    column = SparseColumn(np.float64)
    column.put(5, 1.0)
    column.put(2**31, 2.0)  # an int32 row index cannot hold it
    column.put_many(2**32, np.array([0.0, 3.0]))
    assert column.rows.typecode == "q" and list(column.row_array()) == [5, 2**31, 2**32 + 1]
    assert list(column.value_array()) == [1.0, 2.0, 3.0]


VALUES = st.one_of(st.integers(-3, 3), st.sampled_from([127, -128, 128, 2**15, -(2**15) - 1, 2**31, -(2**40)]))
COLUMN_OPS = st.lists(st.tuples(st.sampled_from(["append", "list", "numpy", "fill", "set"]),
                                st.lists(VALUES, min_size=1, max_size=5)), max_size=30)


@settings(max_examples=300)
@given(COLUMN_OPS)
def test_a_narrow_column_holds_what_it_was_given_in_the_narrowest_type(ops):
    widened, given_ever = [], []
    column, expected = Column(np.int64, narrow=True, on_widen=lambda: widened.append(1)), []
    for kind, values in ops:
        given_ever.extend(values[:1] if kind in ("append", "fill", "set") else values)
        if kind == "append":
            column.append(values[0])
            expected.append(values[0])
        elif kind == "list":
            column.extend(list(values))
            expected.extend(values)
        elif kind == "numpy":
            column.extend(np.array(values, dtype=np.int64))
            expected.extend(values)
        elif kind == "fill":
            column.fill(values[0], len(values))
            expected.extend([values[0]] * len(values))
        elif expected:
            column.set(len(values) % len(expected), values[0])
            expected[len(values) % len(expected)] = values[0]
        else:
            given_ever.pop()
    held = np.array(expected, dtype=np.int64)
    types = [np.int8, np.int16, np.int32, np.int64]
    narrowest = next(t for t in types if all(np.iinfo(t).min <= v <= np.iinfo(t).max for v in given_ever))
    assert column.stored == narrowest  # the narrowest type that held every value given
    assert (narrowest != np.int8) <= len(widened) <= types.index(narrowest)  # at most once a type passed
    np.testing.assert_array_equal(column.array_as_stored(), held)
    out = column.array()  # the declared type, widened in place
    assert out.dtype == np.int64 and column.stored == np.int64 and np.array_equal(out, held)


def test_a_narrow_column_refuses_what_its_declared_type_cannot_hold():
    column = Column(np.int32, narrow=True)
    column.extend([1, 2])
    for add in (lambda: column.append(2**31), lambda: column.extend(np.array([2**40])), lambda: column.fill(-(2**33), 2)):
        try:
            add()
        except OverflowError:
            pass
        else:
            raise AssertionError("a value past int32 was accepted")
    assert column.stored == np.int8 and list(column.array()) == [1, 2]


def test_the_recorder_widens_a_column_mid_step_and_keeps_appending():
    recorder = Recorder()
    for k, kv in enumerate([3, 300, 4, 70_000, 5]):  # blocks used past int8, then int16
        values = row(0, float(k), float(k + 1), 1)
        values["kv_blocks_used"] = kv
        recorder.add_step(**values)
    assert recorder.dense["kv_blocks_used"].stored == np.int32 and recorder.dense["decode_tokens"].stored == np.int8
    assert list(recorder.step_column("kv_blocks_used")) == [3, 300, 4, 70_000, 5]
    assert all(len(c) == 5 for c in recorder.dense.values())
