"""The operator dashboard (sim/outputs/dashboard.py): written by Results.write (one per pool for P/D),
optional panels drawn only when the run reports their data, and the level series it is built on."""
import matplotlib.pyplot as plt
import numpy as np
import pytest

from cbsim.api import run_experiment
from cbsim.sim.outputs import dashboard
from cbsim.sim.metrics import level_series, time_average

from test_pd import PD_EXPERIMENT

SMALL = ["workload.num_requests=80", "workload.arrival.rate=8", "output.dir=null", "output.trace=false",
         "output.plots=true"]


def is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_results_write_a_dashboard(tmp_path):
    res = run_experiment("experiments/quickstart.yaml", overrides=SMALL)
    res.write(tmp_path)
    assert is_png(tmp_path / "dashboard.png")
    assert not list(tmp_path.glob("dashboard_*.png"))


def test_pd_runs_get_one_dashboard_per_pool(tmp_path):
    res = run_experiment({**PD_EXPERIMENT, "output": {"plots": True, "trace": False}})
    res.write(tmp_path)
    for name in ("dashboard.png", "dashboard_prefill.png", "dashboard_decode.png", "transfers.parquet"):
        assert (tmp_path / name).exists(), name
    assert all(is_png(tmp_path / f"dashboard{suffix}.png") for suffix in ("", "_prefill", "_decode"))


def test_optional_panels_appear_only_with_their_data():
    res = run_experiment("experiments/quickstart.yaml", overrides=SMALL)
    plain = dashboard.plot_dashboard(dashboard.whole_view(res))
    titles = [ax.get_title() for ax in plain.axes if ax.get_visible()]
    assert "Prefix-cache hits" not in titles and any(t.startswith("KV cache") for t in titles)
    assert any(t.startswith("TPOT") for t in titles)
    assert any(t.startswith("Step latency, prefill vs decode-only steps") for t in titles)
    efficiency = next(ax for ax in plain.axes if ax.get_title().startswith("Step efficiency"))
    assert "MFU" in efficiency.get_title()
    assert [text.get_text() for text in efficiency.get_legend().get_texts()] == ["MFU", "HBM"]  # 1 GPU: no all-reduce
    plt.close(plain)
    res.steps["kv_blocks_evictable"] = 5
    res.steps["prefix_hit_tokens"] = 16
    fig = dashboard.plot_dashboard(dashboard.whole_view(res))
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    kv = next(ax for ax in fig.axes if ax.get_title().startswith("KV cache"))
    assert "Prefix-cache hits" in titles
    assert "evictable" in [text.get_text() for text in kv.get_legend().get_texts()]
    plt.close(fig)


def test_level_series_time_average_and_bins():
    # intervals [0, 3), [1, end=10), [2, 2.5): 3 + 9 + 0.5 request-seconds over 10 s
    times, level = level_series([0, 1, 2], [3, np.nan, 2.5], end=10)
    assert list(level) == [1, 2, 3, 2, 1, 0]
    assert time_average(times, level, 0, 10) == pytest.approx(1.25)
    edges = np.linspace(0, 10, dashboard.NUM_BINS + 1)
    means = dashboard._level_mean(edges, [0, 1, 2], [3, np.nan, 2.5])
    assert means.mean() == pytest.approx(1.25)  # equal bins: their mean is the time average
    assert level_series([np.nan], [1.0])[0].size == 0  # never entered: never counted


def test_the_batch_panel_draws_decode_tokens_and_prompts_apart():
    """Requests per step equal decode tokens in a decode-only step: the panel draws the prompts instead
    (requests prefilling), so the two lines differ wherever a step is all decodes (issue 30)."""
    res = run_experiment("experiments/quickstart.yaml", overrides=SMALL)
    fig = dashboard.plot_dashboard(dashboard.whole_view(res))
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("Batch"))
    twin = next(ax for ax in fig.axes if ax is not panel and ax.bbox.bounds == panel.bbox.bounds)
    lines = {line.get_label(): np.nan_to_num(line.get_ydata()) for line in twin.lines}
    decode, prompts = lines["decode tokens / step (right)"], lines["prompts / step: requests prefilling (right)"]
    assert decode.max() > 2 * prompts.max() and not np.allclose(decode, prompts)
    plt.close(fig)
