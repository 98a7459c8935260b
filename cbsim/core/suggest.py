"""'did you mean ...?' for a mistyped name: the closest known names (difflib), for the errors that list
what a key, policy, model, GPU or engine flag could have been."""
from __future__ import annotations

import difflib


def did_you_mean(word, known, prefix: str = "") -> str:
    """'; did you mean 'kv_cache'?' (or two names) when `word` is close to a known name, else ''; `prefix`
    is written before each name ('--' for a flag)."""
    if not isinstance(word, str):
        return ""
    names = [str(name) for name in known]
    close = difflib.get_close_matches(word, names, n=2, cutoff=0.6)
    if not close:
        lowered = {name.lower(): name for name in names}
        close = [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=2, cutoff=0.6)]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(prefix + name) for name in close) + "?"
