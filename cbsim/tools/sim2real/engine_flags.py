"""The tiny real engine's settings, by vLLM's own names; a module of its own so that `cbsim` reads the
defaults for its options without importing the driver."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineFlags:
    """The engine's settings, by vLLM's own names (`vllm serve` flags / EngineArgs fields)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    long_prefill_token_threshold: int = 0
    max_model_len: int = 2048
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only ("No common block size for 16")
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # None: what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.1  # on the CPU backend: the fraction of host memory for weights and KV

    def serve_args(self, num_gpu_blocks: int) -> str:
        """The same settings as `vllm serve` flags, for cbsim's `server:` block."""
        caching = "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"
        return (f"--max-num-batched-tokens {self.max_num_batched_tokens} --max-num-seqs {self.max_num_seqs} "
                f"--long-prefill-token-threshold {self.long_prefill_token_threshold} "
                f"--max-model-len {self.max_model_len} --block-size {self.block_size} {caching} "
                f"--num-gpu-blocks-override {num_gpu_blocks}")
