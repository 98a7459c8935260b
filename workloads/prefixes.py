"""Synthetic shared prefixes: system prompts and multi-turn conversations, as block hash chains.

Invariant: a request's `prefix_hashes` is a hash chain, one hash per *full* block of
`hash_block_size` tokens of the part of its prompt that other requests can share. Hash j is
block_hash(hash j-1, content id of block j), so two requests share a KV prefix exactly as far as
their chains agree, as with Mooncake's hash_ids. A block's content id names what the block holds:
block j of system prompt p, or block j of conversation c (a conversation only ever appends, so a
block of it holds the same tokens in every later turn). The hash is a fixed 63-bit integer mix,
identical across runs and platforms (Python's own hash() of strings is salted per process).

- system_prompts: each request gets one of K system prompts (uniform or Zipf popularity) in front
  of its own prompt; its chain covers the system prompt's full blocks.
- multi_turn: conversations of T turns; turn k's prompt is turn k-1's prompt + its output + new
  user tokens, arriving a think time after turn k-1 arrived (open loop: the generator cannot know
  when the simulated reply finishes). The whole prompt is shared with the next turn, so the chain
  covers all its full blocks and each turn's chain extends the previous one. Conversations may
  also start with a system prompt (num_prefixes > 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from cbsim.core.schema import option, require
from cbsim.core.units import Seconds

_MASK = (1 << 64) - 1
_SYSTEM, _CONVERSATION, _DATASET_SESSION = 1, 2, 3


@dataclass
class SharedPrefixConfig:
    """Synthetic shared-prefix structure, filling Request.prefix_hashes for prefix-cache policies."""

    mode: Literal["system_prompts", "multi_turn"] = option(
        "system_prompts", help="system_prompts: one of K shared system prompts before each prompt; "
                               "multi_turn: conversations whose turns repeat the whole history")
    num_prefixes: int = option(8, help="number of distinct system prompts K (>= 1; may be 0 in multi_turn)")
    prefix_len: int = option(1024, help="tokens in each system prompt, added in front of the request's own prompt")
    popularity: Literal["uniform", "zipf"] = option(
        "uniform", help="how a request picks its system prompt: uniform, or zipf (prompt of rank r with weight r^-zipf_a)")
    zipf_a: float = option(1.0, help="Zipf exponent of system-prompt popularity (> 0)")
    hash_block_size: int = option(16, help="tokens per hashed block (match the KV cache block size)")
    turns: int = option(4, help="multi_turn: turns per conversation (>= 1); prompt_len draws each turn's new user tokens")
    think_time: Seconds = option(10.0, help="multi_turn: mean seconds (exponential) between a turn's arrival and the "
                                          "next's (open loop; with max_concurrency turns follow replies and "
                                          "workload.think_time)")

    def validate(self):
        least = 1 if self.mode == "system_prompts" else 0
        require(self.num_prefixes >= least, "num_prefixes", f"an integer >= {least}", self.num_prefixes)
        require(self.prefix_len >= (1 if self.num_prefixes else 0), "prefix_len", "a length >= 1", self.prefix_len)
        require(self.zipf_a > 0, "zipf_a", "an exponent > 0", self.zipf_a)
        require(self.hash_block_size >= 1, "hash_block_size", "an integer >= 1", self.hash_block_size)
        require(self.turns >= 1, "turns", "an integer >= 1", self.turns)
        require(self.think_time >= 0, "think_time", "seconds >= 0", self.think_time)


def block_hash(parent: int, content: int) -> int:
    """Hash of a block given the hash of the chain before it (0 at the root) and its content id."""
    return _mix(_mix(parent) ^ content)


def content_id(kind: int, owner: int, index: int) -> int:
    """Content id of block `index` of system prompt or conversation `owner`."""
    return _mix(_mix(_mix(kind) ^ owner) ^ index)


def hash_chain(contents, parent: int = 0) -> tuple[int, ...]:
    """The chain of hashes over blocks with these content ids, starting below `parent`."""
    chain = []
    for content in contents:
        parent = block_hash(parent, content)
        chain.append(parent)
    return tuple(chain)


def choose_prefixes(cfg: SharedPrefixConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """Which system prompt each of n requests (or conversations) uses."""
    if cfg.popularity == "uniform":
        return rng.integers(0, cfg.num_prefixes, size=n)
    weights = np.arange(1, cfg.num_prefixes + 1, dtype=np.float64) ** -cfg.zipf_a
    return rng.choice(cfg.num_prefixes, size=n, p=weights / weights.sum())


def system_prompts(cfg: SharedPrefixConfig, prompt_len: np.ndarray, rng: np.random.Generator):
    """Put a system prompt in front of each prompt: (new prompt lengths, one hash chain per request)."""
    choice = choose_prefixes(cfg, len(prompt_len), rng)
    blocks = cfg.prefix_len // cfg.hash_block_size
    chains = [hash_chain(content_id(_SYSTEM, p, j) for j in range(blocks)) for p in range(cfg.num_prefixes)]
    return prompt_len + cfg.prefix_len, [chains[p] for p in choice]


def multi_turn(cfg: SharedPrefixConfig, starts: np.ndarray, user_len: np.ndarray, output_len: np.ndarray,
               rng: np.random.Generator):
    """Lay n requests out as conversations of cfg.turns turns (the last one may be shorter).

    `starts` holds one start time per conversation; `user_len[i]` and `output_len[i]` belong to
    request i, and conversation c owns requests c*turns .. c*turns + turns - 1. Returns arrays
    (arrival, prompt_len), the hash chains and each request's output hashes (the chain's continuation
    over the full blocks of its prompt + output: the ids its next turn's chain gives them, so an engine
    that caches computed output blocks, as vLLM does, serves them to the next turn), all indexed like
    the inputs.
    """
    n = len(user_len)
    think = rng.exponential(cfg.think_time, n) if cfg.think_time > 0 else np.zeros(n)
    system = choose_prefixes(cfg, len(starts), rng) if cfg.num_prefixes else None
    arrival = np.empty(n)
    prompt = np.empty(n, dtype=np.int64)
    chains: list[tuple[int, ...]] = []
    outputs: list[tuple[int, ...]] = []
    for c, start in enumerate(starts):
        first, last = c * cfg.turns, min((c + 1) * cfg.turns, n)
        sys_len = cfg.prefix_len if system is not None else 0
        chain: list[int] = []
        context, clock = sys_len, float(start)
        for i in range(first, last):
            clock = clock if i == first else clock + think[i]
            arrival[i], prompt[i] = clock, context + user_len[i]
            extend_chain(chain, int(prompt[i]) // cfg.hash_block_size, cfg.hash_block_size, sys_len,
                         None if system is None else int(system[c]), c)
            chains.append(tuple(chain))
            context = int(prompt[i]) + int(output_len[i])
            outputs.append(continuation(chain, context, cfg.hash_block_size, sys_len,
                                        None if system is None else int(system[c]), c))
    return arrival, prompt, chains, outputs


def session_chains(sessions: np.ndarray, prompt_len: np.ndarray, block_size: int) -> list[tuple[int, ...]]:
    """Hash chains of a dataset's conversations whose every prompt extends the session's earlier ones
    (ShareGPT with all turns): block j of session s has one content id in every turn."""
    chains: dict[int, list[int]] = {}
    out = []
    for session, length in zip(sessions.tolist(), prompt_len.tolist()):
        chain = chains.setdefault(session, [])
        for j in range(len(chain), length // block_size):
            chain.append(block_hash(chain[-1] if chain else 0, content_id(_DATASET_SESSION, session, j)))
        out.append(tuple(chain[: length // block_size]))
    return out


def extend_chain(chain: list[int], blocks: int, block_size: int, sys_len: int, system: int | None, conv: int,
                 kind: int = _CONVERSATION) -> None:
    """Grow a conversation's chain to `blocks` blocks; blocks wholly inside the system prompt share its ids
    (`kind`: the content-id kind of the conversation's own blocks; agents use their own, workloads/agentic.py)."""
    for j in range(len(chain), blocks):
        inside_system = system is not None and (j + 1) * block_size <= sys_len
        content = content_id(_SYSTEM, system, j) if inside_system else content_id(kind, conv, j)
        chain.append(block_hash(chain[-1] if chain else 0, content))


def continuation(chain: list[int], tokens: int, block_size: int, sys_len: int, system: int | None, conv: int,
                 kind: int = _CONVERSATION) -> tuple[int, ...]:
    """The hashes `chain` goes on with over the full blocks of the first `tokens` tokens of its context:
    the ones the conversation's next turn gets there (extend_chain names block j by the owner and j), so a
    turn's output hashes (Request.output_hashes) are its next turn's prompt blocks."""
    longer = list(chain)
    extend_chain(longer, tokens // block_size, block_size, sys_len, system, conv, kind)
    return tuple(longer[len(chain):])


def _mix(x: int) -> int:
    """splitmix64 finaliser, truncated to 63 bits so hashes fit a signed int64 column."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1
