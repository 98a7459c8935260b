"""Random request streams for the scheduler parity test, as both schedulers take them.

A stream is the engine's limits (vLLM's own flag names) and requests on a step clock: request i arrives
at step `arrival` (an integer: with the `unit` cost model every step takes one second, so cbsim's clock
and vLLM's step counter agree), with a prompt of token ids and a fixed number of output tokens
(ignore_eos). Shared prefixes are identical leading token ids, so vLLM's block hashes and cbsim's hash
chains (`prefix_hashes`) see the same sharing. Streams are a pure function of their seed (numpy's PCG64).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

BLOCK_SIZE = 16  # vLLM's --block-size default on CUDA (vllm/config/cache.py); the parity test keeps it
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Limits:
    """vLLM's scheduler flags for one stream (SchedulerConfig / CacheConfig field names)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0  # 0: no cap (vLLM's default)
    num_gpu_blocks: int = 1000  # vLLM's --num-gpu-blocks-override: one of them is vLLM's null block
    enable_prefix_caching: bool = True
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN

    def flags(self) -> dict:
        """The `vllm serve` flags these limits are (cbsim.server.vllm's names, for resolve())."""
        return {"max-num-batched-tokens": self.max_num_batched_tokens, "max-num-seqs": self.max_num_seqs,
                "long-prefill-token-threshold": self.long_prefill_token_threshold,
                "num-gpu-blocks-override": self.num_gpu_blocks, "block-size": self.block_size,
                "enable-prefix-caching": self.enable_prefix_caching, "max-model-len": self.max_model_len}


@dataclass(frozen=True)
class StreamRequest:
    arrival: int  # the step (second) it arrives at
    prompt: tuple[int, ...]  # token ids
    output_len: int  # tokens generated, EOS ignored


@dataclass(frozen=True)
class Stream:
    seed: int
    limits: Limits
    requests: tuple[StreamRequest, ...] = field(default_factory=tuple)


def block_hashes(prompt: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """A hash chain over the prompt's full blocks: hash j names tokens [0, (j + 1) * block_size)."""
    out, digest = [], hashlib.sha256()
    for j in range(len(prompt) // block_size):
        digest.update(np.asarray(prompt[j * block_size:(j + 1) * block_size], dtype=np.int64).tobytes())
        out.append(int.from_bytes(digest.copy().digest()[:8], "little") >> 1)
    return tuple(out)


def random_stream(seed: int, kv_pressure: bool | None = None, prefix_caching: bool | None = None) -> Stream:
    """A stream that exercises chunked prefill, the token and sequence budgets, the per-request cap,
    shared prefixes and, where `kv_pressure` (drawn when None), recompute preemption: the KV cache is
    sized from one request's full length (it must fit alone) up to a few times that. `prefix_caching`:
    vLLM's --enable-prefix-caching (drawn, on in 4 streams of 5, when None)."""
    rng = np.random.default_rng(seed)
    prefixes = [tuple(int(t) for t in rng.integers(3, 4000, size=int(rng.integers(16, 400)))) for _ in range(2)]
    requests, arrival = [], 0
    for _ in range(int(rng.integers(1, 13))):
        arrival += int(rng.choice([0, 0, 1, 2, 5]))
        tail = tuple(int(t) for t in rng.integers(3, 4000, size=int(rng.integers(1, 500))))
        prompt = tail if rng.random() < 0.4 else prefixes[int(rng.integers(2))][:int(rng.integers(1, 400))] + tail
        requests.append(StreamRequest(arrival, prompt, int(rng.integers(1, 24))))
    budget = int(rng.choice([32, 64, 128, 256, 512, 2048]))
    seqs = min(budget, int(rng.choice([1, 2, 4, 8, 16, 128])))
    threshold = int(rng.choice([0, 0, 16, 48, 200]))
    longest = max(-(-(len(r.prompt) + r.output_len) // BLOCK_SIZE) for r in requests)
    pressure = bool(rng.random() < 0.5) if kv_pressure is None else kv_pressure
    blocks = longest + 1 + (int(rng.integers(0, 2 * longest + 1)) if pressure else 4000)
    caching = bool(rng.random() < 0.8)
    limits = Limits(budget, seqs, threshold, blocks, enable_prefix_caching=caching if prefix_caching is None
                    else prefix_caching)
    return Stream(seed, limits, tuple(requests))
