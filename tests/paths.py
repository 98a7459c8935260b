"""Where the tests find the repository and their own data, wherever a test file sits below tests/."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: golden/, data/, factories.py
ROOT = TESTS.parent  # the repository: experiments/, validation/, README.md, pyproject.toml
