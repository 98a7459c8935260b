"""One tiny real vLLM engine at a time, started for the settings a workload asks for.

`cbsim sim2real run` serves workloads that may carry their own engine settings (a small KV cache to
preempt, engine_flags.EngineFlags.for_experiment) and `cbsim sim2real grid` needs one engine per
`max_num_batched_tokens`: `Engines.get(flags)` keeps the running engine while the settings are the
same and otherwise shuts it down and starts one with the new settings (in this process, ~30-60 s here).
Each engine's KV block count is read from its own block pool (what vLLM derived from memory, or the
override), never copied by hand: cbsim is configured with it as `--num-gpu-blocks-override`, which
cbsim.server.vllm resolves to the blocks less vLLM's null block.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

from cbsim.tools.sim2real.driver import engine_core, start_engine
from cbsim.tools.sim2real.engine_flags import EngineFlags
from cbsim.tools.sim2real.recorder import StepRecorder


@dataclass
class RealEngine:
    flags: EngineFlags
    engine: object  # vllm LLMEngine, its core in this process
    core: object  # vllm.v1.engine.core.EngineCore
    recorder: StepRecorder

    @property
    def num_blocks(self) -> int:
        """vLLM's KV blocks, its null block included (cbsim.server.vllm resolves the usable ones)."""
        return self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks

    @property
    def server_args(self) -> str:
        """The engine's settings as `vllm serve` flags for cbsim, its real block count included."""
        return self.flags.serve_args(self.num_blocks)


class Engines:
    """Hands out a RealEngine for the settings asked, restarting the engine only when they change."""

    def __init__(self, say=print):
        self.say = say
        self.current: RealEngine | None = None

    def get(self, flags: EngineFlags) -> RealEngine:
        if self.current is not None and self.current.flags == flags:
            return self.current
        self.close()
        engine = start_engine(flags)
        core = engine_core(engine)
        self.current = RealEngine(flags, engine, core, StepRecorder(core))
        self.say(f"engine up: {self.current.num_blocks} KV blocks of {flags.block_size} tokens, "
                 f"max_num_batched_tokens {flags.max_num_batched_tokens}")
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.engine.engine_core.shutdown()
            self.current = None
            gc.collect()
