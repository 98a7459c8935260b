"""benchmarks/run_memory.py measures every phase of `cbsim run` (a few requests here; the memory figures
are the script's, not asserted), and its experiment is the reference setup the speed benchmarks run."""
from __future__ import annotations

import sys

import pytest

from paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import run_memory  # noqa: E402
import sim_speed  # noqa: E402

pytestmark = pytest.mark.skipif(not (sim_speed.data_root() / sim_speed.TRACE).exists(),
                                reason="Vidur's trace is not under CBSIM_DATA")


def test_every_phase_is_marked_and_the_folder_written(tmp_path):
    """The phases end where run_experiment names the next one: a renamed progress line would leave a
    phase unmeasured, which this catches."""
    row = run_memory.one_row(60, str(tmp_path / "out"), plots=False)
    assert set(run_memory.PHASES) <= set(row) and row["steps"] >= 60
    if sys.platform.startswith("linux"):  # (elsewhere /proc/self/status is missing: NaN)
        assert all(row[phase][2] > 0 for phase in run_memory.PHASES)  # a peak RSS in MB each
    assert (tmp_path / "out" / "steps.parquet").is_file() and not list((tmp_path / "out").glob("*.png"))


def test_the_experiment_is_the_reference_setup(tmp_path):
    cfg = run_memory.experiment(1000, str(tmp_path), plots=True)
    model = sim_speed.model_spec("llama-2-70b")
    assert cfg["cluster"]["kv_cache"]["num_blocks"] == sim_speed.vidur_slots(model, tp=2) * 256 == 3328
    assert cfg["policy"]["max_num_seqs"] == sim_speed.VIDUR_BATCH_CAP and cfg["output"]["plots"]
    assert cfg["workload"]["prompt_len"]["trace"]["path"].endswith(sim_speed.TRACE)
