"""Calibration on top of compare: engine terms fitted to measured whole-step times (steps.py) or to
measured serving metrics (serving.py)."""
