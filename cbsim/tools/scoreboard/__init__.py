"""`cbsim scoreboard`: cbsim's fidelity on every public measurement it ships or cites, per cell, and a
check that fails when a cell gets worse (sources.py, board.py; published.py holds the published tables,
runs.py how cbsim reproduces them, vidur_tables.py the readers of Vidur's tables).

Here, not in validation/ (the scripts): the `cbsim` command imports it, so it is part of the installed
package like the other tools; the committed board (validation/scoreboard.*) is data beside the scripts.
"""
