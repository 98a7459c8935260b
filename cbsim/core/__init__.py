"""The foundation: imports nothing of cbsim."""
