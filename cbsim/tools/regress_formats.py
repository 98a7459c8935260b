"""`cbsim regress --format json|junit`: the comparison for CI, besides the text table (regress.py).

json: {"passed", "mode", "counts", "notes", "rows": [{experiment, metric, baseline, now, change, verdict,
fails}]}, every row; values in the summary's units (seconds: sim/metrics/summary_units.py).
junit: the JUnit XML that CI systems (GitHub Actions reporters, GitLab, Jenkins) read: one <testsuite>
"cbsim regress", one <testcase> per experiment, a <failure> listing its failing metrics, the experiment's
changed-but-passing metrics in <system-out>.
"""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

from cbsim.tools.regress import Report, Row

FORMATS = ("text", "json", "junit")


def report_json(report: Report) -> str:
    rows = [{"experiment": r.experiment, "metric": r.metric, "baseline": r.baseline, "now": r.now,
             "change": _finite(r.change), "verdict": r.verdict, "fails": report.fails(r)} for r in report.rows]
    return json.dumps({"passed": report.passed, "mode": report.mode, "counts": report.counts(),
                       "notes": report.notes, "rows": rows}, indent=2) + "\n"


def report_junit(report: Report) -> str:
    experiments: dict[str, list[Row]] = {}
    for row in report.rows:
        experiments.setdefault(row.experiment, []).append(row)
    failing = {name for name, rows in experiments.items() if any(report.fails(r) for r in rows)}
    suite = ET.Element("testsuite", name="cbsim regress", tests=str(len(experiments)), failures=str(len(failing)),
                       errors="0", skipped="0")
    for name, rows in experiments.items():
        case = ET.SubElement(suite, "testcase", classname="cbsim.tools.regress", name=name)
        bad = [r for r in rows if report.fails(r)]
        if bad:
            failure = ET.SubElement(case, "failure", message=f"{len(bad)} metric(s) {report.mode} than the baseline"
                                    if report.mode == "worse" else f"{len(bad)} metric(s) changed")
            failure.text = "\n".join(_line(r) for r in bad)
        changed = [r for r in rows if r.verdict != "ok" and not report.fails(r)]
        if changed:
            ET.SubElement(case, "system-out").text = "\n".join(_line(r) for r in changed)
    if report.notes:
        ET.SubElement(suite, "system-out").text = "\n".join(report.notes)
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def _line(row: Row) -> str:
    change = "" if row.change is None else f" ({100 * row.change:+.2f}%)"
    return f"{row.metric}: {row.verdict}, baseline {row.baseline} now {row.now}{change}"


def _finite(value):
    return None if value is None or math.isinf(value) else value
