import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# CI runs the default profile: 300 examples drawn the same way on every run, so a result is
# reproducible. `HYPOTHESIS_PROFILE=thorough pytest tests/test_invariants.py` draws 3000 fresh ones.
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=300, derandomize=True, **COMMON)
settings.register_profile("thorough", max_examples=3000, **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
