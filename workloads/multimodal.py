"""Multimodal requests: where a request's images (encoder inputs) sit in its prompt.

A request's `mm_inputs` are (offset, length) placeholders: `length` prompt tokens from `offset`
that one encoder input fills (policies/encoder.py schedules them). Three sources:

- explicit requests: `mm_inputs: [[offset, length], ...]`;
- traces: a generic CSV/JSONL column `mm_inputs`, parsed by `parse_mm_inputs` (a JSON list of
  [offset, length] pairs, or "offset:length" items separated by spaces; empty: none);
- synthetic workloads: `multimodal: {fraction, images, tokens_per_image, offset}`: each request
  carries `images` images with probability `fraction`, drawn from the run's generator after
  everything else (so every other draw is unchanged); its images are inserted back to back at
  `offset` (or at the end of a shorter text), and its prompt grows by images x tokens_per_image:
  the drawn prompt length is the text's. `offset` counts from the prompt's start, a synthetic
  system prompt (shared_prefix) included: put it at or past the shared prefix, whose blocks are
  hashed as text. A trace's images move back by a system prompt shared_prefix puts in front. Placeholder sizes are the model's: e.g. LLaVA-1.5 gives
  576 tokens per 336 x 336 image (a 24 x 24 patch grid of its ViT-L/14-336, Liu et al. 2023),
  Qwen2-VL 256 per 448 x 448 image (14-pixel patches merged 2 x 2, Wang et al. 2024); no default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cbsim.core import bounds
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require
from cbsim.sim.request import Request

MMInputs = tuple[tuple[int, int], ...]


@dataclass
class MultimodalConfig:
    """Synthetic images in prompts."""

    tokens_per_image: int = option(help="placeholder tokens of one image (the model's: LLaVA-1.5 576, Qwen2-VL 256 "
                                   "for a 448 x 448 image; no default)")
    fraction: float = option(1.0, help="probability that a request carries images (0 < fraction <= 1)")
    images: int = option(1, help="images per request that carries them")
    offset: int = option(0, help="prompt position of the first image (the images follow back to back; a shorter "
                         "text puts them at its end)")

    def validate(self) -> None:
        require(self.tokens_per_image >= 1, "tokens_per_image", "an integer >= 1", self.tokens_per_image)
        require(math.isfinite(self.fraction) and 0 < self.fraction <= 1, "fraction", "a probability in (0, 1]",
                self.fraction)
        require(self.images >= 1, "images", "an integer >= 1", self.images)
        require(self.offset >= 0, "offset", "an integer >= 0", self.offset)


def check_mm_inputs(pairs, prompt_len: int | None, where: str) -> MMInputs:
    """`pairs` as sorted, non-overlapping (offset >= 0, length >= 1) placeholders within the prompt."""
    out = []
    end = 0
    for i, pair in enumerate(pairs):
        ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in pair))
        if not ok:
            raise ConfigError(f"{where}[{i}]", "an [offset, length] pair of integers", pair)
        offset, length = pair
        if offset < end or length < 1:
            raise ConfigError(f"{where}[{i}]", f"offset >= {end} (sorted, not overlapping the previous) and "
                              "length >= 1", list(pair))
        end = offset + length
        if prompt_len is not None and end > prompt_len:
            raise ConfigError(f"{where}[{i}]", f"a placeholder within the prompt of {prompt_len} tokens", list(pair))
        out.append((offset, length))
    return tuple(out)


def parse_mm_inputs(cell, where: str) -> MMInputs | None:
    """A trace cell: a JSON list of [offset, length] pairs (a list already in JSONL), or
    "offset:length" items separated by spaces; empty or missing: None."""
    if cell is None or (isinstance(cell, float) and math.isnan(cell)) or cell == "" or cell == []:
        return None
    if isinstance(cell, str):
        text = cell.strip()
        try:
            pairs = bounds.loads(text) if text.startswith("[") else [[int(v) for v in item.split(":")]
                                                                     for item in text.split()]
        except ValueError:
            raise ConfigError(where, "a JSON list of [offset, length] pairs or 'offset:length' items", cell) from None
    else:
        pairs = cell
    if not isinstance(pairs, list):
        raise ConfigError(where, "a list of [offset, length] pairs", cell)
    return check_mm_inputs(pairs, None, where) or None


def add_images(cfg: MultimodalConfig, requests: list[Request], rng: np.random.Generator) -> None:
    """Give each request its images (probability `fraction`), growing its prompt by their placeholders."""
    carries = rng.random(len(requests)) < cfg.fraction
    size = cfg.tokens_per_image
    for req, yes in zip(requests, carries):
        if not yes:
            continue
        start = min(cfg.offset, req.prompt_len)
        req.mm_inputs = tuple((start + k * size, size) for k in range(cfg.images))
        req.prompt_len += cfg.images * size
