"""CPU-side step overhead: scheduling, input preparation, sampling and output processing.

One term shared by the `fitted` and `vidur` cost models: `per_step + per_seq * num_seqs` seconds
of host work per step. With `overlap: false` the host work runs between GPU steps and adds to
the step time; with `overlap: true` (async / zero-overhead scheduling, as in SGLang and vLLM V1)
the host prepares step k+1 while the GPU runs step k, so only the part exceeding the GPU time
shows: max(gpu, cpu) instead of gpu + cpu.

Measured magnitudes (Vidur, MIT; shared/data/vidur/history/6d98aa8/data/profiling/a100/
cpu_overheads.csv, a Sarathi-Serve/vLLM-0.3-style engine on A100, batch sizes 8..128). Sum of the
medians of schedule + prepare_inputs_e2e + sampler_e2e + process_model_outputs, fitted a + b*B by
least squares over the 13 rows of each model:
  Llama-2-7b-hf TP1:  0.790 ms + 42.6 us/seq (1.17 ms at B=8, 6.22 ms at B=128)
  phi-2 TP1:          0.836 ms + 42.1 us/seq
  CodeLlama-34b TP2:  1.405 ms + 43.5 us/seq (1.79 ms at B=8, 6.99 ms at B=128)
  Llama-2-70b-hf TP4: 1.392 ms + 43.0 us/seq
Per sequence, most of it is schedule (~15.5 us) and process_model_outputs (~15.5 us); per step,
the sampler (~0.45-0.5 ms, CPU-bound: its launch time is ~92% of its end-to-end time) and input
preparation (0.26 ms at TP1, ~0.7 ms with TP workers). Ray's worker round trip (ray_comm_time:
~0.5 ms at TP1, ~6 ms at TP>=2) is engine-specific and left out. The older e2d00e9 file
(CodeLlama-34b TP2) gives 0.806 ms + 37.5 us/seq. The A40 host of 6d98aa8 is 2-5x slower.
Modern engines (vLLM V1, SGLang) are faster; these presets are upper-end magnitudes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbsim.schema import option, require

# name -> (per_step seconds, per_seq seconds); see the module docstring for the source rows
PRESETS: tuple[tuple[str, float, float], ...] = (
    ("none", 0.0, 0.0),
    ("vidur-a100-tp1", 0.790e-3, 42.6e-6),
    ("vidur-a100-tp2", 1.405e-3, 43.5e-6),
)
PRESET_NAMES = tuple(name for name, _, _ in PRESETS)


@dataclass(frozen=True)
class CpuOverheadConfig:
    preset: str = option("none", help="measured magnitudes to start from: " + ", ".join(PRESET_NAMES)
                         + " (Vidur cpu_overheads.csv, A100; see profiler/costmodels/cpu_overhead.py)")
    per_step: float | None = option(None, help="seconds of host work per step; overrides the preset")
    per_seq: float | None = option(None, help="seconds of host work per sequence in the batch; overrides the preset")
    overlap: bool = option(False, help="async scheduling: the step takes max(gpu, cpu) instead of gpu + cpu")

    def validate(self) -> None:
        require(self.preset in PRESET_NAMES, "preset", "one of " + ", ".join(PRESET_NAMES), self.preset)
        require(self.per_step is None or self.per_step >= 0, "per_step", "a number >= 0", self.per_step)
        require(self.per_seq is None or self.per_seq >= 0, "per_seq", "a number >= 0", self.per_seq)


@dataclass(frozen=True, slots=True)
class CpuOverhead:
    """Resolved host overhead: seconds per step and per sequence, and whether it overlaps the GPU."""

    per_step: float = 0.0
    per_seq: float = 0.0
    overlap: bool = False

    @classmethod
    def from_config(cls, config: CpuOverheadConfig) -> "CpuOverhead":
        _, step, seq = next(p for p in PRESETS if p[0] == config.preset)
        return cls(
            per_step=step if config.per_step is None else float(config.per_step),
            per_seq=seq if config.per_seq is None else float(config.per_seq),
            overlap=bool(config.overlap),
        )

    def combine(self, gpu: float, num_seqs: int) -> float:
        """Step seconds from GPU seconds (scalar path)."""
        cpu = self.per_step + self.per_seq * num_seqs
        if self.overlap:
            return gpu if gpu >= cpu else cpu
        return gpu + cpu

    def combine_many(self, gpu, num_seqs: int):
        """Step seconds from an array of GPU seconds; element k equals `combine(gpu[k], num_seqs)`."""
        cpu = self.per_step + self.per_seq * num_seqs
        if self.overlap:
            return np.where(gpu >= cpu, gpu, cpu)
        return gpu + cpu

    def describe(self) -> dict:
        return {"per_step": self.per_step, "per_seq": self.per_seq, "overlap": self.overlap}
