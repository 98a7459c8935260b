"""Results that are never half-written or mixed: folders and files appear whole or not at all.

A results folder is written into a temporary sibling (`.<name>.tmp-XXXX` beside it), completed with a
marker file (`.cbsim-complete`, a JSON list of the files, written last) and only then
renamed into place: a reader sees the previous complete folder or the new complete one, never a mixture
and never a table cut short under its final name (a `kill -9`, a full disk or an exception while writing
leaves the old folder as it was and removes the temporary one, or leaves it for the next writer to clear).

Replacing: an existing folder is replaced as a whole (Linux swaps the two in one `renameat2` call;
elsewhere it is moved aside, then the new one moved in) when it carries the marker, that is, when it is
cbsim's own complete results (or holds only the files a run writes, summary and config among them: a
run's from before the marker): a rerun into the same `--out` then holds only the new run's files, none of
the old run's left beside them. Any other non-empty folder is refused unless the caller asks to
overwrite (`--overwrite`): it may be the user's own files (an unset shell variable made `--out ""` the
current folder), and replacing it as a whole would delete them. An empty folder, the current folder or
one that holds it, and a symlink (the files would be written where it points) are refused or, for the
empty folder, simply replaced.

Concurrent writers: a writer holds an exclusive `fcntl.flock` on `.<name>.lock` beside the folder for as
long as it writes (the CLI for its whole run); a second writer fails at once with one line. The lock file
stays (removing it would let two writers lock two different files).

Single files (a sweep's point records, the compiled core) use `write_file_atomic`: a temporary sibling,
fsync, then `os.replace`. Every OSError (a full disk, a read-only folder) becomes an OutputError: one
line, and nothing written under the final name.

This module imports nothing of cbsim: the CLI turns OutputError into its one-line message and exit 2.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

MARKER = ".cbsim-complete"


class OutputError(Exception):
    """An output that cannot be written as asked; the message is one line naming the folder or file."""


def check_target(folder: str | Path, key: str = "--out", overwrite: bool = False) -> Path:
    """The folder `folder` names, as an absolute path, or OutputError (naming `key`) when a run must not
    write there: empty or the current folder (or one that holds it), a symlink, a file, or a non-empty
    folder that is not cbsim's complete results (unless `overwrite`). Creates nothing."""
    text = str(folder)
    if not text.strip() or Path(text) == Path("."):
        raise OutputError(f"{key}: expected a results folder other than the current one, got {text!r}")
    target = Path(os.path.abspath(Path(text).expanduser()))
    here = Path(os.getcwd())
    if target == here or target in here.parents:
        raise OutputError(f"{key}: expected a folder that does not hold the current folder, got {text!r} "
                          "(replacing it would remove the current folder)")
    if target.is_symlink():
        raise OutputError(f"{key}: expected a folder, not a symlink ({text!r}: its results would be written "
                          "where it points)")
    if target.exists() and not target.is_dir():
        raise OutputError(f"{key}: expected a folder, got the file {text!r}")
    if target.is_dir() and not overwrite and not (is_complete(target) or _earlier_results(target)) \
            and any(target.iterdir()):
        raise OutputError(f"{key}: expected a new folder or cbsim's own results ({text!r} holds other files; "
                          "--overwrite replaces it as a whole)")
    return target


# What a run writes (cbsim/api.py Results.write, compare): a folder of these files only, with a summary and a
# config, is an earlier cbsim run's, written before the marker existed, and is replaced like a marked one.
RUN_FILES = re.compile(r"(config\.yaml|summary\.json|bench\.json|compare\.json|trace\.json|shapes\.jsonl"
                       r"|(requests|steps|preemptions|transfers)\.(parquet|csv)|[\w-]+\.png)")


def _earlier_results(folder: Path) -> bool:
    names = [path.name for path in folder.iterdir()]
    return ({"config.yaml", "summary.json"} <= set(names)
            and all(RUN_FILES.fullmatch(name) and (folder / name).is_file() for name in names))


def is_complete(folder: str | Path) -> bool:
    """Whether `folder` is a complete results folder (it carries the marker, written last)."""
    return (Path(folder) / MARKER).is_file()


def require_complete(folder: str | Path, key: str = "results") -> Path:
    """`folder` as a Path, or OutputError unless it is a complete results folder."""
    path = Path(folder)
    if not is_complete(path):
        why = "it does not exist" if not path.exists() else f"it has no {MARKER}: a run was cut short writing it"
        raise OutputError(f"{path}: {key}: expected a complete cbsim results folder ({why})")
    return path


_held: dict[str, list] = {}  # lock file -> [open file, depth]: a process may take its own lock again


@contextlib.contextmanager
def locked(folder: str | Path) -> Iterator[None]:
    """Hold the exclusive lock of `folder` (`.<name>.lock` beside it), or raise OutputError at once
    when another process holds it. Re-entrant within a process."""
    target = Path(os.path.abspath(folder))
    lock = target.parent / f".{target.name}.lock"
    key = str(lock)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")
    except OSError as err:
        raise OutputError(f"{target}: cannot create its lock file ({err.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise OutputError(f"{target}: another cbsim process is writing this folder (lock {lock}); "
                          "wait for it or choose another --out") from None
    _held[key] = [handle, 1]
    try:
        yield
    finally:
        del _held[key]
        handle.close()  # closing releases the lock


@contextlib.contextmanager
def results_folder(folder: str | Path, key: str = "--out", overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of `folder` to write into; when the block ends without an
    error, mark it complete and put it in place of `folder` (module docstring). On an error the
    temporary folder is removed and `folder` is left as it was; an OSError becomes an OutputError."""
    target = check_target(folder, key, overwrite)
    with locked(target):
        target = check_target(folder, key, overwrite)  # as it is now that no other writer can change it
        _clear_leftovers(target)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        except OSError as err:
            raise OutputError(f"{target}: cannot write its results ({err.strerror})") from None
        try:
            yield staging
            _finish(staging)
            _swap_in(staging, target)
        except OSError as err:
            raise OutputError(f"{target}: cannot write its results ({err.strerror}); nothing was written, "
                              "the folder is as it was") from None
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _clear_leftovers(target: Path) -> None:
    """Remove the temporary and moved-aside folders of writers of `target` that were killed."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for left in target.parent.glob(pattern):
            shutil.rmtree(left, ignore_errors=True)


def _finish(staging: Path) -> None:
    """fsync every file, then write the marker (the list of files) and fsync the folder."""
    files = []
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            _fsync(path)
            files.append(str(path.relative_to(staging)))
    mark_complete(staging, files)
    _fsync(staging)


def mark_complete(folder: Path, files: list[str]) -> None:
    """Write `folder`'s completion marker (the list of its files), atomically: the last write of a folder
    that is written in place and resumed (a sweep's, whose point files are each atomic)."""
    write_file_atomic(Path(folder) / MARKER, lambda tmp: tmp.write_text(json.dumps({"files": files}, indent=1) + "\n"))


def mark_incomplete(folder: Path) -> None:
    """Remove `folder`'s completion marker, if any: the first write of a run that resumes it."""
    try:
        (Path(folder) / MARKER).unlink()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise OutputError(f"{folder}: cannot update its completion marker ({err.strerror})") from None


def _swap_in(staging: Path, target: Path) -> None:
    """Put `staging` at `target`: a plain rename when there is none, else an atomic exchange (Linux),
    else move the old one aside first; the old one is then removed."""
    if not target.exists():
        os.rename(staging, target)
    elif not _exchange(staging, target):
        aside = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, aside)
        os.rename(staging, target)
        staging = aside
    shutil.rmtree(staging, ignore_errors=True)  # the old folder, now under the staging name
    _fsync(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def write_file_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` to write a temporary sibling of `path`, fsync it and rename it to `path`:
    a reader finds the old file or the whole new one. `path` itself must not be a symlink (it is
    replaced, never written through). An OSError leaves no temporary file and becomes an OutputError."""
    path = Path(path)
    if path.is_symlink():
        raise OutputError(f"{path}: expected a plain file to replace, not a symlink (it would write where it points)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise OutputError(f"{path}: cannot write it ({err.strerror}); nothing was written under its name") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
