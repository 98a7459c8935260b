"""The compiled core: sim/prompt_run.py compiled with mypyc, used where a user built it; the plain
module everywhere else.

Prompt runs are most of the event loop's time on a chunked-prefill workload (the reference benchmark:
chunk steps, decode segments, the requests joining and leaving a run). mypyc compiles that module as it
is (its annotations are what mypyc needs): 10,000 reference requests take ~20 % less CPU
(benchmarks/sim_speed.py, alternated). `pip install` stays pure Python; building is a step of its own:

    pip install mypy            # mypyc, and a C compiler on the machine
    python -m cbsim.sim.native_core build
    python -m cbsim.sim.native_core status

`build` compiles a copy of prompt_run.py named `_prompt_run_native`, stamped with the source's
sha256, into the package's folder; each file is written to a temporary name and renamed, then
`_prompt_run_native.stamp.json` records the source's and every file's sha256, checked before loading (beside prompt_run.py, wherever the package is installed). `core`
is that compiled copy when it was built from the source as it is now, else prompt_run itself: an edited
source is never shadowed by an old build (it warns once and runs the plain module). CBSIM_NATIVE=0 turns
the compiled core off.

What it buys, measured (issue 29; `python benchmarks/native_gain.py`: each speed-matrix row run plain and
compiled in alternating order, 3 rounds, 10,000 reference requests, the same steps both ways; CPU us per
request, the median of the rounds' plain/compiled ratios; a 2-core machine shared with other work, load
5-7, so +-10 % is noise):

    benchmark 47.0 / 41.6 (1.13x)   orca 55.8 / 52.5 (1.14x)   reserve_full 49.4 / 47.3 (1.28x)
    splitfuse 1.00x   prefill_first 1.02x   pd_1p1d 0.99x   rr_4 1.00x   least_loaded_4 1.04x
    sglang_lpm 1.00x   pp_2 1.02x

The decision: it stays, optional. Its guarantees hold and are tested (identical tables, a clean fall-back
when it is off, missing, stale or cut short), it costs a pure-Python install nothing, and it takes 11-22 %
off the rows whose steps are prompt runs. It does nothing for the other six rows (several replicas, P/D,
prefill_first, sglang, pipeline parallel), which are the ones issue 29 is about: speed there has to come
from the engine loop itself, not from compiling it. Measure again with benchmarks/native_gain.py when the
runs move out of prompt_run.py (issue 29's one run record); if the gain on the benchmark falls under 10 %,
remove this module, its test and the `native` extra.

Invariant: both give the same results bit for bit. The C is compiled with -ffp-contract=off (no fused
multiply-adds: each float operation rounds as Python's does), and mypyc keeps Python's integer
semantics; tests/sim/test_native_core.py builds it where mypyc is installed and holds its tables to the
plain module's.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from cbsim.core.atomic import OutputError, write_file_atomic

from cbsim.sim import prompt_run

NATIVE = "_prompt_run_native"  # the compiled copy's module name, in this package
SOURCE = Path(prompt_run.__file__)


def source_digest(path: Path = SOURCE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load():
    """The prompt-run module to use: the compiled copy, where it exists, is on, whole and fresh; else the
    plain one. Its files are checked against their stamp before it is imported: loading a library cut
    short (an interrupted copy) would end the process with SIGBUS, past any Python error handling."""
    if os.environ.get("CBSIM_NATIVE", "1") == "0":
        return prompt_run
    folder = built_folder()
    if folder is None:
        return prompt_run
    problem = check_build(folder)
    if problem:
        warnings.warn(f"the compiled core in {folder} {problem}: running the plain module (rebuild: python -m "
                      f"{__package__}.native_core build)", stacklevel=2)
        return prompt_run
    try:
        native = importlib.import_module(f"{__package__}.{NATIVE}")
    except ImportError:
        return prompt_run
    if getattr(native, "SOURCE_SHA256", None) != source_digest():
        warnings.warn(f"the compiled core ({native.__file__}) was built from another sim/prompt_run.py: running "
                      f"the plain module (rebuild: python -m {__package__}.native_core build)", stacklevel=2)
        return prompt_run
    return native


def build(target: Path | None = None) -> list[Path]:
    """Compile prompt_run.py with mypyc into `target` (default: this package's folder); returns the files
    written. Raises RuntimeError with mypyc's output where it fails (no mypyc, no C compiler)."""
    target = Path(target) if target is not None else SOURCE.parent
    with tempfile.TemporaryDirectory() as work:
        parts = __package__.split(".")  # the package's folders, so mypyc names the module as it is imported
        package = Path(work, *parts)
        package.mkdir(parents=True)
        for level in range(1, len(parts) + 1):
            Path(work, *parts[:level], "__init__.py").touch()
        module = package / f"{NATIVE}.py"
        module.write_text(SOURCE.read_text() + f'\n\nSOURCE_SHA256 = "{source_digest()}"\n')
        env = {**os.environ, "CFLAGS": (os.environ.get("CFLAGS", "") + " -ffp-contract=off").strip()}
        command = [sys.executable, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=skip",
                   str(module.relative_to(work))]
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed ({' '.join(command)}):\n{done.stdout}{done.stderr}")
        built = sorted(package.glob(f"{NATIVE}*.so")) + sorted(package.glob(f"{NATIVE}*.pyd"))
        return install(built, target)


STAMP = f"{NATIVE}.stamp.json"  # beside the compiled files: the source's digest and each file's


def install(built: list[Path], target: Path) -> list[Path]:
    """Copy the compiled files into `target`, each atomically (a running process keeps the library it
    mapped; a new one never finds a file cut short), then write their stamp, last."""
    stale = target / STAMP  # first: from here until the new stamp, no process loads a mixture
    if stale.exists():
        stale.unlink()
    written = [write_file_atomic(target / path.name, lambda tmp, path=path: shutil.copy2(path, tmp))
               for path in built]
    digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in written}
    record = json.dumps({"source_sha256": source_digest(), "files": digests}, indent=1) + "\n"
    return written + [write_file_atomic(target / STAMP, lambda tmp: tmp.write_text(record))]


def built_folder() -> Path | None:
    """The folder holding the compiled copy import would load, found without loading it; None if none."""
    try:
        spec = importlib.util.find_spec(f"{__package__}.{NATIVE}")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def check_build(folder: Path) -> str | None:
    """Why the compiled files in `folder` must not be loaded (no stamp, another source, a file missing or
    not as built), or None."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
        files = stamp["files"]
        if stamp["source_sha256"] != source_digest():
            return "was built from another sim/prompt_run.py"
        for name, digest in files.items():
            if hashlib.sha256((folder / name).read_bytes()).hexdigest() != digest:
                return f"has {name} not as it was built (cut short or changed)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"has no readable {STAMP} (an interrupted build)"
    return None


core = load()


def status() -> str:
    return f"plain Python ({SOURCE})" if core is prompt_run else f"compiled ({core.__file__})"


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        try:
            written = build()
        except (RuntimeError, OutputError) as err:  # no mypyc, no C compiler, a full disk: one message, no traceback
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        for path in written:
            print(f"wrote {path}")
    elif sys.argv[1:] == ["status"]:
        print(status())
    else:
        print(f"usage: python -m {__package__}.native_core build | status", file=sys.stderr)
        sys.exit(2)
