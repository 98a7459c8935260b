"""Which fitted terms the data identifies: from the Jacobian of the fit's residuals at its end point.

With J (rows x terms, in the optimiser's units) and the residual variance s^2 = 2 cost / (m - p), the
terms' covariance is s^2 (J^T J)^+ (the pseudo-inverse: a flat direction gives no finite error). A term

- is `unmoved` when its column of J is zero: no row's prediction depends on it at the fitted point
  (a launch floor that never binds, collectives on one GPU): its value is whatever the start was;
- is `confounded` with others when it takes part (a component above MEMBER) in a flat direction of J
  (a singular value of J with unit-norm columns below FLAT_RATIO of the largest: the data fixes a
  combination, not each; launches and per-rank collective cost where only TP8's floor binds), or when
  its correlation with another exceeds CONFOUNDED in magnitude;
- is `loose` when its standard error exceeds LOOSE of max(|value|, one optimiser unit: 1 ms, 1 us or a
  factor of 1), so a host term pinned near 0 counts as identified;
- is `at_bound` when it ended on a bound of its physical range: the data wanted it further;
- else `identified`.

The condition number of J with unit-norm columns says how close the terms come to trading off.
"""
from __future__ import annotations

import numpy as np

CONFOUNDED = 0.95  # |correlation| above which two terms are reported as one combination
LOOSE = 0.1  # standard error over max(|value|, 1 unit) above which a term is reported as loose
FLAT = 1e-12  # column norm (relative to the largest) below which a term moves nothing
FLAT_RATIO = 1e-4  # singular value (relative to the largest, unit-norm columns) of a direction the data cannot see
MEMBER = 0.2  # a term's share of a flat direction above which it takes part in it


def identification(jac: np.ndarray, names, x: np.ndarray, cost: float, lower, upper) -> dict:
    """{condition_number, terms: {name: {status, se (optimiser units), correlated: [(name, r)]}}}."""
    jac = np.atleast_2d(np.asarray(jac, dtype=float))
    m, p = jac.shape
    norms = np.linalg.norm(jac, axis=0)
    moved = norms > FLAT * max(norms.max(initial=0.0), 1e-300)
    condition, flat = _flat_directions(jac, norms, moved)
    cov = _covariance(jac, cost, m, p, {i for group in flat for i in group} | set(np.flatnonzero(~moved)))
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    with np.errstate(divide="ignore", invalid="ignore"):
        corr = cov / np.outer(se, se)
    terms = {}
    for i, name in enumerate(names):
        partners = [(names[j], round(float(corr[i, j]), 3)) for j in range(p)
                    if j != i and moved[i] and moved[j] and abs(corr[i, j]) > CONFOUNDED]
        partners += [(names[j], None) for group in flat if i in group for j in group
                     if j != i and names[j] not in dict(partners)]
        terms[name] = {"status": _status(i, x, se, moved, partners, lower, upper), "se": float(se[i]),
                       "correlated": partners}
    out = {"condition_number": condition, "terms": terms}
    if m < p:
        out["underdetermined"] = f"{m} measured values for {p} terms: at most {m} combinations of them are identified"
    return out


def _flat_directions(jac: np.ndarray, norms: np.ndarray, moved: np.ndarray) -> tuple[float, list]:
    """(condition number of J with unit-norm columns, [term indices of each flat direction])."""
    index = np.flatnonzero(moved)
    if not index.size:
        return float("inf"), []
    _, singular, vt = np.linalg.svd(jac[:, index] / norms[index], full_matrices=True)
    singular = np.concatenate([singular, np.zeros(len(index) - len(singular))])  # fewer rows than terms: flat
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else float("inf")
    flat = [[int(index[j]) for j in np.flatnonzero(np.abs(v) > MEMBER)]
            for s, v in zip(singular, vt) if s < FLAT_RATIO * singular[0]]
    return condition, [group for group in flat if len(group) > 1]


def _covariance(jac: np.ndarray, cost: float, m: int, p: int, unseen: set) -> np.ndarray:
    """s^2 (J^T J)^-1 over the terms the data sees (the others: infinite variance, no correlation)."""
    seen = [i for i in range(p) if i not in unseen]
    cov = np.zeros((p, p))
    cov[list(unseen), list(unseen)] = np.inf
    if seen:
        sub = jac[:, seen]
        cov[np.ix_(seen, seen)] = 2.0 * cost / max(m - p, 1) * np.linalg.pinv(sub.T @ sub)
    return cov


def _status(i: int, x, se, moved, partners, lower, upper) -> str:
    if not moved[i]:
        return "unmoved"
    span = max(abs(upper[i] - lower[i]), 1.0) if np.isfinite(upper[i]) else 1.0
    if x[i] <= lower[i] + 1e-9 * span or (np.isfinite(upper[i]) and x[i] >= upper[i] - 1e-9 * span):
        return "at_bound"
    if partners:
        return "confounded"
    if se[i] > LOOSE * max(abs(x[i]), 1.0):
        return "loose"
    return "identified"


def warnings_of(report: dict) -> list[str]:
    """One line per term that is not identified, naming why."""
    out = [report["underdetermined"]] if "underdetermined" in report else []
    for name, t in report["terms"].items():
        if t["status"] == "identified":
            continue
        why = {"unmoved": "no measured step depends on it at the fitted point: its value is not from the data",
               "at_bound": "it ended on a bound of its physical range: the data pulls it further",
               "loose": f"its standard error ({t['se']:.3g} in fit units) is large against its value",
               "confounded": "the data fixes it only together with " + ", ".join(
                   n if r is None else f"{n} (r = {r:+.2f})" for n, r in t["correlated"])}[t["status"]]
        out.append(f"{name}: {t['status']}: {why}")
    return out


def droppable(report: dict, names) -> dict:
    """{term: why} of the terms a refit should leave at their base values: those no row depends on
    (unmoved), and in each group the data fixes only together (a flat direction), every member but the
    first in `names` order (the caller's --fit order says which term carries the combination)."""
    out = {}
    for name in names:
        t = report["terms"][name]
        if t["status"] == "unmoved":
            out[name] = "no measured step depends on it"
        elif t["status"] == "confounded":
            flat = [n for n, r in t["correlated"] if r is None]
            first = min([name, *flat], key=list(names).index)
            if flat and first != name:
                out[name] = f"the data fixes it only together with {first}, which carries the combination"
    return out
