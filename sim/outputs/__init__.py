"""What a run leaves for people to read: plots, the HTML dashboard, the Perfetto trace, progress lines.

Everything here reads the computed metrics (cbsim.sim.metrics) and never changes a run.
"""
