"""StepShape: everything about one forward step that costs time, and nothing else.

The cost model sees only this record; it never sees requests. A prefill row is a pair (c, h):
c new tokens attending to h tokens already in the KV cache. A decode row is its context
length: the number of tokens the single new token attends to, itself included (h + 1).
Padding rows (static batching keeps finished requests in the batch) cost like decode rows
but produce no token. `extra_seconds` is time the step spends beside the decoder (a multimodal
encoder, LoRA adapter loads), priced by the policy that planned it, not by the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()
    num_padding: int = 0  # how many of the decode rows are padding
    tokens_sampled: int = 0
    kv_swap_bytes: float = 0.0  # KV moved between host and GPU in this step
    encoder_tokens: int = 0  # multimodal encoder input tokens encoded in this step (policies/encoder.py)
    # seconds of work beside the decoder's forward in this step (encoder, LoRA loads: StepPlan.extra_seconds),
    # which the step's time adds to what the cost model prices from the rest of the shape
    extra_seconds: float = 0.0

    @classmethod
    def from_batch(
        cls,
        prefill: Iterable[tuple[int, int]] = (),
        decode: Iterable[int] = (),
        kv_swap_bytes: float = 0.0,
    ) -> "StepShape":
        """Build a shape by hand: prefill chunks as (c, h), decode rows as context lengths.

        Every decode row samples a token; a prefill chunk is assumed to finish its prompt.
        """
        prefill = tuple((int(c), int(h)) for c, h in prefill)
        decode = tuple(int(x) for x in decode)
        for c, h in prefill:
            if c <= 0 or h < 0:
                raise ValueError(f"prefill chunk (c={c}, h={h}) needs c > 0 and h >= 0")
        if any(x <= 0 for x in decode):
            raise ValueError("decode context lengths must be positive")
        return cls(prefill, decode, 0, len(prefill) + len(decode), float(kv_swap_bytes))

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for c, _ in self.prefill)

    @property
    def num_decode_tokens(self) -> int:
        """Decode rows that produce a token (padding excluded)."""
        return len(self.decode) - self.num_padding

    @property
    def num_tokens(self) -> int:
        """Tokens pushed through the model's GEMMs, padding rows included."""
        return self.num_prefill_tokens + len(self.decode)

    @property
    def attention_pairs(self) -> float:
        """Causal query-key pairs of the prefill chunks: sum of c * (h + (c + 1) / 2)."""
        return sum(c * (h + (c + 1) / 2) for c, h in self.prefill)

    @property
    def prefill_kv_read(self) -> int:
        """KV tokens the prefill chunks read: sum of h + c."""
        return sum(c + h for c, h in self.prefill)

    @property
    def decode_kv_read(self) -> int:
        """KV tokens the decode rows read: sum of context lengths."""
        return sum(self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode
