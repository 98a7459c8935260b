"""Fit the `vllm-2023-a100` engine preset on the Splitwise measurements (shared/data/measured/).

Whole-step times of vLLM as of 2023 (eager PyTorch, Ray workers for TP, host work serialized with
the GPU) for Llama-2-70B on a DGX-A100 at TP2 and TP8, against the roofline's kernels
(experiments/calibration/llama-2-70b-a100-roofline.yaml). Writes
sim/costmodels/engines/vllm-2023-a100.json (a test keeps the shipped file equal to a refit)
and prints the error table.

    python validation/calibrate_splitwise.py [--data DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "calibration" / "llama-2-70b-a100-roofline.yaml"
CSV = Path("measured") / "splitwise_a100_llama2_70b" / "perf_model_a100_tp2_tp8.csv"
OUT = ROOT / "sim" / "costmodels" / "engines" / "vllm-2023-a100.json"
DESCRIPTION = ("vLLM as of 2023 on a DGX-A100 (Splitwise's measurements): eager PyTorch, Ray workers for tensor "
               "parallelism, host work serialized with the GPU; the terms are fitted to 51 whole-step medians of "
               "Llama-2-70B at TP2 and TP8 over the roofline's kernels")


def build(data: Path) -> dict:
    """The preset's content: the calibration report plus what it describes and where it comes from."""
    from cbsim.tools.calibrate.steps import DEFAULT_FIT, calibrate_steps, file_digest
    from cbsim.config import read_yaml
    from cbsim.profiler.converters.splitwise import read_splitwise

    steps, notes = read_splitwise(data / CSV)
    base = read_yaml(BASE)
    report = calibrate_steps(steps, base["model"], base["cost_model"], DEFAULT_FIT)
    digest = file_digest(data / CSV)
    digest["file"] = "shared/data/" + CSV.as_posix()
    report["base_cost_model"]["file"] = BASE.relative_to(ROOT).as_posix()
    head = {"name": "vllm-2023-a100", "engine": "vLLM (2023, before CUDA graphs)", "version": "as measured by Splitwise "
            "(ISCA'24); Mutinifni/splitwise-sim data/perf_model.csv @ 3780880", "description": DESCRIPTION,
            "source": "Splitwise profiling database, MIT license; see shared/data/measured/SOURCE.md"}
    return {**head, **report, "data": [{**digest, "rows": len(steps)}], "notes": notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("CBSIM_DATA") or ROOT.parent / "shared" / "data"
    parser.add_argument("--data", type=Path, default=Path(default))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    preset = build(args.data)
    args.out.write_text(json.dumps(preset, indent=2) + "\n")
    for kind, table in preset["errors"].items():
        print(f"{kind:<24}" + "  ".join(f"{g} {t['median_abs']:.1%}" for g, t in table.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
