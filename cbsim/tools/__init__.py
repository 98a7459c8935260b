"""The tools on top of a run, stacked one way: sweep (grids and capacity) <- tune; compare (measured
vs simulated) <- calibrate; regress (CI). None of them is imported by the engine."""
