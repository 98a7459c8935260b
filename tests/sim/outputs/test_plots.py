"""Plots that tell the truth (issue 14): each property is read off the matplotlib figure objects.

Per run (sim/outputs/plots.py): stall markers above the token areas, a KV capacity line and % axis, P/D
replicas named with their pool and KV hand-offs drawn; dashboard (sim/outputs/dashboard.py): latency panels
in s once they reach a second; sweeps (cbsim/tools/sweep/plots.py): a knee only along a load, overlapping
lines said so, per-seed ratios to a reference run on the same seed.
"""
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from cbsim.api import run_experiment
from cbsim.sim.outputs import dashboard, plots
from cbsim.sim.metrics import stall_events
from cbsim.tools.sweep.plots import (is_load, overlaps, paired_ratios, plot_latency_throughput, plot_metrics,
                               plot_paired_ratios)

from test_pd import PD_EXPERIMENT

QUIET = ["output.dir=null", "output.trace=false"]


@pytest.fixture(scope="module")
def stalled():
    """The interference case under prefill_first: the long prompt stalls every decode."""
    return run_experiment("experiments/interference.yaml", overrides=QUIET + [
        "policy.name=prefill_first", "policy.chunk_size=512", "policy.token_budget=null"])


@pytest.fixture(scope="module")
def pd_run():
    return run_experiment({**PD_EXPERIMENT, "output": {"plots": False, "trace": False}})


def steps_frame(replicas=(0,), n=6):
    rows = [{"replica": r, "start": float(i), "end": i + 0.5, "prefill_tokens": 100 * (i % 2),
             "decode_tokens": 4, "kv_blocks_used": 10 + i, "duration": 0.5} for r in replicas for i in range(n)]
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- per-run plots


def test_stall_markers_are_drawn_above_the_token_areas(stalled):
    stalls = stall_events(stalled.itl, stalled.config.metrics.stall_factor)
    assert len(stalls)
    fig = plots.plot_step_timeline(stalled.steps, stalls, raw=True)
    marker = next(line for ax in fig.axes for line in ax.lines if line.get_label().startswith("stall"))
    panel = marker.axes
    others = [ax for ax in fig.axes if ax is not panel and ax.bbox.bounds == panel.bbox.bounds]
    assert others, "the token panel has a twin axis"
    # drawn last of the axes sharing the panel (same zorder: figure order decides) and above its own artists
    assert all(fig.axes.index(panel) > fig.axes.index(ax) and panel.get_zorder() >= ax.get_zorder() for ax in others)
    below = [a for ax in [panel] + others for a in ax.collections + ax.lines + ax.patches if a is not marker]
    assert marker.get_zorder() > max(a.get_zorder() for a in below)
    assert marker.get_visible() and marker.get_markersize() >= 6
    plt.close(fig)


def test_kv_usage_has_a_capacity_line_and_a_percent_axis():
    fig = plots.plot_kv_usage(steps_frame((0, 1)), raw=True, kv_blocks={0: 200, 1: 200})
    ax = fig.axes[0]
    capacity = [line for line in ax.lines if line.get_gid() == "kv_capacity"]
    assert len(capacity) == 1 and set(capacity[0].get_ydata()) == {200}
    assert ax.get_ylim()[1] > 200  # the line is inside the plot
    labels = [a.get_ylabel() for a in fig.axes] + [c.get_ylabel() for c in ax.child_axes]
    assert any("% of capacity" in text for text in labels)
    plt.close(fig)
    plain = plots.plot_kv_usage(steps_frame(), raw=True)  # no capacity known: blocks only, said so
    assert not [line for line in plain.axes[0].lines if line.get_gid() == "kv_capacity"]
    plt.close(plain)


def test_kv_usage_of_unequal_caches_is_in_percent_of_each():
    fig = plots.plot_kv_usage(steps_frame((0, 1)), raw=False, kv_blocks={0: 100, 1: 400})
    ax = fig.axes[0]
    assert "%" in ax.get_ylabel()
    assert [set(line.get_ydata()) for line in ax.lines if line.get_gid() == "kv_capacity"] == [{100.0}]
    plt.close(fig)


def test_pd_timeline_names_each_pool_and_draws_every_hand_off(pd_run):
    fig = plots.plot_step_timeline(pd_run.steps, None, True, pd_run.pools, pd_run.transfers, pd_run.handoffs)
    titles = [ax.get_title() for ax in fig.axes]
    for pool, members in pd_run.pools.items():
        assert all(any(f"Replica {r} ({pool} pool)" in t for t in titles) for r in members)
    gantt = next(ax for ax in fig.axes if ax.get_title().startswith("KV hand-offs"))
    ticks = [t.get_text() for t in gantt.get_yticklabels()]
    assert any("prefill pool" in t for t in ticks) and any("decode pool" in t for t in ticks)
    moved = (pd_run.handoffs["decode_replica"] >= 0).sum()
    segments = [c for c in gantt.collections if c.get_label().startswith("KV transfer")]
    assert len(segments) == 1 and len(segments[0].get_segments()) == moved > 0
    plt.close(fig)
    binned = plots.plot_step_timeline(pd_run.steps, None, False, pd_run.pools, pd_run.transfers, pd_run.handoffs)
    assert [ax.get_title().split(":")[0] for ax in binned.axes if "tokens per second" in ax.get_title()] == [
        "Prefill pool (2 replicas)", "Decode pool (1 replica)"]
    plt.close(binned)


def test_a_colocated_timeline_names_no_pool(stalled):
    fig = plots.plot_step_timeline(stalled.steps, None, True, stalled.pools, stalled.transfers, stalled.handoffs)
    assert not any("pool" in ax.get_title() for ax in fig.axes)
    assert not any(ax.get_title().startswith("KV hand-offs") for ax in fig.axes)
    plt.close(fig)


def test_results_plots_are_written_with_the_run(tmp_path, pd_run):
    r = pd_run
    paths = plots.plot_run(r.requests, r.steps, r.itl.values, r.itl.weights, tmp_path, pools=r.pools,
                           kv_blocks=r.kv_blocks, transfers=r.transfers, handoffs=r.handoffs)
    assert sorted(p.name for p in paths) == ["kv_usage.png", "latency_cdf.png", "step_timeline.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


# ---------------------------------------------------------------- dashboard units


def test_dashboard_latency_panels_switch_to_seconds():
    assert dashboard.time_unit([0.2, 0.9]) == (1e3, "ms")
    assert dashboard.time_unit([0.2, 15.0, np.nan]) == (1.0, "s")
    edges = np.linspace(0, 100, dashboard.NUM_BINS + 1)
    times = np.linspace(1, 100, 400)
    fig, ax = plt.subplots()
    dashboard._percentile_panel(ax, edges, edges[:-1], (times, times * 0.3), "TTFT")  # TTFT up to 30 s
    assert ax.get_ylabel() == "s"
    top = max(np.nanmax(line.get_ydata()) for line in ax.lines)
    assert 20 < top <= 30  # seconds, not 30,000
    plt.close(fig)
    fig, ax = plt.subplots()
    dashboard._percentile_panel(ax, edges, edges[:-1], (times, np.full(400, 0.02)), "ITL")
    assert ax.get_ylabel() == "ms" and max(np.nanmax(line.get_ydata()) for line in ax.lines) == pytest.approx(20)
    plt.close(fig)


# ---------------------------------------------------------------- sweeps


def sweep_table(knob="policy.token_budget", values=(256, 512, 1024), same=True):
    """Two policies x knob x 3 seeds; throughput ~ seed (the spread across seeds dwarfs the knob);
    splitfuse equal to sarathi when `same`, else 10 % lower latency."""
    rows = []
    for policy in ("sarathi", "splitfuse"):
        for i, v in enumerate(values):
            for seed in range(3):
                factor = 1.0 if same or policy == "sarathi" else 0.9
                rows.append({"policy.name": policy, knob: v, "seed": seed, "status": "ok",
                             "throughput_tokens_per_s": 900.0 + 100 * seed + 0.01 * i + (policy == "splitfuse") * 1e-3,
                             "itl_p99": (0.01 + 0.01 * i ** 2) * factor * (1 + 0.2 * seed)})
    table = pd.DataFrame(rows)
    table.attrs["grid_keys"] = ["policy.name", knob]
    return table


def knees(fig) -> int:
    return sum(1 for ax in fig.axes for c in ax.collections if c.get_gid() == "knee")


def test_no_knee_along_a_knob_that_is_not_a_load():
    assert is_load("workload.arrival.rate") and not is_load("policy.token_budget")
    assert not is_load(["policy.chunk_size", "policy.token_budget"])
    fig = plot_latency_throughput(sweep_table(), "policy.token_budget")
    assert knees(fig) == 0
    assert "flat" in fig.axes[0].get_title()
    assert "knee" not in [t.get_text() for t in fig.legends[0].get_texts()]
    low, high = fig.axes[0].get_xlim()
    assert high - low > 0.01 * 1000  # a flat throughput is shown flat, not stretched over 0.02 tokens/s


def bent_curve(knob: str) -> pd.DataFrame:
    """Throughput rising and bending while the latency takes off: a clear knee at the 4th point."""
    rows = []
    for value, thr, itl in ((2, 500, 0.010), (4, 1000, 0.011), (6, 1500, 0.012), (8, 1700, 0.05), (10, 1750, 0.2)):
        rows += [{"policy.name": "sarathi", knob: value, "seed": 0, "status": "ok",
                  "throughput_tokens_per_s": thr, "itl_p99": itl}]
    table = pd.DataFrame(rows)
    table.attrs["grid_keys"] = [knob]
    return table


def test_a_knee_is_circled_along_a_load_only():
    assert knees(plot_latency_throughput(bent_curve("workload.arrival.rate"), "workload.arrival.rate")) == 1
    assert knees(plot_latency_throughput(bent_curve("workload.arrival.rate"), "workload.arrival.rate", knee=False)) == 0
    assert knees(plot_latency_throughput(bent_curve("policy.token_budget"), "policy.token_budget")) == 0


def test_overlapping_lines_are_said_and_styled_apart():
    fig = plot_metrics(sweep_table(same=True), "policy.token_budget", ["itl_p99"])
    ax = fig.axes[0]
    assert "splitfuse = sarathi" in ax.get_title()
    lines = [line for line in ax.lines if line.get_label() in ("sarathi", "splitfuse")]
    assert len({line.get_marker() for line in lines}) == 2 and len({line.get_linestyle() for line in lines}) == 2
    apart = plot_metrics(sweep_table(same=False), "policy.token_budget", ["itl_p99"])
    assert "=" not in apart.axes[0].get_title()
    assert overlaps([("a", [1.0, 2.0]), ("b", [1.0, 2.0])]) == [("b", "a")]
    assert overlaps([("a", [1.0, 2.0]), ("b", [1.5, 2.5])]) == []


def test_paired_ratios_cancel_the_seed_spread():
    table = sweep_table(same=False)
    ratios, reference = paired_ratios(table, "policy.token_budget", "itl_p99", ["policy.name"])
    assert reference == "sarathi"
    mine = ratios[ratios["policy.name"] == "splitfuse"]
    assert len(mine) == 9 and np.allclose(mine["ratio"], 0.9)  # the seed factor cancels exactly
    assert np.allclose(ratios.loc[ratios["policy.name"] == "sarathi", "ratio"], 1.0)
    thr, _ = paired_ratios(table, "policy.token_budget", "throughput_tokens_per_s", ["policy.name"])
    assert thr["ratio"].max() - thr["ratio"].min() < 1e-5  # seeds spread 900-1100; their ratios do not
    fig = plot_paired_ratios(table, "policy.token_budget", ["itl_p99", "throughput_tokens_per_s"])
    assert all("ratio to sarathi" in ax.get_ylabel() for ax in fig.axes if ax.get_visible())
    low, high = fig.axes[1].get_ylim()
    assert low <= 0.99 and high >= 1.01  # a 1e-6 ratio is not blown up to fill the panel


def test_paired_ratios_without_hue_use_the_first_knob_value():
    table = sweep_table()
    table = table[table["policy.name"] == "sarathi"]
    ratios, reference = paired_ratios(table, "policy.token_budget", "itl_p99", [])
    assert reference == "policy.token_budget = 256"
    assert np.allclose(ratios.groupby("_knob")["ratio"].mean().tolist(), [1.0, 2.0, 5.0])


def test_a_metric_zero_at_every_reference_run_keeps_every_figure(tmp_path):
    """A chunk-size sweep plotting num_preemptions, 0 at the first budget: that panel says there is no
    ratio, and the sweep keeps every figure (issue 26, defect 14: a ValueError lost them all)."""
    from cbsim.tools.sweep.plots import write_sweep_plots

    table = pd.DataFrame({"policy.token_budget": [64, 128, 256] * 2, "seed": [0, 0, 0, 1, 1, 1],
                          "num_preemptions": [0, 3, 5, 0, 2, 4], "ttft_p50": [0.1, 0.2, 0.3, 0.1, 0.2, 0.4],
                          "throughput_tokens_per_s": [10.0, 20, 30, 11, 21, 31], "itl_p50": [0.01] * 6, "itl_p99": [0.02] * 6,
                          "status": ["ok"] * 6})
    paths = write_sweep_plots(table, tmp_path, "policy.token_budget", ["num_preemptions", "ttft_p50"])
    assert [p.name for p in paths] == ["metrics_vs_knob.png", "paired_ratios.png", "itl_vs_throughput.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_no_knee_on_a_falling_curve_even_when_asked():
    """A chunk-size curve whose latency falls as throughput grows has no knee to circle (issue 30)."""
    falling = bent_curve("policy.token_budget")
    falling["itl_p99"] = falling["itl_p99"].to_numpy()[::-1]
    assert knees(plot_latency_throughput(falling, "policy.token_budget", knee=True)) == 0
    assert knees(plot_latency_throughput(bent_curve("policy.token_budget"), "policy.token_budget", knee=True)) == 1


def test_a_metric_spanning_decades_gets_a_log_axis_and_latencies_read_in_ms():
    table = bent_curve("policy.token_budget")  # ITL p99 from 10 ms to 200 ms: 20x
    ax = plot_metrics(table, "policy.token_budget", ["itl_p99", "throughput_tokens_per_s"]).axes
    assert ax[0].get_yscale() == "log" and ax[1].get_yscale() == "linear"  # throughput spans 3.5x
    assert ax[0].get_ylabel() == "ITL p99 (ms)" and max(ax[0].lines[0].get_ydata()) == pytest.approx(200)
    assert plot_metrics(table, "policy.token_budget", ["itl_p99"], logy=False).axes[0].get_yscale() == "linear"


def test_a_step_that_stalls_many_requests_says_how_many(stalled):
    """One marker per stalling step, 'xN' above it for the N requests it stalled together (issue 30)."""
    stalls = stall_events(stalled.itl, stalled.config.metrics.stall_factor)
    fig = plots.plot_step_timeline(stalled.steps, stalls, raw=True)
    counts = [a for ax in fig.axes for a in ax.texts if a.get_gid() == "stall_count"]
    shown = sum(int(a.get_text()[1:]) for a in counts) + (stalls.groupby("time")["count"].sum() == 1).sum()
    assert counts and shown == int(stalls["count"].sum())
    plt.close(fig)


def test_a_banded_sweep_shades_its_prediction_band():
    """metrics.band's <metric>_low / _high columns (cbsim/band.py) become a shaded band per line, in ms."""
    from matplotlib.collections import PolyCollection

    table = sweep_table(same=False)
    plain = plot_metrics(table, "policy.token_budget", ["itl_p99"])
    assert not [c for c in plain.axes[0].collections if isinstance(c, PolyCollection)]
    table["itl_p99_low"], table["itl_p99_high"] = 0.5 * table["itl_p99"], 3.0 * table["itl_p99"]
    fig = plot_metrics(table, "policy.token_budget", ["itl_p99"])
    shaded = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    assert len(shaded) == 2 and "prediction band" in fig._suptitle.get_text()  # one per policy
    top = max(v[1] for c in shaded for path in c.get_paths() for v in path.vertices)
    means = table.groupby(["policy.name", "policy.token_budget"])["itl_p99_high"].mean() * 1e3  # mean over seeds, ms
    assert top == pytest.approx(means.max(), rel=1e-12)
