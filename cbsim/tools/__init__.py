"""The tools on top of a run, stacked one way: sweep (grids and capacity) <- tune; compare (measured
vs simulated) <- calibrate; regress (CI); scoreboard (fidelity on published data); sim2real (a real vLLM
engine as ground truth: scheduler parity, recorded steps, served workloads). None of them is imported by
the engine."""
