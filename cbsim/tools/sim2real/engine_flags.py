"""The tiny real engine's settings, by vLLM's own names; a module of its own so that `cbsim` reads the
defaults for its options without importing the driver.

An experiment may carry its own engine settings as a `server: {engine: vllm, args: "..."}` block (a small
KV cache with `--num-gpu-blocks-override`, another `--max-num-batched-tokens`): `with_args` lays them over
the command's settings, so the same YAML sets the real engine `cbsim sim2real` starts and the engine
`cbsim run` simulates. The flags are read by vLLM's own flag table (cbsim/server/vllm.py), one copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from cbsim.core.errors import ConfigError


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
    model: str | None = None  # None: the tiny Llama (tiny_llama/, random weights); else a model vLLM loads (a GPU's)

    def serve_args(self, num_gpu_blocks: int) -> str:
        """The same settings as `vllm serve` flags, for cbsim's `server:` block."""
        caching = "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"
        return (f"--max-num-batched-tokens {self.max_num_batched_tokens} --max-num-seqs {self.max_num_seqs} "
                f"--long-prefill-token-threshold {self.long_prefill_token_threshold} "
                f"--max-model-len {self.max_model_len} --block-size {self.block_size} {caching} "
                f"--num-gpu-blocks-override {num_gpu_blocks}")

    def with_args(self, args, path: str) -> EngineFlags:
        """These settings with vLLM flags (`server.args`: a string, list or mapping) laid over them.
        ConfigError at `path` for a flag vLLM lacks or one the sim2real engine is not started with."""
        from cbsim.server.flags import read_flags
        from cbsim.server.vllm import ALIASES, FLAGS, IGNORED

        values, _, _ = read_flags(args, FLAGS, IGNORED, ALIASES, path)
        fields = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(self)}
        for name in values:
            if name not in fields:
                raise ConfigError(f"{path} --{name}", "a flag the sim2real engine is started with ("
                                  + ", ".join(f"--{n}" for n in fields) + ")", has_got=False)
        return dataclasses.replace(self, **{fields[k]: v for k, v in values.items()})

    def for_experiment(self, path: Path) -> EngineFlags:
        """These settings with the experiment's own `server:` block (if any) laid over them."""
        from cbsim.config import read_yaml

        server = read_yaml(path).get("server") or {}
        if not isinstance(server, dict) or server.get("engine", "vllm") != "vllm":
            raise ConfigError("server", "a vLLM server block ({engine: vllm, args: ...}): the real engine is vLLM",
                              server, file=str(path))
        try:
            return self.with_args(server.get("args") or "", "server.args")
        except ConfigError as err:
            raise err.in_file(str(path)) from None
