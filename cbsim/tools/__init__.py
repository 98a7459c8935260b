"""Tools built on cbsim: bridges to real engines (sim2real)."""
