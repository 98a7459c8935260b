"""An experiment's workload as the real engine takes it: the same requests cbsim simulates, as token ids.

The requests are built exactly as `cbsim run` builds them (the experiment's seed and workload section,
workloads.build_run), so the real replay and the simulation see one request list. A prompt becomes
token ids: each block of its hash chain (prefix_hashes, hash_block_size tokens a block) becomes tokens
drawn from a generator seeded by that hash, so requests sharing a chain share an identical token prefix
(and vLLM's own block hashes see the sharing); the rest of the prompt is drawn from the request's id.
A closed-loop workload's client plan (sessions, think times drawn from the seed) comes back as
meta["clients"] for the driver's senders (senders.py); client timeouts are not replayed (an error).
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


def experiment_requests(path: Path, vocab: int, max_model_len: int,
                        workload: dict | None = None) -> tuple[dict, list[RealRequest]]:
    """(the experiment's workload mapping and seed, its requests as token-id prompts); `workload` replaces
    the experiment's workload mapping (a grid point's rate: with_rate)."""
    cfg = load_config(path)
    try:
        spec = parse_workload(cfg.workload if workload is None else workload, "workload")
        run = build_run(spec, np.random.default_rng(cfg.seed), Path(path).parent)
    except ConfigError as err:
        raise err.in_file(str(path)) from None
    if run.clients is not None and run.clients.timeout is not None:
        raise ConfigError("workload.timeout", "no client timeout (the sim2real driver does not abort requests)",
                          run.clients.timeout, file=str(path))
    block = spec.hash_block_size
    out = []
    for req in sorted(run.requests, key=lambda r: r.id):
        if req.prompt_len + req.output_len > max_model_len:
            raise ConfigError(f"workload (request {req.id})", f"prompt_len + output_len <= the engine's "
                              f"max_model_len {max_model_len}", req.prompt_len + req.output_len, file=str(path))
        out.append(RealRequest(float(req.arrival), token_prompt(req.id, req.prompt_len, req.prefix_hashes, block,
                                                                  vocab), int(req.output_len)))
    return {"seed": cfg.seed, "workload": cfg_mapping(path) if workload is None else workload,
            "clients": run.clients}, out


def with_rate(workload: dict, rate: float, path: Path) -> dict:
    """The workload mapping with its arrival rate set to `rate` (arrivals per second)."""
    arrival = workload.get("arrival")
    if not isinstance(arrival, dict) or "rate" not in arrival:
        raise ConfigError("workload.arrival", "an arrival with a rate (poisson, gamma, constant) to set from "
                          "--rates", arrival, file=str(path))
    return {**workload, "arrival": {**arrival, "rate": rate}}


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
