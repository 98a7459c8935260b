"""`python -m cbsim.cli ...` runs the `cbsim` command line."""
from cbsim.cli.app import main

main()
