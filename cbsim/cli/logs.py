"""The `cbsim` app's options before any command: --version, --log-level, -v / -q; logging on stderr.

Everything cbsim reports besides results goes through Python's `logging` under the "cbsim" logger:
warnings ("warning: ..."), and progress, which is info: the commands' progress bar (cbsim/cli/progress.py)
shows at the default level, info, and not with -q (warning) or --log-level warning. Results (the summary,
tables, file paths) are on stdout, never mixed with those lines.
"""
from __future__ import annotations

import logging
import sys

import typer

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
log = logging.getLogger("cbsim")


class _Stderr(logging.Handler):
    """Writes to the sys.stderr of the moment (a test runner swaps it per command)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # pragma: no cover - logging must never end a run
            self.handleError(record)


def configure(level: str) -> None:
    """Route the "cbsim" logger to stderr at `level` ('warning: text', no timestamps), replacing an
    earlier call's handler."""
    if level not in LEVELS:
        raise typer.BadParameter(f"one of {', '.join(LEVELS)}", param_hint="--log-level")
    for handler in [h for h in log.handlers if isinstance(h, _Stderr)]:
        log.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(levelname_lower)s: %(message)s"))
    handler.addFilter(_lower_level)
    log.addHandler(handler)
    log.setLevel(LEVELS[level])


def _lower_level(record: logging.LogRecord) -> bool:
    record.levelname_lower = record.levelname.lower()
    return True


def warn(lines: list[str]) -> None:
    """Log warning lines written as 'warning: text' (workloads.drop_warnings) through the "cbsim" logger."""
    for line in lines:
        log.warning(line.removeprefix("warning: "))


def progress_wanted(quiet: bool) -> bool:
    """A command's progress bar: unless its own --quiet, or the log level is above info."""
    return not quiet and log.isEnabledFor(logging.INFO)


def _print_version(value: bool) -> None:
    if value:
        from cbsim import __version__

        typer.echo(f"cbsim {__version__}")
        raise typer.Exit()


def app_options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                             help="print cbsim's version and exit"),
                log_level: str = typer.Option("info", "--log-level", help="debug | info (progress lines) | "
                                              "warning | error, on stderr"),
                verbose: bool = typer.Option(False, "--verbose", "-v", help="--log-level debug"),
                quiet: bool = typer.Option(False, "--quiet", "-q", help="--log-level warning: no progress lines")):
    """cbsim: simulate LLM serving schedulers on calibrated step-latency cost models."""
    configure("debug" if verbose else "warning" if quiet else log_level)
