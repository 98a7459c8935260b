"""What the optional compiled core (sim/native_core.py) buys: CPU per request of the speed matrix's rows
with the compiled prompt runs against the plain module, alternated in one process (issue 29).

The core is built first (mypyc and a C compiler needed) into a temporary folder put first on the
package's path, so nothing is installed; then every round runs each row once plain and once compiled,
in alternating order, and reports each row's median CPU us per request both ways and the median of the
rounds' ratios (plain / compiled: above 1, the compiled core is faster). The steps counted must match:
the two are the same engine.

    python benchmarks/native_gain.py                          # every row, 10,000 requests, 3 rounds
    python benchmarks/native_gain.py --rows benchmark,orca --requests 100000 --rounds 2
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time

import speed_matrix  # benchmarks/speed_matrix.py: the rows and their setup, one copy
from cbsim import sim as sim_package
from cbsim.sim import native_core, prompt_run


def compiled(folder: str):
    """The compiled core, built into `folder` and imported from there."""
    native_core.build(folder)
    sim_package.__path__.insert(0, folder)
    module = importlib.import_module(f"cbsim.sim.{native_core.NATIVE}")
    if native_core.check_build(native_core.built_folder()) is not None:
        sys.exit("the compiled core did not build as expected")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    args = parser.parse_args()
    rows = [row for row in speed_matrix.ROWS if not args.rows or row.name in args.rows.split(",")]
    setup = speed_matrix.Setup(args.requests, 0)
    with tempfile.TemporaryDirectory() as folder:
        cores = {"plain": prompt_run, "compiled": compiled(folder)}
        times = {(row.name, kind): [] for row in rows for kind in cores}
        for k in range(args.rounds):
            for row in rows:
                steps = set()
                for kind in (("plain", "compiled") if k % 2 == 0 else ("compiled", "plain")):
                    native_core.core = cores[kind]
                    started = time.process_time()
                    seconds, count = setup.run(row)
                    times[row.name, kind].append(seconds / args.requests)
                    steps.add(count)
                    print(f"  round {k + 1} {row.name:16s} {kind:8s} {seconds / args.requests * 1e6:8.1f} us/request "
                          f"({time.process_time() - started:.1f} s)", file=sys.stderr, flush=True)
                if len(steps) != 1:
                    sys.exit(f"{row.name}: the compiled and plain cores took different steps {steps}")
        native_core.core = prompt_run
    print(f"{args.requests:,} requests, {args.rounds} rounds alternated; CPU us per request of the event loop")
    print(f"{'configuration':16s} {'plain':>8s} {'compiled':>9s} {'plain/compiled':>15s}")
    for row in rows:
        plain, fast = times[row.name, "plain"], times[row.name, "compiled"]
        ratio = statistics.median(p / c for p, c in zip(plain, fast))
        print(f"{row.name:16s} {statistics.median(plain) * 1e6:8.1f} {statistics.median(fast) * 1e6:9.1f} "
              f"{ratio:14.2f}x")


if __name__ == "__main__":
    main()
