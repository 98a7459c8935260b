"""User-facing errors: they name the file, the key path and what was expected; the CLI prints them
without a traceback and exits with code 2."""
from __future__ import annotations

from cbsim.core.bounds import short_repr


class ConfigError(ValueError):
    def __init__(self, path: str, expected: str, got=None, file: str | None = None, has_got: bool = True):
        self.path = path or "<root>"
        self.expected = expected
        self.got = got
        self.file = file
        self.has_got = has_got
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.file}: " if self.file else ""
        got = f", got {short_repr(self.got)}" if self.has_got else ""  # one line of it, however large
        return f"{where}{self.path}: expected {self.expected}{got}"

    def in_file(self, file: str | None) -> "ConfigError":
        """The same error, now naming the file it came from (itself when `file` is None); an error
        that already names a file (a trace or profile the experiment points to) keeps that file,
        where the bad content is."""
        if not file or self.file:
            return self
        return ConfigError(self.path, self.expected, self.got, file, self.has_got)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key path nested under `prefix`."""
        path = f"{prefix}.{self.path}" if self.path != "<root>" else prefix
        return ConfigError(path, self.expected, self.got, self.file, self.has_got)


class RunAborted(Exception):
    """A run that cannot go on for a reason outside its input (a worker process died); the message is one
    line saying what happened and how to resume. The CLI prints it like a ConfigError (exit code 2)."""


def missing(path: str, expected: str) -> ConfigError:
    return ConfigError(path, f"a value ({expected})", has_got=False)
