"""Where cbsim finds its data (traces, Vidur's tables): one rule for the CLI, reproduce.py, the
notebooks and the tests.

The folder $CBSIM_DATA names; when it is unset, `shared/data` beside the repository that holds this
package (the project's layout: <root>/main is the repository, <root>/shared/data the data), then
`shared/data` inside it. An installed (non-editable) package has no repository: then only
$CBSIM_DATA counts.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "CBSIM_DATA"


def repo_root() -> Path | None:
    """The repository this package runs from (editable install or checkout), or None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def data_dir() -> Path | None:
    """$CBSIM_DATA, else the first existing shared/data beside or inside the repository; None if neither."""
    named = os.environ.get(DATA_ENV)
    if named:
        return Path(named).expanduser()
    root = repo_root()
    for candidate in ([root.parent / "shared" / "data", root / "shared" / "data"] if root else []):
        if candidate.is_dir():
            return candidate
    return None
