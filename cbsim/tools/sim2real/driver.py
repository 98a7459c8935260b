"""Replay a workload on the tiny real vLLM engine, in this process, on a wall clock.

The engine is vLLM's LLMEngine with its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
so recorder.StepRecorder can wrap it): the tiny Llama of tiny_llama/config.json with random weights
(load_format dummy: nothing is downloaded), no tokenizer (token-id prompts), synchronous scheduling.
The entry script that calls `start_engine` needs an `if __name__ == "__main__":` guard (vLLM may spawn).

`replay` adds each request when the wall clock passes its send time (between engine steps, as a server's
engine loop takes new requests): its arrival, or, for closed-loop clients, when its client may send it
(senders.py, cbsim's own client rule), with `ignore_eos` and `max_tokens` = its output length, and notes when
each output token comes out of a step. A request's TTFT is its first token's time less its arrival,
its ITLs the gaps between its tokens, its E2E the last token's time less its arrival: what `vllm bench
serve` measures at the client, without the HTTP and detokenizing path (there is none here).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from cbsim.bench_result import latency_stats

from cbsim.tools.sim2real.engine_flags import EngineFlags
from cbsim.tools.sim2real.senders import senders
from cbsim.tools.sim2real.vllm_scheduler import TINY_MODEL, offline_hub


@dataclass(frozen=True)
class RealRequest:
    arrival: float  # seconds from the replay's start
    prompt: list[int]  # token ids
    output_len: int


@dataclass
class Served:
    """One request's measured times (seconds from the replay's start)."""

    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times))


def start_engine(flags: EngineFlags, seed: int = 0):
    """vLLM's LLMEngine, its engine core in this process: the tiny model with random weights (nothing is
    downloaded, the hub is offline), or `flags.model` with its own weights (a GPU deployment's model)."""
    if flags.model is None:
        offline_hub()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(model=flags.model or str(TINY_MODEL), skip_tokenizer_init=True, seed=seed,
                      load_format="dummy" if flags.model is None else "auto",
                      max_model_len=flags.max_model_len, max_num_batched_tokens=flags.max_num_batched_tokens,
                      max_num_seqs=flags.max_num_seqs, long_prefill_token_threshold=flags.long_prefill_token_threshold,
                      block_size=flags.block_size, enable_prefix_caching=flags.enable_prefix_caching,
                      num_gpu_blocks_override=flags.num_gpu_blocks_override,
                      gpu_memory_utilization=flags.gpu_memory_utilization, async_scheduling=False)
    return LLMEngine.from_engine_args(args)


def engine_core(engine):
    """The EngineCore of an LLMEngine whose core runs in this process."""
    return engine.engine_core.engine_core


def replay(engine, requests: list[RealRequest], tag: str = "r", clients=None) -> list[Served]:
    """Send every request when it is due (senders.py: at its arrival, or when its closed-loop client may,
    `clients` being the workload's ClientPlan) and step the engine until all have finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sends = senders([r.arrival for r in requests], clients)
    served = [Served(r.arrival, len(r.prompt), r.output_len) for r in requests]
    start = time.perf_counter()
    while sends.left or engine.has_unfinished_requests():
        for sent, i in sends.due(time.perf_counter() - start):
            served[i].arrival = sent
            params = SamplingParams(max_tokens=requests[i].output_len, ignore_eos=True, detokenize=False)
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=requests[i].prompt), params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(sends.next_time, 1e6) - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        done = time.perf_counter() - start
        for out in outputs:
            i = int(out.request_id.rsplit("-", 1)[1])
            got = served[i]
            got.token_times += [done] * (len(out.outputs[0].token_ids) - len(got.token_times))
            if out.finished:
                sends.replied(i, done)
    return served


def bench_json(served: list[Served], label: str, percentiles=(50, 90, 99)) -> dict:
    """The replay in the schema of `vllm bench serve --save-result --save-detailed` (as cbsim writes its
    own: sim/metrics/bench_result.py), so cbsim.tools.compare.measured.load_measured reads it."""
    done = [s for s in served if len(s.token_times) == s.output_len]
    duration = max(s.token_times[-1] for s in done) - min(s.arrival for s in served)
    outputs, prompts = sum(s.output_len for s in done), sum(s.prompt_len for s in done)
    out = {"backend": "vllm", "endpoint_type": "vllm-offline-engine", "label": label, "num_prompts": len(served),
           "duration": duration, "completed": len(done), "failed": len(served) - len(done),
           "total_input_tokens": prompts, "total_output_tokens": outputs,
           "request_throughput": len(done) / duration, "output_throughput": outputs / duration,
           "total_token_throughput": (prompts + outputs) / duration}
    many = [s for s in done if s.output_len > 1]
    samples = {"ttft": [s.ttft for s in done], "tpot": [(s.e2e - s.ttft) / (s.output_len - 1) for s in many],
               "itl": [gap for s in done for gap in s.itls], "e2el": [s.e2e for s in done]}
    for key, values in samples.items():
        out.update(latency_stats(key, np.asarray(values, dtype=np.float64), None, percentiles))
    first = min(s.arrival for s in served)
    out.update(input_lens=[s.prompt_len for s in done], output_lens=[s.output_len for s in done],
               ttfts=[s.ttft for s in done], itls=[s.itls for s in done], latencies=[s.e2e for s in done],
               start_times=[s.arrival - first for s in done], errors=["" for _ in done])
    return out
