"""Token counts of dataset text: a local HuggingFace tokenizer when one is usable, else an approximation.

Invariant: every count of one run comes from one method, named by `TokenCounter.method`, and
`approximated` says whether that method is the approximation (the run's summary shows it). Nothing
is downloaded: a tokenizer is a local `tokenizer.json` (or a folder holding one) read with the
optional `tokenizers` package (`pip install cbsim[tokenizers]`).

The approximation, used when no tokenizer is named or `tokenizers` is not installed, is
ceil(characters / 4): about four characters per token is the usual rule for English text with BPE
tokenizers (GPT, Llama). It is off by tens of percent for code, other languages and emoji; name a
tokenizer for exact lengths.
"""
from __future__ import annotations

import math
from pathlib import Path

from cbsim.core.errors import ConfigError

CHARS_PER_TOKEN = 4
APPROXIMATION = f"approximation: ceil(characters / {CHARS_PER_TOKEN})"


class TokenCounter:
    """Counts tokens of texts with a tokenizer (`tokenizer` set) or the approximation (None)."""

    def __init__(self, tokenizer=None, method: str = APPROXIMATION):
        self.tokenizer = tokenizer
        self.method = method

    @property
    def approximated(self) -> bool:
        return self.tokenizer is None

    def count(self, texts: list[str]) -> list[int]:
        """Token count of each text (special tokens included, as vLLM's benchmark counts a prompt)."""
        if self.tokenizer is None:
            return [math.ceil(len(text) / CHARS_PER_TOKEN) for text in texts]
        return [len(encoding.ids) for encoding in self.tokenizer.encode_batch(texts)]


def token_counter(name: str | None, base_dir: Path | None, key: str) -> TokenCounter:
    """The counter for `trace.tokenizer`: a local tokenizer.json (or its folder), or the approximation
    when `name` is None or the `tokenizers` package is missing. A named file that does not exist is
    a ConfigError (a typo must not silently fall back to approximate lengths)."""
    if name is None:
        return TokenCounter()
    file = _tokenizer_file(name, base_dir, key)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return TokenCounter(method=f"{APPROXIMATION} (tokenizer {file} not used: the 'tokenizers' package is "
                                   "not installed; pip install cbsim[tokenizers])")
    try:
        return TokenCounter(Tokenizer.from_file(str(file)), method=f"tokenizer {file}")
    except Exception as err:  # the library raises a bare Exception for a malformed file
        raise ConfigError(key, "a HuggingFace tokenizer.json", str(err), file=str(file)) from None


def _tokenizer_file(name: str, base_dir: Path | None, key: str) -> Path:
    given = Path(name).expanduser()
    roots = [given] if given.is_absolute() else [Path(r) / given for r in (base_dir, Path.cwd()) if r is not None]
    for root in roots:
        for candidate in (root, root / "tokenizer.json"):
            if candidate.is_file():
                return candidate
    looked = ", ".join(str(r) for r in roots)
    raise ConfigError(key, f"a local tokenizer.json or a folder holding one (looked in: {looked})", name)
