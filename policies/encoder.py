"""Encoder budget for multimodal requests (vLLM V1 `Scheduler._try_schedule_encoder_inputs`).

A request's `mm_inputs` are its image (or other encoder) placeholders in the prompt: (offset, length)
pairs, `length` tokens of the prompt starting at `offset`, each filled by one encoder input whose
encoder produces `length` embeddings. The rules are vLLM V1's (vllm-project/vllm 00024d31 in the
stored index, vllm/v1/core/sched/scheduler.py `Scheduler._try_schedule_encoder_inputs`, and
vllm/v1/core/encoder_cache_manager.py):

- A step that schedules the token range [computed, computed + n) of a request needs the encoder
  output of every input that overlaps it and is neither consumed already (offset + length <=
  computed) nor in the encoder cache (encoded in an earlier step and only partly consumed: a
  running request with offset < computed). Each such input is encoded whole in this step
  ("the encoder input tokens should be processed altogether, as the encoder usually uses
  bidirectional attention").
- Budgets: the encoder input tokens of a step are at most `max_num_encoder_input_tokens` (the
  encoder compute budget), and the encoder cache holds at most `encoder_cache_size` embeddings: the
  outputs of inputs encoded and not yet consumed (an entry is freed once the decoder has computed
  its whole placeholder, `_free_encoder_inputs`, or when its request is preempted).
- An input that does not fit either budget cuts the chunk just before its placeholder (n = offset -
  computed); when the request has computed past the offset already (a prefix-cache hit landing in
  the middle of an image) nothing of it runs this step (n = 0). A running request with n = 0 is
  passed over (`continue`), a waiting one ends the admission scan (`break`).
- `disable_chunked_mm_input`: a chunk that would cover only part of a placeholder it starts before
  stops before it ("a chunk never splits an image").

vLLM raises the compute budget and the cache to the largest item the model can take at start-up
(vllm/multimodal/encoder_budget.py MultiModalBudget); cbsim rejects at arrival a request whose
input exceeds either budget instead (it could never be encoded), and with disable_chunked_mm_input
one whose input exceeds the step's token budget (vLLM's SchedulerConfig check for the same).

Not modelled: vLLM's cross-request reuse of an identical image's encoder output (mm hash), and
remote encoder caches (ECConnector). Encoder time: `seconds_per_token` (no default: it depends on
the encoder and the GPU; `vit_seconds_per_token` derives one from a ViT's size), charged in the
step that encodes (vLLM's GPUModelRunner runs `_execute_mm_encoder` before the decoder's forward,
in the same execute_model call).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from cbsim.core.schema import option, require
from cbsim.sim.request import Request, Status


@dataclass
class EncoderConfig:
    """A step's encoder budget and the encoder's time (vLLM V1's multimodal scheduling)."""

    seconds_per_token: float = option(help="encoder time per encoder input token, added to the step that "
                                      "encodes it (no default: it depends on the encoder and the GPU; a ViT of P "
                                      "parameters costs about 2 P / (peak FLOP/s x MFU), see "
                                      "docs/concepts/step-constraints.md)")
    max_num_encoder_input_tokens: int | None = option(None, help="encoder input tokens one step may encode "
                                                      "(vLLM --max-num-encoder-input-tokens); null = the step's "
                                                      "token budget, vLLM's default")
    encoder_cache_size: int | None = option(None, help="encoder outputs (embeddings) held between encoding and "
                                            "their last use (vLLM encoder_cache_size); null = the compute budget, "
                                            "vLLM's default")
    disable_chunked_mm_input: bool = option(False, help="a chunk that would cover part of an image stops before "
                                            "it (vLLM --disable-chunked-mm-input)")

    def validate(self) -> None:
        require(math.isfinite(self.seconds_per_token) and self.seconds_per_token >= 0, "seconds_per_token",
                "seconds >= 0", self.seconds_per_token)
        for key in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, key)
            require(value is None or value >= 1, key, "an integer >= 1 or null", value)

    def budgets(self, token_budget: int) -> tuple[int, int]:
        """(compute budget, cache size) in tokens, given the step's token budget."""
        compute = self.max_num_encoder_input_tokens or token_budget
        return compute, self.encoder_cache_size or compute


def vit_seconds_per_token(params: float, peak_flops: float, mfu: float) -> float:
    """Compute-bound time per patch token of a ViT with `params` parameters: 2 FLOPs per parameter per
    token (one multiply-add, the dense-transformer rule of Kaplan et al. 2020, attention excluded)
    over `peak_flops` x `mfu`. E.g. Qwen2-VL's 675 M-parameter ViT (Wang et al. 2024, Table 1) on an
    H100 SXM (989 TFLOP/s dense BF16, NVIDIA datasheet) at 40 % MFU: 3.4 us per token."""
    if params <= 0 or peak_flops <= 0 or not 0 < mfu <= 1:
        raise ValueError("params > 0, peak_flops > 0 and 0 < mfu <= 1")
    return 2.0 * params / (peak_flops * mfu)


def encoder_tokens(req: Request) -> int:
    return sum(length for _, length in req.mm_inputs or ())


def cached_tokens(req: Request) -> int:
    """Encoder outputs of a running `req` held in the cache: inputs encoded, partly consumed."""
    if not req.mm_inputs or req.status != Status.RUNNING:
        return 0
    computed = req.num_computed_tokens
    return sum(length for start, length in req.mm_inputs if start < computed < start + length)


class EncoderStep:
    """One step's encoder budget, consumed as the builder schedules (BatchBuilder.fit_encoder)."""

    def __init__(self, config: EncoderConfig, token_budget: int, running: Iterable[Request]):
        self.config = config
        self.compute_left, cache = config.budgets(token_budget)
        self.cache_free = cache - sum(map(cached_tokens, running))
        self.tokens = 0  # encoder input tokens scheduled in this step

    def fit(self, req: Request, computed: int, n: int, running: bool) -> tuple[int, int]:
        """(tokens of `req` that may run from `computed`, at most n; encoder input tokens they need)."""
        end = computed + n
        need = 0
        for start, length in req.mm_inputs:
            if start >= end:
                break
            if start + length <= computed or (running and start < computed):
                continue  # consumed, or in the encoder cache
            if self.config.disable_chunked_mm_input and computed < start and end < start + length:
                return start - computed, need
            if need + length > self.compute_left or need + length > self.cache_free:
                return (start - computed if computed < start else 0), need
            need += length
        return n, need

    def take(self, tokens: int) -> None:
        self.compute_left -= tokens
        self.cache_free -= tokens
        self.tokens += tokens

    def release(self, req: Request) -> None:
        """`req` is preempted in this plan: its cache entries are freed."""
        self.cache_free += cached_tokens(req)

    @property
    def seconds(self) -> float:
        return self.tokens * self.config.seconds_per_token


def encoder_reject_reason(config: EncoderConfig, req: Request, token_budget: int, cap: int | None,
                          chunks: bool = True) -> str:
    """Why `req`'s encoder inputs could never be scheduled (empty if they can); `cap`: the most tokens
    one request advances in a step; `chunks`: whether the policy may split the prompt at all."""
    if not req.mm_inputs:
        return ""
    for start, length in req.mm_inputs:
        if start < 0 or length < 1 or start + length > req.prompt_len:
            return f"encoder input ({start}, {length}) lies outside the prompt of {req.prompt_len} tokens"
    compute, cache = config.budgets(token_budget)
    largest = max(length for _, length in req.mm_inputs)
    if largest > min(compute, cache):
        return (f"an encoder input of {largest} tokens exceeds the encoder budget (max_num_encoder_input_tokens "
                f"{compute}, encoder_cache_size {cache}); vLLM raises both to the largest item at start-up")
    total = encoder_tokens(req)
    if not chunks and total > min(compute, cache):
        return (f"its encoder inputs total {total} tokens, more than the encoder budget (max_num_encoder_input_tokens "
                f"{compute}, encoder_cache_size {cache}), and this policy runs a prompt whole, in one step")
    chunk = min(token_budget, cap) if cap is not None else token_budget
    if config.disable_chunked_mm_input and largest > chunk:
        return (f"an encoder input of {largest} tokens exceeds the {chunk} tokens a step may schedule for one "
                "request, and disable_chunked_mm_input forbids splitting it")
    return ""
