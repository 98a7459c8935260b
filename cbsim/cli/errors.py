"""How every `cbsim` command reports a user error: one line naming the file, key and expectation
(ConfigError), exit code 2, no traceback. Its own module, so that the commands registered beside
their subsystems (sweep_cli, regress_cli, ...) use it without importing cbsim.cli.app, which imports them."""
from __future__ import annotations

import functools

import typer

from cbsim.core.atomic import OutputError

from cbsim.core.errors import ConfigError, RunAborted


def user_errors(func):
    """Turn ConfigError (and a missing file), OutputError (a results folder that cannot be written as
    asked: cbsim/core/atomic.py), RunAborted (a worker died) and any other OSError (a full disk, no
    permission) into a one-line message and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (ConfigError, OutputError, RunAborted) as err:
            typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        except OSError as err:  # the machine, not the input: a full disk, a name too long, no permission
            where = f"{err.filename}: " if err.filename else ""
            typer.secho(f"error: {where}{err.strerror or err}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)

    return wrapper
