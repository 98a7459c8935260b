"""cbsim's vLLM V1 scheduler on a parity stream: the experiment a `server: {engine: vllm}` block resolves to.

The stream's limits are turned into `vllm serve` flags and resolved by cbsim.server.vllm (one copy of the
flag rules): the policy (sarathi with V1's settings), the KV cache (block size, prefix caching, the
blocks), recompute preemption of the last admitted request. The cost model is `unit` (one second a
step), so step k starts at second k as in the vLLM run; fast-forward is off, so every step is planned
and recorded. The KV cache holds the blocks cbsim.server.vllm resolves `--num-gpu-blocks-override` to
(vLLM's num_gpu_blocks less its null block).
"""
from __future__ import annotations

import math

from cbsim.config import KVCacheConfig
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.server import Context
from cbsim.server import vllm as vllm_server
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate

from cbsim.tools.sim2real.streams import Stream, block_hashes
from cbsim.tools.sim2real.vllm_scheduler import FAKE_TOKEN, Step

KV_KEYS = ("block_size", "watermark", "reserve_full_prompt", "check_full_input")

VERSION = (0, 32)  # server.version the parity test resolves (vllm_scheduler.VLLM_VERSION)


def resolved(stream: Stream, version: tuple[int, ...] | None = VERSION) -> dict:
    """The cbsim settings (dotted keys) `server: {engine: vllm}` gives these limits."""
    limits = stream.limits
    settings, _ = vllm_server.resolve(limits.flags(), Context(None, limits.max_model_len, version), "parity")
    return settings


class _Traced:
    """The policy, keeping every plan with the step's start time."""

    def __init__(self, inner, steps: list):
        self.inner, self.steps = inner, steps
        self.name, self.config = inner.name, inner.config
        self.steady_when_blocked = inner.steady_when_blocked

    def schedule(self, state):
        plan = self.inner.schedule(state)
        if plan.scheduled:
            self.steps.append(Step(int(round(state.now)), dict(plan.scheduled), tuple(sorted(plan.preempted))))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def _request(i: int, r, block_size: int, prefix: bool) -> Request:
    """Stream request `r` as cbsim's request `i`: with prefix caching, the hash chains of its prompt and of
    the full blocks its output completes (vLLM samples FAKE_TOKEN every step, and hashes and caches
    those blocks too: sim/kv/prefix.py)."""
    if not prefix:
        return Request(i, float(r.arrival), len(r.prompt), r.output_len)
    chain = block_hashes(r.prompt + (FAKE_TOKEN,) * r.output_len, block_size)
    split = len(r.prompt) // block_size
    return Request(i, float(r.arrival), len(r.prompt), r.output_len, prefix_hashes=chain[:split],
                   output_hashes=chain[split:] or None)


def run_cbsim(stream: Stream, version: tuple[int, ...] | None = VERSION) -> tuple[list[Step], list[Request]]:
    """Every planned step of the stream under cbsim, and its requests (their end states)."""
    settings = resolved(stream, version)
    policy = {key.split(".", 1)[1]: value for key, value in settings.items() if key.startswith("policy.")}
    limits = stream.limits
    prefix = settings["cluster.kv_cache.prefix_caching"]
    requests = [_request(i, r, limits.block_size, prefix) for i, r in enumerate(stream.requests)]
    units = settings["cluster.kv_cache.num_blocks"]
    kv = KVCacheConfig(**{key.rsplit(".", 1)[1]: value for key, value in settings.items()
                          if key.startswith("cluster.kv_cache.") and key.rsplit(".", 1)[1] in KV_KEYS})
    steps: list[Step] = []
    replica = ReplicaSettings(preemption_mode=settings["preemption.mode"], victim="last_admitted",
                              max_model_len=limits.max_model_len, fast_forward=False)
    simulate(requests, lambda: _Traced(make_policy(policy), steps), load_cost_model({"type": "unit"}),
             lambda: KVCache(units, kv.block_size, int(math.floor(kv.watermark * units)), kv.reserve_full_prompt,
                             prefix_caching=prefix, hash_block_size=limits.block_size,
                             check_full_input=kv.check_full_input),
             replica, max_time=100_000.0)
    return steps, requests
