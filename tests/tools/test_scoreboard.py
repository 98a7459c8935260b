"""`cbsim scoreboard`: cells from rows, the 2-point check (a worse cell fails by name, skipped data is
counted outside CI and fails under --strict), the committed board agrees with a fresh run of the sources
that need no data files, and the validation scripts read the one copy of the published tables."""
from __future__ import annotations

import json
import pytest
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.tools.scoreboard import board as sb
from cbsim.tools.scoreboard import published
from cbsim.tools.scoreboard.sources import Row
from paths import ROOT

BOARD = ROOT / "validation" / "scoreboard.json"


def _row(error: float, phase: str = "decode", source: str = "deepep") -> Row:
    return Row(source, "roofline", "h800", "m", 8, phase, "kernel_s", 1.0, 1.0 + error)


def test_cells_give_median_p90_and_signed_bias():
    cells = sb.cells([_row(e) for e in (-0.1, 0.02, 0.04, 0.3)] + [_row(0.5, "prefill")])
    decode = cells[("deepep", "roofline", "h800", "m", 8, "decode")]
    assert decode["n"] == 4
    assert decode["median_abs"] == pytest.approx(0.07)
    assert decode["bias"] == pytest.approx(0.03)
    assert decode["p90_abs"] == pytest.approx(0.24)
    assert cells[("deepep", "roofline", "h800", "m", 8, "prefill")]["bias"] == 0.5


def test_check_fails_a_cell_that_grew_more_than_two_points():
    key = ("deepep", "roofline", "h800", "m", 8, "decode")
    committed = {key: {"n": 1, "median_abs": 0.10, "p90_abs": 0.1, "bias": 0.1}}
    grown = sb.Board(sb.cells([_row(0.121)]))
    within = sb.Board(sb.cells([_row(0.119)]))
    assert [k for k, _ in sb.check(grown, committed).failures] == [key]
    assert sb.check(within, committed).ok
    assert sb.check(sb.Board(sb.cells([_row(0.05)])), committed).improved == [key]


def test_check_skips_absent_data_outside_ci_and_fails_it_under_strict():
    key = ("splitwise", "roofline+none", "a100", "llama-2-70b", 2, "decode")
    committed = {key: {"n": 1, "median_abs": 0.1, "p90_abs": 0.1, "bias": 0.1}}
    board = sb.Board({}, {"splitwise": "no data"})
    result = sb.check(board, committed)
    assert result.ok and result.skipped == [key]
    assert not sb.check(board, committed, strict=True).ok
    assert not sb.check(sb.Board(), committed).ok  # data present but the cell vanished


def test_committed_board_matches_a_fresh_run_of_the_data_free_sources():
    committed = sb.read(BOARD)
    board = sb.score(None, ["deepep", "vllm-custom-allreduce", "int4-l4"])
    assert board.cells and all(committed[key] == stats for key, stats in board.cells.items())


def test_cli_check_names_the_worse_cell_and_exits_1(tmp_path):
    data = json.loads(BOARD.read_text())
    doctored = [dict(rec, median_abs=max(0.0, rec["median_abs"] - 0.05)) if rec["source"] == "deepep" else rec
                for rec in data["cells"]]
    path = tmp_path / "scoreboard.json"
    path.write_text(json.dumps({**data, "cells": doctored}))
    result = CliRunner().invoke(app, ["scoreboard", "--check", "--board", str(path), "--source", "deepep"])
    assert result.exit_code == 1
    assert "WORSE source=deepep" in result.output
    ok = CliRunner().invoke(app, ["scoreboard", "--check", "--board", str(BOARD), "--source", "deepep"])
    assert ok.exit_code == 0, ok.output


def test_cli_bad_board_and_unknown_source_are_user_errors(tmp_path):
    bad = tmp_path / "board.json"
    bad.write_text("{}")
    assert CliRunner().invoke(app, ["scoreboard", "--check", "--board", str(bad)]).exit_code == 2
    assert CliRunner().invoke(app, ["scoreboard", "--source", "nope"]).exit_code == 2


def test_validation_scripts_read_the_one_copy_of_the_published_tables():
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "validation"))
    try:
        for name, table, attr in (("validate_trtllm_fp8", published.TRTLLM_FP8, "PUBLISHED"),
                                  ("validate_moe", published.MIXTRAL_017, "MIXTRAL"),
                                  ("validate_int4", published.INT4_L4_MS, "PUBLISHED_MS")):
            spec = importlib.util.spec_from_file_location(f"cbsim_{name}", ROOT / "validation" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            assert getattr(module, attr) is table
    finally:
        sys.path.remove(str(ROOT / "validation"))
