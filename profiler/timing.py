"""Timing of device work: warm-up, then one sample per call; CUDA events on a GPU, perf_counter on a CPU.

Invariant: a sample covers exactly one call of the timed function and nothing else. On CUDA the
start and end events are recorded on the stream around the call and read after one final
synchronize, so a sample is the GPU time between them, launch gaps included (an eager layer that is
launch-bound is measured as such). On the CPU torch ops run synchronously and perf_counter brackets
the call. Ceilings (GEMM FLOP/s, copy bytes/s) are measured the same way on the same device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Summary:
    median: float
    p10: float
    p90: float
    repeats: int


def summarize(samples: Sequence[float]) -> Summary:
    """Median and 10th/90th percentiles (linear interpolation) of samples in seconds."""
    a = np.asarray(samples, dtype=np.float64)
    p10, median, p90 = np.percentile(a, [10, 50, 90])
    return Summary(float(median), float(p10), float(p90), len(a))


def sample_calls(fns: Sequence[Callable[[], object]], warmup: int, repeats: int, device: torch.device,
                 per_call: float = 1.0) -> list[float]:
    """Run fns round-robin: `warmup` untimed calls, then `repeats` timed ones; seconds per sample,
    divided by `per_call` (e.g. the number of layers one call runs)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    if device.type == "cuda":
        return _cuda_samples(fns, repeats, per_call)
    out = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        out.append((time.perf_counter() - t0) / per_call)
    return out


def _cuda_samples(fns, repeats: int, per_call: float) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    torch.cuda.synchronize()
    for i in range(repeats):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 / per_call for s, e in zip(starts, ends)]


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """Capture fn in a CUDA graph after warming it up on a side stream (as torch's docs prescribe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_plan(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median host seconds of a per-step planning call (any device work it starts is waited for)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


@dataclass(frozen=True)
class Ceilings:
    flops_per_s: float
    bytes_per_s: float
    gemm_size: int
    copy_bytes: int


def measure_ceilings(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Ceilings:
    """Measured GEMM FLOP/s (square n^3 on random data) and copy bytes/s (read + write) on device.

    On a CPU the FLOP ceiling is the faster of `dtype` and float32: CPUs without native bf16 units
    run a bf16 matmul far slower (~1 GFLOP/s) than the fp32 paths that other kernels of the layer
    take internally (the attention math accumulates in fp32), so a bf16-only ceiling would flag
    honest points as impossible."""
    n, nbytes = (8192, 2**30) if device.type == "cuda" else (512, 2**25)
    dtypes = (dtype,) if device.type == "cuda" or dtype == torch.float32 else (dtype, torch.float32)
    gemm = min(_gemm_seconds(n, d, device, gen) for d in dtypes)
    src = torch.randn((nbytes // 4,), generator=gen, device=device)
    dst = torch.empty_like(src)
    copy = summarize(sample_calls([lambda: dst.copy_(src)], 3, 10, device)).median
    return Ceilings(2.0 * n**3 / gemm, 2.0 * nbytes / copy, n, nbytes)


def _gemm_seconds(n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> float:
    """Median seconds of one n x n x n matmul at `dtype`."""
    a = torch.randn((n, n), generator=gen, device=device).to(dtype)
    b = torch.randn((n, n), generator=gen, device=device).to(dtype)
    return summarize(sample_calls([lambda: a @ b], 3, 10, device)).median


def beyond_ceilings(flops: float, nbytes: float, seconds: float, ceilings: Ceilings, slack: float = 1.1) -> bool:
    """True when a point claims more FLOP/s or bytes/s than the device's measured ceilings allow."""
    if seconds <= 0:
        return True
    return flops / seconds > slack * ceilings.flops_per_s or nbytes / seconds > slack * ceilings.bytes_per_s
