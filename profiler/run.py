"""The profiling pipeline: check the backend, build the layer replicas, measure every batch, write rows.

`run_profile(config)` is the one entry point (the CLI and the GPU job call it). It allocates
everything once (R replicas of the layer weights, each with its own paged KV cache filled with
random data; an LM head; a RoPE table), checks a non-reference backend against sdpa, measures the
device's ceilings, then walks the run order (grid.run_order). For each batch it builds a fresh
page layout and random inputs, times one layer per sample, rotating over the replicas so weights
and KV come from memory as in a real forward, times the LM head, and for a decode-only batch on a
GPU also times the replicas captured as one CUDA graph. Each row is written as soon as the batch is
measured; the run stops cleanly before a batch once `max_seconds` have passed since it began.
"""
from __future__ import annotations

import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require

from cbsim.profiler.backends import BackendMismatch, check_backend, make_backend
from cbsim.profiler.grid import Batch, named_grid, read_batches, run_order
from cbsim.profiler.layer import (batch_lengths, build_layout, decoder_layer, layer_bytes, layer_flops, layer_shape,
                    lm_head, pages_needed, random_cache, random_lm_head, random_weights, rope_table)
from cbsim.profiler.measurements import COLUMNS, CsvAppender, git_revision, measurement_row, write_json
from cbsim.profiler.timing import (beyond_ceilings, capture_graph, measure_ceilings, sample_calls, summarize,
                     time_plan)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ProfileConfig:
    out: str = option(help="output folder (measurements.csv, metadata.json, overhead.csv)")
    device: str = option("cpu", help="torch device: cpu, cuda or cuda:N")
    model: str = option("tiny", help="per-GPU layer shape: llama-3-8b, llama-3-70b-tp2/4/8, tiny")
    backend: str = option("sdpa", help="attention backend: sdpa, torch, flash_attn, flashinfer")
    grid: str | None = option("tiny", help="named grid (tiny, h200-8b), or null for held-out batches only")
    batches: str | None = option(None, help="JSONL file of held-out batch shapes, spread through the run")
    max_seconds: float | None = option(None, help="stop cleanly before a batch once this many seconds passed")
    dtype: Literal["bfloat16", "float16", "float32"] = option("bfloat16", help="weights, activations and KV")
    page_size: int | None = option(None, help="KV page size in tokens; default 16 or the backend's multiple")
    replicas: int | None = option(None, help="layer replicas rotated per sample; default 1 on cpu, 4 on cuda")
    warmup: int = option(3, help="untimed calls before the samples (at least 3)")
    repeats: int = option(10, help="timed samples per batch (at least 10)")
    graphs: bool = option(True, help="also time decode-only batches as a CUDA graph (GPU only)")
    check: bool = option(True, help="check a non-sdpa backend against sdpa before timing")
    seed: int = option(0, help="seed of the run's random generator")
    threads: int | None = option(None, help="torch CPU threads during the run; default 1 on cpu (steady "
                                 "timings on shared cores), torch's own on cuda")

    def validate(self) -> None:
        require(self.warmup >= 3, "warmup", "at least 3", self.warmup)
        require(self.repeats >= 10, "repeats", "at least 10", self.repeats)
        require(self.replicas is None or self.replicas >= 1, "replicas", "at least 1", self.replicas)
        require(self.threads is None or self.threads >= 1, "threads", "at least 1", self.threads)
        require(self.page_size is None or self.page_size >= 1, "page_size", "at least 1", self.page_size)
        require(self.max_seconds is None or self.max_seconds > 0, "max_seconds", "a positive number",
                self.max_seconds)
        require(self.grid is not None or self.batches is not None, "grid", "a grid name when no batches file is given")


@dataclass
class ProfileResult:
    out: Path
    rows: int
    batches_measured: int
    batches_planned: int
    stop_reason: str
    wall_s: float
    metadata: dict = field(repr=False, default_factory=dict)


@dataclass
class Rig:
    """Everything allocated once per run."""

    shape: object
    device: torch.device
    dtype: torch.dtype
    backend: object
    weights: list
    caches: list
    head: object
    rope: tuple
    page_size: int
    num_pages: int
    gen: torch.Generator
    graph_error: str | None = None  # set when a capture failed: graphs are off for the rest of the run


def resolve_device(name: str) -> torch.device:
    """A torch device this machine has; ConfigError otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError("device", "cpu, cuda or cuda:N", name) from err
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("device", "cpu, cuda or cuda:N", name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "a device this machine has (torch sees no CUDA device)", name)
    return device


def plan_batches(config: ProfileConfig, rng: np.random.Generator):
    """(run order, grid or None, held-out batches skipped for exceeding the grid's limits)."""
    grid = named_grid(config.grid, rng) if config.grid is not None else None
    heldout = read_batches(config.batches) if config.batches is not None else []
    if grid is not None:
        keep = [b for b in heldout if b.kv_tokens <= grid.max_kv_tokens and b.max_ctx <= grid.max_context]
        skipped = len(heldout) - len(keep)
        heldout = keep
    else:
        skipped = 0
    return run_order(grid, heldout, rng), grid, skipped


def build_rig(config: ProfileConfig, device, order: list[Batch], gen: torch.Generator) -> Rig:
    """Allocate the replicas, their KV caches (sized for the largest batch), the LM head, RoPE."""
    dtype = DTYPES[config.dtype]
    shape = layer_shape(config.model)
    backend = make_backend(config.backend, shape, device, dtype)
    page = config.page_size or max(16, backend.page_multiple)
    if page % backend.page_multiple:
        raise ConfigError("page_size", f"a multiple of {backend.page_multiple} for {backend.name}", page)
    replicas = config.replicas or (4 if device.type == "cuda" else 1)
    num_pages = max(pages_needed(batch_lengths(b.prefill, b.decode)[1], page) for b in order)
    _check_memory(shape, device, dtype, replicas, num_pages * page)
    weights = [random_weights(shape, gen, device, dtype) for _ in range(replicas)]
    caches = [random_cache(shape, num_pages, page, gen, device, dtype) for _ in range(replicas)]
    max_pos = max(b.max_ctx for b in order)
    return Rig(shape, device, dtype, backend, weights, caches, random_lm_head(shape, gen, device, dtype),
               rope_table(shape, max_pos, device), page, num_pages, gen)


def _check_memory(shape, device, dtype, replicas: int, kv_tokens: int) -> None:
    if device.type != "cuda":
        return
    size = torch.finfo(dtype).bits // 8
    need = replicas * (shape.layer_params * size + kv_tokens * shape.kv_bytes_per_token(size))
    need += shape.vocab * shape.hidden * size
    free = torch.cuda.mem_get_info(device)[0]
    if need > 0.8 * free:
        raise ConfigError("replicas", f"fewer replicas or smaller batches: {need / 1e9:.1f} GB needed, "
                          f"{free / 1e9:.1f} GB free", replicas)


def _randn(rig: Rig, *dims) -> torch.Tensor:
    return torch.randn(dims, generator=rig.gen, device=rig.device).to(rig.dtype)


def measure_batch(rig: Rig, config: ProfileConfig, batch: Batch, rng: np.random.Generator):
    """Time one batch: [(graph, Summary)] for its rows, the LM head median, the plan median."""
    q_lens, kv_lens = batch_lengths(batch.prefill, batch.decode)
    layout = build_layout(q_lens, kv_lens, rig.page_size, rig.num_pages, rig.backend.contiguous_kv,
                          rng, rig.device)
    plan_s = time_plan(lambda: rig.backend.plan(layout), 3, rig.device)
    meta = rig.backend.plan(layout)
    x = _randn(rig, layout.num_tokens, rig.shape.hidden)
    calls = [partial(decoder_layer, rig.shape, x, w, cache, layout, rig.backend, meta, rig.rope)
             for w, cache in zip(rig.weights, rig.caches)]
    timings = [(False, summarize(sample_calls(calls, config.warmup, config.repeats, rig.device)))]
    last = _randn(rig, layout.num_seqs, rig.shape.hidden)
    head = sample_calls([partial(lm_head, rig.shape, last, rig.head)], config.warmup, config.repeats, rig.device)
    if _use_graph(rig, config, batch):
        try:
            timings.append((True, _graph_timing(rig, config, calls)))
        except RuntimeError as err:
            rig.graph_error = str(err).splitlines()[0]
            _log(f"CUDA graph capture failed, graphs off from here: {rig.graph_error}")
    return timings, summarize(head).median, plan_s


def _use_graph(rig: Rig, config: ProfileConfig, batch: Batch) -> bool:
    return (config.graphs and rig.device.type == "cuda" and rig.backend.supports_graph
            and rig.graph_error is None and batch.is_decode_only)


def _graph_timing(rig: Rig, config: ProfileConfig, calls):
    """All replicas in one CUDA graph; a sample is one replay divided by the number of layers."""
    def stack():
        for call in calls:
            call()

    graph = capture_graph(stack)
    samples = sample_calls([graph.replay], config.warmup, config.repeats, rig.device, per_call=len(calls))
    del graph
    return summarize(samples)


def batch_rows(rig: Rig, ceilings, batch_id: int, batch: Batch, timings, lm_head_s: float) -> list[dict]:
    """The CSV rows of one measured batch (one per timing: eager, and graph when measured)."""
    size = torch.finfo(rig.dtype).bits // 8
    flops = layer_flops(rig.shape, batch.prefill, batch.decode)
    nbytes = layer_bytes(rig.shape, batch.prefill, batch.decode, size)
    return [measurement_row(batch_id, batch.source, batch.prefill, batch.decode, t, lm_head_s, graph,
                            flops, nbytes, beyond_ceilings(flops, nbytes, t.median, ceilings))
            for graph, t in timings]


def environment(device: torch.device) -> dict:
    """Machine, driver and library versions for the metadata."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "cpu": _cpu_name(), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}", driver=_driver_version())
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _log(message: str) -> None:
    print(f"[profile] {message}", file=sys.stderr, flush=True)


def run_profile(config: ProfileConfig, clock=time.monotonic) -> ProfileResult:
    """Run the whole pipeline into config.out; see the module docstring. `clock` paces max_seconds.
    torch's CPU thread count is set for the run (config.threads; 1 on cpu by default) and restored after it."""
    threads = torch.get_num_threads()
    wanted = config.threads or (1 if config.device.startswith("cpu") else None)
    if wanted is not None:
        torch.set_num_threads(wanted)
    try:
        return _run(config, clock)
    finally:
        torch.set_num_threads(threads)


def _run(config: ProfileConfig, clock) -> ProfileResult:
    start = clock()
    device = resolve_device(config.device)
    rng = np.random.default_rng(config.seed)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
    order, grid, skipped = plan_batches(config, rng)
    rig = build_rig(config, device, order, gen)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _metadata(config, rig, grid, len(order), skipped)
    write_json(out / "metadata.json", meta)
    meta["check"] = _check(config, rig, rng, out, meta)
    ceilings = measure_ceilings(device, rig.dtype, gen)
    meta["ceilings"] = asdict(ceilings)
    write_json(out / "metadata.json", meta)
    progress = {"stop_reason": "error", "batches_measured": 0, "rows": 0}
    try:
        _measure_all(rig, config, order, rng, out, ceilings, meta["failed_batches"], progress,
                     lambda: clock() - start)
    except BaseException as err:
        kind = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "error"
        progress["stop_reason"] = f"{kind}: {type(err).__name__}: {err}"
        raise
    finally:
        meta.update(progress, finished=_now(), wall_s=clock() - start, graph_error=rig.graph_error)
        write_json(out / "metadata.json", meta)
    return ProfileResult(out, progress["rows"], progress["batches_measured"], len(order),
                         progress["stop_reason"], clock() - start, meta)


def _measure_all(rig, config, order, rng, out: Path, ceilings, failed: list, progress: dict, elapsed) -> None:
    """Measure batches in order, appending rows at once; keeps `progress` (stop reason, counts) current."""
    with CsvAppender(out / "measurements.csv", COLUMNS) as rows, \
            CsvAppender(out / "overhead.csv", ("batch_id", "plan_s")) as overhead:
        for batch_id, batch in enumerate(order):
            if config.max_seconds is not None and elapsed() >= config.max_seconds:
                progress["stop_reason"] = "max_seconds"
                return
            try:
                timings, lm_s, plan_s = measure_batch(rig, config, batch, rng)
            except torch.cuda.OutOfMemoryError as err:
                failed.append({"batch_id": batch_id, "error": str(err).splitlines()[0]})
                torch.cuda.empty_cache()
                continue
            for row in batch_rows(rig, ceilings, batch_id, batch, timings, lm_s):
                rows.append(row)
            overhead.append({"batch_id": batch_id, "plan_s": plan_s})
            progress.update(batches_measured=progress["batches_measured"] + 1, rows=rows.rows)
            if progress["batches_measured"] % 50 == 0:
                _log(f"{progress['batches_measured']}/{len(order)} batches, {elapsed():.0f} s")
    progress["stop_reason"] = "done"


def _check(config: ProfileConfig, rig: Rig, rng, out: Path, meta: dict) -> dict:
    if rig.backend.name == "sdpa" or not config.check:
        return {"skipped": "sdpa is the reference" if rig.backend.name == "sdpa" else "check disabled"}
    try:
        error = check_backend(rig.backend, rng)
    except BackendMismatch as err:
        meta.update(check={"failed": str(err)}, finished=_now(), stop_reason="check failed")
        write_json(out / "metadata.json", meta)
        raise
    return {"max_error": error, "against": "sdpa in float32"}


def _metadata(config: ProfileConfig, rig: Rig, grid, planned: int, skipped: int) -> dict:
    return {
        "started": _now(), "environment": environment(rig.device),
        "backend": {"name": rig.backend.name, "version": rig.backend.version()},
        "model": asdict(rig.shape), "dtype": config.dtype, "device": str(rig.device),
        "page_size": rig.page_size, "kv_pages_per_replica": rig.num_pages, "replicas": len(rig.weights),
        "warmup": config.warmup, "repeats": config.repeats,
        "graphs": bool(config.graphs and rig.device.type == "cuda" and rig.backend.supports_graph),
        "git_revision": git_revision(), "seed": config.seed, "grid": config.grid, "batches_file": config.batches,
        "grid_max_kv_tokens": grid.max_kv_tokens if grid else None, "batches_planned": planned,
        "heldout_skipped": skipped, "failed_batches": [], "columns": list(COLUMNS), "config": asdict(config),
        "timing": "one layer per sample, replicas rotated; graph rows: all replicas in one graph, "
                  "replay time / replicas; lm_head: final norm + vocab GEMM + argmax for num_seqs rows",
    }


def estimate_seconds(order, shape, config: ProfileConfig, replicas: int, flops_per_s: float = 400e12,
                     bytes_per_s: float = 3.5e12, per_batch_s: float = 0.03, graphs: bool = True) -> float:
    """A roofline guess of a GPU run's length, for sizing grids to the device time."""
    total = 0.0
    runs = config.warmup + config.repeats
    for b in order:
        layer = max(layer_flops(shape, b.prefill, b.decode) / flops_per_s,
                    layer_bytes(shape, b.prefill, b.decode, 2) / bytes_per_s) + 2e-4
        head = 2.0 * shape.vocab * shape.hidden / bytes_per_s + 1e-4
        total += per_batch_s + runs * (layer + head)
        if graphs and b.is_decode_only:
            total += (4 + runs) * replicas * layer
    return total
