"""An experiment's workload as the real engine takes it: the same requests cbsim simulates, as token ids.

The requests are built exactly as `cbsim run` builds them (the experiment's seed and workload section,
workloads.build_run), so the real replay and the simulation see one request list. A prompt becomes
token ids: each block of its hash chain (prefix_hashes, hash_block_size tokens a block) becomes tokens
drawn from a generator seeded by that hash, so requests sharing a chain share an identical token prefix
(and vLLM's own block hashes see the sharing); the rest of the prompt is drawn from the request's id.
Closed-loop workloads (clients, think times) are not replayed yet: an error says so.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.workloads import build_run, parse_workload

from cbsim.tools.sim2real.driver import RealRequest

FIRST_TOKEN = 3  # ids below are BOS, EOS and padding in Llama-style vocabularies
MASK = (1 << 63) - 1


def experiment_requests(path: Path, vocab: int, max_model_len: int) -> tuple[dict, list[RealRequest]]:
    """(the experiment's workload mapping and seed, its requests as token-id prompts)."""
    cfg = load_config(path)
    try:
        spec = parse_workload(cfg.workload, "workload")
        run = build_run(spec, np.random.default_rng(cfg.seed), Path(path).parent)
    except ConfigError as err:
        raise err.in_file(str(path)) from None
    if run.clients is not None:
        raise ConfigError("workload", "an open-loop workload (the sim2real driver replays arrival times; "
                          "closed-loop clients and think times are not replayed yet)", "closed-loop clients",
                          file=str(path))
    block = spec.hash_block_size
    out = []
    for req in sorted(run.requests, key=lambda r: r.id):
        if req.prompt_len + req.output_len > max_model_len:
            raise ConfigError(f"workload (request {req.id})", f"prompt_len + output_len <= the engine's "
                              f"max_model_len {max_model_len}", req.prompt_len + req.output_len, file=str(path))
        out.append(RealRequest(float(req.arrival), token_prompt(req.id, req.prompt_len, req.prefix_hashes, block,
                                                                  vocab), int(req.output_len)))
    return {"seed": cfg.seed, "workload": cfg_mapping(path)}, out


def cfg_mapping(path: Path) -> dict:
    from cbsim.config import read_yaml

    return read_yaml(path)["workload"]


def token_prompt(request_id: int, prompt_len: int, hashes, block: int | None, vocab: int) -> list[int]:
    """`prompt_len` token ids: one block per hash of the chain, then the request's own tokens."""
    tokens: list[int] = []
    for h in (hashes or ())[:prompt_len // block if block else 0]:
        tokens += np.random.default_rng(int(h) & MASK).integers(FIRST_TOKEN, vocab, size=block).tolist()
    rest = prompt_len - len(tokens)
    tokens += np.random.default_rng([request_id, 1]).integers(FIRST_TOKEN, vocab, size=rest).tolist()
    return tokens
