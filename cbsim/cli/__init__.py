"""The `cbsim` command line: app.py is the typer app and imports every command module by name;
one module per command family, each with `register(app)`; errors.py is how every command reports a
user error (one line, exit code 2)."""
