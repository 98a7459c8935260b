"""Sweeps of an experiment over a grid of config values (sweep.py), the capacity search on top of
them (capacity.py) and their figures (plots.py)."""
