"""vLLM V1's own scheduler (vllm.v1.core.sched.scheduler.Scheduler), run standalone on a stream.

No model and no engine: a VllmConfig of the tiny Llama's config.json (tiny_llama/, nothing downloaded,
no tokenizer), a KVCacheConfig with one full-attention group of `num_gpu_blocks` blocks, and a virtual
step clock. Each step: the requests that arrived by now are added, `schedule()` runs, every request
whose prompt the step completes (or that decodes) samples one fake token, and `update_from_output`
applies it, as EngineCore.step does (vllm/v1/engine/core.py). A step that schedules nothing while
requests wait is an error (vLLM would spin). vLLM is imported here, lazily: this module runs only in
an environment that has the engine (.ci/install_vllm_cpu.sh).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cbsim.tools.sim2real.streams import Stream

VLLM_VERSION = "0.32.0"  # the vllm-cpu release the parity test pins (.ci/install_vllm_cpu.sh)
TINY_MODEL = Path(__file__).with_name("tiny_llama")
FAKE_TOKEN = 7  # any id but EOS (2): outputs end by max_tokens (ignore_eos)


@dataclass(frozen=True)
class Step:
    """One scheduled step: its start on the step clock, request index -> tokens scheduled, and the
    requests preempted in it."""

    time: int
    scheduled: dict[int, int]
    preempted: tuple[int, ...] = ()
    # vLLM only: requests admitted in this step whose prefix-cache hit reaches into blocks that another
    # request computes in this same step (allocate_slots caches a chunk's full blocks when it allocates
    # them); cbsim's cache publishes a step's blocks when the step starts, after the plan (a known difference)
    same_step_hits: tuple[int, ...] = field(default=(), compare=False)
    # vLLM only: requests resumed after a preemption whose hit covers blocks of their generated tokens
    # (vLLM hashes and caches every full block, outputs included; cbsim too where Request.output_hashes say)
    output_hits: tuple[int, ...] = field(default=(), compare=False)
    # vLLM only: the step evicted cached prompt blocks cbsim keeps: more of them (vLLM's free queue is one
    # LRU list of free and evictable blocks; cbsim evicts only when no free block is left), or one a request
    # admitted later in the step would have hit (vLLM allocates as it schedules)
    early_eviction: bool = field(default=False, compare=False)
    hits: dict[int, int] = field(default_factory=dict, compare=False)  # vLLM only: admitted request -> tokens hit


def offline_hub() -> None:
    """Nothing may try the network: the model is a local config.json with dummy weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class VllmScheduler:
    """Builds vLLM's Scheduler for a stream's limits and runs the stream through it."""

    def __init__(self):
        offline_hub()
        from vllm.config import ModelConfig

        self._model = {}
        self._model_config = ModelConfig  # built per max_model_len (cached)

    def version(self) -> str:
        from importlib.metadata import version

        return version("vllm-cpu")

    def _config(self, limits):
        from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

        model = self._model.get(limits.max_model_len)
        if model is None:
            model = self._model[limits.max_model_len] = self._model_config(
                model=str(TINY_MODEL), skip_tokenizer_init=True, max_model_len=limits.max_model_len,
                dtype="bfloat16")
        scheduler = SchedulerConfig(max_num_batched_tokens=limits.max_num_batched_tokens,
                                    max_num_seqs=limits.max_num_seqs,
                                    long_prefill_token_threshold=limits.long_prefill_token_threshold,
                                    max_model_len=limits.max_model_len, is_encoder_decoder=False,
                                    enable_chunked_prefill=True, async_scheduling=False)
        cache = CacheConfig(block_size=limits.block_size, enable_prefix_caching=limits.enable_prefix_caching,
                            num_gpu_blocks_override=limits.num_gpu_blocks)
        config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache)
        config.cache_config.num_gpu_blocks = limits.num_gpu_blocks  # what the engine core sets after profiling
        return config

    def _scheduler(self, limits):
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        config = self._config(limits)
        spec = FullAttentionSpec(block_size=limits.block_size, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
        kv = KVCacheConfig(num_blocks=limits.num_gpu_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        return Scheduler(config, kv, StructuredOutputManager(config), block_size=limits.block_size)

    def run(self, stream: Stream, max_steps: int = 100_000) -> list[Step]:
        """Every non-empty step of the stream, until every request finished."""
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        limits = stream.limits
        scheduler = self._scheduler(limits)
        evictions: list[bool] = []
        prompt_hashes: set = set()  # hashes of full prompt blocks: what cbsim's prefix cache holds
        lost: set = set()  # hashes evicted in the current step
        _watch_evictions(scheduler.kv_cache_manager.block_pool, evictions, prompt_hashes, lost)
        hasher = None
        if limits.enable_prefix_caching:
            init_none_hash(sha256)
            hasher = get_request_block_hasher(limits.block_size, sha256)
        pending = sorted(range(len(stream.requests)), key=lambda i: (stream.requests[i].arrival, i))
        steps, now, index = [], 0, 0
        while index < len(pending) or scheduler.has_unfinished_requests():
            while index < len(pending) and stream.requests[pending[index]].arrival <= now:
                i = pending[index]
                req = stream.requests[i]
                params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
                request = Request(str(i), list(req.prompt), params, None, arrival_time=float(req.arrival),
                                  block_hasher=hasher)
                prompt_hashes.update(request.block_hashes)  # at creation: the prompt's full blocks
                scheduler.add_request(request)
                index += 1
            if not scheduler.has_unfinished_requests():
                now = stream.requests[pending[index]].arrival
                continue
            cached = _cached_hashes(scheduler)
            out = scheduler.schedule()
            if out.total_num_scheduled_tokens == 0 or len(steps) >= max_steps:
                raise RuntimeError(f"stream {stream.seed}: vLLM scheduled nothing at step {now} with requests left")
            ids = list(out.num_scheduled_tokens)
            sampled = [[FAKE_TOKEN] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
                       else [] for r in ids]
            steps.append(Step(now, {int(r): n for r, n in out.num_scheduled_tokens.items()},
                              tuple(sorted(int(r) for r in out.preempted_req_ids or ())),
                              _same_step_hits(scheduler, out, cached, limits.block_size),
                              _output_hits(stream, out, limits.block_size),
                              bool(evictions) or _lost_hits(scheduler, out, lost, limits.block_size), _hits(out)))
            evictions.clear()
            lost.clear()
            scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in
                                                                                               enumerate(ids)},
                                                                sampled_token_ids=sampled))
            now += 1
        return steps


def _cached_hashes(scheduler) -> set:
    """The block hashes in vLLM's prefix cache now (BlockPool.cached_block_hash_to_block, keyed by hash and
    KV cache group)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return {get_block_hash(key) for key in scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache}


def _same_step_hits(scheduler, out, cached: set, block_size: int) -> tuple[int, ...]:
    """Requests admitted or resumed by `out` whose hit includes a block that was not cached when the
    step began: a block another request computes in this step."""
    hits = []
    for i, hit in _hits(out).items():
        hashes = scheduler.requests[str(i)].block_hashes[:hit // block_size]
        if any(h not in cached for h in hashes):
            hits.append(i)
    return tuple(hits)


def _lost_hits(scheduler, out, lost: set, block_size: int) -> bool:
    """Whether a request admitted or resumed by `out` stopped short of a prompt block that this step's
    allocations evicted: cbsim's plan takes its hits before the step's evictions, so it hits the block."""
    new = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    new += [(r, n) for r, n in zip(cached.req_ids, cached.num_computed_tokens) if r in cached.resumed_req_ids]
    for r, hit in new:
        hashes = scheduler.requests[r].block_hashes
        if hit // block_size < len(hashes) and hashes[hit // block_size] in lost:
            return True
    return False


def _hits(out) -> dict[int, int]:
    """Tokens each request admitted or resumed by `out` found in the prefix cache (those it hit > 0)."""
    hits = {int(new.req_id): new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    hits.update((int(r), n) for r, n in zip(cached.req_ids, cached.num_computed_tokens) if r in cached.resumed_req_ids)
    return {i: n for i, n in hits.items() if n > 0}


def _output_hits(stream: Stream, out, block_size: int) -> tuple[int, ...]:
    """Requests `out` resumes whose hit reaches past their prompt's full blocks."""
    cached = out.scheduled_cached_reqs
    return tuple(int(r) for r, hit in zip(cached.req_ids, cached.num_computed_tokens)
                 if r in cached.resumed_req_ids
                 and hit > len(stream.requests[int(r)].prompt) // block_size * block_size)


def _watch_evictions(pool, events: list, prompt_hashes: set, lost: set) -> None:
    """Note in `events` every allocation of n blocks that evicts more cached prompt blocks than cbsim
    would: cbsim first takes the blocks it counts as free and evicts only the rest; vLLM takes the first
    n of its one LRU queue. Blocks of generated tokens count as free here although cbsim's parity requests
    now cache them too (output_hashes): the order in which cbsim's LRU leaves and vLLM's queue give up
    output and prompt blocks differs (seed 355 of the 1000: vLLM evicts a prompt block of a preempted
    request that cbsim keeps), and counting only prompt blocks names that an `lru_eviction`.
    `lost` collects the hashes of the cached blocks evicted (the caller clears it every step)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    allocate = pool.get_new_blocks

    def prompt_block(block) -> bool:  # the pool keys blocks by hash + group id
        return block.block_hash is not None and get_block_hash(block.block_hash) in prompt_hashes

    def get_new_blocks(num_blocks: int):
        queue = pool.free_block_queue
        blocks, block = [], queue.fake_free_list_head.next_free_block
        while block is not None and block is not queue.fake_free_list_tail:
            blocks.append(prompt_block(block))
            if len(blocks) <= num_blocks and block.block_hash is not None:
                lost.add(get_block_hash(block.block_hash))  # evicted as it is taken
            block = block.next_free_block
        evicted = sum(blocks[:num_blocks])
        if evicted and evicted > max(0, num_blocks - (len(blocks) - sum(blocks))):
            events.append(True)
        return allocate(num_blocks)

    if pool.enable_caching:
        pool.get_new_blocks = get_new_blocks
