"""Held-out batches from simulated schedulers (profiler/heldout.py) and the committed H200 file."""
from collections import Counter
from pathlib import Path

import numpy as np

from cbsim.profiler.grid import named_grid, read_batches
from cbsim.profiler.heldout import POLICIES, main, simulated_batches
from cbsim.profiler.measurements import batch_class
from paths import ROOT

COMMITTED = ROOT / "profiler" / "heldout" / "h200-llama-3-8b.jsonl"


def classes(batches) -> Counter:
    return Counter(batch_class(b.prefill, b.decode) for b in batches)


def test_batches_come_from_every_policy_capped_per_class_within_the_grid_limits():
    batches, dropped = simulated_batches(requests=80, per_class=3, seed=1)
    limits = named_grid("h200-8b", np.random.default_rng(0))
    assert all(b.source == "heldout" for b in batches)
    assert all(b.kv_tokens <= limits.max_kv_tokens and b.max_ctx <= limits.max_context for b in batches)
    counts = classes(batches)
    assert all(n <= 3 * len(POLICIES) for n in counts.values())
    assert counts["mixed"] >= 3 and counts["decode"] >= 3  # sarathi mixes; everyone decodes
    assert (batches, dropped) == simulated_batches(requests=80, per_class=3, seed=1)  # seeded


def test_command_writes_a_file_the_profiler_reads(tmp_path, capsys):
    out = tmp_path / "heldout.jsonl"
    main(["--out", str(out), "--requests", "60", "--per-class", "2"])
    assert read_batches(out) and "held-out batches from sarathi-512, sarathi-2048, prefill_first" in capsys.readouterr().out


def test_committed_h200_file_covers_the_classes_the_targets_are_stated_for():
    batches = read_batches(COMMITTED)
    counts = classes(batches)
    assert counts["mixed"] >= 30 and counts["decode"] >= 30 and counts["prefill"] >= 10
    limits = named_grid("h200-8b", np.random.default_rng(0))
    assert all(b.kv_tokens <= limits.max_kv_tokens and b.max_ctx <= limits.max_context for b in batches)
    assert max(len(b.decode) for b in batches) >= 128  # large decode batches, as a loaded H200 forms
