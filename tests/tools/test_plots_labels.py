"""Knob labels on the latency-throughput plot do not pile up (issue 30: chunk sizes drawn as a cluster)."""
import pandas as pd

from cbsim.tools.sweep.plots import plot_latency_throughput


def test_labels_of_clustered_points_are_not_overprinted():
    rows = [{"policy.token_budget": value, "seed": 0, "status": "ok", "throughput_tokens_per_s": thr, "itl_p99": itl}
            for value, thr, itl in ((64, 1000.0, 0.010), (128, 1000.5, 0.0101), (256, 1001.0, 0.0102),
                                    (512, 1400.0, 0.03), (1024, 1800.0, 0.09))]
    table = pd.DataFrame(rows)
    table.attrs["grid_keys"] = ["policy.token_budget"]
    fig = plot_latency_throughput(table, "policy.token_budget")
    labels = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "knob_label"]
    assert labels == ["64", "512", "1024"]  # 128 and 256 sit on 64
