"""Published measurements turned into cbsim's formats: Vidur's profiling tables into `vidur`
profiles (vidur_data.py), measured whole-step tables for `cbsim calibrate --steps` (step_table.py)
and the Splitwise profiling CSV (splitwise.py)."""
