"""The scoreboard's sources: each turns one body of public measurements into scored rows
(measured vs what a cost model, with an engine preset, predicts for the same thing).

- splitwise: whole-step times of vLLM (2023) serving Llama-2-70B on a DGX-A100 at TP2 and TP8
  (shared/data/measured; prefill and decode steps, medians per configuration), priced by every step
  cost model that has these kernels (roofline at the row's TP; vidur and fitted with their shipped
  A100 Llama-2-70B TP2 profiles, TP2 rows only), each with no engine and with every engine preset.
- vidur-gemm, vidur-allreduce: Vidur's per-operator tables (shared/data/vidur): the four GEMMs of
  every model file against the roofline's GEMM curve, the single-node all-reduces against its
  collective model (kernel times, no engine).
- deepep: DeepEP's low-latency all-to-all against the roofline's dispatch and combine.
- vllm-custom-allreduce: vLLM's custom all-reduce on H100 (sglang PR #2904's table) against one
  all-reduce as the roofline charges it under the vllm-v1 engine.
- vllm-fused-moe: vLLM's Triton fused_moe on H100 (PR #24700's Mixtral TP2 kernel times) against one MoE
  layer's routed experts as the roofline charges them under the vllm-v1 engine (moe_gemms.py).
- trtllm-fp8, trtllm-0.17: TensorRT-LLM's published offline throughput against whole cbsim runs
  (roofline, engine trtllm): the FP8 table at its published request counts (seconds), v0.17's at
  1 / RUN_SCALE of them (the full table takes minutes; a smaller queue drains sooner, so these cells
  read a few points lower than the full-size rows validation/validate_moe.py prints).
- int4-l4: vLLM's AWQ (Marlin) decode runs on an L4 against whole cbsim runs (default engine).

A source whose data files are absent (CBSIM_DATA unset and no shared/data) yields no rows and says
why; the board counts it as skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cbsim.tools.scoreboard import published as pub

RUN_SCALE = 5  # v0.17's whole runs use 1 / RUN_SCALE of the published request counts (the scripts' `quick`)


@dataclass(frozen=True)
class Row:
    """One measurement and cbsim's prediction of it, in the metric's own unit."""

    source: str
    cost_model: str  # cost model and engine, e.g. roofline+vllm-2023-a100
    gpu: str
    model: str
    tp: int
    phase: str  # prefill, decode, throughput, gemm, allreduce, dispatch, ...
    metric: str  # step_s, tokens_per_s, run_ms, kernel_s
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """Signed relative error predicted / measured - 1."""
        return self.predicted / self.measured - 1.0


CITATIONS = {"splitwise": pub.SPLITWISE, "vidur-gemm": pub.VIDUR + " (mlp.csv)",
             "vidur-allreduce": pub.VIDUR + " (all_reduce.csv)", "deepep": pub.DEEPEP, "vllm-custom-allreduce": pub.CUSTOM_AR,
             "vllm-fused-moe": pub.FUSED_MOE, "trtllm-fp8": pub.TRTLLM,
             "trtllm-0.17": pub.TRTLLM_017, "int4-l4": pub.INT4_L4}
STEP_MODELS = {  # label -> (cost model mapping, the only TP it prices or None for the row's)
    "roofline": ({"type": "roofline", "gpu": "a100"}, None),
    "vidur": ({"type": "vidur", "profile": "a100-llama-2-70b-tp2.json"}, 2),
    "fitted": ({"type": "fitted", "profile": "a100-llama-2-70b-tp2-published.json"}, 2),
}


def splitwise(data: Path | None) -> tuple[list[Row], str | None]:
    """Every step cost model x (no engine, each preset) on the Splitwise steps."""
    path = data.joinpath(*pub.SPLITWISE_CSV) if data else None
    if path is None or not path.is_file():
        return [], f"no {'/'.join(pub.SPLITWISE_CSV)} under CBSIM_DATA"
    from cbsim.profiler.converters.splitwise import read_splitwise
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.costmodels.catalog.lookup import model_spec
    from cbsim.sim.costmodels.engine import preset_names

    steps, _ = read_splitwise(path)
    rows = []
    for label, (mapping, only_tp) in STEP_MODELS.items():
        for engine in ("none", *preset_names()):
            models = {}
            for step in steps:
                if only_tp is not None and step.tp != only_tp:
                    continue
                key = (step.model, step.tp)
                if key not in models:
                    tp = {} if only_tp else {"tp": step.tp}
                    models[key] = load_cost_model({**mapping, **tp, "engine": engine}, model_spec(step.model))
                rows.append(Row("splitwise", f"{label}+{engine}", step.gpu, step.model, step.tp, step.kind, "step_s",
                                step.time_s, models[key].step_time(step.shape)))
    return rows, None


def _vidur_dir(data: Path | None) -> Path | None:
    root = data / "vidur" if data else None
    return root if root is not None and (root / "data" / "profiling").is_dir() else None


def vidur_gemm(data: Path | None) -> tuple[list[Row], str | None]:
    """The roofline's GEMM curve on Vidur's mlp.csv GEMMs (A100, H100)."""
    root = _vidur_dir(data)
    if root is None:
        return [], "no vidur/data/profiling under CBSIM_DATA"
    from cbsim.tools.scoreboard.vidur_tables import gemm_predicted, gemm_rows

    rows = []
    for gpu in ("a100", "h100"):
        table = gemm_rows(root, gpu)
        predicted = gemm_predicted(table, gpu)
        for (model, tp, seconds), p in zip(table[["model", "tp", "seconds"]].itertuples(index=False), predicted):
            rows.append(Row("vidur-gemm", "roofline", gpu, _model_name(model), int(tp), "gemm", "kernel_s",
                            float(seconds), float(p)))
    return rows, None


def vidur_allreduce(data: Path | None) -> tuple[list[Row], str | None]:
    """The roofline's all-reduce model on Vidur's single-node all_reduce.csv (by node topology)."""
    root = _vidur_dir(data)
    if root is None:
        return [], "no vidur/data/profiling under CBSIM_DATA"
    from cbsim.tools.scoreboard.vidur_tables import NODES, allreduce_predicted, allreduce_rows

    rows = []
    for (gpu, topology), node in NODES.items():
        table = allreduce_rows(root, node)
        predicted = allreduce_predicted(table, gpu, topology)
        for (n, seconds), p in zip(table[["n", "seconds"]].itertuples(index=False), predicted):
            rows.append(Row("vidur-allreduce", f"roofline:{topology}", gpu, "-", int(n), "allreduce", "kernel_s",
                            float(seconds), float(p)))
    return rows, None


def deepep(data: Path | None) -> tuple[list[Row], str | None]:
    """The roofline's all-to-all on DeepEP's low-latency table (published.DEEPEP_LL)."""
    from cbsim.tools.scoreboard.runs import alltoall_rows

    return [Row("deepep", "roofline", "h800", "deepseek-v3", ep, kind, "kernel_s", measured, predicted)
            for ep, kind, measured, predicted in alltoall_rows()], None


def custom_allreduce(data: Path | None) -> tuple[list[Row], str | None]:
    """The roofline's all-reduce (engine vllm-v1) on vLLM's custom all-reduce on H100 (published.CUSTOM_AR_MS),
    small messages (< 1 MiB) and large apart."""
    from cbsim.tools.scoreboard.runs import custom_allreduce_rows

    return [Row("vllm-custom-allreduce", "roofline+vllm-v1", "h100", "-", tp, "allreduce<1MiB" if size < 1 << 20
                else "allreduce>=1MiB", "kernel_s", measured, predicted)
            for tp, size, measured, predicted in custom_allreduce_rows()], None


def fused_moe(data: Path | None) -> tuple[list[Row], str | None]:
    """The roofline's routed experts (engine vllm-v1) on vLLM's fused_moe kernel times (published.FUSED_MOE_US),
    decode batches (<= 128 tokens) and prefill apart."""
    from cbsim.tools.scoreboard.runs import fused_moe_rows

    return [Row("vllm-fused-moe", "roofline+vllm-v1", "h100", "mixtral-8x7b", 2, "decode" if tokens <= 128
                else "prefill", "kernel_s", measured, predicted) for tokens, measured, predicted in fused_moe_rows()], None


def trtllm_fp8(data: Path | None) -> tuple[list[Row], str | None]:
    """Whole runs against TensorRT-LLM's FP8 table (published.TRTLLM_FP8)."""
    from cbsim.tools.scoreboard.runs import trtllm_fp8_throughput

    rows = []
    for (model, gpu, tp, ep), table in pub.TRTLLM_FP8.items():
        for (isl, osl), published in table.items():
            n = pub.TRTLLM_FP8_REQUESTS[(isl, osl)]
            rows.append(Row("trtllm-fp8", "roofline+trtllm", gpu, model, tp, _run_phase(isl, osl), "tokens_per_s",
                            float(published), trtllm_fp8_throughput(model, gpu, tp, ep, isl, osl, n)))
    return rows, None


def trtllm_017(data: Path | None) -> tuple[list[Row], str | None]:
    """Whole runs against TensorRT-LLM v0.17's dense and Mixtral rows (published.DENSE_017, MIXTRAL_017)."""
    from cbsim.tools.scoreboard.runs import trtllm_017_throughput

    rows = []
    for (model, gpu, tp), table in {**pub.DENSE_017, **pub.MIXTRAL_017}.items():
        for (isl, osl), published in table.items():
            n = pub.TRTLLM_REQUESTS[(isl, osl)] // RUN_SCALE
            rows.append(Row("trtllm-0.17", "roofline+trtllm", gpu, model, tp, _run_phase(isl, osl), "tokens_per_s",
                            float(published), trtllm_017_throughput(model, gpu, tp, isl, osl, n)))
    return rows, None


def int4_l4(data: Path | None) -> tuple[list[Row], str | None]:
    """Whole offline runs against the int4 AWQ table on an L4 (published.INT4_L4_MS)."""
    from cbsim.tools.scoreboard.runs import int4_run_ms

    return [Row("int4-l4", "roofline+vllm-v1", "l4", "mistral-7b-awq", 1, "decode", "run_ms", published,
                int4_run_ms(batch, tokens)) for (batch, tokens), published in pub.INT4_L4_MS.items()], None


def _run_phase(isl: int, osl: int) -> str:
    """A throughput row's phase: which side dominates its tokens (prefill-heavy when isl >= 4 osl)."""
    return "prefill-heavy" if isl >= 4 * osl else "decode-heavy"


def _model_name(folder: str) -> str:
    """Vidur's model folder (Llama-2-70b-hf, CodeLlama-34b-Instruct-hf) as a lower-case name."""
    name = folder.lower()
    return name[:-3] if name.endswith("-hf") else name


SOURCES = {"splitwise": splitwise, "vidur-gemm": vidur_gemm, "vidur-allreduce": vidur_allreduce, "deepep": deepep,
           "vllm-custom-allreduce": custom_allreduce, "vllm-fused-moe": fused_moe, "trtllm-fp8": trtllm_fp8, "trtllm-0.17": trtllm_017, "int4-l4": int4_l4}

