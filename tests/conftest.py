import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# tests/ mirrors the source tree (sim/, policies/, workloads/, profiler/, tools/, cli/, ...). factories.py and
# paths.py sit here, and some property suites reuse another suite's strategies (test_invariants' workloads,
# test_prefix's chains): every test folder is importable by module name (test file names are unique).
TESTS = Path(__file__).parent
for folder in [TESTS, *sorted(d for d in TESTS.rglob("*") if d.is_dir() and d.name not in ("data", "golden", "__pycache__")
                              and "data" not in d.relative_to(TESTS).parts and "golden" not in d.relative_to(TESTS).parts)]:
    sys.path.insert(0, str(folder))

# CI runs the default profile: 300 examples drawn the same way on every run, so a result is
# reproducible. `HYPOTHESIS_PROFILE=thorough pytest tests/sim/test_invariants.py` draws 3000 fresh ones.
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=300, derandomize=True, **COMMON)
settings.register_profile("thorough", max_examples=3000, **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
