"""benchmarks/speed_matrix.py runs every row of the matrix (a few requests each; the timings are the
script's, not asserted here), and its rows are the configurations they name."""
from __future__ import annotations

import sys

import pytest

from paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import sim_speed  # noqa: E402
import speed_matrix  # noqa: E402

pytestmark = pytest.mark.skipif(not (sim_speed.data_root() / sim_speed.TRACE).exists(),
                                reason="Vidur's trace is not under CBSIM_DATA")


@pytest.mark.parametrize("row", speed_matrix.ROWS, ids=lambda row: row.name)
def test_every_row_runs(row):
    setup = speed_matrix.Setup(40, seed=0)
    seconds, steps = setup.run(row)
    assert seconds >= 0 and steps >= 40  # every request took a step at least


def test_rows_differ_from_the_benchmark_by_what_they_name():
    setup = speed_matrix.Setup(40, seed=0)
    rows = {row.name: row for row in speed_matrix.ROWS}
    assert setup.requests(4).column("arrival")[-1] == pytest.approx(setup.requests(1).column("arrival")[-1] / 4)
    assert setup.cost(2).pipeline_stages == 2 and setup.cost(1).pipeline_stages == 1
    assert setup.make_kv(rows["reserve_full"])().reserve_full_prompt
    assert setup.make_kv(rows["sglang_lpm"])().prefix is not None
    assert not setup.make_kv(rows["benchmark"])().reserve_full_prompt
