"""Measured vs simulated: measured serving results read into cbsim's metric names (measured.py), the
comparison of a run with them (compare.py) and its CDF figure (plots.py)."""
