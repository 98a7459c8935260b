"""The foundation under everything: user errors, typed config sections, the generic registry and
where data is found. It imports nothing of cbsim (tests/test_import_cycles.py checks)."""
