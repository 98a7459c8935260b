"""The compiled core (sim/native_core.py). Off, missing or built from another source, the plain module
runs. Built (where mypyc and a C compiler are installed: the dev extra has mypyc), its prompt runs give
what stepping one by one gives and what the plain module gives, bit for bit, on random workloads."""
from __future__ import annotations

import importlib
import shutil
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cbsim.sim as sim_package
from cbsim.policies import make_policy
from cbsim.sim import native_core, prompt_run
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate
from factories import assert_same_run
from test_fast_path import ADMITTING, MAX_MODEL_LEN, SPREAD, cost_model


def test_off_missing_or_stale_the_plain_module_runs(monkeypatch):
    monkeypatch.setenv("CBSIM_NATIVE", "0")
    assert native_core.load() is prompt_run
    monkeypatch.delenv("CBSIM_NATIVE")
    monkeypatch.setattr(native_core, "built_folder", lambda: None)  # none built: nothing imported
    monkeypatch.setattr(native_core.importlib, "import_module", lambda name: 1 / 0)
    assert native_core.load() is prompt_run
    monkeypatch.setattr(native_core, "built_folder", lambda: sim_package.__path__[0])  # built, its stamp as built
    monkeypatch.setattr(native_core, "check_build", lambda folder: None)

    def missing(name):
        raise ImportError(name)

    monkeypatch.setattr(native_core.importlib, "import_module", missing)
    assert native_core.load() is prompt_run
    stale = SimpleNamespace(SOURCE_SHA256="0" * 64, __file__="old.so")
    monkeypatch.setattr(native_core.importlib, "import_module", lambda name: stale)
    with pytest.warns(UserWarning, match="built from another sim/prompt_run.py"):
        assert native_core.load() is prompt_run
    fresh = SimpleNamespace(SOURCE_SHA256=native_core.source_digest(), __file__="new.so")
    monkeypatch.setattr(native_core.importlib, "import_module", lambda name: fresh)
    assert native_core.load() is fresh


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The core built here (into a folder of its own, put first on the package's path), imported fresh."""
    pytest.importorskip("mypyc")
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler")
    target = tmp_path_factory.mktemp("native")
    assert native_core.build(target)
    names = [f"cbsim.sim.{native_core.NATIVE}", f"cbsim.sim.{native_core.NATIVE}__mypyc"]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sim_package.__path__.insert(0, str(target))
    try:
        module = importlib.import_module(names[0])
        assert module.__file__.startswith(str(target)) and module.SOURCE_SHA256 == native_core.source_digest()
        yield module
    finally:
        sim_package.__path__.remove(str(target))
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def run_with(core, policy: str, cost: str, specs, num_blocks: int, watermark: int, max_time: float,
             fast_forward: bool = True):
    requests, t = [], 0.0
    for i, (gap, prompt, output) in enumerate(specs):
        t += gap
        requests.append(Request(i, t, prompt, output))
    before, native_core.core = native_core.core, core
    try:
        recorder, _ = simulate(requests, lambda: make_policy(ADMITTING[policy]), cost_model(cost),
                               lambda: KVCache(num_blocks, 16, watermark, False, 1024.0),
                               ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward),
                               max_time=max_time)
    finally:
        native_core.core = before
    return requests, recorder


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(ADMITTING)), st.sampled_from(["linear", "vidur", "roofline"]), SPREAD,
       st.integers(12, 160), st.sampled_from([1, 4, 12]), st.sampled_from([1e6, 1e6, 2.0]))
def test_the_compiled_core_gives_stepping_and_the_plain_module_bit_for_bit(native, policy, cost, specs,
                                                                           num_blocks, watermark, max_time):
    compiled = run_with(native, policy, cost, specs, num_blocks, watermark, max_time)
    assert_same_run(run_with(prompt_run, policy, cost, specs, num_blocks, watermark, max_time), compiled)
    assert_same_run(run_with(prompt_run, policy, cost, specs, num_blocks, watermark, max_time, fast_forward=False),
                    compiled)


def test_the_compiled_core_is_the_one_that_runs(native, monkeypatch):
    from cbsim.sim import step_apply

    made = []
    commit = step_apply.commit_prompt_run
    monkeypatch.setattr(step_apply, "commit_prompt_run", lambda replica, run: (made.append(type(run)), commit(replica, run)))
    specs = [(0.0, 150, 60), (0.05, 90, 40), (0.3, 120, 30), (0.6, 40, 80)]
    compiled = run_with(native, "sarathi", "vidur", specs, 120, 1, 1e6)
    assert made and all(kind.__module__ == native.__name__ for kind in made)
    assert_same_run(run_with(prompt_run, "sarathi", "vidur", specs, 120, 1, 1e6), compiled)


def test_a_failed_build_says_what_mypyc_said(monkeypatch, tmp_path):
    failed = SimpleNamespace(returncode=1, stdout="", stderr="No module named mypyc\n")
    monkeypatch.setattr(native_core.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match="No module named mypyc"):
        native_core.build(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_interrupted_or_damaged_build_is_never_loaded(tmp_path, monkeypatch):
    """install() writes each file atomically and the stamp last; check_build refuses a folder whose
    stamp is missing or whose file was cut short, before anything is imported (a truncated library
    ends the process with SIGBUS at import, issue 26 defect 8)."""
    built = tmp_path / "built"
    built.mkdir()
    library = built / f"{native_core.NATIVE}.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    target = tmp_path / "target"
    target.mkdir()
    written = native_core.install([library], target)
    assert [p.name for p in written] == [library.name, native_core.STAMP]
    assert native_core.check_build(target) is None
    assert not [p for p in target.iterdir() if p.name.endswith(".tmp")]
    copy = target / library.name
    copy.write_bytes(copy.read_bytes()[:1000])  # an interrupted copy under the final name
    assert "cut short" in native_core.check_build(target)
    (target / native_core.STAMP).unlink()
    assert "interrupted build" in native_core.check_build(target)
    monkeypatch.setattr(native_core, "built_folder", lambda: target)
    monkeypatch.setattr(native_core.importlib, "import_module", lambda name: 1 / 0)  # never reached
    with pytest.warns(UserWarning, match="interrupted build"):
        assert native_core.load() is prompt_run
