"""vLLM's custom all-reduce (one-shot / two-shot over NVLink peer memory), as the engine runs it.

vLLM replaces NCCL for a TP all-reduce when its custom kernels apply (vllm-project/vllm
vllm/distributed/device_communicators/custom_all_reduce.py @00d618aa, CustomAllreduce):
  - world size 2, 4, 6 or 8 (`_SUPPORTED_WORLD_SIZES`), all ranks in one node;
  - two GPUs, or every pair fully NVLink-connected (`world_size == 2 or self.fully_connected`; "not
    supported on more than two PCIe-only GPUs");
  - the message strictly below `max_size`, 8192 * 1024 bytes by default (`inp_size < self.max_size`);
    larger messages go to NCCL (pynccl).
The kernel (csrc/custom_all_reduce.cuh @036bb685, CustomAllreduce::allreduce) is one-shot
(`cross_device_reduce_1stage`: every rank reads the whole message from each of the n - 1 peers) for
2 GPUs, for <= 4 GPUs below 512 KiB and for <= 8 GPUs below 256 KiB; otherwise two-shot
(`cross_device_reduce_2stage`: reduce-scatter then all-gather, each rank reading 2 (n - 1) / n of
the message from its peers). It runs on at most 36 blocks of 512 threads (`block_limit = 36`), which
bounds the rate at which a rank pulls peer memory well below the NVLink peak. So

    t(S, n) = a + R(S, n) / B,   R = (n - 1) S (one-shot) or 2 (n - 1) / n S (two-shot)

with a and B fitted (log-ratio least squares) on the only public timings we found, sgl-project/sglang
PR #2904 (vLLM's kernel measured outside CUDA graphs on H100 SXM): 8.7 / 9.2 / 11.8 us at 32 KB and
17.7 / 26.9 / 30.4 us at 512 KB for TP 2 / 4 / 8. a = 7.30 us, B = 43.3 GB/s; errors on those six
points -7.4, +4.0, +6.7, +9.7, -5.3, -6.3 % (one latency and one pull rate for both algorithms: a
separate pair per algorithm fits the two two-shot points exactly and says nothing). Not measured:
  - inside a CUDA graph (where vLLM runs it for graph steps: no launch and no copy into the registered
    buffer, which vLLM's comment puts at <= 1 %); the eager timing is used for both, an upper bound;
  - above 512 KiB. The fit's pull rate would make a multi-MiB two-shot slower than NCCL, which is not
    why vLLM keeps the kernel up to 8 MiB; above the measured range cbsim takes the lower of the fit and
    NCCL (collectives.py), a bound, not a measurement;
  - GPUs other than H100: H200 shares its NVLink 4 and die; A100 and others take H100's constants (their
    error is unknown).
Quick all-reduce (vllm .../quick_all_reduce.py) is ROCm-only (MI300-class) and not modelled; nor is the
symmetric-memory all-reduce of later vLLM releases (VLLM_ALLREDUCE_USE_SYMM_MEM).

Invariant: `custom_allreduce_seconds` is a pure function of Python scalars.
"""
from __future__ import annotations

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)  # CustomAllreduce._SUPPORTED_WORLD_SIZES
VLLM_MAX_BYTES = 8192 * 1024  # CustomAllreduce max_size default
ONE_SHOT_BELOW = {4: 512 * 1024, 8: 256 * 1024}  # world size <= key: one-shot below this many bytes
LATENCY = 7.30e-6  # s, a (fitted on sglang PR #2904, module docstring)
PULL_RATE = 43.3e9  # bytes/s, B
MEASURED_UP_TO = 512 * 1024  # bytes: the largest message of the fitted timings


def applies(size: float, n: int, topology: str, max_bytes: float, within_node: bool) -> bool:
    """Whether vLLM runs its custom kernel (not NCCL) for an all-reduce of `size` bytes on `n` GPUs."""
    if max_bytes <= 0 or n not in SUPPORTED_WORLD_SIZES or not within_node or size >= max_bytes:
        return False
    return n == 2 or topology == "nvswitch"


def one_shot(size: float, n: int) -> bool:
    """The kernel's choice: one-shot for 2 GPUs and small messages, else two-shot."""
    if n == 2:
        return True
    limit = ONE_SHOT_BELOW[4] if n <= 4 else ONE_SHOT_BELOW[8]
    return size < limit


def custom_allreduce_seconds(size: float, n: int) -> float:
    """Fitted time of one custom all-reduce of `size` bytes among `n` GPUs (module docstring)."""
    pulled = (n - 1) * size if one_shot(size, n) else 2.0 * (n - 1) / n * size
    return LATENCY + pulled / PULL_RATE


def engine_allreduce_seconds(size: float, n: int, nccl: float) -> float:
    """The custom kernel's time, bounded by NCCL's (`nccl` seconds) beyond the measured sizes."""
    custom = custom_allreduce_seconds(size, n)
    if size > MEASURED_UP_TO and nccl < custom:
        return nccl
    return custom
