#!/usr/bin/env bash
# The prepared profiling job for a GPU session. The device tool runs it in the repository root with
# $OUT set:   bash profiler/gpu_job.sh [--seconds 480] [--heldout FILE] [--backend torch] [--model M]
#
# 1. prints the machine (nvidia-smi, torch, CUDA) and a roofline estimate of the run's length;
# 2. checks the attention backend against sdpa on random mixed batches (before any timing; a
#    mismatch stops the job and is recorded in $OUT/metadata.json);
# 3. profiles the h200-8b grid with the `torch` backend (Llama-3-8B, bf16, 4 rotated replicas) into
#    $OUT/measurements.csv, each row flushed as measured, and stops cleanly once --seconds have passed
#    since the run began. Held-out batches (--heldout FILE, written by the simulator; on the GPU the
#    default is the committed profiler/heldout/h200-llama-3-8b.jsonl: sarathi and prefill_first steps,
#    see profiler/heldout.py; on --cpu a random off-grid set is drawn into $OUT/heldout.jsonl) are
#    spread through the run, so a cut run keeps some of them.
# --cpu runs the same steps on the CPU with the tiny model and grid (the tests do this).
# Needs python3 with torch and numpy; cbsim is imported from this checkout, not installed.
set -euo pipefail
seconds=480 cpu=0 heldout="" backend="" model=""
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --heldout) heldout=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    *) echo "gpu_job.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "$cpu" = 1 ]; then
  set -- cpu "${model:-tiny}" tiny "${backend:-sdpa}" 1
else
  nvidia-smi || true
  if [ -z "$heldout" ] && [ -z "$model" ] && [ -f profiler/heldout/h200-llama-3-8b.jsonl ]; then
    heldout=profiler/heldout/h200-llama-3-8b.jsonl  # simulated sarathi/prefill_first steps (profiler/heldout.py)
  fi
  set -- cuda "${model:-llama-3-8b}" h200-8b "${backend:-torch}" 4
fi

timeout -k 20 $((seconds + 120)) "$PY" - "$@" "$seconds" "$heldout" "$OUT" <<'EOF' 2>&1 | tee "$OUT/job.log"
import importlib.util
import os
import signal
import sys

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # let the run write its metadata on timeout


def load(name, folder):
    """Import a folder of this checkout as package `name` (setuptools maps them the same way)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[os.path.abspath(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load("cbsim", "cbsim").profiler = load("cbsim.profiler", "profiler")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cbsim.profiler.grid import named_grid, random_batches, write_batches  # noqa: E402
from cbsim.profiler.layer import layer_shape  # noqa: E402
from cbsim.profiler.run import ProfileConfig, estimate_seconds, plan_batches, run_profile  # noqa: E402
from cbsim.core.schema import parse  # noqa: E402

device, model, grid, backend, replicas, seconds, heldout, out = sys.argv[1:]
cpu = device == "cpu"
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {device} model {model} grid {grid} "
      f"backend {backend} budget {seconds} s")
if not heldout:
    rng = np.random.default_rng(20261)
    g = named_grid(grid, rng)
    heldout = os.path.join(out, "heldout.jsonl")
    shapes = (random_batches(rng, 4, g.max_kv_tokens, 2048, max_chunk=256, max_decodes=16, source="heldout")
              if cpu else random_batches(rng, 60, g.max_kv_tokens, g.max_context, source="heldout"))
    write_batches(heldout, shapes)
config = parse(ProfileConfig, {
    "out": out, "device": device, "model": model, "backend": backend, "grid": grid, "batches": heldout,
    "max_seconds": float(seconds), "replicas": int(replicas), "threads": 1 if cpu else None}, "gpu_job")
order, _, skipped = plan_batches(config, np.random.default_rng(config.seed))
guess = estimate_seconds(order, layer_shape(model), config, int(replicas))
print(f"{len(order)} batches planned ({skipped} held-out skipped), roofline estimate {guess:.0f} s")
result = run_profile(config)
print(f"{result.rows} rows from {result.batches_measured}/{result.batches_planned} batches in "
      f"{result.wall_s:.1f} s, stop: {result.stop_reason}, check: {result.metadata.get('check')}")
EOF
