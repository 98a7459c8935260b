"""One request and its progress.

Invariant: a request's whole progress is `num_computed_tokens` against `num_tokens`
(prompt + generated so far), as in vLLM V1. A new request is far behind, a decode is one
token behind, a prefill chunk advances the counter by the chunk, recompute preemption resets
it to zero. When the counter catches up, the step samples one output token. There is no
prefill/decode flag: `need` says which phase a request is in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: back in the waiting queue with the counter reset
    SWAPPED = 3  # KV on the host: back in the waiting queue with the counter kept
    FINISHED = 4
    REJECTED = 5


@dataclass(slots=True, eq=False)
class Request:
    """A request as the simulator sees it; identity-hashed, mutated only by a replica's commit."""

    id: int
    arrival: float
    prompt_len: int
    output_len: int
    prefix_hashes: tuple[int, ...] | None = None
    # the chain's continuation over the full blocks the request's own output completes (prompt + output),
    # where the workload knows their content (a later prompt repeats them: sim/kv/prefix.py); needs a
    # prefix_hashes that covers every full prompt block. None: its output blocks are not cached
    output_hashes: tuple[int, ...] | None = None
    priority: int = 0  # larger is more important
    tenant: str | None = None  # who sent it (fair sharing, policies/fairness.py); None: no tenant
    adapter: str | None = None  # the LoRA adapter it asks for (policies/lora.py); None: base model
    # encoder inputs (images) in the prompt: (offset, length) placeholders, sorted (policies/encoder.py); None: text
    mm_inputs: tuple[tuple[int, int], ...] | None = None
    session: int | None = None  # its agentic session (agent), for session-affinity routing; None: none
    # progress
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    status: Status = Status.WAITING
    # bookkeeping owned by the replica that runs it
    replica: int = -1
    epoch: int = 0  # bumped on every preemption; a stale step entry carries the old one
    admit_seq: int = -1  # order of the latest admission (victim = last admitted)
    num_blocks: int = 0  # KV blocks held on the GPU
    num_swapped_blocks: int = 0  # KV blocks held on the host
    num_preemptions: int = 0
    first_scheduled: float = math.nan
    first_scheduled_step: int = -1
    first_token_time: float = math.nan
    first_token_step: int = -1
    completion_time: float = math.nan
    reject_reason: str = ""
    # token-run tracking (see recorder.py): the step of the last token and where its run began
    last_token_step: int = -1
    run_start_step: int = -1
    run_tokens: int = 0
    # speculative decoding (sim/speculative.py): verify steps, draft tokens accepted, and the tokens emitted
    # beyond one per step (a token run counts the steps that emitted, these the tokens past the first of each)
    spec_steps: int = 0
    spec_accepted: int = 0
    spec_extra: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output generated so far: what must be in the KV cache to sample the next token."""
        return self.prompt_len + self.num_output_tokens

    @property
    def need(self) -> int:
        """Tokens still to compute before the next output token can be sampled."""
        return self.prompt_len + self.num_output_tokens - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        return self.num_output_tokens >= self.output_len

    @property
    def in_prefill(self) -> bool:
        return self.prompt_len + self.num_output_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0
