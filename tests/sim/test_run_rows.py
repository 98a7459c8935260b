"""RunRows (sim/run_rows.py) builds a prompt run's columns from chunk rows and decode segments exactly as
appending every step's row in order would (the fast path's equality with stepping is tests/sim/test_fast_path.py)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.run_rows import COLUMNS, RunRows

# a run's steps in order: a chunk step ("chunk", its row) or a decode segment ("decode", length, rows, total)
PIECES = st.lists(st.one_of(
    st.tuples(st.just("chunk"), st.lists(st.integers(0, 10**5), min_size=len(COLUMNS), max_size=len(COLUMNS))),
    st.tuples(st.just("decode"), st.integers(0, 25), st.integers(1, 200), st.integers(0, 10**7))), max_size=12)


def step_by_step(pieces, crossings, used):
    """The rows appended one step at a time (the reference)."""
    rows = []
    for piece in pieces:
        if piece[0] == "chunk":
            rows.append(piece[1])
            continue
        _, length, n, total = piece
        blocks = used
        for _ in range(length):
            j = len(rows) + 1
            blocks += crossings[j]
            rows.append([0, n, n, blocks, total + n * j, 0, 0])
    return rows


@settings(max_examples=200)
@given(PIECES, st.dictionaries(st.integers(1, 300), st.integers(1, 5)), st.integers(0, 1000))
def test_columns_equal_rows_appended_step_by_step(pieces, crossings, used):
    counted = [crossings.get(j, 0) for j in range(400)]
    run = RunRows()
    step = 1
    for piece in pieces:
        if piece[0] == "chunk":
            run.chunk((step, *piece[1]))
            step += 1
        else:
            _, length, n, total = piece
            run.decodes(step, step + length, n, total, used)
            step += length
    columns = run.columns(step - 1, counted)
    expected = np.array(step_by_step(pieces, counted, used), dtype=np.int64).reshape(-1, len(COLUMNS))
    for k, name in enumerate(COLUMNS):
        assert columns[name].dtype == np.int64
        assert np.array_equal(columns[name], expected[:, k]), name


def test_a_segment_counts_only_its_own_crossings():
    run = RunRows()
    run.decodes(1, 4, 2, 10, used=5)  # steps 1-3
    run.chunk((4, 7, 2, 3, 9, 30, 100, 800))
    run.decodes(5, 7, 3, 20, used=9)  # steps 5-6
    columns = run.columns(6, [0, 0, 1, 2, 9, 0, 1])
    assert columns["kv_blocks_used"].tolist() == [5, 6, 8, 9, 9, 10]
    assert columns["decode_context_tokens"].tolist() == [12, 14, 16, 30, 35, 38]
    assert columns["num_seqs"].tolist() == [2, 2, 2, 3, 3, 3]
    assert columns["prefill_attention_pairs"].tolist() == [0, 0, 0, 800, 0, 0]
