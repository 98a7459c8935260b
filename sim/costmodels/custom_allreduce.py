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

with a and B fitted (log-ratio least squares) on the only public timings we found, the vLLM column of
sgl-project/sglang PR #2904 ("unit test performance in H100 (without cuda graph)"): vLLM's kernel on H100
SXM at TP 2 / 4 / 8 for 512 .. 1,048,576 elements. The test behind it (sgl-kernel/tests/test_trt_reduce.py,
`performance`) reduces float32 tensors of that many elements, so the messages are 2 KiB .. 4 MiB (the
"32768" row, 8.7 / 9.2 / 11.8 us, is 128 KiB; "524288", 17.7 / 26.9 / 30.4 us, is 2 MiB), and it times
5,000 back-to-back launches by wall clock, so the small-message floor includes launch throughput. One pull
rate and one latency per algorithm (the two-shot pays a second, release/acquire barrier and a round through
the temporary buffer): a = 8.79 us (one-shot), 15.26 us (two-shot), B = 249.8 GB/s. Errors on the 18 rows:
median 3.7 %, max 12.7 % (TP8 2 KiB -12.4 %, TP4 128 KiB +12.7 %); one latency for both fits to median
8.5 %, max 24 %. Not measured:
  - inside a CUDA graph (where vLLM runs it for graph steps: no launch, no copy into the registered
    buffer, which vLLM's comment puts at <= 1 %): the timings are upper bounds there, mostly at small sizes;
  - 4 .. 8 MiB (the fit is extrapolated up to vLLM's max_size);
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
ONE_SHOT_LATENCY = 8.79e-6  # s (fitted on sglang PR #2904, module docstring)
TWO_SHOT_LATENCY = 15.26e-6  # s
PULL_RATE = 249.8e9  # bytes/s a rank pulls from its peers


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
    if one_shot(size, n):
        return ONE_SHOT_LATENCY + (n - 1) * size / PULL_RATE
    return TWO_SHOT_LATENCY + 2.0 * (n - 1) / n * size / PULL_RATE
