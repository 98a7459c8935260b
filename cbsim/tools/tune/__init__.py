"""`cbsim tune`: a deployment search under SLOs (tune.py) built on the capacity search: the tune file
(spec.py), its stages (stages.py), the chosen deployment as engine flags (flags.py), the report and
its figure (report.py, plots.py)."""
